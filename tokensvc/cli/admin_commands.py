"""`tokensvc admin rotate-db-credentials|status|audit|reload-trust-bundle|migrate` (admin certificate)."""

from __future__ import annotations

import argparse
from typing import Any

from tokensvc.cli.connection import add_connection_flags, call_service
from tokensvc.cli.data_subject_commands import add_data_subject_commands
from tokensvc.cli.output import output
from tokensvc.cli.reembedding_commands import add_reembedding_commands
from tokensvc.v1 import admin_pb2

__all__ = ["add_admin_commands"]

_MODES = {
    "reload": admin_pb2.CREDENTIAL_ROTATION_MODE_RELOAD,
    "rotate": admin_pb2.CREDENTIAL_ROTATION_MODE_ROTATE,
}
_CREDENTIALS = {
    "serving": admin_pb2.DATABASE_CREDENTIAL_SERVING,
    "runner": admin_pb2.DATABASE_CREDENTIAL_RUNNER,
}


def add_admin_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    admin = commands.add_parser("admin", help="platform admin operations")
    sub = admin.add_subparsers(dest="admin_command", required=True, metavar="COMMAND")

    rotate = sub.add_parser(
        "rotate-db-credentials",
        help="rotate the database credential with zero downtime",
        description=(
            "reload: adopt the credential an external rotator wrote into the secret source (tested first). "
            "rotate: tokensvc rotates itself, alternating between its two login roles. "
            "--credential runner does either for the re-embedding runner's credential."
        ),
    )
    rotate.add_argument("--mode", choices=sorted(_MODES), default="rotate")
    rotate.add_argument(
        "--credential",
        choices=sorted(_CREDENTIALS),
        default="serving",
        help="the serving pool's credential (default) or the re-embedding runner's",
    )
    rotate.set_defaults(handler=_rotate)
    status = sub.add_parser("status", help="credential and pool status", description="GetCredentialStatus.")
    status.set_defaults(handler=_status)
    audit = sub.add_parser("audit", help="the audit trail, newest first", description="ListAuditEvents.")
    audit.add_argument("--page-size", type=int, default=50)
    audit.add_argument("--page-token", default="")
    audit.set_defaults(handler=_audit)
    reload = sub.add_parser("reload-trust-bundle", help="reload the capability trust bundle now")
    reload.set_defaults(handler=_reload)
    for parser in (rotate, status, audit, reload):
        parser.add_argument("--json", action="store_true", help="print the response as JSON")
        add_connection_flags(parser)
    add_reembedding_commands(sub)
    add_data_subject_commands(sub)


def _call(args: argparse.Namespace, method: str, request: Any) -> Any:
    return call_service(args, "admin", "AdminService", method, request)


def _describe(status: admin_pb2.CredentialStatus) -> str:
    lines = [
        f"credential:         {admin_pb2.DatabaseCredential.Name(status.credential)}",
        f"active role:        {status.active_role}",
        f"credential version: {status.credential_version}",
        f"last rotated:       {status.last_rotated_at.ToJsonString() if status.HasField('last_rotated_at') else '-'}",
        f"last rotation:      {admin_pb2.CredentialRotationMode.Name(status.last_rotation_mode)} "
        f"{admin_pb2.RotationOutcome.Name(status.last_rotation_outcome)}",
        f"pool:               {status.pool_in_use} in use of {status.pool_size}",
    ]
    for pepper in status.pepper_versions:
        lines.append(
            f"pepper v{pepper.pepper_version}:          {pepper.row_count} rows{' (current)' if pepper.current else ''}"
        )
    return "\n".join(lines)


def _rotate(args: argparse.Namespace) -> int:
    request = admin_pb2.RotateDatabaseCredentialsRequest(
        mode=_MODES[args.mode], credential=_CREDENTIALS[args.credential]
    )
    response = _call(args, "RotateDatabaseCredentials", request)
    return output(args, response, _describe(response.status))


def _status(args: argparse.Namespace) -> int:
    response = _call(args, "GetCredentialStatus", admin_pb2.GetCredentialStatusRequest())
    text = _describe(response.status)
    if response.HasField("runner_status"):
        text += "\n\n" + _describe(response.runner_status)
    return output(args, response, text)


def _audit(args: argparse.Namespace) -> int:
    response = _call(
        args,
        "ListAuditEvents",
        admin_pb2.ListAuditEventsRequest(page_size=args.page_size, page_token=args.page_token),
    )
    lines = [
        f"{e.occurred_at.ToJsonString()}  {admin_pb2.AuditOutcome.Name(e.outcome).removeprefix('AUDIT_OUTCOME_'):9}  "
        f"{e.action}  {e.target}  by {e.actor}"
        for e in response.events
    ]
    if response.next_page_token:
        lines.append(f"(more: --page-token {response.next_page_token})")
    return output(args, response, "\n".join(lines) or "(no audit events)")


def _reload(args: argparse.Namespace) -> int:
    response = _call(args, "ReloadTrustBundle", admin_pb2.ReloadTrustBundleRequest())
    return output(args, response, f"trust bundle keys: {', '.join(response.key_ids)}")
