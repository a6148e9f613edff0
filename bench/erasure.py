"""End-user erasure: other tenants' search latency while one user's memories are erased (issue 17).

    .venv/bin/python -m bench.erasure [--rows 100000] [--others 20] [--searches 500]

One end-user of the dev launcher's agent holds `--rows` memories (bulk-loaded as the superuser,
with one Remember first to pin the space); `--others` other users of the same agent hold 100
memories each, remembered through the service (the `hash` embedder). Measured in the same run,
on the embedded PostgreSQL, in process:

- the other users' searches (VECTOR, query text, concurrency 1) with nothing else running;
- the same searches while EraseEndUser deletes the user's rows (batches of 1,000, one transaction
  each);
- the erasure itself: rows per second, start to answer.

Results go to bench/results/erasure.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from bench.client import mtls_channel
from bench.env import AGENT, NAMESPACE, bench_env, connect_as
from bench.stats import latency_summary, percentile
from tokensvc.auth.buckets import bucket_id
from tokensvc.v1 import common_pb2, data_subject_pb2, data_subject_pb2_grpc, memory_pb2, memory_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
VICTIM = "bench-erasure-subject"


def log(message: str) -> None:
    print(f"[erasure {time.strftime('%H:%M:%S')}] {message}", flush=True)


async def run(rows: int, others: int, searches: int) -> dict[str, Any]:
    async with bench_env() as env:
        service = await env.start_service(memory_embedder="hash")
        ca = env.dev.ca_cert.read_bytes()
        launcher_cert, launcher_key = env.dev.client("launcher")
        control_cert, control_key = env.dev.client("control-plane")
        launcher = mtls_channel(service.port, ca, launcher_cert.read_bytes(), launcher_key.read_bytes())
        control = mtls_channel(service.port, ca, control_cert.read_bytes(), control_key.read_bytes())
        memory = memory_pb2_grpc.MemoryServiceStub(launcher)
        try:
            victim = (
                (
                    "authorization",
                    f"Bearer {env.capability(user=VICTIM, per_user=True, long_term_memory=True)}",
                ),
            )
            await memory.Remember(
                memory_pb2.RememberRequest(items=[memory_pb2.RememberItem(content="the first memory")]),
                metadata=victim,
                timeout=60,
            )
            bucket = bucket_id(env.keyring, NAMESPACE, AGENT, VICTIM)
            log(f"bulk-loading {rows} memories into the user's bucket")
            conn = await connect_as(env, "superuser")
            try:
                await conn.execute(
                    "INSERT INTO tokensvc.memories (bucket, id, namespace, agent, content, content_sha256, "
                    "dimension, embedding) SELECT $1, gen_random_uuid(), $2, $3, 'erasure bench memory ' || i, "
                    "sha256(convert_to('erasure bench memory ' || i, 'UTF8')), m.dimension, m.embedding "
                    "FROM generate_series(1, $4) AS i, (SELECT dimension, embedding FROM tokensvc.memories "
                    "WHERE bucket = $1 LIMIT 1) AS m",
                    bucket,
                    NAMESPACE,
                    AGENT,
                    rows - 1,
                )
                await conn.execute("VACUUM ANALYZE tokensvc.memories")
            finally:
                await conn.close()
            tokens = [
                env.capability(user=f"other-{u}", per_user=True, long_term_memory=True) for u in range(others)
            ]
            log(f"remembering 100 memories for each of {others} other users")
            for token in tokens:
                items = [memory_pb2.RememberItem(content=f"note {i} about topic {i % 7}") for i in range(100)]
                await memory.Remember(
                    memory_pb2.RememberRequest(items=items),
                    metadata=(("authorization", f"Bearer {token}"),),
                    timeout=60,
                )

            async def search(i: int) -> float:
                request = memory_pb2.SearchMemoriesRequest(
                    query_text=f"topic {i % 7}", top_k=10, mode=common_pb2.SEARCH_MODE_VECTOR
                )
                t0 = time.perf_counter()
                await memory.SearchMemories(
                    request, metadata=(("authorization", f"Bearer {tokens[i % len(tokens)]}"),), timeout=60
                )
                return (time.perf_counter() - t0) * 1000

            for i in range(100):
                await search(i)
            before = [await search(i) for i in range(searches)]
            log(
                f"other users' searches without an erasure: p50 {percentile(before, 50):.2f} ms, "
                f"p99 {percentile(before, 99):.2f} ms"
            )
            erase = data_subject_pb2_grpc.DataSubjectServiceStub(control).EraseEndUser(
                data_subject_pb2.EraseEndUserRequest(namespace=NAMESPACE, user_id=VICTIM), timeout=600
            )
            began = time.perf_counter()
            erasing = asyncio.ensure_future(erase)
            during: list[float] = []
            i = 0
            while not erasing.done():
                during.append(await search(i))
                i += 1
            receipt = (await erasing).receipt
            seconds = time.perf_counter() - began
            log(
                f"erased {receipt.memories} memories in {seconds:.1f} s; searches during it: "
                f"p50 {percentile(during, 50):.2f} ms, p99 {percentile(during, 99):.2f} ms over {len(during)}"
            )
        finally:
            await launcher.close(grace=None)
            await control.close(grace=None)
    return {
        "rows_erased": receipt.memories,
        "erase_seconds": round(seconds, 2),
        "erase_rows_per_s": round(receipt.memories / seconds, 1),
        "other_users": others,
        "search_c1_without_erasure": latency_summary(before),
        "search_c1_during_erasure": latency_summary(during),
        "search_p99_during_over_without": round(percentile(during, 99) / percentile(before, 99), 3),
        "search_p50_during_over_without": round(percentile(during, 50) / percentile(before, 50), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000, help="the user's memories (default %(default)s)")
    parser.add_argument("--others", type=int, default=20, help="other users searching (default %(default)s)")
    parser.add_argument("--searches", type=int, default=500, help="baseline searches (default %(default)s)")
    args = parser.parse_args()
    results = asyncio.run(run(args.rows, args.others, args.searches))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "erasure.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    log(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
