"""Composition root: settings -> database -> domain -> servicers -> mTLS gRPC server.

`Service` is what `tokensvc serve`/`dev` run and what tests start in-process. Lifecycle:
`start()` opens the database (embedded or configured), checks the schema, binds the mTLS port
and marks health SERVING; `stop()` flips health to NOT_SERVING, lets in-flight RPCs finish within
the grace period, then closes the pool and the embedded database.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import _async as health_aio  # re-exported as health.aio; named for mypy
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tokensvc.admin import Administration
from tokensvc.api.edge import EdgeInterceptor
from tokensvc.api.policy import POLICIES, RpcPolicy
from tokensvc.api.servicers import Domain, register_servicers, service_names
from tokensvc.audit import AuditLog
from tokensvc.auth.authenticator import Authenticator
from tokensvc.auth.buckets import PepperKeyring
from tokensvc.auth.capabilities import CapabilityVerifier
from tokensvc.auth.identity import IdentityPolicy
from tokensvc.auth.issuer import CapabilityIssuer
from tokensvc.auth.keyset import TrustBundle
from tokensvc.auth.operations import CapabilityOperations
from tokensvc.auth.revocation import RevocationList
from tokensvc.credentials.custody import CredentialCustodian
from tokensvc.embedders import EmbedderRegistry, load_embedders
from tokensvc.knowledge.extraction_pool import ExtractionPool
from tokensvc.knowledge.formats import ExtractionLimits
from tokensvc.knowledge.ingestion import IngestionRunner, IngestionSettings
from tokensvc.knowledge.service import KnowledgeBases
from tokensvc.memory.data_subjects import DataSubjectRequests
from tokensvc.memory.service import LongTermMemory
from tokensvc.observability import METRICS, Vitals, configure_tracing, start_metrics_server
from tokensvc.reembedding import EmbeddingMigrations, MigrationRunner, RunnerSettings
from tokensvc.retrieval import FusionWeights, RetrievalEngine, SearchTuning
from tokensvc.settings import Settings, SettingsError
from tokensvc.storage.caching import CachingKnowledgeStore, CachingMemoryStore
from tokensvc.storage.ports import ConnectionPool
from tokensvc.storage.postgres import Database, DatabaseLocation
from tokensvc.storage.postgres.audit import PostgresAuditStore
from tokensvc.storage.postgres.data_subjects import PostgresDataSubjectStore
from tokensvc.storage.postgres.ingestion import PostgresIngestionStore
from tokensvc.storage.postgres.knowledge import PostgresKnowledgeStore
from tokensvc.storage.postgres.logins import PostgresLogins
from tokensvc.storage.postgres.memories import PostgresMemoryStore
from tokensvc.storage.postgres.monitoring import PostgresHealth, PostgresStatistics
from tokensvc.storage.postgres.reembedding import PostgresEmbeddingMigrationStore
from tokensvc.storage.postgres.revocations import PostgresRevocationStore
from tokensvc.storage.postgres.rotations import CREDENTIALS, PostgresRotationJournal
from tokensvc.storage.postgres.vector_indexes import PostgresVectorIndexes
from tokensvc.supervision import (
    HealthMonitor,
    finish_vector_indexes_forever,
    refresh_gauges_forever,
    sweep_forever,
)
from tokensvc.tls import ReloadingServerCredentials, TlsMaterialError

__all__ = ["Service", "run_service"]

_log = logging.getLogger(__name__)


# How often the gauges read from the database (memories per space, open rotations, re-embedding migrations)
# are refreshed: the alerts on them wait 15 minutes or more, every replica runs the same reads,
# and counting memories per space scans the memories table.
_DATABASE_GAUGE_SECONDS = 60.0
# How often each replica looks in the catalogue for vector-index builds to finish: a first write
# of a new dimension on Citus starts one, and search is exact on its partitions until it ends.
_VECTOR_INDEX_SECONDS = 5.0


class SchemaOutdated(RuntimeError):
    """The database schema is behind this tokensvc; `tokensvc migrate` fixes it."""


@dataclass
class Service:
    """One tokensvc server: its database, gRPC server and health state."""

    settings: Settings
    extra_handlers: Sequence[grpc.GenericRpcHandler[Any, Any]] = ()
    # Who may call each extra handler's methods (extra handlers are deny-by-default too).
    extra_policies: Mapping[str, RpcPolicy] = field(default_factory=dict)
    database: Database | None = None
    server: grpc.aio.Server | None = None
    health: Any = field(default_factory=lambda: health_aio.HealthServicer())  # noqa: PLW0108
    port: int = 0
    authenticator: Authenticator | None = None
    revocations: RevocationList | None = None
    embedders: EmbedderRegistry | None = None
    memory: LongTermMemory | None = None
    knowledge: KnowledgeBases | None = None
    extraction: ExtractionPool | None = None
    migration_runner: MigrationRunner | None = None
    ingestion_runner: IngestionRunner | None = None
    audit: AuditLog | None = None
    custodian: CredentialCustodian | None = None
    # The re-embedding runner's credential (None: this replica runs no re-embedding migrations).
    runner_custodian: CredentialCustodian | None = None
    tls: ReloadingServerCredentials | None = None
    monitor: HealthMonitor | None = None
    _stop_metrics: Callable[[], None] | None = None
    _unwatch_vitals: Callable[[], None] | None = None
    _draining: bool = False  # stop() has begun: health is NOT_SERVING, and so is the gauge
    _background: list[asyncio.Task[None]] = field(default_factory=list)

    async def start(self) -> None:
        """Check every file and setting, open the database, build the domain, serve."""
        configure_tracing(self.settings.otlp_endpoint)
        self.tls = self._tls()
        bundle_file, pepper_dir = self.settings.require_capability_files()
        bundle = TrustBundle(bundle_file)
        bundle.load()
        keyring = _load_keyring(pepper_dir)
        issuer = self._issuer()
        self.embedders = self._embedders()

        database = await self._open_database()
        self.revocations = RevocationList(
            PostgresRevocationStore(database.pool, database.connect),
            poll_seconds=self.settings.revocation_poll_seconds,
        )
        await self.revocations.start()
        identities = self._identities()
        self.authenticator = self._authenticator(bundle, keyring, identities)
        domain = self._domain(database, bundle, keyring, issuer)
        self.server = self._server(domain, identities)
        self.port = self.server.add_secure_port(self.settings.listen_address, self.tls.credentials())
        if self.port == 0:
            raise SettingsError(f"listen_address: cannot bind {self.settings.listen_address}")
        await self.server.start()
        await self._publish_health(True)
        self._start_background(database)
        _log.info("serving", extra={"address": self.settings.listen_address, "port": self.port})

    def _tls(self) -> ReloadingServerCredentials:
        cert_file, key_file, ca_file = self.settings.require_tls_files()
        try:
            return ReloadingServerCredentials(cert_file, key_file, ca_file)
        except TlsMaterialError as exc:
            raise SettingsError(f"tls_cert_file/tls_key_file/tls_client_ca_file: {exc}") from None

    def _embedders(self) -> EmbedderRegistry:
        embedders = load_embedders(
            self.settings.embedders_file,
            local_threads=self.settings.embedder_threads,
            tenant_queue_texts=self.settings.embedder_queue_texts,
        )
        if self.settings.memory_embedder not in embedders.names:
            raise SettingsError(
                f"memory_embedder: {self.settings.memory_embedder!r} is not a configured embedder "
                f"({', '.join(embedders.names)})"
            )
        return embedders

    async def _open_database(self) -> Database:
        """Locate (or start) the database, migrate if asked, open the pool, recover rotations."""
        database = self.database = await locate_database(self.settings)
        if self.settings.migrate_on_start:
            await migrate(database, self.settings)
        target = database.target
        self.custodian = CredentialCustodian(
            source=target.app_credentials,
            rotator=target.rotator_credentials,
            login_roles=(self.settings.database_login_roles[0], self.settings.database_login_roles[1]),
            logins=PostgresLogins(target),
        )
        pool = await database.open_pool(self.custodian.credential_for_new_connection)
        if target.runner_credentials is None:
            _log.warning(
                "no database_runner_credential_dir: this replica runs no re-embedding migrations "
                "and no background ingestion (it queues uploads for the replicas that do)"
            )
        else:
            # The background runners' own pool and role (migration 0021), with a custodian of
            # its own (rotated like the serving one): a batch may run on each parallel migration
            # while the next is read, and a write on each parallel ingestion (and on each upload
            # that waits) while its lease is renewed.
            roles = self.settings.database_runner_login_roles
            self.runner_custodian = CredentialCustodian(
                source=target.runner_credentials,
                rotator=target.rotator_credentials,
                login_roles=(roles[0], roles[1]),
                logins=PostgresLogins(target),
                subject="runner database credential",
            )
            await database.open_runner_pool(
                self.runner_custodian.credential_for_new_connection,
                2 * (self.settings.migration_parallel + self.settings.knowledge_ingest_parallel) + 2,
            )
        await self._check_schema()
        self.audit = AuditLog(PostgresAuditStore(pool))
        self.custodian.attach(pool, PostgresRotationJournal(pool), self.audit)
        await self.custodian.recover()
        if self.runner_custodian is not None and database.runner_pool is not None:
            # Its journal is the service's record, written by the serving pool like the other.
            self.runner_custodian.attach(
                database.runner_pool, PostgresRotationJournal(pool, "runner"), self.audit
            )
            await self.runner_custodian.recover()
        return database

    def _authenticator(
        self, bundle: TrustBundle, keyring: PepperKeyring, identities: IdentityPolicy
    ) -> Authenticator:
        assert self.revocations is not None
        return Authenticator(
            verifier=CapabilityVerifier(
                bundle,
                issuers=self.settings.capability_issuers,
                audience=self.settings.capability_audience,
                max_lifetime_seconds=self.settings.capability_max_lifetime_seconds,
                leeway_seconds=self.settings.capability_leeway_seconds,
            ),
            bundle=bundle,
            keyring=keyring,
            revocations=self.revocations,
            launcher_id=identities.launcher_id,
            cache_size=self.settings.capability_cache_size,
        )

    def _domain(
        self, database: Database, bundle: TrustBundle, keyring: PepperKeyring, issuer: CapabilityIssuer | None
    ) -> Domain:
        assert self.embedders is not None
        assert self.audit is not None
        assert self.custodian is not None
        assert self.revocations is not None
        settings = self.settings
        pool = database.pool
        tuning = SearchTuning(
            exact_threshold=settings.memory_exact_search_threshold,
            ef_search=settings.memory_hnsw_ef_search,
            max_scan_tuples=settings.memory_hnsw_max_scan_tuples,
            candidates=settings.search_candidates,
        )
        fusion = FusionWeights(
            vector=settings.search_vector_weight, neighbour=settings.search_neighbour_weight
        )
        memories = PostgresMemoryStore(pool)
        self.memory = LongTermMemory(
            # Serving reuses pins and row counts for a while; re-embedding reads the store itself.
            CachingMemoryStore(memories, pin_seconds=settings.memory_space_cache_seconds),
            self.embedders,
            default_embedder=settings.memory_embedder,
            default_text_config=settings.text_search_config,
            engine=RetrievalEngine(tuning, fusion),
        )
        migration_store = PostgresEmbeddingMigrationStore(
            pool, runner_pool=database.runner_pool, distributed=database.citus is not None
        )
        self.migration_runner = MigrationRunner(
            migration_store,
            self.embedders,
            self.audit,
            RunnerSettings(
                lease_seconds=settings.migration_lease_seconds,
                retire_seconds=settings.migration_retire_seconds,
                pause_after=settings.migration_pause_after_failures,
                batch_size=settings.migration_batch_size,
                parallel=settings.migration_parallel,
            ),
        )
        self.extraction = ExtractionPool(
            settings.knowledge_extract_workers,
            settings.knowledge_extract_seconds,
            settings.knowledge_extract_memory_bytes,
            ExtractionLimits(
                max_pages=settings.knowledge_extract_max_pages,
                max_slides=settings.knowledge_extract_max_slides,
                max_sheets=settings.knowledge_extract_max_sheets,
                max_cells=settings.knowledge_extract_max_cells,
                max_uncompressed_bytes=settings.knowledge_extract_max_unpacked_bytes,
            ),
        )
        knowledge = PostgresKnowledgeStore(pool)
        # Background ingestion runs as the runner role, as re-embedding does: without its
        # credential this replica queues uploads and another replica ingests them.
        ingestions = PostgresIngestionStore(pool, database.runner_pool)
        if database.runner_pool is not None:
            self.ingestion_runner = IngestionRunner(
                ingestions,
                self.embedders,
                self.extraction,
                IngestionSettings(
                    lease_seconds=settings.knowledge_ingest_lease_seconds,
                    pause_after=settings.knowledge_ingest_failures,
                    batch_size=settings.knowledge_ingest_batch_size,
                    parallel=max(1, settings.knowledge_ingest_parallel),
                ),
            )
        self.knowledge = KnowledgeBases(
            CachingKnowledgeStore(knowledge),
            self.embedders,
            audit=self.audit,
            ingestions=ingestions,
            ingestion=self.ingestion_runner,
            default_embedder=settings.memory_embedder,
            default_text_config=settings.text_search_config,
            # A corpus is searched exactly up to 5x the bucket threshold: chunks are fewer, longer
            # rows than memories and a whole corpus is one search's scope.
            engine=RetrievalEngine(
                dataclasses.replace(tuning, exact_threshold=5 * settings.memory_exact_search_threshold),
                fusion,
            ),
        )
        return Domain(
            capabilities=CapabilityOperations(
                revocations=self.revocations,
                issuer=issuer,
                audit=self.audit,
                qualify_shared_keys=settings.shared_session_keys_per_namespace,
            ),
            memory=self.memory,
            knowledge=self.knowledge,
            max_upload_bytes=settings.knowledge_max_upload_bytes,
            administration=Administration(
                custodian=self.custodian,
                runner_custodian=self.runner_custodian,
                bundle=bundle,
                keyring=keyring,
                audit=self.audit,
                statistics=PostgresStatistics(pool),
            ),
            migrations=EmbeddingMigrations(
                migration_store,
                memories,
                self.embedders,
                self.audit,
                knowledge=knowledge,
                wake=self.migration_runner.wake,
            ),
            data_subjects=DataSubjectRequests(PostgresDataSubjectStore(pool), lambda: keyring, self.audit),
        )

    def _server(self, domain: Domain, identities: IdentityPolicy) -> grpc.aio.Server:
        settings = self.settings
        server = grpc.aio.server(
            interceptors=[
                EdgeInterceptor(
                    identities,
                    self.authenticator,
                    {**POLICIES, **self.extra_policies},
                    max_in_flight_per_caller=settings.max_concurrent_rpcs_per_caller,
                )
            ],
            options=[
                ("grpc.max_receive_message_length", settings.max_message_bytes),
                ("grpc.max_send_message_length", settings.max_message_bytes),
                # A capability may be 8 KiB; gRPC's default 8 KiB metadata budget (all headers
                # together) would shed such calls with RESOURCE_EXHAUSTED.
                ("grpc.max_metadata_size", 32 * 1024),
                ("grpc.absolute_max_metadata_size", 64 * 1024),
                # One process per port unless scaling on one host is asked for (`workers` > 1,
                # tokensvc/workers.py): then every worker binds the same port and the kernel
                # spreads connections over them.
                ("grpc.so_reuseport", 1 if settings.workers > 1 else 0),
                # Connections older than this are closed (after a grace period for in-flight RPCs),
                # so a reloaded certificate reaches every client in bounded time.
                ("grpc.max_connection_age_ms", int(settings.max_connection_age_seconds * 1000)),
                ("grpc.max_connection_age_grace_ms", int(settings.shutdown_grace_seconds * 1000)),
            ],
        )
        register_servicers(server, domain)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if settings.reflection:
            health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
            reflection.enable_server_reflection(
                [*service_names(), health_name, reflection.SERVICE_NAME], server
            )
        for handler in self.extra_handlers:
            server.add_generic_rpc_handlers((handler,))
        return server

    async def _publish_health(self, serving: bool) -> None:
        """Every service's gRPC health status (and the server's, named "")."""
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *service_names()):
            await self.health.set(name, status)

    def _start_background(self, database: Database) -> None:
        assert self.custodian is not None
        assert self.memory is not None
        assert self.migration_runner is not None
        settings = self.settings
        pool = database.pool
        self.monitor = HealthMonitor(
            PostgresHealth(pool, probe_timeout=settings.database_connect_timeout_seconds),
            self._publish_health,
            embedded=database.embedded,
            interval=settings.health_check_interval_seconds,
        )
        duties = {
            "health-monitor": self.monitor.run(),
            "credential-watch": self.custodian.watch(settings.credential_watch_seconds),
            "memory-sweeper": sweep_forever(self.memory, settings.memory_sweep_interval_seconds),
            "vector-indexes": finish_vector_indexes_forever(
                PostgresVectorIndexes(pool), _VECTOR_INDEX_SECONDS
            ),
            "database-gauges": refresh_gauges_forever(
                PostgresStatistics(pool),
                [PostgresRotationJournal(pool, credential) for credential in CREDENTIALS],
                PostgresEmbeddingMigrationStore(pool),
                _DATABASE_GAUGE_SECONDS,
                PostgresIngestionStore(pool),
            ),
        }
        if self.ingestion_runner is not None and settings.knowledge_ingest_parallel > 0:
            duties["knowledge-ingestion"] = self.ingestion_runner.run()
        if database.runner_pool is not None:
            duties["embedding-migrations"] = self.migration_runner.run()
        if self.runner_custodian is not None:
            duties["runner-credential-watch"] = self.runner_custodian.watch(settings.credential_watch_seconds)
        self._background += [asyncio.create_task(duty, name=name) for name, duty in duties.items()]
        assert self.embedders is not None
        METRICS.initialise(self.embedders.names)
        self._unwatch_vitals = METRICS.live.watch(lambda: self._vitals(pool))
        if settings.metrics_address is not None:
            self._stop_metrics = start_metrics_server(settings.metrics_address)

    def _vitals(self, pool: ConnectionPool) -> Vitals:
        """What every scrape reads of this service (tokensvc/observability/metrics.py)."""
        revocations = self.revocations
        size = pool.get_size()
        return Vitals(
            pool_open=size,
            pool_in_use=max(0, size - pool.get_idle_size()),  # two reads: never below 0
            pool_max=pool.get_max_size(),
            serving=not self._draining and (self.monitor is None or self.monitor.serving),
            revocation_age_seconds=revocations.age_seconds if revocations is not None else 0.0,
            revocation_max_staleness_seconds=revocations.max_staleness if revocations is not None else 0.0,
        )

    def _issuer(self) -> CapabilityIssuer | None:
        if self.settings.signing_key_file is None:
            return None
        try:
            return CapabilityIssuer.from_file(
                self.settings.signing_key_file,
                issuer=self.settings.capability_issuers[0],
                audience=self.settings.capability_audience,
                max_lifetime=self.settings.capability_max_lifetime_seconds,
            )
        except (OSError, ValueError) as exc:
            raise SettingsError(f"signing_key_file: {exc}") from None

    def _identities(self) -> IdentityPolicy:
        return IdentityPolicy(
            trust_domain=self.settings.trust_domain,
            launcher_template=self.settings.launcher_spiffe_template,
            admin_ids=self.settings.admin_spiffe_ids,
            control_plane_ids=self.settings.control_plane_spiffe_ids,
        )

    async def _check_schema(self) -> None:
        assert self.database is not None
        have, want = await self.database.schema_versions()
        if have < want:
            raise SchemaOutdated(
                f"the database schema is at version {have}, this tokensvc needs {want}: "
                "run `tokensvc migrate` (or set migrate_on_start)"
            )

    async def stop(self, grace: float | None = None) -> None:
        """Drain: NOT_SERVING first (so load balancers move on), then finish in-flight RPCs."""
        grace = self.settings.shutdown_grace_seconds if grace is None else grace
        self._draining = True
        await self.health.enter_graceful_shutdown()
        if self.server is not None:
            await self.server.stop(grace)
        if self.revocations is not None:
            await self.revocations.stop()
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.ingestion_runner is not None:
            await self.ingestion_runner.close()
        if self.embedders is not None:
            await self.embedders.aclose()
        if self.extraction is not None:
            await asyncio.to_thread(self.extraction.close)
        if self._stop_metrics is not None:
            await asyncio.to_thread(self._stop_metrics)
        if self._unwatch_vitals is not None:
            self._unwatch_vitals()
        if self.database is not None:
            await self.database.close()
        _log.info("stopped")

    async def wait(self) -> None:
        assert self.server is not None
        await self.server.wait_for_termination()


def _load_keyring(pepper_dir: Path) -> PepperKeyring:
    try:
        return PepperKeyring.load(pepper_dir)
    except ValueError as exc:
        raise SettingsError(f"pepper_dir: {exc}") from None


def database_location(settings: Settings) -> DatabaseLocation:
    """What the database layer needs of the settings."""
    return DatabaseLocation(
        dsn=settings.database_dsn,
        state_dir=settings.state_dir,
        connect_timeout=settings.database_connect_timeout_seconds,
        pool_sizes=(settings.pool_min_size, settings.pool_max_size),
        app_credential_dir=settings.database_credential_dir,
        owner_credential_dir=settings.database_owner_credential_dir,
        rotator_credential_dir=settings.database_rotator_credential_dir,
        runner_credential_dir=settings.database_runner_credential_dir,
    )


async def locate_database(settings: Settings) -> Database:
    """`Database.locate` for these settings: the embedded server is started when no DSN is set."""
    return await Database.locate(database_location(settings))


async def migrate(database: Database, settings: Settings) -> list[str]:
    """Apply the pending schema migrations as the schema owner; returns the names applied."""
    return await database.migrate(settings.database_app_role, settings.database_runner_role)


async def run_service(
    settings: Settings,
    *,
    extra_handlers: Sequence[grpc.GenericRpcHandler[Any, Any]] = (),
    extra_policies: Mapping[str, RpcPolicy] | None = None,
    on_started: Callable[[Service], None] | None = None,
    worker: int | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then drain and exit.

    `on_started` is called once the server answers; `worker` is this process's index when it is
    one of `settings.workers` processes sharing the port (tokensvc/workers.py), for the logs.
    """
    service = Service(settings, extra_handlers=extra_handlers, extra_policies=extra_policies or {})
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    try:
        await service.start()
        if worker is not None:
            _log.info("worker started", extra={"worker": worker, "workers": settings.workers})
        if on_started is not None:
            on_started(service)
        await stop_requested.wait()
        _log.info("shutdown requested; draining", extra={"grace_seconds": settings.shutdown_grace_seconds})
    finally:
        await service.stop()
