"""One frozen Settings object: every setting with its default, its meaning, and the rules between
settings (`Settings.validate`). Where values come from (a TOML file, `TOKENSVC_*` variables, CLI
flags) is `tokensvc.settings_sources`. Secrets are never values here: settings hold *paths* to
secret files, so a repr or a log of the settings cannot leak one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from tokensvc.names import TEXT_CONFIGS, is_sql_identifier

__all__ = ["Settings", "SettingsError"]

_TRUST_DOMAIN = re.compile(r"[a-z0-9._-]{1,255}")
_MIN_EXTRACT_MEMORY = 256 * 1024 * 1024


class SettingsError(ValueError):
    """A setting is missing or invalid; the message names it and says what is expected."""


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass(frozen=True)
class Settings:
    """Everything tokensvc is configured with. Field names are the config-file keys."""

    # --- serving ---------------------------------------------------------------------------
    listen_address: str = field(default="127.0.0.1:50051", metadata=_doc("host:port to serve mTLS gRPC on."))
    tls_cert_file: Path | None = field(default=None, metadata=_doc("Server certificate chain (PEM)."))
    tls_key_file: Path | None = field(default=None, metadata=_doc("Server private key (PEM)."))
    tls_client_ca_file: Path | None = field(
        default=None, metadata=_doc("CA bundle that client certificates must chain to (PEM).")
    )
    trust_domain: str = field(default="dev.local", metadata=_doc("SPIFFE trust domain of callers."))
    reflection: bool = field(default=False, metadata=_doc("Serve gRPC server reflection."))
    shutdown_grace_seconds: float = field(
        default=10.0, metadata=_doc("How long in-flight RPCs may run after SIGTERM.")
    )
    max_connection_age_seconds: float = field(
        default=300.0,
        metadata=_doc("Connections are recycled after this long (bounds certificate rotation)."),
    )
    max_message_bytes: int = field(default=16 * 1024 * 1024, metadata=_doc("Largest gRPC message."))
    workers: int = field(
        default=1,
        metadata=_doc(
            "Server processes sharing listen_address (SO_REUSEPORT) on one large host; each is a full "
            "server with its own database pool (up to pool_max_size connections each) and, with "
            "metrics_address host:P, its own metrics port P + worker index. 1: this process serves. "
            "Under Kubernetes, scale with replicas instead."
        ),
    )

    # --- roles -----------------------------------------------------------------------------
    admin_spiffe_ids: tuple[str, ...] = field(default=(), metadata=_doc("SPIFFE IDs of admins."))
    control_plane_spiffe_ids: tuple[str, ...] = field(
        default=(), metadata=_doc("SPIFFE IDs of the ctxmesh control plane.")
    )
    launcher_spiffe_template: str = field(
        default="spiffe://{trust_domain}/ns/{namespace}/sa/{agent}",
        metadata=_doc("How a launcher's SPIFFE ID is built from a capability's namespace and agent."),
    )

    # --- capabilities and buckets ------------------------------------------------------------
    trust_bundle_file: Path | None = field(
        default=None, metadata=_doc("JWKS of the Ed25519 keys capabilities are signed with.")
    )
    capability_issuers: tuple[str, ...] = field(
        default=("ctxmesh-control-plane",), metadata=_doc("Accepted `iss` values.")
    )
    capability_audience: str = field(default="tokensvc", metadata=_doc("Required `aud` value."))
    capability_max_lifetime_seconds: int = field(
        default=12 * 3600, metadata=_doc("Longest accepted `exp - iat`.")
    )
    capability_leeway_seconds: int = field(
        default=30, metadata=_doc("Clock skew allowed on exp/nbf/iat (at most 60).")
    )
    capability_cache_size: int = field(default=10_000, metadata=_doc("Verified capabilities cached."))
    signing_key_file: Path | None = field(
        default=None,
        metadata=_doc("Private Ed25519 JWK for IssueCapability; unset means this server cannot mint."),
    )
    pepper_dir: Path | None = field(
        default=None, metadata=_doc("Directory of versioned bucket peppers (files v1, v2, ...).")
    )
    shared_session_keys_per_namespace: bool = field(
        default=False,
        metadata=_doc(
            "Qualify shared session keys with the namespace (mem:shared:{namespace}/{registry}:...) "
            "for clusters whose registry names are not unique; off: the documented layout."
        ),
    )
    revocation_poll_seconds: float = field(
        default=1.0, metadata=_doc("How often revocations made by other replicas are picked up.")
    )

    # --- long-term memory -------------------------------------------------------------------
    embedders_file: Path | None = field(
        default=None,
        metadata=_doc(
            "TOML file of embedders ([embedders.NAME]); unset means only the built-in "
            "`multilingual-e5-small` and `hash`."
        ),
    )
    memory_embedder: str = field(
        default="multilingual-e5-small",
        metadata=_doc(
            "Embedder new memory spaces are pinned to at their first write, and new knowledge bases "
            "that name none (the built-in embedded model by default)."
        ),
    )
    embedder_threads: int = field(
        default=2, metadata=_doc("Worker threads of the built-in embedded model (one per core is best).")
    )
    embedder_queue_texts: int = field(
        default=4096,
        metadata=_doc(
            "Texts one tenant may have waiting for one embedder in one class (query, interactive, "
            "bulk); a call past it gets RESOURCE_EXHAUSTED, reason CONCURRENCY_LIMIT (never a call "
            "that finds its tenant's queue empty)."
        ),
    )
    text_search_config: str = field(
        default="english",
        metadata=_doc(
            "PostgreSQL text-search configuration new memory spaces and knowledge bases pin "
            "(`simple` for no stemming)."
        ),
    )
    search_vector_weight: float = field(
        default=0.5,
        metadata=_doc("HYBRID search: weight of the vector score (the text score gets the rest)."),
    )
    search_neighbour_weight: float = field(
        default=0.7,
        metadata=_doc(
            "HYBRID search: how far a result is lifted towards a better-scoring neighbour (0 turns "
            "neighbours off; below 1)."
        ),
    )
    search_candidates: int = field(
        default=50, metadata=_doc("HYBRID and TEXT search: candidates each ranker contributes.")
    )
    memory_exact_search_threshold: int = field(
        default=1000, metadata=_doc("Buckets up to this many rows are searched exactly, larger via HNSW.")
    )
    memory_hnsw_ef_search: int = field(default=100, metadata=_doc("HNSW ef_search (at least 2 x top_k)."))
    memory_hnsw_max_scan_tuples: int = field(
        default=20_000, metadata=_doc("Bound on tuples an iterative HNSW scan visits.")
    )
    memory_sweep_interval_seconds: float = field(
        default=60.0, metadata=_doc("How often expired memories are deleted.")
    )
    memory_space_cache_seconds: float = field(
        default=5.0,
        metadata=_doc("How long a replica trusts a memory space's pin before reading it again."),
    )
    migration_lease_seconds: float = field(
        default=30.0,
        metadata=_doc("An embedding migration runner's lease: another replica takes over after it."),
    )
    migration_retire_seconds: float = field(
        default=60.0,
        metadata=_doc(
            "How long old vectors stay after a migration's cutover (> memory_space_cache_seconds)."
        ),
    )
    migration_batch_size: int = field(
        default=0,
        metadata=_doc(
            "Texts (memories or chunks) per migration embedding batch; 0: the target embedder's batch size."
        ),
    )
    migration_pause_after_failures: int = field(
        default=5, metadata=_doc("Consecutive embedder failures after which a migration pauses.")
    )
    migration_parallel: int = field(
        default=2,
        metadata=_doc("Migrations one replica drives at once (a slow one does not hold the others back)."),
    )

    knowledge_ingest_parallel: int = field(
        default=2,
        metadata=_doc(
            "Uploaded documents one replica ingests at once in the background (0: none; other replicas do)."
        ),
    )
    knowledge_ingest_lease_seconds: float = field(
        default=30.0,
        metadata=_doc("A background ingestion's lease: another replica resumes a document after it."),
    )
    knowledge_ingest_batch_size: int = field(
        default=0,
        metadata=_doc("Chunks per ingestion embedding batch and commit; 0: the embedder's batch size."),
    )
    knowledge_ingest_failures: int = field(
        default=5,
        metadata=_doc("Consecutive embedder failures after which an ingestion ends FAILED."),
    )

    knowledge_max_upload_bytes: int = field(
        default=64 * 1024 * 1024, metadata=_doc("Largest document UploadDocument accepts.")
    )
    knowledge_extract_workers: int = field(
        default=2,
        metadata=_doc(
            "Processes that extract and chunk uploaded documents (started at the first ingestion); "
            "one still working when its ingestion stops (the replica stops) is killed."
        ),
    )
    knowledge_extract_seconds: float = field(
        default=60.0,
        metadata=_doc(
            "Longest one document may take to extract and chunk; beyond, its version ends FAILED (an "
            "upload that waits: INVALID_ARGUMENT, reason PAYLOAD_TOO_LARGE)."
        ),
    )
    knowledge_extract_memory_bytes: int = field(
        default=2 * 1024 * 1024 * 1024,
        metadata=_doc(
            "Address space of one extraction process (RLIMIT_AS; about 170 MiB of it is the process "
            "itself); a document needing more is refused, INVALID_ARGUMENT, reason PAYLOAD_TOO_LARGE."
        ),
    )
    knowledge_extract_max_pages: int = field(
        default=5_000,
        metadata=_doc("Most pages of a PDF extracted; a longer one is refused (PAYLOAD_TOO_LARGE)."),
    )
    knowledge_extract_max_slides: int = field(
        default=2_000, metadata=_doc("Most slides of a PPTX extracted; more is refused (PAYLOAD_TOO_LARGE).")
    )
    knowledge_extract_max_sheets: int = field(
        default=100, metadata=_doc("Most sheets of an XLSX extracted; more is refused (PAYLOAD_TOO_LARGE).")
    )
    knowledge_extract_max_cells: int = field(
        default=10_000_000,
        metadata=_doc(
            "Most non-empty cells of a spreadsheet or CSV read; more is refused (PAYLOAD_TOO_LARGE)."
        ),
    )
    knowledge_extract_max_unpacked_bytes: int = field(
        default=512 * 1024 * 1024,
        metadata=_doc(
            "Most bytes a DOCX, PPTX or XLSX may unpack to (its zip directory says, read before any "
            "parsing), and at most 200 times its packed size: more is refused as a decompression bomb."
        ),
    )

    # --- database --------------------------------------------------------------------------
    state_dir: Path = field(
        default=Path(".tokensvc-dev"),
        metadata=_doc("Directory for the embedded database and dev material."),
    )
    database_dsn: str | None = field(
        default=None,
        metadata=_doc(
            "postgresql://host:port/dbname of an external PostgreSQL, without credentials; "
            "unset means the embedded PostgreSQL in state_dir."
        ),
    )
    database_credential_dir: Path | None = field(
        default=None,
        metadata=_doc("Directory with `username` and `password` files of the serving role."),
    )
    database_owner_credential_dir: Path | None = field(
        default=None,
        metadata=_doc("Directory with `username` and `password` of the schema owner (schema migrations)."),
    )
    database_rotator_credential_dir: Path | None = field(
        default=None,
        metadata=_doc(
            "`username`/`password` of the rotator role (CREATEROLE) for ROTATE; embedded: generated."
        ),
    )
    database_runner_credential_dir: Path | None = field(
        default=None,
        metadata=_doc(
            "`username`/`password` of the re-embedding runner's login role (a member of "
            "database_runner_role); unset with database_dsn: this replica runs no re-embedding migrations; "
            "embedded: generated."
        ),
    )
    database_runner_role: str = field(
        default="tokensvc_runner",
        metadata=_doc("Group role that holds the re-embedding runner's grants (migration 0021)."),
    )
    database_login_roles: tuple[str, ...] = field(
        default=("tokensvc_app_a", "tokensvc_app_b"),
        metadata=_doc(
            "The two alternating login roles ROTATE switches between (members of database_app_role)."
        ),
    )
    database_runner_login_roles: tuple[str, ...] = field(
        default=("tokensvc_runner_a", "tokensvc_runner_b"),
        metadata=_doc(
            "The two alternating login roles the runner's ROTATE switches between (members of "
            "database_runner_role)."
        ),
    )
    credential_watch_seconds: float = field(
        default=1.0, metadata=_doc("How often the secret source is checked for an external change.")
    )
    database_app_role: str = field(
        default="tokensvc_app", metadata=_doc("Group role that holds the serving grants.")
    )
    pool_min_size: int = field(default=2, metadata=_doc("Connections kept open."))
    pool_max_size: int = field(default=10, metadata=_doc("Most connections at once."))
    database_connect_timeout_seconds: float = field(
        default=5.0, metadata=_doc("Bound on one connection attempt.")
    )
    migrate_on_start: bool = field(
        default=False, metadata=_doc("Apply the schema migrations when serving starts.")
    )

    # --- observability and limits ------------------------------------------------------------
    otlp_endpoint: str | None = field(
        default=None,
        metadata=_doc("OTLP/gRPC endpoint for traces (e.g. http://otel-collector:4317); unset: none."),
    )
    metrics_address: str | None = field(
        default=None,
        metadata=_doc("host:port of the Prometheus /metrics endpoint; unset: no metrics server."),
    )
    max_concurrent_rpcs_per_caller: int = field(
        default=64,
        metadata=_doc("In-flight RPCs one caller (SPIFFE ID) may have; beyond: RESOURCE_EXHAUSTED."),
    )
    health_check_interval_seconds: float = field(
        default=1.0, metadata=_doc("How often the database is probed for the health service.")
    )

    # --- logging ---------------------------------------------------------------------------
    log_level: str = field(default="INFO", metadata=_doc("DEBUG, INFO, WARNING or ERROR."))

    @property
    def embedded_database(self) -> bool:
        return self.database_dsn is None

    def validate(self) -> Settings:
        """Check cross-field rules; returns self so calls chain."""
        _check_address("listen_address", self.listen_address)
        if not _TRUST_DOMAIN.fullmatch(self.trust_domain):
            raise SettingsError(f"trust_domain: {self.trust_domain!r} is not a valid SPIFFE trust domain")
        for name in ("admin_spiffe_ids", "control_plane_spiffe_ids"):
            for spiffe_id in getattr(self, name):
                if not spiffe_id.startswith("spiffe://") or len(spiffe_id) <= len("spiffe://"):
                    raise SettingsError(f"{name}: {spiffe_id!r} is not a spiffe:// ID")
        for placeholder in ("{namespace}", "{agent}"):
            if placeholder not in self.launcher_spiffe_template:
                raise SettingsError(f"launcher_spiffe_template: must contain {placeholder}")
        _check_login_roles("database_login_roles", self.database_login_roles)
        _check_login_roles("database_runner_login_roles", self.database_runner_login_roles)
        if set(self.database_runner_login_roles) & set(self.database_login_roles):
            raise SettingsError("database_runner_login_roles: must not be database_login_roles")
        if self.credential_watch_seconds <= 0:
            raise SettingsError("credential_watch_seconds: must be greater than 0")
        if not is_sql_identifier(self.database_app_role):
            raise SettingsError("database_app_role: must be a lower-case SQL identifier")
        if self.pool_min_size < 0 or self.pool_max_size < 1 or self.pool_min_size > self.pool_max_size:
            raise SettingsError("pool_min_size/pool_max_size: need 0 <= min <= max and max >= 1")
        for name in (
            "shutdown_grace_seconds",
            "database_connect_timeout_seconds",
            "max_connection_age_seconds",
        ):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name}: must be greater than 0")
        self._validate_capabilities()
        self._validate_memory_and_limits()
        return self._validate_database()

    def _validate_capabilities(self) -> None:
        if not 0 <= self.capability_leeway_seconds <= 60:
            raise SettingsError("capability_leeway_seconds: must be between 0 and 60")
        if self.capability_max_lifetime_seconds < 60:
            raise SettingsError("capability_max_lifetime_seconds: must be at least 60")
        if not self.capability_issuers or not self.capability_audience:
            raise SettingsError("capability_issuers/capability_audience: must not be empty")
        if self.capability_cache_size < 0:
            raise SettingsError("capability_cache_size: must not be negative")
        if not 0 < self.revocation_poll_seconds <= 5:
            raise SettingsError("revocation_poll_seconds: must be in (0, 5] so revocations apply within 5 s")

    def _validate_migrations(self) -> None:
        if self.memory_space_cache_seconds <= 0:
            raise SettingsError("memory_space_cache_seconds: must be greater than 0")
        if self.migration_lease_seconds < 1:
            raise SettingsError("migration_lease_seconds: must be at least 1")
        if self.migration_retire_seconds <= 2 * self.memory_space_cache_seconds:
            # A replica that read the old pin just before the cutover searches the old vectors.
            raise SettingsError(
                "migration_retire_seconds: must be more than twice memory_space_cache_seconds"
            )
        if not 0 <= self.migration_batch_size <= 4096:
            raise SettingsError("migration_batch_size: must be between 0 and 4096")
        if self.migration_pause_after_failures < 1:
            raise SettingsError("migration_pause_after_failures: must be at least 1")
        if not 1 <= self.migration_parallel <= 16:
            raise SettingsError("migration_parallel: must be between 1 and 16")

    def _validate_search(self) -> None:
        if not 0.0 <= self.search_vector_weight <= 1.0:
            raise SettingsError("search_vector_weight: must be between 0 and 1")
        if not 0.0 <= self.search_neighbour_weight < 1.0:
            raise SettingsError("search_neighbour_weight: must be at least 0 and below 1")
        if self.text_search_config not in TEXT_CONFIGS:
            raise SettingsError(
                f"text_search_config: {self.text_search_config!r} is not one of {', '.join(sorted(TEXT_CONFIGS))}"
            )

    def _validate_memory_and_limits(self) -> None:
        for name in (
            "memory_exact_search_threshold",
            "memory_hnsw_ef_search",
            "memory_hnsw_max_scan_tuples",
            "embedder_threads",
            "embedder_queue_texts",
            "search_candidates",
        ):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name}: must be at least 1")
        self._validate_search()
        self._validate_knowledge()
        if self.memory_sweep_interval_seconds <= 0:
            raise SettingsError("memory_sweep_interval_seconds: must be greater than 0")
        self._validate_migrations()
        if self.metrics_address is not None:
            _check_address("metrics_address", self.metrics_address)
        if self.otlp_endpoint is not None and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise SettingsError("otlp_endpoint: must start with http:// or https://")
        if self.max_concurrent_rpcs_per_caller < 1:
            raise SettingsError("max_concurrent_rpcs_per_caller: must be at least 1")
        if self.health_check_interval_seconds <= 0:
            raise SettingsError("health_check_interval_seconds: must be greater than 0")
        self._validate_workers()
        if self.max_message_bytes < 64 * 1024:
            raise SettingsError("max_message_bytes: must be at least 65536")
        if self.log_level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise SettingsError(f"log_level: {self.log_level!r} is not DEBUG, INFO, WARNING or ERROR")

    def _validate_knowledge(self) -> None:
        if self.knowledge_max_upload_bytes < 1:
            raise SettingsError("knowledge_max_upload_bytes: must be at least 1")
        if not 0 <= self.knowledge_ingest_parallel <= 16:
            raise SettingsError("knowledge_ingest_parallel: must be between 0 and 16")
        if self.knowledge_ingest_lease_seconds < 1:
            raise SettingsError("knowledge_ingest_lease_seconds: must be at least 1")
        if not 0 <= self.knowledge_ingest_batch_size <= 4096:
            raise SettingsError("knowledge_ingest_batch_size: must be between 0 and 4096")
        if self.knowledge_ingest_failures < 1:
            raise SettingsError("knowledge_ingest_failures: must be at least 1")
        if self.knowledge_extract_workers < 1:
            raise SettingsError("knowledge_extract_workers: must be at least 1")
        for name in (
            "knowledge_extract_max_pages",
            "knowledge_extract_max_slides",
            "knowledge_extract_max_sheets",
            "knowledge_extract_max_cells",
            "knowledge_extract_max_unpacked_bytes",
        ):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name}: must be at least 1")
        if self.knowledge_extract_seconds <= 0:
            raise SettingsError("knowledge_extract_seconds: must be greater than 0")
        if self.knowledge_extract_memory_bytes < _MIN_EXTRACT_MEMORY:
            raise SettingsError(
                f"knowledge_extract_memory_bytes: must be at least {_MIN_EXTRACT_MEMORY} (256 MiB): "
                "an extraction process needs about 170 MiB of address space before any document"
            )

    def _validate_workers(self) -> None:
        if not 1 <= self.workers <= 256:
            raise SettingsError("workers: must be between 1 and 256")
        if self.workers == 1:
            return
        if self.listen_address.rpartition(":")[2] == "0":
            raise SettingsError(
                "listen_address: workers > 1 share one port, so it cannot be 0 (any free port)"
            )
        if self.metrics_address is not None:
            port = int(self.metrics_address.rpartition(":")[2])
            if port != 0 and port + self.workers - 1 > 65535:
                raise SettingsError(
                    f"metrics_address: worker metrics ports {port}..{port + self.workers - 1} pass 65535"
                )

    def _validate_database(self) -> Settings:
        if (
            not is_sql_identifier(self.database_runner_role)
            or self.database_runner_role == self.database_app_role
        ):
            raise SettingsError(
                "database_runner_role: must be a lower-case SQL identifier other than database_app_role"
            )
        if self.database_dsn is not None:
            if not self.database_dsn.startswith(("postgresql://", "postgres://")):
                raise SettingsError("database_dsn: must start with postgresql://")
            if "@" in self.database_dsn.split("//", 1)[1].split("/", 1)[0]:
                raise SettingsError("database_dsn: must not carry credentials; use database_credential_dir")
            if self.database_credential_dir is None:
                raise SettingsError("database_credential_dir: required when database_dsn is set")
        return self

    def require_capability_files(self) -> tuple[Path, Path]:
        """The trust bundle and pepper directory every launcher RPC needs."""
        missing = [name for name in ("trust_bundle_file", "pepper_dir") if getattr(self, name) is None]
        if missing:
            raise SettingsError(f"{', '.join(missing)}: required to serve")
        assert self.trust_bundle_file is not None
        assert self.pepper_dir is not None
        return self.trust_bundle_file, self.pepper_dir

    def require_tls_files(self) -> tuple[Path, Path, Path]:
        """The server's TLS files; there is no plaintext mode, so serving needs all three."""
        missing = [
            name
            for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file")
            if getattr(self, name) is None
        ]
        if missing:
            raise SettingsError(f"{', '.join(missing)}: required to serve (mTLS only, no plaintext port)")
        assert self.tls_cert_file is not None
        assert self.tls_key_file is not None
        assert self.tls_client_ca_file is not None
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
            path: Path = getattr(self, name)
            if not path.is_file():
                raise SettingsError(f"{name}: {path} does not exist or is not a file")
        return self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file


def _check_login_roles(name: str, roles: tuple[str, ...]) -> None:
    if len(roles) != 2 or len(set(roles)) != 2 or not all(is_sql_identifier(role) for role in roles):
        raise SettingsError(f"{name}: must be two different lower-case SQL identifiers")


def _check_address(name: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise SettingsError(f"{name}: {value!r} is not host:port")


# --- parsing -----------------------------------------------------------------------------------
