"""The import rules of the layout (docs/architecture.md, README "Layout"), checked on the source.

Every module under `tokensvc/` (the generated `tokensvc/v1` aside) is parsed with `ast`; every
import counts, including those inside functions. The layers, bottom to top:

    shared -> storage ports -> storage implementations -> retrieval / embedders -> jobs -> domain
    -> api -> app (composition root) -> cli

A module may import its own layer and the layers below it, never one above. Storage
implementations (PostgreSQL, in-process) implement the ports they sit on: only the composition
root (app, cli) names them, so the domain can only ever hold a port. On top of the ranking:
no transport (gRPC, protobuf, the generated stubs) below the API, the database driver only in
`tokensvc/storage/postgres`, the API reaching storage only through domain re-exports, the
dev PKI only in the CLI, and re-embedding (`tokensvc/reembedding`) above memory and knowledge
within the domain: it re-chunks with `tokensvc.knowledge.chunking`, neither of them imports it.
The job runner (`tokensvc.jobs`) sits below the domain: it runs every kind of background job and
knows none of them.

An exception is an entry in `ALLOWED` with a one-line reason; an entry that no longer matches an
import fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tokensvc"
GENERATED = "tokensvc.v1"

# Bottom to top. A module belongs to the layer of its longest matching prefix.
# The composition root: the service (app) and the processes that run it (workers: the parent
# starts the embedded database the workers share).
COMPOSITION_ROOT = ("tokensvc.app", "tokensvc.workers")
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "shared",
        (
            "tokensvc",  # the package itself (exact)
            "tokensvc.errors",
            "tokensvc.names",
            "tokensvc.untrusted_json",
            "tokensvc.settings",
            "tokensvc.settings_sources",
            "tokensvc.logs",
            "tokensvc.observability",
        ),
    ),
    ("storage ports", ("tokensvc.storage",)),
    ("storage implementations", ("tokensvc.storage.postgres", "tokensvc.storage.inprocess")),
    ("retrieval / embedders", ("tokensvc.retrieval", "tokensvc.embedders")),
    # The one runner of background work (claims, leases, backoff); each kind of job is domain.
    ("jobs", ("tokensvc.jobs",)),
    (
        "domain",
        (
            "tokensvc.reembedding",
            "tokensvc.memory",
            "tokensvc.knowledge",
            "tokensvc.credentials",
            "tokensvc.auth",
            "tokensvc.audit",
            "tokensvc.admin",
            "tokensvc.supervision",
        ),
    ),
    ("api", ("tokensvc.api", "tokensvc.tls", GENERATED)),
    ("app", COMPOSITION_ROOT),
    ("cli", ("tokensvc.cli", "tokensvc.client", "tokensvc.__main__")),
)
RANK = {name: rank for rank, (name, _) in enumerate(LAYERS)}

STORAGE = "tokensvc.storage"
IMPLEMENTATIONS = ("tokensvc.storage.postgres", "tokensvc.storage.inprocess")
DOMAIN_AND_BELOW = (
    "domain",
    "jobs",
    "retrieval / embedders",
    "storage ports",
    "storage implementations",
    "shared",
)
TRANSPORT = (
    "grpc",
    "grpc_health",
    "grpc_status",
    "grpc_reflection",
    "google.protobuf",
    "google.rpc",
    GENERATED,
)
DRIVER = ("asyncpg", "pgvector")
DEV_PKI = "tokensvc.auth.devpki"
# Re-embedding sits above these domain packages: it uses them, they never import it.
REEMBEDDING = "tokensvc.reembedding"
BELOW_REEMBEDDING = ("tokensvc.memory", "tokensvc.knowledge")

# (importing module, imported module or prefix) -> why this one import is allowed.
ALLOWED: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. tokensvc.memory.metadata
    target: str  # what it imports, e.g. tokensvc.v1.common_pb2
    line: int

    def __str__(self) -> str:
        path = self.module.replace(".", "/")
        return f"{path}.py:{self.line}: {self.module} imports {self.target}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(module: str) -> bool:
    return (ROOT / module.replace(".", "/") / "__init__.py").is_file()


def _is_module(module: str) -> bool:
    return _is_package(module) or (ROOT / (module.replace(".", "/") + ".py")).is_file()


def imports_of(source: str, module: str, is_package: bool = False) -> Iterator[Import]:
    """Every import in `source` (module `module`), relative ones resolved; `from X import name`
    also yields `X.name` when that is one of tokensvc's modules."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield Import(module, target, node.lineno)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub.startswith("tokensvc.") and _is_module(sub):
                    yield Import(module, sub, node.lineno)


def all_imports() -> list[Import]:
    found: list[Import] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        if within(module, GENERATED):
            continue
        found += imports_of(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")
    return found


def within(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def layer_of(module: str) -> str | None:
    best: tuple[int, str] | None = None
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            matches = module == prefix if prefix == "tokensvc" else within(module, prefix)
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), name)
    return None if best is None else best[1]


def allowed(imp: Import) -> bool:
    return any(imp.module == module and within(imp.target, target) for module, target in ALLOWED)


def offences(imports: Iterable[Import], rule: str) -> str:
    lines = [f"  {imp}" for imp in imports if not allowed(imp)]
    return "" if not lines else f"{rule}:\n" + "\n".join(lines)


IMPORTS = all_imports()
OWN = [imp for imp in IMPORTS if within(imp.target, "tokensvc")]


def test_the_parser_sees_nested_relative_and_from_imports() -> None:
    source = (
        "import grpc\n"
        "from . import models\n"
        "from tokensvc.storage import ports\n"
        "def f():\n"
        "    from tokensvc.v1 import common_pb2\n"
    )
    found = {imp.target for imp in imports_of(source, "tokensvc.memory.metadata")}
    assert {"grpc", "tokensvc.memory", "tokensvc.memory.models", "tokensvc.storage.ports"} <= found
    assert "tokensvc.v1.common_pb2" in found


def test_every_module_has_a_layer() -> None:
    modules = {module_name(path) for path in PACKAGE.rglob("*.py")}
    missing = sorted(m for m in modules if layer_of(m) is None)
    assert not missing, f"place these modules in a layer in tests/test_layering.py: {missing}"


def test_storage_imports_nothing_of_the_domain_api_or_composition_root() -> None:
    above = (
        "memory",
        "knowledge",
        "reembedding",
        "jobs",
        "api",
        "credentials",
        "admin",
        "app",
        "cli",
        "auth",
        "audit",
    )
    forbidden = tuple(f"tokensvc.{name}" for name in above)
    bad = [imp for imp in OWN if within(imp.module, STORAGE) and within(imp.target, *forbidden)]
    assert not bad, offences(bad, "storage must not import the domain, the API or the composition root")


def test_the_domain_imports_no_transport_and_no_database_driver() -> None:
    forbidden = (*TRANSPORT, *DRIVER, *IMPLEMENTATIONS)
    bad = [
        imp
        for imp in IMPORTS
        if layer_of(imp.module) in ("domain", "jobs", "retrieval / embedders")
        and within(imp.target, *forbidden)
    ]
    assert not bad, offences(
        bad,
        "domain, jobs, retrieval and embedders: no grpc/protobuf/tokensvc.v1, no asyncpg, "
        "no storage implementation",
    )


def test_nothing_below_the_api_imports_transport() -> None:
    bad = [
        imp for imp in IMPORTS if layer_of(imp.module) in DOMAIN_AND_BELOW and within(imp.target, *TRANSPORT)
    ]
    assert not bad, offences(bad, "only the API, app and CLI may import gRPC, protobuf or tokensvc.v1")


def test_the_database_driver_is_imported_only_in_storage_postgres() -> None:
    bad = [
        imp
        for imp in IMPORTS
        if within(imp.target, *DRIVER) and not within(imp.module, "tokensvc.storage.postgres")
    ]
    assert not bad, offences(bad, "asyncpg and pgvector belong to tokensvc/storage/postgres only")


def test_the_api_reaches_storage_only_through_the_domain() -> None:
    bad = [
        imp for imp in IMPORTS if within(imp.module, "tokensvc.api") and within(imp.target, STORAGE, *DRIVER)
    ]
    assert not bad, offences(
        bad, "the API imports storage records from the domain's re-exports, never storage or asyncpg"
    )


def test_no_module_imports_a_layer_above_its_own() -> None:
    bad = []
    for imp in OWN:
        mine, theirs = layer_of(imp.module), layer_of(imp.target)
        if mine is not None and theirs is not None and RANK[theirs] > RANK[mine]:
            bad.append(imp)
    assert not bad, offences(bad, "imports up the layers (" + " -> ".join(name for name, _ in LAYERS) + ")")


def imports_of_reembedding_from_below(imports: Iterable[Import]) -> list[Import]:
    """The imports by which memory or knowledge would reach up into re-embedding."""
    return [
        imp for imp in imports if within(imp.module, *BELOW_REEMBEDDING) and within(imp.target, REEMBEDDING)
    ]


def test_the_reembedding_rule_sees_memory_or_knowledge_importing_it() -> None:
    nested = imports_of(
        "def f():\n    from tokensvc.reembedding import MigrationRunner\n", "tokensvc.memory.service"
    )
    relative = imports_of("from ..reembedding import runner\n", "tokensvc.knowledge.service")
    downward = imports_of(
        "from tokensvc.knowledge.chunking import chunk_document\n", "tokensvc.reembedding.runner"
    )
    found = imports_of_reembedding_from_below([*nested, *relative, *downward])
    assert {(imp.module, imp.target) for imp in found} == {
        ("tokensvc.memory.service", "tokensvc.reembedding"),
        ("tokensvc.knowledge.service", "tokensvc.reembedding"),
        ("tokensvc.knowledge.service", "tokensvc.reembedding.runner"),
    }


def test_memory_and_knowledge_never_import_reembedding() -> None:
    bad = imports_of_reembedding_from_below(OWN)
    assert not bad, offences(
        bad, "re-embedding sits above memory and knowledge: they must not import tokensvc.reembedding"
    )


def test_storage_implementations_are_named_only_by_the_composition_root() -> None:
    bad = [
        imp
        for imp in OWN
        if within(imp.target, *IMPLEMENTATIONS)
        and not within(imp.module, *IMPLEMENTATIONS, *COMPOSITION_ROOT, "tokensvc.cli")
    ]
    assert not bad, offences(bad, "only app and cli construct storage implementations; the rest take ports")


def test_the_server_never_imports_the_dev_pki() -> None:
    bad = [
        imp for imp in OWN if within(imp.target, DEV_PKI) and not within(imp.module, DEV_PKI, "tokensvc.cli")
    ]
    assert not bad, offences(
        bad, "the dev PKI is for `tokensvc dev` and the CLI; production code uses auth.keys"
    )


def _module_of(target: str) -> str | None:
    """The module an import target names: itself, or the module a `from X import name` is in."""
    while target and not _is_module(target):
        target = target.rpartition(".")[0]
    return target or None


def import_circles(imports: Iterable[Import]) -> list[list[str]]:
    """Every set of two or more modules that import each other round a circle (each reaches the
    others by imports), each sorted; imports inside functions count like the others."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        target = _module_of(imp.target)
        if target is not None and target != imp.module:
            graph.setdefault(imp.module, set()).add(target)

    def reachable(start: str) -> set[str]:
        seen: set[str] = set()
        todo = list(graph.get(start, ()))
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo += graph.get(module, ())
        return seen

    reach = {module: reachable(module) for module in graph}
    circles = {
        tuple(sorted({module} | {other for other in reach[module] if module in reach.get(other, ())}))
        for module in graph
        if module in reach[module]
    }
    return [list(circle) for circle in sorted(circles)]


def test_the_circle_finder_finds_a_circle_through_a_function_level_import() -> None:
    a = imports_of("from tokensvc.settings import Settings\n", "tokensvc.errors")
    b = imports_of("def f():\n    from tokensvc.errors import Reason\n", "tokensvc.settings")
    c = imports_of("import tokensvc.errors\n", "tokensvc.names")
    assert import_circles([*a, *b, *c]) == [["tokensvc.errors", "tokensvc.settings"]]


def test_no_modules_import_each_other_round_a_circle() -> None:
    circles = import_circles(OWN)
    assert not circles, "modules that import each other (break the circle: move what both need down):\n" + (
        "\n".join("  " + " <-> ".join(circle) for circle in circles)
    )


def private_imports(source: str, module: str) -> list[str]:
    """`from tokensvc.x import _name` in `source`: a name another module keeps to itself."""
    return [
        f"{module}:{node.lineno}: {node.module}.{alias.name}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tokensvc")
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]


def test_the_private_import_finder_sees_a_private_name() -> None:
    found = private_imports("from tokensvc.storage.inprocess.memories import MemoryRow, _slot\n", "m")
    assert found == ["m:1: tokensvc.storage.inprocess.memories._slot"]


def test_no_module_imports_another_modules_private_names() -> None:
    bad = [
        offence
        for path in sorted(PACKAGE.rglob("*.py"))
        if not within(module_name(path), GENERATED)
        for offence in private_imports(path.read_text(encoding="utf-8"), module_name(path))
    ]
    assert not bad, "private names used across modules (make them public, or share a record):\n" + "\n".join(
        bad
    )


def test_every_allowed_exception_is_still_needed() -> None:
    stale = [
        (module, target)
        for module, target in sorted(ALLOWED)
        if not any(imp.module == module and within(imp.target, target) for imp in IMPORTS)
    ]
    assert not stale, f"these ALLOWED entries match no import any more; remove them: {stale}"


def test_the_job_runner_reaching_up_to_a_kind_of_job_is_an_import_up_the_layers() -> None:
    found = imports_of("from tokensvc.reembedding import MigrationRunner\n", "tokensvc.jobs.runner")
    up = [
        imp for imp in found if RANK[layer_of(imp.target) or "shared"] > RANK[layer_of(imp.module) or "cli"]
    ]
    assert {imp.target for imp in up} == {"tokensvc.reembedding"}
