"""Where a ListMemories page starts: the position of the previous page's last memory.

The API edge carries it in an opaque page token (`tokensvc.api.page_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

__all__ = ["PageCursor"]


@dataclass(frozen=True)
class PageCursor:
    created_at: datetime
    id: str
