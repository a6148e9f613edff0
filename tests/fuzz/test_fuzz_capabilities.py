"""Validly signed capabilities with hostile claims, over every RPC of every service.

The fuzzer signs with the dev key the service trusts, so the signature is never why a token is
refused: each payload is the fuzzed launcher's valid claims with one to three of them given odd
values (NUL, line breaks, lone surrogates escaped in JSON or raw, invisible and look-alike
characters, wrong types, huge arrays and numbers, deep nesting, extra claims and headers). The
answer is deliberate (a bad token UNAUTHENTICATED, a binding or scope PERMISSION_DENIED), never
INTERNAL or UNKNOWN; look-alikes of another end-user never reach that user's bucket (the canary).

And what the verifier accepts the revocation path can store: every accepted capability, however
odd its `jti` or run id, is revoked by it (issue 14, finding 5).
"""

from __future__ import annotations

import collections
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import assume
from hypothesis import strategies as st

from tests.fuzz.hostile import IDENTIFIERS, hostile_claim_values, hostile_tokens, hostile_variant
from tests.fuzz.rpcs import RPCS, Rpc, call, rpc_named
from tests.fuzz.strategies import fuzzed
from tests.fuzz.target import AGENT, CANARY_USER, FUZZ_NS, KB_A, KB_B, Answer, Target, send
from tests.support import Signer, bearer, launcher_claims
from tokensvc.auth.devpki import DevPaths
from tokensvc.v1 import capability_pb2, knowledge_pb2, memory_pb2

CLAIM_EXAMPLES = 30  # per RPC
REVOCATION_EXAMPLES = 40
DEEP_EXAMPLES = 300  # per RPC, in the slow variant (`make test`; `make test-fast` skips it)
HOSTILE_USER = "hostile-user@example.com"  # the hostile tokens' own end-user (a bucket of its own)


def fuzzed_claims() -> dict[str, object]:
    """Valid claims for the fuzzed launcher, before the hostile changes."""
    return launcher_claims(
        ns=FUZZ_NS, agent=AGENT, user=HOSTILE_USER, per_user=True, ltm=True, kbs=[KB_A, KB_B]
    )


MAX_TOKEN_CHARS = 30_000  # under the 32 KiB metadata limit with the other headers
CLAIM_VALUES = hostile_claim_values(FUZZ_NS, AGENT, CANARY_USER, [KB_A, KB_B, "kb-missing"])


async def hostile_signed_claims(
    fuzz: Target, dev: DevPaths, tally: collections.Counter[str], rpc: Rpc, data: st.DataObject
) -> None:
    signer = Signer.dev(dev)
    hostile = data.draw(hostile_tokens(fuzzed_claims, CLAIM_VALUES, signer.header()), label="token")
    token = signer.sign(hostile.header, hostile.payload)
    # gRPC itself refuses metadata past 32 KiB (RESOURCE_EXHAUSTED, before tokensvc sees the call;
    # three long non-ASCII claims in UTF-16 get there): such a token tests the transport, not us.
    assume(len(token) < MAX_TOKEN_CHARS)
    request = rpc.draw(data, fuzz)
    # Launcher RPCs from the launcher; the others from their own role (the token is extra) or,
    # now and then, from the launcher, which may not call them.
    role = (
        rpc.role if rpc.role == "launcher" else data.draw(st.sampled_from([rpc.role, rpc.role, "launcher"]))
    )
    answer = await call(fuzz, rpc, request, bearer(token), role=role)
    tally[answer.code] += 1
    if role == "launcher" and rpc.role != "launcher":
        assert answer.code == "PERMISSION_DENIED", answer
        assert answer.reason == "ROLE_NOT_ALLOWED" or answer.misreported, answer


each_rpc = pytest.mark.parametrize("rpc", RPCS, ids=lambda rpc: rpc.id)
test_a_signed_capability_with_hostile_claims_gets_a_deliberate_status = each_rpc(
    fuzzed(CLAIM_EXAMPLES)(hostile_signed_claims)
)
test_many_signed_capabilities_with_hostile_claims_get_a_deliberate_status = pytest.mark.slow(
    each_rpc(fuzzed(DEEP_EXAMPLES)(hostile_signed_claims))
)


def unique_identifiers() -> st.SearchStrategy[str]:
    """Odd run ids and jtis, each unique to the example (a revocation is for the whole session)
    except the few one-character values `hostile_variant` makes of nothing: those can come back,
    in a later example or while Hypothesis shrinks, so the test remembers what it revoked."""
    return st.one_of(
        st.builds(lambda: f"rv-{uuid.uuid4().hex}").flatmap(
            lambda value: hostile_variant(value, longest=513)
        ),
        st.builds(lambda odd: f"{odd}-{uuid.uuid4().hex}", IDENTIFIERS),
    )


async def verify(target: Target, token: str) -> Answer:
    request = capability_pb2.VerifyCapabilityRequest()
    return await send(
        target, "CapabilityService", "VerifyCapability", request, bearer(token), role="launcher"
    )


REVOKED: set[tuple[str, str]] = set()  # (claim, value) revoked so far; revocations outlive examples


@pytest.mark.parametrize("claim", ["jti", "sub"])
@fuzzed(REVOCATION_EXAMPLES)
async def test_every_capability_the_verifier_accepts_can_be_revoked_by_its_id(
    fuzz: Target, dev: DevPaths, tally: collections.Counter[str], claim: str, data: st.DataObject
) -> None:
    value = data.draw(unique_identifiers(), label=claim)
    token = Signer.dev(dev).token(ns=FUZZ_NS, agent=AGENT, **{claim: value})
    accepted = await verify(fuzz, token)
    tally[accepted.code] += 1
    if (claim, value) in REVOKED:
        assert (accepted.code, accepted.reason) == ("UNAUTHENTICATED", "CAPABILITY_REVOKED"), accepted
        return
    if accepted.code != "OK":
        assert (accepted.code, accepted.reason) == ("UNAUTHENTICATED", "CAPABILITY_INVALID"), accepted
        return
    target = "jti" if claim == "jti" else "run_id"
    request = capability_pb2.RevokeCapabilityRequest(reason="fuzz: an odd id", **{target: value})
    revoked = await send(fuzz, "CapabilityService", "RevokeCapability", request, (), role="admin")
    assert revoked.code == "OK", (
        f"a capability with {claim}={value!r} is accepted but cannot be revoked: {revoked}"
    )
    REVOKED.add((claim, value))
    refused = await verify(fuzz, token)
    assert (refused.code, refused.reason) == ("UNAUTHENTICATED", "CAPABILITY_REVOKED"), refused


PLAIN_REQUESTS: dict[str, Callable[[], Any]] = {
    "VerifyCapability": capability_pb2.VerifyCapabilityRequest,
    "ListMemories": memory_pb2.ListMemoriesRequest,
    "Remember": lambda: memory_pb2.RememberRequest(items=[memory_pb2.RememberItem(content="x")]),
    "SearchKnowledge": lambda: knowledge_pb2.SearchKnowledgeRequest(
        knowledge_base_refs=[KB_A], query_text="tides"
    ),
}


@pytest.mark.parametrize(
    ("claims", "method"),
    [
        pytest.param({"user": "a\ud800b", "per_user": True}, "VerifyCapability", id="surrogate-user"),
        pytest.param({"jti": "a\ud800b"}, "VerifyCapability", id="surrogate-jti"),
        pytest.param({"sub": "\udfff"}, "ListMemories", id="surrogate-sub"),
        pytest.param({"jti": " "}, "ListMemories", id="whitespace-jti"),
        pytest.param({"sub": "\t\n"}, "VerifyCapability", id="whitespace-sub"),
        pytest.param({"jti": "a\x00b"}, "VerifyCapability", id="nul-jti"),
        pytest.param({"user": "a\x00b", "per_user": True}, "Remember", id="nul-user"),
        pytest.param({"ns": f"{FUZZ_NS}\n"}, "VerifyCapability", id="newline-namespace"),
        pytest.param({"kbs": [f"{KB_A}\n"]}, "SearchKnowledge", id="newline-kb-ref"),
        pytest.param({"kbs": [[KB_A]]}, "SearchKnowledge", id="nested-kb-ref"),
        pytest.param({"exp": 10**400}, "VerifyCapability", id="exp-huge"),
        pytest.param({"exp": float("inf")}, "VerifyCapability", id="exp-infinite"),
    ],
)
async def test_capabilities_found_by_the_attack_run_are_unauthenticated(
    fuzz: Target, dev: DevPaths, tally: collections.Counter[str], claims: dict[str, object], method: str
) -> None:
    """Issue 14, findings 5 and 6 and their siblings: each once answered INTERNAL or was accepted."""
    signer = Signer.dev(dev)
    token = signer.sign(signer.header(), fuzzed_claims() | claims)
    answer = await call(fuzz, rpc_named(method), PLAIN_REQUESTS[method](), bearer(token))
    tally[answer.code] += 1
    assert (answer.code, answer.reason) == ("UNAUTHENTICATED", "CAPABILITY_INVALID"), answer
