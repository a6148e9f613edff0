"""`tokensvc admin erase-user|export-user|receipt`: an end-user's data-subject requests
(DataSubjectService), with the control plane's certificate by default.

The user id is read from a file or standard input, never from the command line: argv is visible
to every process on the host (`ps`) and lands in shell history.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from google.protobuf import json_format

from tokensvc.cli.connection import RpcFailed, add_connection_flags, call_service, client_for
from tokensvc.cli.output import output
from tokensvc.client import CallFailed
from tokensvc.v1 import data_subject_pb2

__all__ = ["add_data_subject_commands"]

_ROLE = "control-plane"


def add_data_subject_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    erase = sub.add_parser(
        "erase-user",
        help="erase an end-user's memories in every agent (a data-subject erasure request)",
        description="EraseEndUser. The user id is read from --user-file or standard input.",
    )
    export = sub.add_parser(
        "export-user",
        help="export an end-user's memories from every agent, as JSON lines",
        description="ExportEndUser: one JSON object per line (memories, then session-key prefixes, "
        "then the receipt) to --output or standard output. The user id is read from --user-file "
        "or standard input.",
    )
    for parser in (erase, export):
        parser.add_argument("--namespace", default="", help="the namespace (default: every namespace)")
        parser.add_argument(
            "--user-file", type=Path, help="a file holding the user id (default: read it from standard input)"
        )
        parser.add_argument(
            "--agent",
            action="append",
            default=[],
            help="also this agent of --namespace (one with session memory only; repeatable)",
        )
    erase.set_defaults(handler=_erase)
    export.add_argument("--output", type=Path, help="write the export here (default: standard output)")
    export.add_argument(
        "--resume-token", default="", help="resume after the memory that returned it (appends to --output)"
    )
    export.set_defaults(handler=_export)
    receipt = sub.add_parser(
        "receipt", help="an erasure's or export's receipt", description="GetErasureReceipt."
    )
    receipt.add_argument("id")
    receipt.set_defaults(handler=_receipt)
    for parser in (erase, export, receipt):
        parser.add_argument("--json", action="store_true", help="print the response as JSON")
        add_connection_flags(parser)


def _user_id(args: argparse.Namespace) -> str:
    text: str
    if args.user_file is not None:
        path: Path = args.user_file
        text = path.read_text(encoding="utf-8")
    else:
        if sys.stdin.isatty():
            print("user id (end with Enter):", file=sys.stderr)
        text = sys.stdin.readline()
    user = text.strip("\r\n")
    if not user:
        raise SystemExit("tokensvc: no user id given (--user-file, or one line on standard input)")
    return user


def _describe(receipt: data_subject_pb2.DataSubjectReceipt) -> str:
    kind = data_subject_pb2.DataSubjectRequestKind.Name(receipt.kind).removeprefix(
        "DATA_SUBJECT_REQUEST_KIND_"
    )
    lines = [
        f"receipt {receipt.id}: {kind.lower()} in {receipt.namespace or 'every namespace'}",
        f"  {receipt.memories} memories in {len(receipt.per_agent)} of {receipt.agents} agents, "
        f"{receipt.session_key_prefixes} session-key prefixes",
    ]
    lines += [f"  {a.namespace}/{a.agent}: {a.memories}" for a in receipt.per_agent]
    if not receipt.complete:
        lines.append("  INCOMPLETE: cut off part of the way; run the erasure again")
    return "\n".join(lines)


def _erase(args: argparse.Namespace) -> int:
    request = data_subject_pb2.EraseEndUserRequest(
        namespace=args.namespace, user_id=_user_id(args), agents=args.agent
    )
    response = call_service(args, _ROLE, "DataSubjectService", "EraseEndUser", request)
    text = _describe(response.receipt)
    if response.session_key_prefixes:
        text += "\nsession-memory key prefixes to purge:\n" + "\n".join(
            f"  {p}" for p in response.session_key_prefixes
        )
    return output(args, response, text)


def _export(args: argparse.Namespace) -> int:
    request = data_subject_pb2.ExportEndUserRequest(
        namespace=args.namespace, user_id=_user_id(args), resume_token=args.resume_token, agents=args.agent
    )
    # Resuming continues the file the interrupted export wrote.
    mode = "a" if args.resume_token else "w"
    target: TextIO = sys.stdout if args.output is None else args.output.open(mode, encoding="utf-8")
    try:
        receipt = asyncio.run(_stream(args, request, target))
    except CallFailed as exc:
        raise RpcFailed(str(exc)) from None
    finally:
        if target is not sys.stdout:
            target.close()
    if receipt is None:
        raise RpcFailed("the export ended without its receipt")
    if args.output is not None or not args.json:
        print(_describe(receipt), file=sys.stderr)
    return 0


async def _stream(
    args: argparse.Namespace, request: data_subject_pb2.ExportEndUserRequest, target: TextIO
) -> data_subject_pb2.DataSubjectReceipt | None:
    receipt = None
    async with client_for(args, _ROLE) as client:
        async for message in client.stream("DataSubjectService", "ExportEndUser", request):
            line: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
            target.write(json.dumps(line) + "\n")
            if message.HasField("receipt"):
                receipt = message.receipt
    return receipt


def _receipt(args: argparse.Namespace) -> int:
    response = call_service(
        args,
        _ROLE,
        "DataSubjectService",
        "GetErasureReceipt",
        data_subject_pb2.GetErasureReceiptRequest(id=args.id),
    )
    return output(args, response, _describe(response.receipt))
