"""Which roles may call each RPC, and which RPCs need a run capability. Deny by default.

Every method the server exposes must appear here: a method with no entry is refused, so adding
an RPC without deciding who may call it fails closed (and a test checks every proto method).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokensvc.auth.identity import Role

__all__ = ["ANY_ROLE", "POLICIES", "RpcPolicy"]


@dataclass(frozen=True)
class RpcPolicy:
    roles: frozenset[Role]
    needs_capability: bool = False
    # Health and reflection answer any authenticated peer of the trust domain, role or not.
    any_authenticated_peer: bool = False


ANY_ROLE = frozenset(Role)
_LAUNCHER = frozenset({Role.LAUNCHER})
_CONTROL_PLANE = frozenset({Role.CONTROL_PLANE})
_ADMIN = frozenset({Role.ADMIN})
_MANAGERS = frozenset({Role.CONTROL_PLANE, Role.ADMIN})

_LAUNCHER_WITH_CAPABILITY = RpcPolicy(_LAUNCHER, needs_capability=True)
_OPEN = RpcPolicy(ANY_ROLE, any_authenticated_peer=True)


def _service(name: str, methods: dict[str, RpcPolicy]) -> dict[str, RpcPolicy]:
    return {f"/tokensvc.v1.{name}/{method}": policy for method, policy in methods.items()}


POLICIES: dict[str, RpcPolicy] = {
    **_service(
        "CapabilityService",
        {
            "VerifyCapability": _LAUNCHER_WITH_CAPABILITY,
            "DeriveSessionKey": _LAUNCHER_WITH_CAPABILITY,
            "IssueCapability": RpcPolicy(_CONTROL_PLANE),
            "RevokeCapability": RpcPolicy(_MANAGERS),
        },
    ),
    **_service(
        "MemoryService",
        dict.fromkeys(
            (
                "Remember",
                "SearchMemories",
                "GetMemory",
                "ListMemories",
                "UpdateMemory",
                "Forget",
                "ForgetAll",
            ),
            _LAUNCHER_WITH_CAPABILITY,
        ),
    ),
    **_service(
        "KnowledgeService",
        {
            **{
                method: RpcPolicy(_MANAGERS)
                for method in (
                    "CreateKnowledgeBase",
                    "GetKnowledgeBase",
                    "ListKnowledgeBases",
                    "DeleteKnowledgeBase",
                    "UploadDocument",
                    "GetDocument",
                    "ListDocuments",
                    "DeleteDocument",
                )
            },
            "SearchKnowledge": _LAUNCHER_WITH_CAPABILITY,
        },
    ),
    **_service(
        "AdminService",
        {
            method: RpcPolicy(_ADMIN)
            for method in (
                "RotateDatabaseCredentials",
                "GetCredentialStatus",
                "ReloadTrustBundle",
                "ListAuditEvents",
            )
        },
    ),
    **_service(
        "MigrationService",
        {
            method: RpcPolicy(_MANAGERS)
            for method in (
                "StartEmbeddingMigration",
                "GetEmbeddingMigration",
                "ListEmbeddingMigrations",
                "CancelEmbeddingMigration",
                "ResumeEmbeddingMigration",
            )
        },
    ),
    # An end-user's data across agents: the control plane acts on data-subject requests; an admin
    # (who operates the service, not its users) does not.
    **_service(
        "DataSubjectService",
        dict.fromkeys(("EraseEndUser", "ExportEndUser", "GetErasureReceipt"), RpcPolicy(_CONTROL_PLANE)),
    ),
    "/grpc.health.v1.Health/Check": _OPEN,
    "/grpc.health.v1.Health/Watch": _OPEN,
    "/grpc.health.v1.Health/List": _OPEN,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": _OPEN,
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": _OPEN,
}
