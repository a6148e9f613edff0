"""Client commands: they call a running tokensvc over mTLS."""

from __future__ import annotations

import argparse
import asyncio
import json

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokensvc.cli.connection import add_connection_flags, client_files, open_channel

__all__ = ["add_client_commands"]


def add_client_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    health = commands.add_parser(
        "health",
        help="check that tokensvc is SERVING (exit 0) over mTLS",
        description="Call grpc.health.v1.Health/Check over mTLS; exit 0 when SERVING, 1 otherwise.",
    )
    health.add_argument("--service", default="", help="service name to check (default: the server)")
    health.add_argument("--json", action="store_true", help="print the result as JSON")
    add_connection_flags(health)
    health.set_defaults(handler=_health)


def _health(args: argparse.Namespace) -> int:
    files = client_files(args, role="launcher")

    async def check() -> str:
        async with open_channel(args.target, files) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            response = await stub.Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
            return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

    try:
        status = asyncio.run(check())
    except grpc.aio.AioRpcError as exc:
        status = f"UNREACHABLE ({exc.code().name}: {exc.details()})"
    if args.json:
        print(json.dumps({"target": args.target, "status": status}))
    else:
        print(status)
    return 0 if status == "SERVING" else 1
