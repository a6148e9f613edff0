"""Every RPC of the API declares who may call it; nothing is open by accident."""

from __future__ import annotations

from tokensvc.api.policy import POLICIES
from tokensvc.auth.identity import Role
from tokensvc.v1 import admin_pb2, capability_pb2, data_subject_pb2, knowledge_pb2, memory_pb2, migration_pb2


def proto_methods() -> set[str]:
    methods = set()
    for module in (capability_pb2, memory_pb2, knowledge_pb2, admin_pb2, migration_pb2, data_subject_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            methods |= {f"/{service.full_name}/{method.name}" for method in service.methods}
    return methods


def test_every_proto_method_has_a_policy_and_no_policy_is_stale() -> None:
    tokensvc_policies = {name for name in POLICIES if name.startswith("/tokensvc.v1.")}
    assert tokensvc_policies == proto_methods()


def test_launcher_rpcs_need_a_capability_and_admin_rpcs_are_admin_only() -> None:
    for method, policy in POLICIES.items():
        if Role.LAUNCHER in policy.roles and not policy.any_authenticated_peer:
            assert policy.needs_capability, method
        if method.startswith("/tokensvc.v1.AdminService/"):
            assert policy.roles == {Role.ADMIN}, method
        if method.startswith("/tokensvc.v1.MigrationService/"):
            assert policy.roles == {Role.ADMIN, Role.CONTROL_PLANE}, method
            assert not policy.needs_capability, method
        if method.startswith("/tokensvc.v1.DataSubjectService/"):
            # An end-user's data across agents: the control plane only (not an admin).
            assert policy.roles == {Role.CONTROL_PLANE}, method
            assert not policy.needs_capability, method


def test_only_health_and_reflection_answer_any_authenticated_peer() -> None:
    open_methods = {name for name, policy in POLICIES.items() if policy.any_authenticated_peer}
    assert all(name.startswith(("/grpc.health.", "/grpc.reflection.")) for name in open_methods)
