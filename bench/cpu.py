"""CPU per call: the server's CPU seconds per RPC under a fixed concurrent load, and `--workers`.

    .venv/bin/python -m bench.cpu [--calls 3000] [--concurrency 16] [--workers 1 2] [--rounds 3]
                                  [--baseline OTHER_TREE] [--profile DIR] [--out FILE]

One run starts a throwaway embedded PostgreSQL (migrated) and the dev PKI (bench/env.py), then
runs `tokensvc serve [--workers N]` as a child process (logging at INFO to a file, as in
production), the way an operator would. For each configuration it starts the server, remembers
`--rows` memories in one bucket (hash embedder), warms up, then sends `--calls` SearchMemories
(query text, VECTOR mode, so the embedder runs) at `--concurrency` in flight over `--channels` mTLS
connections, then as many grpc.health Check calls (the transport and the edge, nothing behind
them) on the same connections. It reads the CPU time (user + system, /proc) of the server's whole
process tree (every worker and the parent) before and after each phase:

- `cpu_us_per_call`: server CPU microseconds per RPC (what this script is for: robust to a noisy
  machine, unlike latency), and `threads_cpu_us_per_call` by thread name (`python`: the event
  loop; `event_engine`: gRPC core's I/O threads);
- `calls_per_s`, `p50_ms`, `mean_ms`, `p99_ms`: throughput and latency at that concurrency; the load
  generator and PostgreSQL share the machine, so compare configurations of the same run;
- `rpcs_per_worker`: how the kernel spread the connections (RPC log lines per process).

`--baseline DIR` runs the server from another source tree too (e.g. `git archive main | tar -x -C
DIR`), alternating the order every round, and the summary gives medians over `--rounds` and ratios
against this tree with one worker. `--profile DIR` also records a py-spy profile of each phase
(`pip install py-spy`: a profiling tool, not a tokensvc dependency) as collapsed stacks and prints
the top frames of the event-loop thread.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.env import ROOT, BenchEnv, ServerProcess, bench_env
from bench.stats import latency_summary
from tokensvc.v1 import common_pb2, memory_pb2, memory_pb2_grpc

__all__ = ["main"]

RESULTS = ROOT / "bench" / "results"
TIMEOUT = 60.0
_TICKS = os.sysconf("SC_CLK_TCK")


def log(message: str) -> None:
    print(f"[bench.cpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- the server's CPU time ----------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (Linux /proc)."""
    found = [pid]
    for current in found:
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                found += [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                continue
    return found


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name over `pid`'s process tree (threads of one name summed)."""
    by_name: dict[str, float] = collections.defaultdict(float)
    for member in process_tree(pid):
        for task in Path(f"/proc/{member}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            by_name[name] += (int(fields[11]) + int(fields[12])) / _TICKS
    return dict(by_name)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its live descendants."""
    total = 0
    for member in process_tree(pid):
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / _TICKS


# --- the server process --------------------------------------------------------------------------


# --- the load ------------------------------------------------------------------------------------


def channels(env: BenchEnv, port: int, count: int) -> list[grpc.aio.Channel]:
    """`count` mTLS connections (own subchannel pools: gRPC would otherwise share one)."""
    cert, key = env.dev.client("launcher")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=env.dev.ca_cert.read_bytes(),
        private_key=key.read_bytes(),
        certificate_chain=cert.read_bytes(),
    )
    options = [("grpc.use_local_subchannel_pool", 1)]
    return [grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials, options=options) for _ in range(count)]


async def wait_ready(server: ServerProcess, chans: list[grpc.aio.Channel], deadline_s: float = 90) -> None:
    """Until a Health Check on every connection answers SERVING."""
    began = time.monotonic()
    for channel in chans:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if server.process.poll() is not None:
                raise RuntimeError(f"tokensvc exited with {server.process.returncode}: see {server.log_file}")
            try:
                response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() - began > deadline_s:
                raise RuntimeError(f"tokensvc was not healthy within {deadline_s} s")
            await asyncio.sleep(0.3)


async def drive(calls: list[Any], total: int, concurrency: int) -> dict[str, Any]:
    """`total` calls, `concurrency` in flight, spread over the callables in `calls`."""
    latencies: list[float] = []
    counter = iter(range(total))

    async def lane(lane_no: int) -> None:
        call = calls[lane_no % len(calls)]
        for _ in counter:
            began = time.perf_counter()
            await call()
            latencies.append((time.perf_counter() - began) * 1000)

    began = time.perf_counter()
    await asyncio.gather(*(lane(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - began
    return {"seconds": elapsed, "calls_per_s": round(total / elapsed, 1), **latency_summary(latencies)}


async def measure(
    server: ServerProcess, phase: Any, total: int, concurrency: int, profile: Path | None = None
) -> dict[str, Any]:
    spy = None
    if profile is not None:
        spy = start_profiler(server.pid, profile)
    before, threads_before = cpu_seconds(server.pid), thread_cpu(server.pid)
    result = await phase(total, concurrency)
    used = cpu_seconds(server.pid) - before
    threads = thread_cpu(server.pid)
    result["threads_cpu_us_per_call"] = {
        name: round((seconds - threads_before.get(name, 0.0)) / total * 1e6, 1)
        for name, seconds in sorted(threads.items(), key=lambda item: -item[1])
        if seconds - threads_before.get(name, 0.0) > 0
    }
    if spy is not None:
        stop_profiler(spy)
    result["server_cpu_s"] = round(used, 3)
    result["cpu_us_per_call"] = round(used / total * 1e6, 1)
    return result


def start_profiler(pid: int, out: Path) -> subprocess.Popen[bytes]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    command = [spy, "record", "--pid", str(pid), "--rate", "250", "--format", "raw", "-o", str(out)] + (
        ["--native"] if os.environ.get("BENCH_CPU_NATIVE") else []
    )
    if "workers1-" not in out.name:
        command.append("--subprocesses")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaches
    return process


def stop_profiler(spy: subprocess.Popen[bytes]) -> None:
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(30)
    except subprocess.TimeoutExpired:
        spy.kill()


def top_frames(raw: Path, limit: int = 30) -> list[dict[str, Any]]:
    """Self and inclusive share of the event-loop thread's samples per function: the `limit`
    largest by self first, then the largest by inclusive share not already listed.

    From py-spy's collapsed stacks. Other threads are left out: py-spy counts gRPC's poller thread
    as busy while it waits for the GIL, yet /proc gives it a few per cent of the process's CPU.
    """
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        frames = [_frame_name(frame) for frame in stack.split(";")]
        if not stack or any(frame.startswith("Thread._bootstrap") for frame in frames):
            continue
        count = int(count_text)
        total += count
        for frame in set(frames):
            inclusive[frame] += count
        own[frames[-1]] += count

    def row(frame: str) -> dict[str, Any]:
        return {
            "frame": frame,
            "inclusive_pct": round(100 * inclusive[frame] / total, 1),
            "self_pct": round(100 * own[frame] / total, 1),
        }

    by_self = [row(frame) for frame, _ in own.most_common(limit)]
    by_inclusive = [row(frame) for frame, _ in inclusive.most_common(limit)]
    return by_self + [r for r in by_inclusive if r["frame"] not in {s["frame"] for s in by_self}]


def _frame_name(frame: str) -> str:
    """`function (path:line)` -> `function (path)`, site-packages and tree prefixes dropped."""
    name, _, where = frame.partition(" (")
    if not where:
        return frame
    path = where.rsplit(":", 1)[0].rstrip(")")
    path = path.split("site-packages/")[-1]
    path = path.split("/tokensvc/", 1)[-1] if "/tokensvc/" in path else path
    return f"{name} ({path})"


# --- one configuration ---------------------------------------------------------------------------


async def run_workers(
    env: BenchEnv, workers: int, args: argparse.Namespace, tree: Path = ROOT, label: str = "current"
) -> dict[str, Any]:
    server = await env.start_server_process(
        workers, tree=tree, log_name=f"server-{label}-{workers}-{time.monotonic_ns()}", memory_embedder="hash"
    )
    log_file = server.log_file
    chans = channels(env, server.port, args.channels)
    try:
        await wait_ready(server, chans)
        token = env.capability(user="cpu-bench-user", per_user=True, long_term_memory=True, ttl_seconds=3600)
        auth = (("authorization", f"Bearer {token}"),)
        stubs = [memory_pb2_grpc.MemoryServiceStub(channel) for channel in chans]
        health = [health_pb2_grpc.HealthStub(channel) for channel in chans]
        items = [
            memory_pb2.RememberItem(
                content=f"fact {i}: the build of service {i % 37} moved to runner pool {i % 11}",
                metadata={"tag": common_pb2.MetadataValue(string_value=f"t{i % 5}")},
            )
            for i in range(args.rows)
        ]
        await stubs[0].Remember(memory_pb2.RememberRequest(items=items), metadata=auth, timeout=TIMEOUT)
        request = memory_pb2.SearchMemoriesRequest(
            query_text="which runner pool did the build move to",
            top_k=10,
            mode=common_pb2.SEARCH_MODE_VECTOR,
        )
        check = health_pb2.HealthCheckRequest()

        def search_call(stub: memory_pb2_grpc.MemoryServiceStub) -> Any:
            async def call() -> None:
                response = await stub.SearchMemories(request, metadata=auth, timeout=TIMEOUT)
                assert len(response.results) == min(10, args.rows)

            return call

        def health_call(stub: health_pb2_grpc.HealthStub) -> Any:
            async def call() -> None:
                await stub.Check(check, timeout=TIMEOUT)

            return call

        searches = [search_call(stub) for stub in stubs]
        checks = [health_call(stub) for stub in health]

        async def search_phase(total: int, concurrency: int) -> dict[str, Any]:
            return await drive(searches, total, concurrency)

        async def health_phase(total: int, concurrency: int) -> dict[str, Any]:
            return await drive(checks, total, concurrency)

        await drive(searches, args.warmup, args.concurrency)
        result = {
            "tree": label,
            "workers": workers,
            "search": await measure(server, search_phase, args.calls, args.concurrency),
            "health": await measure(server, health_phase, args.calls, args.concurrency),
        }
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
            for name, phase in (("search", search_phase), ("health", health_phase)):
                raw = args.profile / f"{label}-workers{workers}-{name}.txt"
                profiled = await measure(server, phase, args.calls, args.concurrency, profile=raw)
                result[f"profiled_{name}"] = profiled
                result[f"top_frames_{name}"] = top_frames(raw)
        per_pid: collections.Counter[int] = collections.Counter(
            json.loads(line).get("pid")
            for line in log_file.read_text().splitlines()
            if line.startswith("{") and '"msg": "rpc"' in line
        )
        result["serving_pids"] = len(per_pid)
        # How the kernel spread the connections: RPCs logged by each worker, most first.
        result["rpcs_per_worker"] = sorted(per_pid.values(), reverse=True)
        return result
    finally:
        for channel in chans:
            await channel.close(grace=None)
        result_code = server.stop()
        env.process = None
        if result_code != 0:
            log(f"tokensvc (workers={workers}) exited with {result_code}; see {log_file}")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    trees = [("current", ROOT)] + ([("baseline", args.baseline)] if args.baseline else [])
    results: dict[str, Any] = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cpus": os.cpu_count(),
        "runs": [],
    }
    async with bench_env() as env:
        for round_no in range(args.rounds):
            # Alternate the order each round, so drift on a shared machine hits every variant alike.
            order = trees if round_no % 2 == 0 else trees[::-1]
            for workers in args.workers:
                for label, tree in order:
                    log(f"round {round_no + 1}, {label}, workers={workers}: {args.calls} calls per phase")
                    run_result = await run_workers(env, workers, args, tree, label)
                    run_result["round"] = round_no + 1
                    results["runs"].append(run_result)
                    search, health = run_result["search"], run_result["health"]
                    log(
                        f"  search {search['cpu_us_per_call']} us CPU/call, {search['calls_per_s']} calls/s, "
                        f"p50 {search['p50_ms']} ms; health {health['cpu_us_per_call']} us CPU/call, "
                        f"{health['calls_per_s']} calls/s; RPCs per worker {run_result['rpcs_per_worker']}"
                    )
                    for frame in run_result.get("top_frames_search", [])[:20]:
                        log(
                            f"  {frame['inclusive_pct']:5.1f}% incl {frame['self_pct']:5.1f}% self  {frame['frame']}"
                        )
    results["summary"] = summarize(results["runs"])
    for line in results["summary"]["lines"]:
        log(line)
    return results


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds per (tree, workers), and ratios against current/workers=1 of this run."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = collections.defaultdict(list)
    for run_result in runs:
        groups[(run_result["tree"], run_result["workers"])].append(run_result)
    table: dict[str, dict[str, Any]] = {}
    for (tree, workers), members in groups.items():
        table[f"{tree}/workers={workers}"] = {
            f"{phase}_{metric}": statistics.median(m[phase][metric] for m in members)
            for phase in ("search", "health")
            for metric in ("cpu_us_per_call", "calls_per_s", "p50_ms", "mean_ms", "p99_ms")
        }
    lines = []
    base = dict(table.get("current/workers=1") or next(iter(table.values())))
    for name, row in table.items():
        ratios = {key: round(value / base[key], 2) for key, value in row.items() if base[key]}
        row["ratios_vs_current_workers_1"] = ratios
        lines.append(
            f"{name}: search {row['search_cpu_us_per_call']} us CPU/call (x{ratios['search_cpu_us_per_call']}), "
            f"{row['search_calls_per_s']} calls/s (x{ratios['search_calls_per_s']}), "
            f"p50/mean/p99 {row['search_p50_ms']}/{row['search_mean_ms']}/{row['search_p99_ms']} ms; "
            f"health {row['health_cpu_us_per_call']} us CPU/call "
            f"(x{ratios['health_cpu_us_per_call']}), {row['health_calls_per_s']} calls/s "
            f"(x{ratios['health_calls_per_s']})"
        )
    return {"medians": table, "lines": lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000, help="measured calls per phase (default 3000)")
    parser.add_argument("--warmup", type=int, default=500, help="unmeasured searches first (default 500)")
    parser.add_argument("--concurrency", type=int, default=16, help="calls in flight (default 16)")
    parser.add_argument("--channels", type=int, default=8, help="mTLS connections (default 8)")
    parser.add_argument("--rows", type=int, default=50, help="memories in the searched bucket (default 50)")
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[1], help="server processes, one run each (default 1)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="repeat every configuration (default 1)")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another source tree (e.g. `git archive main | tar -x -C DIR`) measured alternately in the same run",
    )
    parser.add_argument("--profile", type=Path, help="also record a py-spy profile into this directory")
    parser.add_argument(
        "--out", type=Path, default=RESULTS / "cpu.json", help="results JSON (default bench/results/cpu.json)"
    )
    args = parser.parse_args()
    results = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
