"""The statements that fetch search candidates with both scores, for memories and chunks alike.

`candidate_statement`: the vector ranker's top k, the text ranker's top k (BM25 over the rows
matching any query term), their union with BOTH scores of every candidate, its ranks in each
ranker, and (when asked) the scores of its two neighbours, in one statement, so one snapshot.
`vector_statement` is the plain VECTOR search (no text, no neighbours). Fusion happens in
`tokensvc.retrieval`.

A HYBRID search whose vector is still being embedded ranks by text meanwhile, in one snapshot. A
small exact one (at most WHOLE_READ_ROWS rows) reads every searchable row with its vector and BM25
score in one statement (`ahead_statement`), ends its transaction, and is ranked in Python once
the vector is there (`tokensvc.storage.scoring`, the candidate statement's semantics); a larger
one runs `ahead_statement` and then the candidate statement with its rows as parameters, in one
REPEATABLE READ transaction.

BM25 per candidate row d and query term t, over the rows the query matches:
`idf(t) * tf(t, d) * (k1 + 1) / (tf(t, d) + k1 * (1 - b + b * |d| / avg|d|))`,
`idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))` where N is the bucket's (or the corpora's)
row count (counted up to a cap by the caller) and df(t) the matching rows containing t; |d| is
the number of distinct lexemes. A corpus with statistics (large knowledge bases) takes N, avg|d|
and the df of common lexemes from them, and reads only the rows that can reach the top
(`_pruned_bm25_parts`). The query's terms are stemmed and stop-word-filtered by the text
configuration the rows were indexed with (`text_config`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import asyncpg
import numpy as np
from opentelemetry import trace

from tokensvc.observability.deadlines import remaining_ms
from tokensvc.storage.postgres.tenant import declare, distributed_pool, is_distributed, tenant_transaction
from tokensvc.storage.records import Candidate, CandidateQuery, SearchPlan, Tenant, pending_vector
from tokensvc.storage.scoring import RowSet, Searchable, TextRanking

__all__ = [
    "Corpus",
    "TextIndex",
    "ahead_statement",
    "candidate_statement",
    "candidates_from",
    "fetch_candidates",
    "hnsw_settings",
    "plain_vector",
    "search_settings",
    "search_statement",
    "short",
    "vector_statement",
]

T = TypeVar("T")
_tracer = trace.get_tracer("tokensvc.storage")

# An exact HYBRID search of at most this many rows (the default exact threshold) that runs ahead of
# its query's embedding reads them whole and is ranked in Python (`ahead_statement`): reading 1,000
# rows with their vectors takes a few milliseconds, hidden behind the embedding's ~20.
WHOLE_READ_ROWS = 1_000

# Past this many rows the text ranker's rows are not sent back with the candidate statement (the
# statement ranks by text again): decoding and re-encoding them would cost more than the ranking.
MAX_GIVEN_TEXT_ROWS = 2_000

# The text ranker scores at most this many matching rows: a very common term in a very large
# bucket would otherwise make every search unnest every row. Past it, BM25 ranks the first rows the
# index returns, not all of them (docs/architecture.md, "Search").
MAX_TEXT_MATCHES = 10_000


@dataclass(frozen=True)
class Corpus:
    """A searchable table: how rows are identified, and what a row's neighbours are."""

    table: str
    partition: tuple[str, ...]  # neighbours share these columns...
    local: str  # ...and this column identifies a row among them (key = partition + local)...
    order: tuple[str, ...]  # ...in which order rows are adjacent
    columns: tuple[str, ...]  # what a result carries
    key_types: tuple[str, ...]  # the SQL types of `key`'s columns (text rows travel as arrays)
    # The vector and its dimension: a memory space reads the slot of its generation.
    vector: str = "embedding"
    dimension: str = "dimension"
    # Whether BM25 statistics are kept for it (`text_statistics` and `common_lexemes`, keyed as
    # the rows the search's scope selects): knowledge chunks, whose bases grow large.
    statistics: bool = False

    def __post_init__(self) -> None:
        if len(self.key_types) != len(self.key):
            raise ValueError("one SQL type per key column")

    @property
    def key(self) -> tuple[str, ...]:
        """Identifies a row: the join key of the statement's parts."""
        return (*self.partition, self.local)


@dataclass(frozen=True)
class TextIndex:
    """How a corpus's text ranker reads its matching rows past row-level security: through
    `function` (for chunks `tokensvc.chunks_matching`, functions/chunk_text.sql), which answers a
    text match from the GIN index and checks the caller's tenant itself. Under the serving role's
    own policy the index is unusable (`@@` is not leakproof), so every matching row would be found
    by reading the whole scope.

    `arguments(params)` appends the search scope's parameters and returns the function's leading
    arguments (before the query and the row cap); `filtered`: the search selects fewer rows than
    its scope (a metadata filter), so each row read is checked against its predicate by key.
    """

    function: str
    arguments: Callable[[list[Any]], str]
    filtered: bool


def hnsw_settings(*, ef_search: int, max_scan_tuples: int) -> dict[str, str]:
    """Transaction-local settings of an approximate search (set with the tenant, one round trip).

    pgvector 0.8's iterative scan, so a filtered search finds k rows, bounded by
    `max_scan_tuples`; and `enable_sort = off`, so the planner takes the HNSW index the caller
    chose by size: under row-level security its row estimate for a bucket multiplies the
    selectivities of the query's and the policy's predicates (far too few rows), which makes
    "read the bucket and sort" look cheap when it is the slow plan. A sort stays possible; it is
    only costed as a last resort.
    """
    return {
        "hnsw.iterative_scan": "relaxed_order",
        "hnsw.ef_search": str(ef_search),
        "hnsw.max_scan_tuples": str(max_scan_tuples),
        "enable_sort": "off",
    }


class _Params:
    def __init__(self, params: list[Any]):
        self.values = params

    def add(self, value: Any) -> str:
        self.values.append(value)
        return f"${len(self.values)}"


def _cols(alias: str, names: Sequence[str]) -> str:
    return ", ".join(f"{alias}.{name}" for name in names)


def _distance(corpus: Corpus, vector: str, dimension: int, *, exact: bool) -> str:
    column = corpus.vector
    if exact:
        return f"{column} <#> {vector}"
    # The typed expression and `dimension = N` match the partial index <table>_hnsw_N.
    return f"{column}::vector({dimension}) <#> {vector}::vector({dimension})"


def vector_statement(
    corpus: Corpus, where: str, params: list[Any], vector: np.ndarray, *, k: int, exact: bool
) -> str:
    """VECTOR mode: the top k by inner product (one plain statement, the fast path)."""
    p = _Params(params)
    dimension = int(vector.shape[0])
    q = p.add(vector)
    limit = p.add(k)
    distance = _distance(corpus, q, dimension, exact=exact)
    where = where if exact else f"{corpus.dimension} = {dimension} AND {where}"
    # Ties break by key, as in every ranker. The exact scan sorts by (distance, key), so the top k
    # is the same set every time; the approximate scan keeps the index order alone (the HNSW
    # index serves no second key) and ties break among the rows it returned.
    inner = distance if not exact else f"{distance}, {', '.join(corpus.key)}"
    outer = ", ".join(["vector_score DESC", *(c for c in corpus.key if c in corpus.columns)])
    # The rank is numbered after the outer sort: relaxed_order iterative scans may return rows
    # slightly out of order, and a window over the index order would number them as they came.
    return (
        f"SELECT *, row_number() OVER (ORDER BY {outer}) AS vector_rank, 0::bigint AS text_rank, "
        f"{_NO_NEIGHBOURS}, NULL::float8 AS text_ideal FROM (SELECT {', '.join(corpus.columns)}, -({distance}) AS vector_score, "
        f"0::float8 AS text_score FROM {corpus.table} WHERE {where} ORDER BY {inner} LIMIT {limit}) s "
        f"ORDER BY {outer}"
    )


# A matched row's occurrences of the query's terms: its tsvector with the query's lexemes marked
# weight A (every stored lexeme is D, to_tsvector's default) and only those kept, so the other
# ~90 % of its lexemes are never expanded into (lexeme, positions, weights) rows. Each matched
# row's tsvector is read once, by this (reading it again per use cost more than the ranking).
_QUERY_HITS = "ts_filter(setweight(content_tsv, 'A', (SELECT array_agg(lexeme) FROM terms)), '{a}')"


@dataclass(frozen=True)
class _TextParameters:
    """The text ranker's parameters, added to the statement's: the text configuration, the query's
    words, N as the caller counted it, k1 and b."""

    cfg: str
    raw: str
    n: str
    k1: str
    b: str

    @classmethod
    def of(cls, p: _Params, query: CandidateQuery) -> _TextParameters:
        assert query.text is not None
        return cls(
            p.add(query.text_config), p.add(query.text), p.add(query.row_count), p.add(query.bm25_k1),
            p.add(query.bm25_b),
        )  # fmt: skip

    @property
    def terms(self) -> str:
        """The CTE `terms`: the query's distinct lexemes."""
        return (
            f"terms AS (SELECT DISTINCT lexeme FROM unnest(to_tsvector({self.cfg}::regconfig, {self.raw})))"
        )


def _matching(corpus: Corpus, where: str, p: _Params, index: TextIndex | None, match: str) -> str:
    """The searchable rows whose text matches the tsquery `match`, up to MAX_TEXT_MATCHES (per
    corpus, through an index), as (key, dl, hits): their lengths and the query terms they hold."""
    key = ", ".join(corpus.key)
    columns = f"{key}, length(content_tsv) AS dl, {_QUERY_HITS} AS hits"
    if index is None:
        return f"SELECT {columns} FROM {corpus.table} WHERE {where} AND content_tsv @@ {match} LIMIT {MAX_TEXT_MATCHES}"
    read = f"{index.function}({index.arguments(p.values)}, {match}, {p.add(MAX_TEXT_MATCHES)}) g"
    if not index.filtered:
        return f"SELECT {columns} FROM {read}"
    same = " AND ".join(f"r.{c} = g.{c}" for c in corpus.key)
    return (
        f"SELECT {columns} FROM {read} WHERE EXISTS (SELECT FROM {corpus.table} r WHERE {where} AND {same})"
    )


def _bm25_parts(
    corpus: Corpus, where: str, p: _Params, query: CandidateQuery, k: str, index: TextIndex | None
) -> list[str]:
    """The CTEs `bm25` (every matching row's score) and `by_text` (the top `k`, ranked)."""
    key = ", ".join(corpus.key)
    text = _TextParameters.of(p, query)
    cfg, n, k1, b = text.cfg, text.n, text.k1, text.b
    alternatives = p.add(query.or_text)
    match = f"websearch_to_tsquery({cfg}::regconfig, {alternatives})"
    return [
        text.terms,
        f"matched AS ({_matching(corpus, where, p, index, match)})",
        f"postings AS (SELECT {_cols('m', corpus.key)}, u.lexeme, cardinality(u.positions) AS tf, m.dl "
        "FROM matched m CROSS JOIN LATERAL unnest(m.hits) u)",
        "df AS (SELECT lexeme, count(*) AS n FROM postings GROUP BY lexeme)",
        f"stats AS (SELECT greatest({n}::float8, count(*)) AS n, "
        "coalesce(avg(dl), 1)::float8 AS avgdl FROM matched)",
        # The score no row reaches: every query term (one no row holds too), saturated.
        "ideal AS (SELECT coalesce(sum(ln(1 + (s.n - coalesce(d.n, 0) + 0.5) / (coalesce(d.n, 0) + 0.5))), 0) "
        f"* ({k1}::float8 + 1) AS score FROM terms t LEFT JOIN df d USING (lexeme) CROSS JOIN stats s)",
        f"bm25 AS (SELECT {_cols('p', corpus.key)}, sum(ln(1 + (s.n - df.n + 0.5) / (df.n + 0.5)) "
        f"* p.tf * ({k1}::float8 + 1) / (p.tf + {k1}::float8 * (1 - {b}::float8 + {b}::float8 "
        f"* p.dl / s.avgdl))) AS score FROM postings p JOIN df USING (lexeme) CROSS JOIN stats s "
        f"GROUP BY {_cols('p', corpus.key)})",
        f"by_text AS (SELECT {key}, score, row_number() OVER (ORDER BY score DESC, {key}) AS rank "
        f"FROM bm25 ORDER BY score DESC, {key} LIMIT {k})",
    ]


# Pruning keeps the text ranker's top this-many rows those of exact BM25 (`_pruned_bm25_parts`).
PRUNING_RANK = 10
# The most common terms a row must hold together to be read for them (`_pruned_bm25_parts`).
MAX_COVER = 3

# A lexeme as a tsquery operand, quoted as it is (backslashes and quotes escaped), so nothing is
# parsed or stemmed again.
_QUOTED_LEXEME = r"'''' || replace(replace(lexeme, '\', '\\'), '''', '''''') || ''''"


def _tsquery_of(lexemes: str) -> str:
    """A tsquery matching any lexeme of the CTE `lexemes` (NULL, matching nothing, when empty)."""
    return f"(SELECT string_agg({_QUOTED_LEXEME}, ' | ')::tsquery FROM {lexemes})"


def _pruned_bm25_parts(
    corpus: Corpus, where: str, scope: str, p: _Params, query: CandidateQuery, k: str, index: TextIndex | None
) -> list[str]:
    """`bm25` and `by_text` for a corpus with statistics, reading few rows (MaxScore).

    The chunk count, mean length and the chunk counts of the common lexemes come from the
    statistics the runners keep (`text_statistics.py`); a query term not listed there is rare,
    and its chunk count is counted among the rows holding it, which are read anyway. First the
    rows holding a rare term (the rarest common one when there is none) are read and scored with
    every query term; the score of the PRUNING_RANK-th of them is a floor the final top rows
    reach. A common term adds less than idf * (k1 + 1) to any row's score, so a row holding only
    common terms whose bounds add up to less than that floor cannot enter the top PRUNING_RANK:
    only the rows holding a set of common terms whose bounds reach it are read and scored too. Without
    statistics (a small base, or not counted yet) every term is rare: every matching row is read,
    as `_bm25_parts` does.
    """
    key = ", ".join(corpus.key)
    text = _TextParameters.of(p, query)
    n, k1, b = text.n, text.k1, text.b
    rank = p.add(PRUNING_RANK)
    saturation = f"p.tf * ({k1}::float8 + 1) / (p.tf + {k1}::float8 * (1 - {b}::float8 + {b}::float8 * p.dl / s.avgdl))"

    def read(name: str, match: str, *, unless: str = "", guard: str = "true") -> list[str]:
        rows = _matching(corpus, f"{guard} AND {where}", p, index, match)
        return [
            f"{name} AS (SELECT * FROM ({rows}) m {unless})",
            f"{name}_postings AS (SELECT {_cols('m', corpus.key)}, u.lexeme, cardinality(u.positions) AS tf, "
            f"m.dl FROM {name} m CROSS JOIN LATERAL unnest(m.hits) u)",
        ]

    def scored(name: str) -> str:
        return (
            f"{name}_scored AS (SELECT {_cols('p', corpus.key)}, sum(w.idf * {saturation}) AS score "
            f"FROM {name}_postings p JOIN weights w USING (lexeme) CROSS JOIN s GROUP BY {_cols('p', corpus.key)})"
        )

    return [
        text.terms,
        "counted AS (SELECT sum(chunks)::float8 AS chunks, sum(chunks * avg_length) / nullif(sum(chunks), 0) "
        f"AS avgdl FROM text_statistics WHERE {scope})",
        "listed AS (SELECT t.lexeme, c.chunks FROM terms t LEFT JOIN (SELECT lexeme, sum(chunks) AS chunks "
        f"FROM common_lexemes WHERE {scope} AND lexeme = ANY (ARRAY(SELECT lexeme FROM terms)) "
        "GROUP BY lexeme) c USING (lexeme))",
        "seeds AS (SELECT lexeme FROM listed WHERE chunks IS NULL UNION ALL (SELECT lexeme FROM listed "
        "WHERE NOT EXISTS (SELECT FROM listed WHERE chunks IS NULL) ORDER BY chunks, lexeme LIMIT 1))",
        *read("rare", _tsquery_of("seeds")),
        "rare_counts AS (SELECT lexeme, count(*) AS chunks FROM rare_postings GROUP BY lexeme)",
        f"s AS (SELECT greatest({n}::float8, c.chunks, (SELECT count(*) FROM rare)) AS n, "
        "coalesce(c.avgdl, (SELECT avg(dl) FROM rare), 1)::float8 AS avgdl FROM counted c)",
        "weights AS (SELECT l.lexeme, ln(1 + (s.n - d.chunks + 0.5) / (d.chunks + 0.5)) AS idf, "
        "l.chunks IS NOT NULL AND l.lexeme NOT IN (SELECT lexeme FROM seeds) AS common "
        "FROM listed l LEFT JOIN rare_counts r USING (lexeme) CROSS JOIN s "
        "CROSS JOIN LATERAL (SELECT coalesce(l.chunks, r.chunks, 0)::float8 AS chunks) d)",
        scored("rare"),
        f"ideal AS (SELECT coalesce(sum(idf), 0) * ({k1}::float8 + 1) AS score FROM weights)",
        "floor AS (SELECT coalesce((SELECT score FROM rare_scored ORDER BY score DESC "
        f"LIMIT 1 OFFSET {rank} - 1), 0) AS score)",
        # A row holding no rare term scores at most the bounds of the common terms it holds. The
        # smallest sets of common terms whose bounds reach the floor (`covers`: in bound order, a
        # set grows while it is short of the floor and the terms after it can still make it up;
        # cut at MAX_COVER terms, which matches more rows, never fewer): the rows holding every
        # term of one of them are the only others read.
        f"bounds AS (SELECT lexeme, idf * ({k1}::float8 + 1) AS bound, row_number() OVER (ORDER BY idf DESC, lexeme) "
        f"AS i, sum(idf * ({k1}::float8 + 1)) OVER (ORDER BY idf DESC, lexeme ROWS BETWEEN CURRENT ROW AND "
        "UNBOUNDED FOLLOWING) AS reach FROM weights WHERE common)",
        "covers AS (SELECT ARRAY[lexeme] AS lexemes, i, bound AS total FROM bounds "
        "WHERE reach >= (SELECT score FROM floor) UNION ALL SELECT c.lexemes || b.lexeme, b.i, c.total + b.bound "
        "FROM covers c JOIN bounds b ON b.i > c.i WHERE c.total < (SELECT score FROM floor) "
        f"AND c.total + b.reach >= (SELECT score FROM floor) AND cardinality(c.lexemes) < {MAX_COVER})",
        f"cover_query AS (SELECT string_agg('(' || (SELECT string_agg({_QUOTED_LEXEME}, ' & ') "
        "FROM unnest(c.lexemes) AS t(lexeme)) || ')', ' | ')::tsquery AS q FROM covers c "
        f"WHERE c.total >= (SELECT score FROM floor) OR cardinality(c.lexemes) = {MAX_COVER})",
        *read(
            "common",
            "(SELECT q FROM cover_query)",
            # The rows of a cover holding no seed (those were read); `hits` holds every query
            # term a row holds, so this is the row's own test.
            unless=f"WHERE NOT m.hits @@ {_tsquery_of('seeds')}",
            # A test on the query alone, first: without a cover the rows are not read.
            guard="(SELECT q FROM cover_query) IS NOT NULL",
        ),
        scored("common"),
        "bm25 AS (SELECT * FROM rare_scored UNION ALL SELECT * FROM common_scored)",
        f"by_text AS (SELECT {key}, score, row_number() OVER (ORDER BY score DESC, {key}) AS rank "
        f"FROM bm25 ORDER BY score DESC, {key} LIMIT {k})",
    ]


def _text_parts(
    corpus: Corpus,
    where: str,
    p: _Params,
    query: CandidateQuery,
    k: str,
    scope: str | None,
    index: TextIndex | None,
) -> list[str]:
    if scope is not None:
        return _pruned_bm25_parts(corpus, where, scope, p, query, k, index)
    return _bm25_parts(corpus, where, p, query, k, index)


def ahead_statement(
    corpus: Corpus,
    where: str,
    params: list[Any],
    query: CandidateQuery,
    *,
    whole: bool,
    scope: str | None = None,
    index: TextIndex | None = None,
) -> str:
    """The statement a HYBRID search runs while its query is embedded.

    `whole=False`: the text ranker alone, every row it scored (`bm25`) with its key, `score` and
    `rank` among the top k (`by_text`; 0 past it); the candidate statement then takes these rows
    as parameters (`text_rows`) in the same snapshot. `whole=True`: every searchable row with what
    a result carries, its key, order, vector (`row_vector`), BM25 score (`text_score`, NULL where
    the query matches nothing) and `text_rank`, in partition and order: a small exact search,
    ranked in Python once the vector is there (`tokensvc.storage.scoring`).
    """
    p = _Params(params)
    k = p.add(query.k)
    parts = _text_parts(corpus, where, p, query, k, scope, index)
    key = ", ".join(corpus.key)
    ranked = f"WITH {'RECURSIVE ' if scope is not None else ''}{', '.join(parts)} "
    if not whole:
        return (
            ranked
            + f"SELECT {key}, b.score, coalesce(t.rank, 0) AS rank FROM bm25 b LEFT JOIN by_text t USING ({key})"
        )
    carried = [*corpus.columns, *(c for c in (*corpus.key, *corpus.order) if c not in corpus.columns)]
    # `key_order`: the row's place in key order, the ties' order as the statements break them (the
    # database's collation, not Python's code points). One row past the limit tells a stale count.
    return ranked + (
        f"SELECT {_cols('m', carried)}, m.{corpus.vector} AS row_vector, b.score AS text_score, "
        f"coalesce(t.rank, 0) AS text_rank, row_number() OVER (ORDER BY {_cols('m', corpus.key)}) AS key_order "
        f"FROM {_scoped(corpus, where)} m LEFT JOIN bm25 b USING ({key}) LEFT JOIN by_text t USING ({key}) "
        f"ORDER BY {_cols('m', (*corpus.partition, *corpus.order))} LIMIT {p.add(WHOLE_READ_ROWS + 1)}"
    )


def _read_whole(
    corpus: Corpus, rows: Sequence[asyncpg.Record], local: Callable[[Any], Any], *, neighbours: bool
) -> RowSet[asyncpg.Record]:
    """The rows `ahead_statement` read, prepared for ranking (their records as the items: only the
    candidates' become results)."""
    searchable = [
        Searchable(
            row,
            (row["key_order"],),
            tuple(row[c] for c in corpus.partition),
            tuple(row[c] for c in corpus.order),
            local(row[corpus.local]),
            row["row_vector"].to_numpy(),
        )
        for row in rows
    ]
    scores = {i: float(row["text_score"]) for i, row in enumerate(rows) if row["text_score"] is not None}
    top = sorted((i for i, row in enumerate(rows) if row["text_rank"]), key=lambda i: rows[i]["text_rank"])
    return RowSet(searchable, TextRanking(scores, top), neighbours=neighbours)


def _given_text_parts(corpus: Corpus, p: _Params, rows: Sequence[Any]) -> list[str]:
    """`bm25` and `by_text` from the rows `ahead_statement` returned, passed as arrays."""
    key = ", ".join(corpus.key)
    arrays = [
        f"{p.add([row[name] for row in rows])}::{kind}[]"
        for name, kind in zip(corpus.key, corpus.key_types, strict=True)
    ]
    arrays += [
        f"{p.add([row['score'] for row in rows])}::float8[]",
        f"{p.add([row['rank'] for row in rows])}::bigint[]",
    ]
    return [
        f"given AS (SELECT * FROM unnest({', '.join(arrays)}) AS g({key}, score, rank))",
        f"bm25 AS (SELECT {key}, score FROM given)",
        f"by_text AS (SELECT {key}, score, rank FROM given WHERE rank > 0)",
    ]


def candidate_statement(
    corpus: Corpus,
    where: str,
    params: list[Any],
    query: CandidateQuery,
    *,
    scope: str | None = None,
    index: TextIndex | None = None,
    text_rows: Sequence[Any] | None = None,
) -> str:
    """TEXT or HYBRID mode: both rankers' candidates with both scores (see the module docstring).

    `where` selects the searchable rows (tenant, liveness, filter) with unqualified column names;
    it is applied to every part, neighbours included, so nothing outside it lends a score.
    `scope` (a corpus with statistics) selects the statistics of the searched rows' corpora;
    `index` reads the rows matching the query's terms (else `where` and a scan do);
    `text_rows`: the text ranker's rows, already ranked by `ahead_statement` in this snapshot.
    """
    p = _Params(params)
    key = ", ".join(corpus.key)
    k = p.add(query.k)
    parts: list[str] = []
    vector_score = "0::float8"
    if query.vector is not None:
        dimension = int(query.vector.shape[0])
        q = p.add(query.vector)
        distance = _distance(corpus, q, dimension, exact=query.exact)
        vwhere = where if query.exact else f"{corpus.dimension} = {dimension} AND {where}"
        parts.append(
            f"by_vector AS (SELECT {key}, row_number() OVER (ORDER BY d, {key}) AS rank FROM "
            f"(SELECT {key}, {distance} AS d FROM {corpus.table} WHERE {vwhere} "
            # An exact scan sorts by key too, so ties at the k-th place always keep the same rows.
            f"ORDER BY {distance if not query.exact else f'{distance}, {key}'} LIMIT {k}) v)"
        )
        vector_score = f"-(%s.{corpus.vector} <#> {q})"
    if query.text is not None and text_rows is not None:
        parts += _given_text_parts(corpus, p, text_rows)
        scope = None
    elif query.text is not None:
        parts += _text_parts(corpus, where, p, query, k, scope, index)
    rankers = [
        name
        for name, on in (("by_vector", query.vector is not None), ("by_text", query.text is not None))
        if on
    ]
    pool = [f"SELECT {key} FROM {r}" for r in rankers]
    parts.append(f"pool AS ({' UNION '.join(pool)})")

    text_score = "coalesce(b.score, 0)" if query.text is not None else "0::float8"
    fetched = _scoped(corpus, where) if query.exact else _fetched(corpus, where, "pool", corpus.key)
    joins = [f"JOIN {fetched} m USING ({key})"]
    if query.text is not None:
        joins.append(f"LEFT JOIN bm25 b USING ({key})")
        joins.append(f"LEFT JOIN by_text t USING ({key})")
    if query.vector is not None:
        joins.append(f"LEFT JOIN by_vector v USING ({key})")
    neighbour_columns = _NO_NEIGHBOURS
    if query.neighbours and query.exact and query.vector is not None:
        # One pass over the bucket scores every row once and numbers its neighbours.
        parts = _exact_scored(corpus, where, q, k) + parts[1:]
        neighbour_columns = _hood_neighbours(corpus, joins, text=query.text is not None)
        vector_score = "h.vs"
    elif query.neighbours:
        parts.append(_links(corpus, where, exact=query.exact))
        neighbour_columns = _linked_neighbours(
            corpus, where, joins, vector_score, text=query.text is not None
        )
    vector_found = "(SELECT count(*) FROM by_vector)" if query.vector is not None else "0::bigint"
    ideal = "(SELECT score FROM ideal)" if query.text is not None and text_rows is None else "NULL::float8"
    return (
        f"WITH {'RECURSIVE ' if scope is not None and query.text is not None else ''}{', '.join(parts)} "
        f"SELECT {_cols('m', corpus.columns)}, {vector_score.replace('%s', 'm')} AS vector_score, "
        f"{text_score} AS text_score, "
        f"{'coalesce(v.rank, 0)' if query.vector is not None else '0::bigint'} AS vector_rank, "
        f"{'coalesce(t.rank, 0)' if query.text is not None else '0::bigint'} AS text_rank, "
        f"{neighbour_columns}, {vector_found} AS vector_found, {ideal} AS text_ideal "
        f"FROM pool {' '.join(joins)}"
    )


# A candidate's neighbours, by the prefix of their columns: the rows 1 and 2 places before and after
# it in its partition's order (`Candidate.previous`, `.next`, `.second_previous`, `.second_next`),
# with the offset and direction that reach each.
_SIDES = (("prev", 1, "lag"), ("next", 1, "lead"), ("prev2", 2, "lag"), ("next2", 2, "lead"))

_NO_NEIGHBOURS = ", ".join(
    f"NULL::float8 AS {side}_vector, NULL::float8 AS {side}_text, NULL AS {side}_local"
    for side, _, _ in _SIDES
)


def _hood_neighbours(corpus: Corpus, joins: list[str], *, text: bool) -> str:
    """Neighbour columns from `hood` (exact scans); appends its joins to `joins`."""
    joins.append(f"JOIN hood h USING ({', '.join(corpus.key)})")
    columns = []
    for side, _, _ in _SIDES:
        text_of = "0::float8"
        if text:
            on = " AND ".join(
                [
                    *(f"{side}b.{c} = h.{c}" for c in corpus.partition),
                    f"{side}b.{corpus.local} = h.{side}_local",
                ]
            )
            joins.append(f"LEFT JOIN bm25 {side}b ON {on}")
            text_of = f"coalesce({side}b.score, 0)"
        columns += [
            f"h.{side}_vs AS {side}_vector",
            f"CASE WHEN h.{side}_local IS NOT NULL THEN {text_of} END AS {side}_text",
            f"h.{side}_local AS {side}_local",
        ]
    return ", ".join(columns)


def _scoped(corpus: Corpus, where: str) -> str:
    """The corpus's table as a join reads it: only the rows `where` selects. A join on the key
    alone would not name the tenant, so the planner could not prune `memories`' partitions (it
    would plan, lock and probe all 256); the subquery is flattened, so this costs no extra scan."""
    return f"(SELECT * FROM {corpus.table} WHERE {where})"


def _fetched(corpus: Corpus, where: str, outer: str, columns: Sequence[str]) -> str:
    """The corpus's row whose key is `outer`'s `columns`, looked up by key (LATERAL): an approximate
    search's statement runs with nested loops off (`search_settings`), and this is the one join
    that must stay one: the others read the statement's own small CTEs, which the planner, blind
    to their sizes, would otherwise rescan per row (`bm25` holds up to MAX_TEXT_MATCHES rows: 50
    candidates x 10k rows was half of a 100k-chunk search). OFFSET 0 keeps it from being flattened
    into a plain join."""
    match = " AND ".join(
        f"{name} = {outer}.{column}" for name, column in zip(corpus.key, columns, strict=True)
    )
    return f"LATERAL (SELECT * FROM {corpus.table} WHERE {where} AND {match} OFFSET 0)"


def _linked_neighbours(corpus: Corpus, where: str, joins: list[str], vector_score: str, *, text: bool) -> str:
    """Neighbour columns from `links` (approximate scans: rows fetched by key); appends joins."""
    joins.append(f"JOIN links l USING ({', '.join(corpus.key)})")
    columns = []
    for side, _, _ in _SIDES:
        alias = f"{side}_n"
        on = " AND ".join(
            [*(f"{alias}.{c} = l.{c}" for c in corpus.partition), f"{alias}.{corpus.local} = l.{side}_local"]
        )
        neighbour = [*corpus.partition, f"{side}_local"]
        joins.append(f"LEFT JOIN {_fetched(corpus, where, 'l', neighbour)} {alias} ON true")
        text_of = "0::float8"
        if text:
            joins.append(f"LEFT JOIN bm25 {alias}b ON {on.replace(f'{alias}.', f'{alias}b.')}")
            text_of = f"coalesce({alias}b.score, 0)"
        present = f"{alias}.{corpus.local} IS NOT NULL"
        columns += [
            f"CASE WHEN {present} THEN {vector_score.replace('%s', alias)} END AS {side}_vector",
            f"CASE WHEN {present} THEN {text_of} END AS {side}_text",
            f"{alias}.{corpus.local} AS {side}_local",
        ]
    return ", ".join(columns)


def _exact_scored(corpus: Corpus, where: str, q: str, k: str) -> list[str]:
    """An exact search's vector ranker and neighbours from ONE scan of the bucket (or corpus):
    `scored` (every row's cosine), `by_vector` (the top k, ranked) and `hood` (each row with its
    neighbours' local keys and cosines)."""
    key = ", ".join(corpus.key)
    carried = ", ".join([*corpus.key, *(c for c in corpus.order if c not in corpus.key)])
    part = ", ".join(corpus.partition)
    order = ", ".join(corpus.order)
    return [
        f"scored AS MATERIALIZED (SELECT {carried}, -({corpus.vector} <#> {q}) AS vs FROM {corpus.table} "
        f"WHERE {where})",
        f"by_vector AS (SELECT {key}, rank FROM (SELECT {key}, row_number() OVER "
        f"(ORDER BY vs DESC, {key}) AS rank FROM scored) r WHERE rank <= {k})",
        f"hood AS (SELECT {key}, vs, "
        + ", ".join(
            f"{step}({corpus.local}, {offset}) OVER w AS {side}_local, {step}(vs, {offset}) OVER w AS {side}_vs"
            for side, offset, step in _SIDES
        )
        + f" FROM scored WINDOW w AS (PARTITION BY {part} ORDER BY {order}))",
    ]


def _links(corpus: Corpus, where: str, *, exact: bool) -> str:
    """`links`: each candidate's key with its previous and next rows' local keys.

    An exact search reads the whole bucket (or corpus) anyway, so one window pass over its rows
    finds every row's neighbours; an approximate one (a large bucket) looks up two rows per
    candidate in the order index instead (its transaction turns sorts off, so the planner takes it).
    """
    key = ", ".join(corpus.key)
    part = ", ".join(corpus.partition)
    order = ", ".join(corpus.order)
    if exact:
        locals_ = ", ".join(f"w.{side}_local" for side, _, _ in _SIDES)
        steps = ", ".join(
            f"{step}({corpus.local}, {offset}) OVER w AS {side}_local" for side, offset, step in _SIDES
        )
        return (
            f"links AS (SELECT {_cols('c', corpus.key)}, {locals_} FROM pool c JOIN "
            f"(SELECT {key}, {steps} "
            f"FROM {corpus.table} WHERE {where} WINDOW w AS (PARTITION BY {part} ORDER BY {order})) w "
            f"USING ({key}))"
        )
    same = " AND ".join(f"n.{c} = m.{c}" for c in corpus.partition)

    def lookup(side: str, offset: int, step: str) -> str:
        op, direction = ("<", "DESC") if step == "lag" else (">", "ASC")
        return (
            f"(SELECT n.{corpus.local} FROM {corpus.table} n WHERE {where} AND {same} AND "
            f"({_cols('n', corpus.order)}) {op} ({_cols('m', corpus.order)}) "
            f"ORDER BY {', '.join(f'n.{c} {direction}' for c in corpus.order)} "
            f"LIMIT 1 OFFSET {offset - 1}) AS {side}_local"
        )

    lookups = [lookup(*side) for side in _SIDES]
    return (
        f"links AS (SELECT {_cols('m', corpus.key)}, {', '.join(lookups)} "
        f"FROM pool c JOIN {_fetched(corpus, where, 'c', corpus.key)} m USING ({key}))"
    )


def search_settings(query: CandidateQuery) -> dict[str, str] | None:
    """Transaction-local settings of a search (declared with the tenant: no extra round trip).

    Approximate: the HNSW scan's. TEXT/HYBRID, exact or approximate: no nested loops (an
    approximate statement's lookups by key stay loops: `_fetched`). Under row-level security the
    planner estimates one row for any bucket, so it joins the statement's parts (candidates, BM25
    scores, neighbours) by nested loops that rescan the bucket per candidate (55 ms for a
    400-row bucket, measured); an exact search reads the whole bucket anyway, and hash joins over
    it take 7 ms. TEXT/HYBRID also plan for their parameters every time: after five executions
    PostgreSQL would switch a prepared statement to a generic plan, which for the BM25 parts is
    slower than planning anew (a 419-row bucket: text 2.2 -> 1.3 ms, hybrid 4.3 -> 3.9 ms).
    Merge joins are off as well, for the same blindness: at one estimated row per part a merge
    join looks free, and at the real sizes its sorts and rescans multiplied the rows (a 2,500-chunk
    base beside a 100k-chunk one: 190,000 rows re-read per join, the statement 94 -> 34 ms with
    hash joins). And they join in the order written (`join_collapse_limit = 1`): the pool of
    candidates first, every other part hashed or looked up by key onto it. The planner's search
    over the orders of HYBRID's eight joined parts took longer than running them (a 2,500-chunk
    base: planning 6.7 -> 1.3 ms), and no order it found was better.
    """
    if plain_vector(query):
        return (
            None
            if query.exact
            else hnsw_settings(ef_search=query.ef_search, max_scan_tuples=query.max_scan_tuples)
        )
    custom = {
        "enable_nestloop": "off",
        "enable_mergejoin": "off",
        "plan_cache_mode": "force_custom_plan",
        "join_collapse_limit": "1",
    }
    if not query.exact:
        return {**hnsw_settings(ef_search=query.ef_search, max_scan_tuples=query.max_scan_tuples), **custom}
    return custom


def plain_vector(query: CandidateQuery) -> bool:
    """Whether the fast VECTOR statement answers the query (no text ranker, no neighbours)."""
    return query.text is None and not query.neighbours


async def fetch_candidates(
    pool: asyncpg.Pool,
    tenant: Tenant,
    corpus: Corpus,
    plan: SearchPlan,
    where: Callable[[list[Any], bool], str],
    item: Callable[[asyncpg.Record], T],
    local: Callable[[Any], Any] = lambda value: value,
    *,
    row_count: int | None,
    count_cap: int,
    checks: Sequence[str] = (),
    text_index: TextIndex | None = None,
) -> tuple[int, list[Candidate[T]]]:
    """Run one search in one tenant transaction: count the searched rows first (up to
    `count_cap`) unless `row_count` is known, then the statement `plan(row_count)` asks for.

    `where(params, searchable)` appends its parameters and returns the predicate of the tenant's
    rows (`searchable=False`: what is counted) or of the searchable ones (liveness and filter
    too); `item(row)` builds a result's record and `local(value)` a neighbour's local key;
    `checks` run with the transaction's start (`tenant_transaction`); `text_index` is how the text
    ranker finds its rows, when the corpus has one. A query whose vector is still being embedded
    (`vector_later`) ranks by text first and awaits the vector after (the module docstring). An
    approximate search that comes back short (a selective filter in a big index) re-runs exactly
    in the same transaction, so results stay complete. Every statement reads the transaction's
    one snapshot (REPEATABLE READ; on Citus, where nothing runs ahead of the embedding, the
    statement is the only one after the count). Returns the row count the plan was given (the
    query's `row_count`) and the candidates.
    """
    query = None if row_count is None else plan(row_count)
    pending = pending_vector(plan) if query is None else query.vector_later
    if pending is not None and distributed_pool(pool):
        # Citus: nothing runs ahead (docs/scaling.md), so no transaction waits for the embedding.
        plan = _embedded(plan, await pending)
        query = None if row_count is None else plan(row_count)
    settings = None if query is None else search_settings(query)
    async with tenant_transaction(
        pool, tenant, isolation="one_snapshot", settings=settings, checks=checks
    ) as conn:
        distributed = is_distributed(conn)
        if distributed:
            # Citus runs the statement on the shard's worker, where a function reading the
            # distributed table would be a distributed query nested in a shard's, which it refuses:
            # there the text ranker reads the scope's rows (docs/scaling.md).
            text_index = None
        if query is None:
            params: list[Any] = []
            scope = where(params, False)
            params.append(count_cap)
            counted = await conn.fetchval(
                f"SELECT count(*) FROM (SELECT 1 FROM {corpus.table} WHERE {scope} LIMIT ${len(params)}) s",
                *params,
            )
            query = plan(int(counted))
            if settings := search_settings(query):
                await declare(conn, settings)
        ahead = query.vector_later is not None and query.text is not None and not distributed
        whole = None
        text_rows = None
        if ahead and query.exact and query.row_count <= WHOLE_READ_ROWS:
            sql, params = search_statement(corpus, where, query, text_index, ahead="whole")
            whole = await conn.fetch(sql, *params)
            if len(whole) > WHOLE_READ_ROWS:
                # The count was capped or cached: more rows than it said. Rank by text instead.
                whole = None
        if ahead and whole is None:
            with _tracer.start_as_current_span("text_ranker", record_exception=False):
                sql, params = search_statement(corpus, where, query, text_index, ahead="text")
                text_rows = await conn.fetch(sql, *params)
            if len(text_rows) > MAX_GIVEN_TEXT_ROWS:
                text_rows = None  # cheaper ranked again in the statement than sent back
        if whole is None:
            query = await query.with_vector()
            if ahead and (left := remaining_ms()) is not None:
                # The deadline moved on while the query embedded; so does the statements' timeout.
                await declare(conn, {"statement_timeout": str(max(1, left))})
            sql, params = search_statement(corpus, where, query, text_index, text_rows=text_rows)
            rows = await conn.fetch(sql, *params)
            if not query.exact and (len(rows) < query.k if plain_vector(query) else short(rows, query)):
                trace.get_current_span().set_attribute("tokensvc.search.exact_fallback", True)
                exact = dataclasses.replace(query, exact=True)
                sql, params = search_statement(corpus, where, exact, text_index, text_rows=text_rows)
                rows = await conn.fetch(sql, *params)
    if whole is not None:
        # Read whole, the transaction is over (its connection back in the pool).
        return query.row_count, await _ranked_whole(corpus, whole, query, item, local)
    return query.row_count, candidates_from(rows, item, local)


def _embedded(plan: SearchPlan, vector: np.ndarray) -> SearchPlan:
    """`plan` with its pending vector already embedded."""

    def embedded(rows: int) -> CandidateQuery:
        return dataclasses.replace(plan(rows), vector=vector, vector_later=None)

    return embedded


async def _ranked_whole(
    corpus: Corpus,
    rows: Sequence[asyncpg.Record],
    query: CandidateQuery,
    item: Callable[[asyncpg.Record], T],
    local: Callable[[Any], Any],
) -> list[Candidate[T]]:
    """The candidates among rows read whole: prepared while the query embeds, ranked in Python
    once its vector is there; only the candidates' records become results."""
    prepared = _read_whole(corpus, rows, local, neighbours=query.neighbours)
    found = prepared.candidates(await query.with_vector())
    rest = [f.name for f in dataclasses.fields(Candidate)][1:]
    return [Candidate(item(c.item), *(getattr(c, name) for name in rest)) for c in found]


def search_statement(
    corpus: Corpus,
    where: Callable[[list[Any], bool], str],
    query: CandidateQuery,
    text_index: TextIndex | None = None,
    *,
    ahead: Literal["text", "whole"] | None = None,
    text_rows: Sequence[Any] | None = None,
) -> tuple[str, list[Any]]:
    """The statement a search runs and its parameters: the plain VECTOR one when it answers the
    query, else the candidate statement (EXPLAIN tests and the bench run exactly this); `ahead`:
    the statement run while the query embeds (`ahead_statement`, whole or text only);
    `text_rows`: what `ahead_statement` returned."""
    params: list[Any] = []
    if ahead == "text" and text_index is not None and not text_index.filtered:
        # The index function reads the rows by its own scope; the predicate would go unused, and
        # PostgreSQL cannot type a parameter no part of the statement names.
        predicate = "false"
    else:
        predicate = where(params, True)
    if plain_vector(query):
        assert query.vector is not None
        return vector_statement(corpus, predicate, params, query.vector, k=query.k, exact=query.exact), params
    ranks_text = query.text is not None and text_rows is None
    scope = where(params, False) if corpus.statistics and ranks_text else None
    if ahead is not None:
        whole = ahead == "whole"
        return ahead_statement(
            corpus, predicate, params, query, whole=whole, scope=scope, index=text_index
        ), params
    statement = candidate_statement(
        corpus, predicate, params, query, scope=scope, index=text_index, text_rows=text_rows
    )
    return statement, params


def candidates_from(rows: Sequence[Any], item: Any, local: Any = None) -> list[Candidate[Any]]:
    """Rows of either statement as candidates; `item(row)` builds the result record and
    `local(value)` the neighbours' local keys (as they are; `str` for uuids)."""
    local = local or (lambda value: value)
    out = []

    def scores(row: Any, side: str) -> tuple[float, float] | None:
        vector = row[f"{side}_vector"]
        return None if vector is None else (float(vector), float(row[f"{side}_text"]))

    def key(row: Any, side: str) -> Any:
        value = row[f"{side}_local"]
        return None if value is None else local(value)

    for row in rows:
        out.append(
            Candidate(
                item(row),
                float(row["vector_score"]),
                float(row["text_score"]),
                int(row["vector_rank"]),
                int(row["text_rank"]),
                scores(row, "prev"),
                scores(row, "next"),
                key(row, "prev"),
                key(row, "next"),
                scores(row, "prev2"),
                scores(row, "next2"),
                key(row, "prev2"),
                key(row, "next2"),
                row["text_ideal"],
            )
        )
    return out


def short(rows: Sequence[Any], query: CandidateQuery) -> bool:
    """Whether an approximate search came back with fewer vector candidates than asked."""
    if query.exact or query.vector is None:
        return False
    found = int(rows[0]["vector_found"]) if rows else 0
    return found < query.k
