"""A tokensvc process that SIGKILLs itself at one step of a credential rotation.

Run as `python -m tests.credentials.crash_server SETTINGS.json` (the JSON holds setting values)
with CRASH_AT_STEP set to a journal step (`set_password`, `test_login`, `write_secret`, `switch`,
`retire_old`) or `completed`: the process dies the moment the rotation journal is about to record
that step, i.e. after the previous step was taken and before this one is. Only this script reads
CRASH_AT_STEP; the service code is the production code.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from tokensvc.app import run_service
from tokensvc.logs import configure_logging
from tokensvc.settings_sources import load_settings
from tokensvc.storage.postgres.rotations import PostgresRotationJournal

CRASH_AT = os.environ.get("CRASH_AT_STEP", "")

_record_step = PostgresRotationJournal.step
_close = PostgresRotationJournal.close


def _die() -> None:
    sys.stderr.write(f"crash_server: SIGKILL before journal step {CRASH_AT}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


async def _step(self: PostgresRotationJournal, rotation_id: int, step: str) -> None:
    if step == CRASH_AT:
        _die()
    await _record_step(self, rotation_id, step)


async def _close_rotation(
    self: PostgresRotationJournal,
    rotation_id: int,
    *,
    outcome: str,
    reason: str = "",
    step: str | None = None,
    keep_version: bool = False,
) -> int | None:
    if step == CRASH_AT:
        _die()
    return await _close(
        self, rotation_id, outcome=outcome, reason=reason, step=step, keep_version=keep_version
    )


def main() -> None:
    configure_logging()
    values = json.loads(Path(sys.argv[1]).read_text())
    PostgresRotationJournal.step = _step  # type: ignore[method-assign]
    PostgresRotationJournal.close = _close_rotation  # type: ignore[method-assign]
    asyncio.run(run_service(load_settings(environ={}, overrides=values)))


if __name__ == "__main__":
    main()
