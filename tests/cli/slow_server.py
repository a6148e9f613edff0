"""A tokensvc process with one extra, slow RPC: lets a test catch an RPC in flight at SIGTERM.

Run as `python -m tests.cli.slow_server` with settings in TOKENSVC_* variables.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from tokensvc.api.policy import ANY_ROLE, RpcPolicy
from tokensvc.app import run_service
from tokensvc.logs import configure_logging
from tokensvc.settings_sources import load_settings

SLOW_METHOD = "/test.Slow/Sleep"
SLEEP_SECONDS = 2.0


async def _sleep(request: bytes, context: Any) -> bytes:
    await asyncio.sleep(SLEEP_SECONDS)
    return b"finished:" + request


def main() -> None:
    configure_logging()
    handler = grpc.method_handlers_generic_handler(
        "test.Slow", {"Sleep": grpc.unary_unary_rpc_method_handler(_sleep)}
    )
    policies = {SLOW_METHOD: RpcPolicy(ANY_ROLE, any_authenticated_peer=True)}
    asyncio.run(run_service(load_settings(), extra_handlers=[handler], extra_policies=policies))


if __name__ == "__main__":
    main()
