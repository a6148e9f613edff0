"""A knowledge base's BM25 statistics, counted in the background (migration 0027).

The text ranker of a large base reads its chunk count, mean length and the chunk counts of its
common lexemes from `text_statistics` and `common_lexemes` instead of counting them per query
(`ranking.py`). The runners keep them: after a version lands in a base, and after a base cuts
over to a new generation, `recount` counts them again when they are missing or the base's size
moved by a tenth since (functions/text_statistics.sql). Between counts a search uses the last
ones: a lexeme's weight then lags the base by less than a tenth, the same for every chunk.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import asyncpg

from tokensvc.storage.postgres.tenant import tenant_transaction
from tokensvc.storage.records import Tenant

__all__ = ["TEXT_STATISTICS", "TextStatisticsPolicy", "recount"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TextStatisticsPolicy:
    """When a base has statistics, and which lexemes they list (docs/benchmarks.md, "Knowledge
    search at scale")."""

    # A smaller base's searches count from its rows: fewer chunks than the text ranker's cap
    # (`ranking.MAX_TEXT_MATCHES`) all get scored, so its ranking is exact in one pass, where
    # statistics would add a second one (2,500 chunks: TEXT p50 21 -> 27 ms, hit@5 unchanged).
    min_base: int = 10_000
    # Listed: the lexemes in at least this share of the chunks (and at least `min_chunks` of
    # them); a search reads every chunk holding an unlisted query term, so this bounds that work.
    min_share: float = 0.002
    min_chunks: int = 20
    # Counted again when the base's chunk count moved by this share.
    drift: float = 0.1


TEXT_STATISTICS = TextStatisticsPolicy()


async def recount(
    pool: asyncpg.Pool, namespace: str, kb_ref: str, policy: TextStatisticsPolicy = TEXT_STATISTICS
) -> bool:
    """Count the base's statistics again if they are missing or stale; whether it counted.

    Best effort: the version or cutover that asked is done already, and searches stay correct
    with the last statistics (or none), so a failure is logged, not raised."""
    try:
        async with tenant_transaction(pool, Tenant(namespace, knowledge_bases=(kb_ref,))) as conn:
            return bool(
                await conn.fetchval(
                    "SELECT count_text_statistics($1, $2, $3, $4, $5, $6)",
                    namespace,
                    kb_ref,
                    policy.min_base,
                    policy.min_share,
                    policy.min_chunks,
                    policy.drift,
                )
            )
    except (asyncpg.PostgresError, OSError) as exc:
        _log.warning(
            "text statistics not counted",
            extra={"namespace": namespace, "error": type(exc).__name__},
        )
        return False
