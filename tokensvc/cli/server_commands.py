"""`tokensvc dev`, `serve`, `migrate` and `certs issue`: the commands that run the service."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from tokensvc.auth import devpki
from tokensvc.settings import Settings
from tokensvc.settings_sources import load_settings

__all__ = ["add_server_commands"]

DEFAULT_STATE_DIR = Path(".tokensvc-dev")


def add_server_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dev = commands.add_parser(
        "dev",
        help="run tokensvc locally on embedded defaults",
        description=(
            "Run tokensvc for development: on first run, create a dev CA, certificates, a signing "
            "key, trust bundle and pepper under the state dir; start the embedded PostgreSQL; "
            "migrate; serve mTLS gRPC."
        ),
    )
    dev.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="default ./.tokensvc-dev")
    dev.add_argument("--port", type=int, default=50051, help="port on 127.0.0.1 (default 50051)")
    dev.add_argument("--config", type=Path, help="optional TOML config file")
    dev.set_defaults(handler=_dev)

    serve = commands.add_parser(
        "serve",
        help="run tokensvc from settings (production entry point)",
        description="Serve mTLS gRPC with everything taken from TOKENSVC_* variables and --config.",
    )
    serve.add_argument("--config", type=Path, help="TOML config file (or $TOKENSVC_CONFIG)")
    serve.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help=(
            "server processes sharing the port (SO_REUSEPORT) on one large host, each with its own "
            "database pool and metrics port P + index (setting `workers`, default 1; "
            "docs/scaling.md)"
        ),
    )
    serve.set_defaults(handler=_serve)

    migrate = commands.add_parser(
        "migrate",
        help="apply the schema migrations as the schema owner",
        description="Apply pending SQL schema migrations (idempotent; safe to run concurrently).",
    )
    migrate.add_argument("--config", type=Path, help="TOML config file (or $TOKENSVC_CONFIG)")
    migrate.add_argument("--state-dir", type=Path, help="embedded database state dir")
    migrate.add_argument("--json", action="store_true", help="print the result as JSON")
    migrate.set_defaults(handler=_migrate)

    certs = commands.add_parser("certs", help="development certificates")
    certs_commands = certs.add_subparsers(dest="certs_command", required=True, metavar="COMMAND")
    issue = certs_commands.add_parser(
        "issue",
        help="issue a client certificate from the dev CA",
        description="Issue a client certificate with one SPIFFE ID, signed by a dev state dir's CA.",
    )
    issue.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    issue.add_argument("--spiffe-id", required=True, help="e.g. spiffe://dev.local/ns/team/sa/agent")
    issue.add_argument("--out", type=Path, required=True, help="directory for <name>.crt and <name>.key")
    issue.add_argument("--name", default="client", help="file name stem (default client)")
    issue.add_argument("--json", action="store_true", help="print the paths as JSON")
    issue.set_defaults(handler=_certs_issue)


def dev_settings(state_dir: Path, port: int, config: Path | None = None) -> Settings:
    """Settings for `tokensvc dev`: the dev material wired in, reflection on, migrate on start."""
    paths = devpki.ensure_dev_material(state_dir)
    return load_settings(
        config_file=config,
        overrides={
            "state_dir": str(state_dir),
            "listen_address": f"127.0.0.1:{port}",
            "tls_cert_file": str(paths.server_cert),
            "tls_key_file": str(paths.server_key),
            "tls_client_ca_file": str(paths.ca_cert),
            "trust_domain": devpki.DEV_TRUST_DOMAIN,
            "admin_spiffe_ids": [devpki.ADMIN_SPIFFE_ID],
            "control_plane_spiffe_ids": [devpki.CONTROL_PLANE_SPIFFE_ID],
            "trust_bundle_file": str(paths.trust_bundle),
            "pepper_dir": str(paths.pepper_dir),
            "signing_key_file": str(paths.signing_key),
            "reflection": True,
            "migrate_on_start": True,
        },
    )


def _dev(args: argparse.Namespace) -> int:
    from tokensvc.app import run_service
    from tokensvc.logs import configure_logging

    settings = dev_settings(args.state_dir, args.port, args.config)
    configure_logging(settings.log_level)
    state = args.state_dir
    print(
        f"tokensvc dev: serving mTLS gRPC on {settings.listen_address} (state in {state})\n"
        f"  check it:  tokensvc health --state-dir {state}\n"
        f"  launcher certificate: {state}/pki/launcher.crt (SPIFFE ID {devpki.LAUNCHER_SPIFFE_ID})\n"
        "  stop with Ctrl-C",
        file=sys.stderr,
        flush=True,
    )
    asyncio.run(run_service(settings))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from tokensvc.app import run_service
    from tokensvc.logs import configure_logging

    settings = load_settings(config_file=args.config, overrides={"workers": args.workers})
    configure_logging(settings.log_level)
    if settings.workers > 1:
        from tokensvc.workers import run_workers

        return run_workers(settings)
    asyncio.run(run_service(settings))
    return 0


def _migrate(args: argparse.Namespace) -> int:
    from tokensvc.app import locate_database, migrate

    overrides = {"state_dir": str(args.state_dir)} if args.state_dir else {}
    settings = load_settings(config_file=args.config, overrides=overrides)

    async def run() -> list[str]:
        database = await locate_database(settings)
        try:
            return await migrate(database, settings)
        finally:
            await database.close()

    applied = asyncio.run(run())
    if args.json:
        print(json.dumps({"applied": applied}))
    elif applied:
        print("applied: " + ", ".join(applied))
    else:
        print("the schema is up to date")
    return 0


def _certs_issue(args: argparse.Namespace) -> int:
    paths = devpki.DevPaths.for_state_dir(args.state_dir)
    if not paths.ca_key.is_file():
        raise devpki.DevMaterialError(f"{args.state_dir} has no dev CA; run `tokensvc dev` first")
    cert, key = devpki.issue_client_certificate(paths, args.spiffe_id, args.out, args.name)
    if args.json:
        print(json.dumps({"certificate": str(cert), "key": str(key), "spiffe_id": args.spiffe_id}))
    else:
        print(f"certificate: {cert}\nkey: {key}")
    return 0
