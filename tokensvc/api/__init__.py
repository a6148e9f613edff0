"""The API edge: interceptor, RPC policy, call context and thin servicers."""

from tokensvc.api.context import CallContext, current_call
from tokensvc.api.edge import EdgeInterceptor
from tokensvc.api.policy import POLICIES, RpcPolicy
from tokensvc.api.servicers import Domain, register_servicers, service_names

__all__ = [
    "POLICIES",
    "CallContext",
    "Domain",
    "EdgeInterceptor",
    "RpcPolicy",
    "current_call",
    "register_servicers",
    "service_names",
]
