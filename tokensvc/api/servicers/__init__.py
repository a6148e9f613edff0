"""The tokensvc.v1 servicers and their registration on a server.

Each servicer is thin: decode, one domain call, encode. RPCs not built yet raise NotImplementedRpc
and answer UNIMPLEMENTED with the NOT_IMPLEMENTED reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from tokensvc.admin import Administration
from tokensvc.api.servicers.admin import AdminServicer
from tokensvc.api.servicers.capability import CapabilityServicer
from tokensvc.api.servicers.data_subject import DataSubjectServicer
from tokensvc.api.servicers.knowledge import KnowledgeServicer
from tokensvc.api.servicers.memory import MemoryServicer
from tokensvc.api.servicers.migration import MigrationServicer
from tokensvc.auth.operations import CapabilityOperations
from tokensvc.knowledge.service import KnowledgeBases
from tokensvc.memory.data_subjects import DataSubjectRequests
from tokensvc.memory.service import LongTermMemory
from tokensvc.reembedding import EmbeddingMigrations
from tokensvc.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    capability_pb2,
    capability_pb2_grpc,
    data_subject_pb2,
    data_subject_pb2_grpc,
    knowledge_pb2,
    knowledge_pb2_grpc,
    memory_pb2,
    memory_pb2_grpc,
    migration_pb2,
    migration_pb2_grpc,
)

__all__ = ["Domain", "register_servicers", "service_names"]


@dataclass(frozen=True)
class Domain:
    """The domain objects servicers delegate to (built by the composition root)."""

    capabilities: CapabilityOperations
    memory: LongTermMemory
    knowledge: KnowledgeBases
    max_upload_bytes: int
    administration: Administration
    migrations: EmbeddingMigrations
    data_subjects: DataSubjectRequests


def register_servicers(server: grpc.aio.Server, domain: Domain) -> None:
    capability_pb2_grpc.add_CapabilityServiceServicer_to_server(
        CapabilityServicer(domain.capabilities), server
    )
    memory_pb2_grpc.add_MemoryServiceServicer_to_server(MemoryServicer(domain.memory), server)
    knowledge_pb2_grpc.add_KnowledgeServiceServicer_to_server(
        KnowledgeServicer(domain.knowledge, max_upload_bytes=domain.max_upload_bytes), server
    )
    admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(domain.administration), server)
    migration_pb2_grpc.add_MigrationServiceServicer_to_server(MigrationServicer(domain.migrations), server)
    data_subject_pb2_grpc.add_DataSubjectServiceServicer_to_server(
        DataSubjectServicer(domain.data_subjects), server
    )


def service_names() -> list[str]:
    """Full names of the tokensvc.v1 services, for health and reflection."""
    return [
        module.DESCRIPTOR.services_by_name[name].full_name
        for module, name in (
            (capability_pb2, "CapabilityService"),
            (memory_pb2, "MemoryService"),
            (knowledge_pb2, "KnowledgeService"),
            (admin_pb2, "AdminService"),
            (migration_pb2, "MigrationService"),
            (data_subject_pb2, "DataSubjectService"),
        )
    ]
