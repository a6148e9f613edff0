"""What the edge learned about the current call, handed to servicers through a context variable.

Servicers call `current_call()`; they never read metadata or certificates themselves, so scope
can only come from what the edge verified.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from tokensvc.auth.identity import Caller
from tokensvc.auth.scope import TenantScope

__all__ = ["CallContext", "current_call", "reset_call", "use_call"]


@dataclass(frozen=True)
class CallContext:
    request_id: str
    method: str
    caller: Caller
    # The tenant scope of the verified run capability when the RPC needs one, else None.
    capability: TenantScope | None = None


_CURRENT: contextvars.ContextVar[CallContext] = contextvars.ContextVar("tokensvc_call")


def current_call() -> CallContext:
    """The verified context of the RPC being served; only valid inside a servicer."""
    return _CURRENT.get()


def use_call(call: CallContext) -> contextvars.Token[CallContext]:
    return _CURRENT.set(call)


def reset_call(token: contextvars.Token[CallContext]) -> None:
    _CURRENT.reset(token)
