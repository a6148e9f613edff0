"""`tokensvc capability mint|verify|revoke` and `tokensvc session-key`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from tokensvc.auth import devpki
from tokensvc.auth.capabilities import mint_capability
from tokensvc.cli.connection import add_connection_flags, call_service
from tokensvc.cli.output import output
from tokensvc.settings_sources import load_settings
from tokensvc.v1 import capability_pb2

__all__ = ["add_capability_commands", "add_capability_source", "read_capability"]

_CAPABILITY_ENV = "TOKENSVC_CAPABILITY"


def add_capability_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    capability = commands.add_parser("capability", help="mint, verify and revoke run capabilities")
    sub = capability.add_subparsers(dest="capability_command", required=True, metavar="COMMAND")

    mint = sub.add_parser(
        "mint",
        help="print a capability signed with a dev state dir's signing key",
        description="Mint a run capability locally with the dev signing key (no server call).",
    )
    mint.add_argument("--state-dir", type=Path, default=Path(".tokensvc-dev"))
    mint.add_argument("--namespace", required=True)
    mint.add_argument("--agent", required=True)
    mint.add_argument("--user", help="end-user id (kept only as an HMAC bucket by tokensvc)")
    mint.add_argument("--per-user", action="store_true", help="isolate memory per end-user")
    mint.add_argument("--registry", help="registry name (shared session scope)")
    mint.add_argument("--ltm", action="store_true", help="enable long-term memory")
    mint.add_argument("--kb", action="append", default=[], metavar="REF", help="grant a knowledge base")
    mint.add_argument("--ttl", type=int, default=3600, metavar="SECONDS", help="lifetime (default 3600)")
    mint.add_argument("--run-id", help="run id (default: a new UUID)")
    mint.add_argument("--json", action="store_true", help="print the token and its run id as JSON")
    mint.set_defaults(handler=_mint)

    verify = sub.add_parser(
        "verify",
        help="ask tokensvc to verify a capability and show its scope",
        description="Call CapabilityService.VerifyCapability as the launcher.",
    )
    add_capability_source(verify)
    verify.add_argument("--json", action="store_true", help="print the scope as JSON")
    add_connection_flags(verify)
    verify.set_defaults(handler=_verify)

    revoke = sub.add_parser(
        "revoke",
        help="revoke capabilities by token id or run id (control plane)",
        description="Call CapabilityService.RevokeCapability with the control-plane certificate.",
    )
    target = revoke.add_mutually_exclusive_group(required=True)
    target.add_argument("--jti", help="revoke one capability by its token id")
    target.add_argument("--run-id", help="revoke every capability of a run")
    revoke.add_argument("--reason", default="", help="why (recorded)")
    revoke.add_argument("--json", action="store_true")
    add_connection_flags(revoke)
    revoke.set_defaults(handler=_revoke)

    session = commands.add_parser(
        "session-key",
        help="derive the session-memory key of a conversation",
        description="Call CapabilityService.DeriveSessionKey as the launcher.",
    )
    session.add_argument("conversation_id", metavar="CONVERSATION_ID")
    session.add_argument("--scope", choices=["session", "shared"], default="session")
    add_capability_source(session)
    session.add_argument("--json", action="store_true", help="print the full response as JSON")
    add_connection_flags(session)
    session.set_defaults(handler=_session_key)


def add_capability_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--capability-file", type=Path, help=f"file holding the capability (default ${_CAPABILITY_ENV})"
    )


def read_capability(args: argparse.Namespace) -> str:
    if args.capability_file is not None:
        token: str = args.capability_file.read_text(encoding="utf-8").strip()
    else:
        token = os.environ.get(_CAPABILITY_ENV, "").strip()
    if not token:
        raise ValueError(f"no capability: pass --capability-file or set {_CAPABILITY_ENV}")
    return token


def _mint(args: argparse.Namespace) -> int:
    paths = devpki.DevPaths.for_state_dir(args.state_dir)
    if not paths.signing_key.is_file():
        raise devpki.DevMaterialError(f"{args.state_dir} has no dev signing key; run `tokensvc dev` first")
    kid, key = devpki.load_signing_key(paths.signing_key)
    settings = load_settings()
    token = mint_capability(
        key,
        kid,
        issuer=settings.capability_issuers[0],
        audience=settings.capability_audience,
        namespace=args.namespace,
        agent=args.agent,
        run_id=args.run_id,
        user=args.user,
        per_user=args.per_user,
        registry=args.registry,
        long_term_memory=args.ltm,
        knowledge_bases=args.kb,
        ttl_seconds=args.ttl,
        now=time.time(),
    )
    if args.json:
        print(json.dumps({"token": token}))
    else:
        print(token)
    return 0


def _verify(args: argparse.Namespace) -> int:
    token = read_capability(args)
    response = call_service(
        args,
        "launcher",
        "CapabilityService",
        "VerifyCapability",
        capability_pb2.VerifyCapabilityRequest(),
        token,
    )
    scope = response.scope
    text = "\n".join(
        [
            f"namespace:        {scope.namespace}",
            f"agent:            {scope.agent}",
            f"bucket:           {scope.bucket_id}{' (per user)' if scope.per_user else ''}",
            f"registry:         {scope.registry or '-'}",
            f"long-term memory: {'yes' if scope.long_term_memory else 'no'}",
            f"knowledge bases:  {', '.join(scope.knowledge_bases) or '-'}",
            f"run id:           {scope.run_id}",
            f"expires:          {scope.expires_at.ToJsonString()}",
        ]
    )
    output(args, response, text)
    return 0


def _revoke(args: argparse.Namespace) -> int:
    request = capability_pb2.RevokeCapabilityRequest(reason=args.reason)
    if args.jti:
        request.jti = args.jti
    else:
        request.run_id = args.run_id
    response = call_service(args, "control-plane", "CapabilityService", "RevokeCapability", request)
    output(args, response, f"revoked at {response.revoked_at.ToJsonString()}")
    return 0


def _session_key(args: argparse.Namespace) -> int:
    token = read_capability(args)
    scope = (
        capability_pb2.SESSION_SCOPE_SHARED
        if args.scope == "shared"
        else capability_pb2.SESSION_SCOPE_SESSION
    )
    request = capability_pb2.DeriveSessionKeyRequest(conversation_id=args.conversation_id, scope=scope)
    response = call_service(args, "launcher", "CapabilityService", "DeriveSessionKey", request, token)
    if response.downgraded and not args.json:
        print("note: shared scope needs registry membership; the private layout is used", file=sys.stderr)
    output(args, response, response.key)
    return 0
