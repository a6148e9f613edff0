"""The Go client (clients/go) against a live in-process tokensvc over mTLS.

Runs `go test` in clients/go with the connection info in the environment (clients/go/live_test.go):
remember and search by meaning, knowledge upload and search with a citation, a session key, a bad
capability answering with its reason, a field error, deadlines; and (clients/go/retry_test.go) the
retry policy against a server that answers UNAVAILABLE, and no capability without TLS. The Go libraries are Debian's
(golang-google-grpc-dev and friends, installed by tools/setup-test-deps), which live in a GOPATH
tree: the module is linked into a temporary GOPATH and built there, not through the module proxy.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

import pytest

from tests.clients.test_node_client import run
from tests.conftest import ServiceFactory
from tests.support import dev_capability
from tokensvc.auth.devpki import DevPaths

REPO = Path(__file__).resolve().parents[2]
MODULE = "github.com/ctxmesh/tokensvc/clients/go"
DEBIAN_GOPATH = Path("/usr/share/gocode")
GO_TEST_TIMEOUT = 300.0
# live_test.go's tests; a run that passed fewer (or skipped any) did not test the client.
EXPECTED_GO_TESTS = {
    "TestRememberAndSearchByMeaning",
    "TestKnowledgeUploadAndSearchWithCitation",
    "TestDeriveSessionKey",
    "TestABadCapabilityIsRefusedWithItsReason",
    "TestInvalidArgumentNamesTheField",
    "TestDeadlines",
    "TestRetriesUnavailableOnIdempotentCallsOnly",
    "TestTheCapabilityIsNeverSentWithoutTLS",
}
SETUP = (
    "run tools/setup-test-deps (as root), or install Debian's golang-go, golang-google-grpc-dev, "
    "golang-google-protobuf-dev, golang-google-genproto-dev and golang-github-golang-protobuf-1-5-dev"
)


def go_toolchain() -> str:
    go = shutil.which("go")
    if go is None:
        pytest.fail(f"`go` is not on PATH: the Go client test needs it; {SETUP}", pytrace=False)
    for library in ("google.golang.org/grpc", "google.golang.org/protobuf", "google.golang.org/genproto"):
        if not (DEBIAN_GOPATH / "src" / library).is_dir():
            pytest.fail(f"{library} is not under {DEBIAN_GOPATH}: {SETUP}", pytrace=False)
    # github.com/golang/protobuf 1.3 (its table marshaller) crashes on generated v2 messages; 1.5
    # wraps the v2 API and has no such file.
    if (DEBIAN_GOPATH / "src/github.com/golang/protobuf/proto/table_marshal.go").exists():
        pytest.fail(
            f"github.com/golang/protobuf under {DEBIAN_GOPATH} is 1.3, not 1.5: {SETUP}", pytrace=False
        )
    return go


def gopath_with_the_module(root: Path) -> Path:
    """A GOPATH whose src/ holds this repository at the module's import path; returns the module's
    directory inside it (reached through the link, so `./...` resolves to import paths)."""
    link = root / "src" / MODULE.removesuffix("/clients/go")
    link.parent.mkdir(parents=True)
    link.symlink_to(REPO, target_is_directory=True)
    return link / "clients" / "go"


@pytest.mark.slow
@pytest.mark.timeout(GO_TEST_TIMEOUT + 60)
async def test_go_client_against_a_live_server(
    start_service: ServiceFactory, dev: DevPaths, tmp_path: Path
) -> None:
    go = go_toolchain()
    module = gopath_with_the_module(tmp_path / "gopath")
    service = await start_service()
    cert, key = dev.client("launcher")  # spiffe://dev.local/ns/default/sa/dev-agent
    admin_cert, admin_key = dev.client("admin")
    knowledge_base = f"go-client-{uuid.uuid4().hex[:12]}"
    env = {
        **os.environ,
        "GO111MODULE": "off",
        "GOPATH": f"{tmp_path / 'gopath'}:{DEBIAN_GOPATH}",
        "GOFLAGS": "",
        "GRPC_GO_RETRY": "on",  # grpc-go < 1.40 (Debian bookworm's 1.33) applies retry policies only so
        "PWD": str(module),  # go takes the import path from the linked directory, not its target
        "TOKENSVC_TARGET": f"127.0.0.1:{service.port}",
        "TOKENSVC_CA": str(dev.ca_cert),
        "TOKENSVC_CERT": str(cert),
        "TOKENSVC_KEY": str(key),
        "TOKENSVC_ADMIN_CERT": str(admin_cert),
        "TOKENSVC_ADMIN_KEY": str(admin_key),
        "TOKENSVC_CAPABILITY": dev_capability(
            dev, agent="dev-agent", long_term_memory=True, knowledge_bases=[knowledge_base]
        ),
        "OTHER_AGENT_CAPABILITY": dev_capability(dev, agent="other-agent", long_term_memory=True),
        "TOKENSVC_KNOWLEDGE_BASE": knowledge_base,
        "TOKENSVC_SERVER_CERT": str(dev.server_cert),  # retry_test.go's flaky server
        "TOKENSVC_SERVER_KEY": str(dev.server_key),
    }
    code, output = await run(
        [go, "test", "-count=1", "-v", "./..."], cwd=module, env=env, time_limit=GO_TEST_TIMEOUT
    )
    assert code == 0, f"go test failed (exit {code}):\n{output}"
    passed = set(re.findall(r"^--- PASS: (\w+)", output, re.M))
    assert passed == EXPECTED_GO_TESTS, output
    assert not re.search(r"^--- (FAIL|SKIP)", output, re.M), output
