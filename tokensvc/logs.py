"""Structured JSON log lines on stderr: one object per line, extra fields included.

Callers pass only safe fields (request id, method, SPIFFE ID, status, duration); no secret,
token, memory content or raw user id is ever given to a logger.

Every RPC writes one line, so the formatter is on the request path: it encodes with one
module-level JSON encoder (`json.dumps` with options builds a new encoder per call) and formats
the timestamp's date and time once per second.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time

__all__ = ["JsonFormatter", "configure_logging"]

_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
_ENCODER = json.JSONEncoder(default=str)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC, milliseconds), level, logger, msg, pid, the extras."""

    def __init__(self) -> None:
        super().__init__()
        # (whole second, its "YYYY-MM-DDTHH:MM:SS" text), replaced as one tuple (thread-safe).
        self._second: tuple[int, str] = (-1, "")

    def timestamp(self, created: float) -> str:
        """`created` as ISO 8601 in UTC to the millisecond, e.g. 2025-12-01T11:23:35.123+00:00."""
        fraction, whole = math.modf(created)
        micros = round(fraction * 1_000_000)
        second = int(whole)
        if micros >= 1_000_000:  # rounded up into the next second, as datetime.fromtimestamp does
            second, micros = second + 1, micros - 1_000_000
        if self._second[0] != second:
            self._second = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
        return f"{self._second[1]}.{micros // 1000:03d}+00:00"

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": self.timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            # Which process wrote it: with `workers` > 1 several share one stream.
            "pid": record.process,
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key[0] != "_":
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return _ENCODER.encode(entry)


def configure_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # asyncpg and grpc are chatty at INFO about internals we already report.
    logging.getLogger("asyncio").setLevel(logging.WARNING)
