"""The name formats tokensvc validates, in one place, always matched whole (and the one set of
PostgreSQL text-search configuration names, shared by settings and retrieval).

Every check is `fullmatch`: with `match`, a pattern ending in `$` still accepts a trailing newline
(`$` matches before a final `\\n`), so `"default\\n"` would pass as a namespace.
"""

from __future__ import annotations

import re

__all__ = [
    "DNS_LABEL",
    "KB_REF",
    "SQL_IDENTIFIER",
    "TEXT_CONFIGS",
    "is_dns_label",
    "is_kb_ref",
    "is_sql_identifier",
]

# A Kubernetes namespace, agent or registry name (RFC 1123 label).
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
# A knowledge base ref: a Kubernetes object name (RFC 1123 subdomain).
KB_REF = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
# A plain, unquoted, lower-case PostgreSQL identifier.
SQL_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")
# PostgreSQL's built-in text-search configurations (pg_catalog). `simple` lower-cases only: the
# choice for text where stemming would hurt (identifiers, mixed languages).
TEXT_CONFIGS = frozenset(
    {
        "simple", "arabic", "armenian", "basque", "catalan", "danish", "dutch", "english", "finnish",
        "french", "german", "greek", "hindi", "hungarian", "indonesian", "irish", "italian",
        "lithuanian", "nepali", "norwegian", "portuguese", "romanian", "russian", "serbian",
        "spanish", "swedish", "tamil", "turkish", "yiddish",
    }
)  # fmt: skip


def is_dns_label(value: str) -> bool:
    return DNS_LABEL.fullmatch(value) is not None


def is_kb_ref(value: str) -> bool:
    return KB_REF.fullmatch(value) is not None


def is_sql_identifier(value: str) -> bool:
    return SQL_IDENTIFIER.fullmatch(value) is not None
