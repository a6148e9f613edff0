"""The metadata filter language: validation with exact field paths, SQL that agrees with `matches`.

Every semantic case runs twice, in PostgreSQL (the compiled SQL over a jsonb column, with the same
jsonb codec the serving pool registers) and in `matches`; a property test checks they agree on
random rows and filters.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence

import asyncpg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support import SharedDatabase, superuser
from tokensvc.api.filter_codec import filter_from_proto
from tokensvc.api.metadata_codec import scalar_to_proto
from tokensvc.errors import InvalidArgument, PayloadTooLarge
from tokensvc.memory import (
    AllOf,
    AnyOf,
    Condition,
    Filter,
    Not,
    Operator,
    matches,
)
from tokensvc.memory.metadata import MetadataScalar
from tokensvc.storage.postgres.filter_sql import compile_filter
from tokensvc.v1 import common_pb2 as pb

Row = dict[str, MetadataScalar]
OPERATOR_TO_PROTO = {op: pb.FilterOperator.Value(f"FILTER_OPERATOR_{op.name}") for op in Operator}


# --- building proto filters -------------------------------------------------------------------


def leaf(
    key: str,
    op: int,
    value: MetadataScalar | pb.MetadataValue | None = None,
    values: Sequence[MetadataScalar | pb.MetadataValue] = (),
) -> pb.Filter:
    def proto(v: MetadataScalar | pb.MetadataValue) -> pb.MetadataValue:
        return v if isinstance(v, pb.MetadataValue) else scalar_to_proto(v)

    field = pb.FieldFilter(key=key, operator=op, values=[proto(v) for v in values])
    if value is not None:
        field.value.CopyFrom(proto(value))
    return pb.Filter(field=field)


def and_(*filters: pb.Filter) -> pb.Filter:
    return pb.Filter(and_filters=pb.FilterList(filters=filters))


def or_(*filters: pb.Filter) -> pb.Filter:
    return pb.Filter(or_filters=pb.FilterList(filters=filters))


def not_(inner: pb.Filter) -> pb.Filter:
    return pb.Filter(not_filter=inner)


def to_proto(node: Filter) -> pb.Filter:
    if isinstance(node, Condition):
        return leaf(node.key, OPERATOR_TO_PROTO[node.op], node.value, node.values)
    if isinstance(node, Not):
        return not_(to_proto(node.filter))
    children = [to_proto(child) for child in node.filters]
    return and_(*children) if isinstance(node, AllOf) else or_(*children)


OK = leaf("a", pb.FILTER_OPERATOR_EQ, 1.0)
EQ, IN, NIN, GT, EXISTS = (OPERATOR_TO_PROTO[op] for op in ("eq", "in", "nin", "gt", "exists"))


# --- validation -------------------------------------------------------------------------------

INVALID = [
    ("no node set", pb.Filter(), "filter"),
    ("empty and", and_(), "filter.and_filters.filters"),
    ("empty or", or_(), "filter.or_filters.filters"),
    ("unset not", not_(pb.Filter()), "filter.not_filter"),
    (
        "unset value kind",
        and_(OK, leaf("a", EQ, pb.MetadataValue())),
        "filter.and_filters.filters[1].field.value",
    ),
    ("empty key", leaf("", EQ, 1.0), "filter.field.key"),
    ("key with space", leaf("a b", EQ, 1.0), "filter.field.key"),
    ("key with newline", leaf("a\n", EQ, 1.0), "filter.field.key"),
    ("key of 65 chars", leaf("k" * 65, EQ, 1.0), "filter.field.key"),
    ("unspecified operator", leaf("a", pb.FILTER_OPERATOR_UNSPECIFIED, 1.0), "filter.field.operator"),
    ("unknown operator", leaf("a", 42, 1.0), "filter.field.operator"),
    ("EQ without value", leaf("a", EQ), "filter.field.value"),
    ("EQ with values", leaf("a", EQ, 1.0, [1.0]), "filter.field.values"),
    ("GT with values only", leaf("a", GT, None, [1.0]), "filter.field.values"),
    ("EXISTS with value", leaf("a", EXISTS, 1.0), "filter.field.value"),
    ("EXISTS with values", leaf("a", EXISTS, None, ["x"]), "filter.field.values"),
    ("IN with value", leaf("a", IN, 1.0, [1.0]), "filter.field.value"),
    ("IN without values", leaf("a", IN), "filter.field.values"),
    ("NIN with 101 values", leaf("a", NIN, None, [float(i) for i in range(101)]), "filter.field.values"),
    ("IN with unset element", leaf("a", IN, None, ["x", 1.0, pb.MetadataValue()]), "filter.field.values[2]"),
    ("IN with NaN element", leaf("a", IN, None, [float("nan")]), "filter.field.values[0]"),
    ("GT with a boolean", leaf("a", GT, True), "filter.field.value"),
    ("LTE with a boolean", leaf("a", pb.FILTER_OPERATOR_LTE, False), "filter.field.value"),
    ("NaN", leaf("a", EQ, float("nan")), "filter.field.value"),
    ("infinity", leaf("a", pb.FILTER_OPERATOR_LT, float("-inf")), "filter.field.value"),
    ("NUL in a string", leaf("a", EQ, "x\x00y"), "filter.field.value"),
    (
        "nested bad key",
        or_(OK, not_(and_(OK, leaf("bad key", EQ, 1.0)))),
        "filter.or_filters.filters[1].not_filter.and_filters.filters[1].field.key",
    ),
]


@pytest.mark.parametrize(("message", "path"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_malformed_filter_is_invalid_argument_naming_the_node(message: pb.Filter, path: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        filter_from_proto(message)
    assert caught.value.field == path


def test_field_paths_start_at_the_given_field() -> None:
    with pytest.raises(InvalidArgument) as caught:
        filter_from_proto(and_(OK, leaf("", EQ, 1.0)), "query.filter")
    assert caught.value.field == "query.filter.and_filters.filters[1].field.key"


def test_oversized_string_operand_is_payload_too_large() -> None:
    with pytest.raises(PayloadTooLarge) as caught:
        filter_from_proto(leaf("a", EQ, "x" * 1025))
    assert caught.value.field == "filter.field.value"
    assert filter_from_proto(leaf("a", EQ, "x" * 1024)) == Condition("a", Operator.EQ, "x" * 1024)


def test_valid_filter_becomes_its_tree() -> None:
    message = and_(
        leaf("lang", EQ, "en"),
        or_(leaf("year", GT, 2020.0), not_(leaf("draft", EXISTS))),
        leaf("tag", IN, None, ["1", 1.0, True]),  # kinds may mix: each compares with its own kind
    )
    assert filter_from_proto(message) == AllOf(
        (
            Condition("lang", Operator.EQ, "en"),
            AnyOf((Condition("year", Operator.GT, 2020.0), Not(Condition("draft", Operator.EXISTS)))),
            Condition("tag", Operator.IN, None, ("1", 1.0, True)),
        )
    )
    in_list = filter_from_proto(leaf("tag", IN, None, ["1", 1.0, True]))
    assert isinstance(in_list, Condition)
    assert [type(v) for v in in_list.values] == [str, float, bool]


def chain(depth: int) -> pb.Filter:
    """`depth` nested Filter messages: not(not(...(a EQ 1))), built without recursion."""
    root = pb.Filter()
    node = root
    for _ in range(depth - 1):
        node = node.not_filter
    node.field.CopyFrom(OK.field)
    return root


def test_eight_levels_are_accepted_and_nine_are_not() -> None:
    assert filter_from_proto(chain(8)) is not None
    with pytest.raises(InvalidArgument) as caught:
        filter_from_proto(chain(9))
    assert caught.value.field == "filter" + ".not_filter" * 8


@pytest.mark.parametrize("depth", [20, 10_000])
def test_deep_filter_is_invalid_argument_not_recursion_error(depth: int) -> None:
    with pytest.raises(InvalidArgument) as caught:
        filter_from_proto(chain(depth))
    assert caught.value.field == "filter" + ".not_filter" * 8


def test_sixty_four_nodes_are_accepted_and_sixty_five_are_not() -> None:
    assert filter_from_proto(and_(*[OK] * 63)) is not None  # 1 + 63 nodes
    with pytest.raises(InvalidArgument) as caught:
        filter_from_proto(and_(*[OK] * 64))
    assert caught.value.field == "filter.and_filters.filters[63]"


def test_thousand_node_filter_is_invalid_argument() -> None:
    wide = and_(*[OK] * 999)
    with pytest.raises(InvalidArgument) as caught:
        filter_from_proto(wide)
    assert caught.value.field == "filter.and_filters.filters[63]"
    nested = and_(or_(*[OK] * 10), *[and_(*[OK] * 30) for _ in range(30)])
    with pytest.raises(InvalidArgument) as caught:
        filter_from_proto(nested)
    # Pre-order: root, the or and its 10 leaves (12), the first and and its 30 leaves (43),
    # the second and (44) and its leaves 0..19 (64): the 65th node is its leaf 20.
    assert caught.value.field == "filter.and_filters.filters[2].and_filters.filters[20]"


# --- semantics, in PostgreSQL and in Python ---------------------------------------------------


@pytest.fixture(scope="module")
async def conn(database: SharedDatabase) -> AsyncIterator[asyncpg.Connection]:
    async with superuser(database) as connection:
        # The serving pool's jsonb codec: compiled filters must not depend on it.
        await connection.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")
        await connection.execute(
            "CREATE TEMP TABLE filter_rows (id int PRIMARY KEY, metadata jsonb NOT NULL)"
        )
        yield connection


async def selected(conn: asyncpg.Connection, rows: Sequence[Row], node: Filter) -> list[int]:
    """Ids of `rows` the compiled filter selects in PostgreSQL (asserting `matches` agrees)."""
    await conn.execute("TRUNCATE filter_rows")
    await conn.executemany("INSERT INTO filter_rows VALUES ($1, $2)", list(enumerate(rows)))
    params: list[object] = []
    sql = compile_filter(node, "metadata", params)
    query = f"SELECT id FROM filter_rows WHERE {sql} ORDER BY id"  # noqa: S608 -- params carry all data
    in_sql = [row["id"] for row in await conn.fetch(query, *params)]
    assert in_sql == [i for i, row in enumerate(rows) if matches(node, row)], sql
    return in_sql


ROWS: list[Row] = [
    {"num": 10.0, "str": "10", "flag": True, "mixed": 1.0},  # 0
    {"num": 9.0, "str": "9", "flag": False, "mixed": True},  # 1
    {"num": -0.0, "str": "é", "mixed": "1"},  # 2
    {"num": 1e308, "str": "Z"},  # 3
    {},  # 4
    {"num": "10", "flag": 1.0},  # 5: a string where others have numbers, a number for a flag
]
ALL = list(range(len(ROWS)))


def c(key: str, op: Operator, value: MetadataScalar | None = None, *values: MetadataScalar) -> Condition:
    return Condition(key, op, value, values)


SEMANTICS = [
    ("numbers compare as numbers", c("num", Operator.GT, 9.0), [0, 3]),
    ("strings compare as strings", c("str", Operator.LT, "9"), [0]),
    ("string order is code point order", c("str", Operator.GT, "Z"), [2]),
    ("upper case sorts before lower case", c("str", Operator.LT, "a"), [0, 1, 3]),
    ("string GT skips other kinds", c("str", Operator.GTE, "1"), [0, 1, 2, 3]),
    ("number EQ ignores the string '10'", c("num", Operator.EQ, 10.0), [0]),
    ("string EQ ignores the number 10", c("str", Operator.EQ, "10"), [0]),
    ("minus zero equals zero", c("num", Operator.EQ, 0.0), [2]),
    ("minus zero is not below zero", c("num", Operator.LT, 0.0), []),
    ("LTE minus zero", c("num", Operator.LTE, -0.0), [2]),
    ("largest numbers", c("num", Operator.GTE, 1e308), [3]),
    ("true is not 1", c("flag", Operator.EQ, True), [0]),
    ("1 is not true", c("mixed", Operator.EQ, 1.0), [0]),
    ("true is not 1 either way", c("mixed", Operator.EQ, True), [1]),
    ("'1' is neither", c("mixed", Operator.EQ, "1"), [2]),
    ("NE needs the same kind", c("mixed", Operator.NE, 2.0), [0]),
    ("NE on numbers", c("num", Operator.NE, 10.0), [1, 2, 3]),
    ("NE on booleans", c("flag", Operator.NE, True), [1]),
    ("IN with mixed kinds", c("mixed", Operator.IN, None, 1.0, "1"), [0, 2]),
    ("IN with a boolean", c("flag", Operator.IN, None, False, 1.0), [1, 5]),
    ("NIN matches other kinds but not missing keys", c("mixed", Operator.NIN, None, 1.0), [1, 2]),
    ("EXISTS is presence", c("flag", Operator.EXISTS), [0, 1, 5]),
    ("NOT EXISTS", Not(c("flag", Operator.EXISTS)), [2, 3, 4]),
    ("AND", AllOf((c("num", Operator.GT, 0.0), c("str", Operator.LT, "Z"))), [0, 1]),
    ("OR", AnyOf((c("flag", Operator.EQ, False), c("str", Operator.EQ, "Z"))), [1, 3]),
    ("empty AND is everything", AllOf(()), ALL),
    ("empty OR is nothing", AnyOf(()), []),
]


@pytest.mark.parametrize(("node", "expected"), [s[1:] for s in SEMANTICS], ids=[s[0] for s in SEMANTICS])
async def test_filter_semantics(conn: asyncpg.Connection, node: Filter, expected: list[int]) -> None:
    assert await selected(conn, ROWS, node) == expected


MISSING = [
    c("absent", op, *operands)
    for op, operands in [
        *[(op, (1.0,)) for op in (Operator.EQ, Operator.NE, Operator.GT, Operator.GTE, Operator.LT)],
        *[(op, ("x",)) for op in (Operator.NE, Operator.GTE, Operator.LTE)],
        (Operator.IN, (None, 1.0, "x", True)),
        (Operator.NIN, (None, 1.0)),
        (Operator.EXISTS, ()),
    ]
]


@pytest.mark.parametrize("node", MISSING, ids=[f"{m.op}-{m.value!r}" for m in MISSING])
async def test_missing_key_matches_no_operator_and_its_negation_matches_all(
    conn: asyncpg.Connection, node: Condition
) -> None:
    assert await selected(conn, ROWS, node) == []
    # Negation is two-valued: NOT of a comparison on a missing key is true (documented; this is
    # how a caller matches "not equal, or absent").
    assert await selected(conn, ROWS, Not(node)) == ALL


INJECTIONS = ["'; DROP TABLE filter_rows; --", '"', '\\"}', "$1", "?", "'", "ü😀\u202e", "a' OR '1'='1"]


@pytest.mark.parametrize("text", INJECTIONS)
async def test_sql_in_keys_and_values_is_just_data(conn: asyncpg.Connection, text: str) -> None:
    rows: list[Row] = [{"k": text}, {"k": "other"}, {text: 1.0}]
    at_least = [i for i, row in enumerate(rows) if "k" in row and str(row["k"]) >= text]
    cases: list[tuple[Callable[[str], Filter], list[int]]] = [
        (lambda t: c("k", Operator.EQ, t), [0]),
        (lambda t: c("k", Operator.NE, t), [1]),
        (lambda t: c("k", Operator.IN, None, t, "$2"), [0]),
        (lambda t: c("k", Operator.NIN, None, t), [1]),
        (lambda t: c("k", Operator.GTE, t), at_least),
        (lambda t: c(t, Operator.EXISTS), [2]),  # compile_filter trusts keys; they are still parameters
        (lambda t: c(t, Operator.GT, 0.5), [2]),
        (lambda t: c(t, Operator.EQ, 1.0), [2]),
    ]
    for build, expected in cases:
        # The SQL text is the same whatever the data: keys and values only travel as parameters.
        assert compile_filter(build(text), "metadata", []) == compile_filter(build("plain"), "metadata", [])
        assert await selected(conn, rows, build(text)) == expected
    assert await conn.fetchval("SELECT to_regclass('pg_temp.filter_rows') IS NOT NULL")


def test_compiled_parameters_follow_those_already_bound() -> None:
    params: list[object] = ["bucket", 10]
    sql = compile_filter(AllOf((c("a", Operator.EQ, "x"), c("b", Operator.GT, 1.5))), "m.metadata", params)
    assert params[:2] == ["bucket", 10]
    assert "$3" in sql
    assert f"${len(params)}" in sql
    assert "$1" not in sql
    assert "$2" not in sql


ORDERINGS = (Operator.GT, Operator.GTE, Operator.LT, Operator.LTE)


@pytest.mark.parametrize("op", ORDERINGS)
def test_string_order_does_not_depend_on_the_database_collation(op: Operator) -> None:
    # The test database's default collation is C and this PostgreSQL build has no ICU or other
    # locales, so no database here orders text differently; a production database in en_US would.
    # String comparisons therefore carry their own collation.
    assert 'COLLATE "C"' in compile_filter(c("a", op, "x"), "metadata", [])
    assert "COLLATE" not in compile_filter(c("a", op, 1.0), "metadata", [])


@pytest.mark.parametrize("column", ["metadata; DROP TABLE x", "Metadata", "1col", "a b", ""])
def test_untrusted_column_identifier_is_refused(column: str) -> None:
    with pytest.raises(ValueError, match="column"):
        compile_filter(c("a", Operator.EXISTS), column, [])


# --- property: PostgreSQL and matches() agree -------------------------------------------------

KEYS = st.sampled_from(["a", "b", "c"])
FLOATS = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(
    [-0.0, 0.0, 1.0, 10.0, 9.0, 1e308, -1e308, 5e-324, -5e-324, 2.0**53, 2.0**53 + 2]
)
TEXTS = st.text(
    alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=4
) | st.sampled_from(["", "1", "10", "9", "a", "A", "é", "😀", "\uffff", "true"])
SCALARS = FLOATS | TEXTS | st.booleans()
IN_LISTS = st.lists(SCALARS, min_size=1, max_size=4).map(tuple)
CONDITIONS = (
    st.builds(Condition, KEYS, st.sampled_from([Operator.EQ, Operator.NE]), SCALARS)
    | st.builds(Condition, KEYS, st.sampled_from(list(ORDERINGS)), FLOATS | TEXTS)
    | st.builds(Condition, KEYS, st.sampled_from([Operator.IN, Operator.NIN]), st.none(), IN_LISTS)
    | st.builds(Condition, KEYS, st.just(Operator.EXISTS))
)


def filters(depth: int) -> st.SearchStrategy[Filter]:
    if depth == 1:
        return CONDITIONS
    inner = filters(depth - 1)
    lists = st.lists(inner, min_size=1, max_size=3).map(tuple)
    return CONDITIONS | lists.map(AllOf) | lists.map(AnyOf) | inner.map(Not)


ROW_LISTS = st.lists(st.dictionaries(KEYS, SCALARS, max_size=3), max_size=8)


@settings(max_examples=200, deadline=None)
@given(rows=ROW_LISTS, node=filters(3))
async def test_postgres_and_matches_select_the_same_rows(
    conn: asyncpg.Connection, rows: list[Row], node: Filter
) -> None:
    # Also through the proto: what the API accepts is exactly the generated tree.
    assert filter_from_proto(to_proto(node)) == node
    await selected(conn, rows, node)
