"""Database loss: the embedded PostgreSQL stopped (fast shutdown) and SIGKILLed under Remember traffic.

One tokensvc in embedded mode (its own PostgreSQL in its state dir, supervised by the service).
For each fault, while several tasks keep calling Remember over mTLS:
- every RPC that fails during the outage fails fast with UNAVAILABLE / DATABASE_UNAVAILABLE
  (never INTERNAL, never a hang): within the connect timeout plus 2 s;
- health turns NOT_SERVING, the service restarts PostgreSQL by itself (a new postmaster on the
  same port, so the pool's DSN still holds), health returns to SERVING and traffic succeeds again;
- afterwards every acknowledged memory is stored with its content, and nothing is half-written:
  every row's content, hash, embedding and space agree, a failed Remember batch is stored whole or
  not at all, and no row exists that no call tried to write.
And a database that hangs instead of dying (every PostgreSQL process SIGSTOPped): health turns
NOT_SERVING within the probe timeout, calls end by their deadline, the live postmaster is not
replaced, and everything resumes with it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from tests.faults.harness import (
    NOT_SERVING,
    SERVING,
    HealthTrace,
    RememberTraffic,
    Tenants,
    check_remembered,
    embedded_settings,
    new_state_dir,
    percentile,
    postmaster_port,
    report,
    stop_postmaster,
    wait_until,
)
from tokensvc.app import Service
from tokensvc.auth.devpki import DevPaths, ensure_dev_material

CONNECT_TIMEOUT = 2.0
HEALTH_INTERVAL = 0.2
RPC_TIMEOUT = 15.0
WORKERS = 8
BEFORE_FAULT = 100  # acknowledged calls before the fault
AFTER_RECOVERY = 50  # acknowledged calls after health is SERVING again
FAULTS = {"fast-shutdown": signal.SIGINT, "sigkill": signal.SIGKILL}
EXPECTED_FAILURE = (grpc.StatusCode.UNAVAILABLE, "DATABASE_UNAVAILABLE")


@pytest.fixture(scope="module")
async def embedded_service() -> AsyncIterator[tuple[Service, DevPaths]]:
    """A tokensvc with its own embedded PostgreSQL, probed every 0.2 s."""
    state = new_state_dir("db-loss")
    dev = ensure_dev_material(state)
    settings = embedded_settings(
        state,
        dev,
        health_check_interval_seconds=HEALTH_INTERVAL,
        database_connect_timeout_seconds=CONNECT_TIMEOUT,
    )
    service = Service(settings)
    try:
        await service.start()
        yield service, dev
    finally:
        await service.stop(grace=0)
        await stop_postmaster(state)
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(FAULTS))
async def test_database_loss_fails_fast_recovers_by_itself_and_loses_nothing(
    embedded_service: tuple[Service, DevPaths], fault: str
) -> None:
    service, dev = embedded_service
    assert service.database is not None
    embedded = service.database.embedded
    assert embedded is not None
    state = embedded.paths.root
    tenants = Tenants(dev, state / f"clients-{fault}")
    callers = [tenants.tenant(), tenants.tenant(user="user-1", per_user=True), tenants.tenant()]
    health = HealthTrace(service.port, dev)
    await health.start()
    traffic = RememberTraffic(service.port, tenants, callers, WORKERS, RPC_TIMEOUT)
    traffic.start()
    try:
        await wait_until(lambda: traffic.acknowledged() >= BEFORE_FAULT, 60, "traffic before the fault")
        old_pid, port = embedded.postmaster_pid(), embedded.port
        assert old_pid is not None
        faulted = time.monotonic()
        os.kill(old_pid, FAULTS[fault])

        await wait_until(lambda: health.first(NOT_SERVING, faulted) is not None, 30, "NOT_SERVING")
        down = health.first(NOT_SERVING, faulted)
        assert down is not None
        await wait_until(lambda: health.first(SERVING, down) is not None, 60, "SERVING again")
        up = health.first(SERVING, down)
        assert up is not None
        await wait_until(lambda: traffic.acknowledged(since=up) >= AFTER_RECOVERY, 30, "traffic to succeed")
    finally:
        await traffic.stop()
        await health.stop()

    # The supervisor, not the test, brought PostgreSQL back: a new postmaster on the same port.
    new_pid = embedded.postmaster_pid()
    assert new_pid is not None
    assert new_pid != old_pid
    assert embedded.port == port == postmaster_port(state)

    failures = traffic.failures
    unexpected = [
        a.failure for a in failures if a.failure and (a.failure.code, a.failure.reason) != EXPECTED_FAILURE
    ]
    assert not unexpected, f"failures other than UNAVAILABLE/DATABASE_UNAVAILABLE: {unexpected[:5]}"
    assert failures, "no RPC failed: the fault was not observed under traffic"
    assert all(a.finished >= faulted for a in failures), "an RPC failed before the fault"
    latencies = [a.latency for a in failures]
    assert max(latencies) < CONNECT_TIMEOUT + 2, f"a failed RPC took {max(latencies):.2f} s"

    outcome = await check_remembered(state, [traffic], callers)

    report(
        f"database loss ({fault})",
        failed_rpcs=len(failures),
        failed_latency_p50_s=percentile(latencies, 0.5),
        failed_latency_max_s=max(latencies),
        not_serving_after_s=down - faulted,
        recovery_to_serving_s=up - faulted,
        outage_first_to_last_failure_s=max(a.finished for a in failures) - min(a.finished for a in failures),
        acknowledged_memories=outcome.acknowledged,
        failed_batches_committed_anyway=outcome.committed_anyway,
    )


FREEZE_SECONDS = 5.0
FROZEN_DEADLINE = 3.0  # the callers' deadline while the database hangs
DEADLINE_FAILURES = {
    (grpc.StatusCode.DEADLINE_EXCEEDED, None),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"),
}


def postgres_processes(postmaster: int) -> list[int]:
    """The postmaster and its children (each child is in a session of its own, so no killpg)."""
    children = Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text().split()
    return [postmaster, *map(int, children)]


@pytest.mark.slow
async def test_hung_database_turns_health_not_serving_and_calls_end_by_their_deadline(
    embedded_service: tuple[Service, DevPaths],
) -> None:
    """A database that hangs (every PostgreSQL process SIGSTOPped) rather than dies: in-flight calls
    end by their deadline, health turns NOT_SERVING within the probe timeout, the supervisor does not
    restart a live postmaster, and everything resumes when the database does."""
    service, dev = embedded_service
    assert service.database is not None
    embedded = service.database.embedded
    assert embedded is not None
    state = embedded.paths.root
    tenants = Tenants(dev, state / "clients-freeze")
    callers = [tenants.tenant(), tenants.tenant(user="user-1", per_user=True)]
    health = HealthTrace(service.port, dev)
    await health.start()
    traffic = RememberTraffic(service.port, tenants, callers, WORKERS, FROZEN_DEADLINE)
    traffic.start()
    try:
        await wait_until(lambda: traffic.acknowledged() >= BEFORE_FAULT, 60, "traffic before the fault")
        postmaster = embedded.postmaster_pid()
        assert postmaster is not None
        frozen = time.monotonic()
        for pid in postgres_processes(postmaster):
            os.kill(pid, signal.SIGSTOP)
        try:
            # The probe gives up after its timeout, once to get a connection and once for its query.
            await wait_until(
                lambda: health.first(NOT_SERVING, frozen) is not None,
                2 * CONNECT_TIMEOUT + 2,
                "NOT_SERVING while the database hangs",
            )
            await asyncio.sleep(max(0.0, frozen + FREEZE_SECONDS - time.monotonic()))
            serving_gauge = [REGISTRY.get_sample_value("tokensvc_serving")]  # what the alerts read
        finally:
            for pid in postgres_processes(postmaster):
                os.kill(pid, signal.SIGCONT)
        thawed = time.monotonic()
        await wait_until(lambda: health.first(SERVING, thawed) is not None, 30, "SERVING again")
        up = health.first(SERVING, thawed)
        assert up is not None
        serving_gauge.append(REGISTRY.get_sample_value("tokensvc_serving"))
        await wait_until(lambda: traffic.acknowledged(since=up) >= AFTER_RECOVERY, 30, "traffic to succeed")
    finally:
        await traffic.stop()
        await health.stop()

    assert embedded.postmaster_pid() == postmaster, "a hung (not dead) postmaster was replaced"
    assert serving_gauge == [0.0, 1.0], "tokensvc_serving follows health"
    failures = traffic.failures
    outcomes = Counter((a.failure.code, a.failure.reason) for a in failures if a.failure is not None)
    unexpected = set(outcomes) - DEADLINE_FAILURES - {EXPECTED_FAILURE}
    assert not unexpected, f"failures other than a deadline or DATABASE_UNAVAILABLE: {unexpected}"
    assert failures, "no call was caught by the hang"
    assert all(frozen <= a.finished <= up + 1 for a in failures), "a call failed outside the hang"
    latencies = [a.latency for a in failures]
    assert max(latencies) < FROZEN_DEADLINE + 1
    outcome = await check_remembered(state, [traffic], callers)
    down = health.first(NOT_SERVING, frozen)
    assert down is not None
    report(
        "database hang (SIGSTOP)",
        hang_s=thawed - frozen,
        failed_rpcs=len(failures),
        by_status=dict(sorted((f"{code.name}/{reason}", n) for (code, reason), n in outcomes.items())),
        not_serving_after_s=down - frozen,
        serving_after_resume_s=up - thawed,
        acknowledged_memories=outcome.acknowledged,
    )
