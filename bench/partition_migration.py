"""How long migration 0013 (memories hash-partitioned by bucket) takes on a populated database.

    .venv/bin/python -m bench.partition_migration [--scale 1m]

A scratch database on the bench's embedded PostgreSQL is migrated to 0012, the scale's memories
are COPYed in (bench/dataset.py; the old table's HNSW graph is dropped first and not rebuilt,
since 0013 drops it unread), then 0013 is applied as `tokensvc migrate` applies it (one
transaction) and timed. Writes the seconds, and seconds per million
rows, to bench/results/partition-migration-<scale>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import asyncpg

from bench.dataset import DIM, make_dataset
from bench.env import bench_env
from bench.load import MEMORY_COLUMNS, binary_vectors, bucket_ids, copy_connection, memory_records
from tokensvc.storage.postgres import schema_migrations as migrations

ROOT = Path(__file__).resolve().parent.parent
SEED = 20_240_601
PARTITIONED = 13


def log(message: str) -> None:
    print(f"[partition-migration {time.strftime('%H:%M:%S')}] {message}", flush=True)


async def run(scale: str) -> dict[str, Any]:
    data = make_dataset(scale, seed=SEED)
    shipped = migrations.available_schema_migrations()
    functions = migrations.available_schema_functions()
    async with bench_env() as env:
        name = "partition_migration"
        admin = await copy_connection(env, "superuser")
        owner_name = env.credential("owner")[0]
        await admin.execute(f"CREATE DATABASE {name} OWNER {owner_name}")
        await admin.close()
        plain = await asyncpg.connect(**env.conninfo("superuser", name))
        await plain.execute("CREATE EXTENSION vector")
        await plain.close()
        superuser = await copy_connection(env, "superuser", name)
        owner = await copy_connection(env, "owner", name)
        app_role = env.settings.database_app_role
        try:
            migrations.available_schema_migrations = lambda: [m for m in shipped if m.version < PARTITIONED]  # type: ignore[assignment]
            # Today's functions are defined over today's tables: only with the newest migration.
            migrations.available_schema_functions = lambda: []  # type: ignore[assignment]
            await migrations.apply_schema_migrations(owner, app_role=app_role)
            await owner.execute(f"DROP INDEX tokensvc.memories_hnsw_{DIM}")
            ids = bucket_ids(env, len(data.sizes))
            encoded = binary_vectors(data.vectors)
            buckets = list(range(len(data.sizes)))
            log(f"copying {data.rows} rows")
            for start in range(0, len(buckets), 200):
                records = list(memory_records(data, buckets[start : start + 200], ids, encoded))
                await superuser.copy_records_to_table(
                    "memories", schema_name="tokensvc", records=records, columns=MEMORY_COLUMNS
                )
            # The old table's single HNSW graph is not rebuilt after the COPY: 0013 drops it unread
            # (it builds memories_hnsw_384 anew), and building it takes longer than the migration.
            await owner.execute("ANALYZE tokensvc.memories")
            # 0013 runs with the server's defaults, as `tokensvc migrate` would (one partition's
            # graph at a time fits the default maintenance_work_mem).
            log("applying 0013")
            migrations.available_schema_migrations = lambda: shipped  # type: ignore[assignment]
            migrations.available_schema_functions = lambda: functions  # type: ignore[assignment]
            began = time.perf_counter()
            applied = await migrations.apply_schema_migrations(owner, app_role=app_role)
            seconds = time.perf_counter() - began
            assert [m.label for m in applied][:1] == ["0013_memories_by_bucket"], applied
            count = await superuser.fetchval("SELECT count(*) FROM tokensvc.memories")
            assert count == data.rows, (count, data.rows)
        finally:
            migrations.available_schema_migrations = lambda: shipped  # type: ignore[assignment]
            migrations.available_schema_functions = lambda: functions  # type: ignore[assignment]
            await owner.close()
            await superuser.close()
    result = {
        "scale": scale,
        "rows": data.rows,
        "seconds": round(seconds, 1),
        "seconds_per_million_rows": round(seconds * 1e6 / data.rows, 1),
        "maintenance_work_mem": "the server's default",
    }
    log(str(result))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--scale", default="1m", help="a bench/dataset.py scale (default 1m)")
    args = parser.parse_args()
    result = asyncio.run(run(args.scale))
    out = ROOT / "bench" / "results" / f"partition-migration-{args.scale}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
