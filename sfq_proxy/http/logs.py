"""The proxy's own log lines (not the access log): where they go, and what never appears.

Every line is redacted as it is formatted, whichever logger wrote it: aiohttp's server
logs a malformed header *with its value* (``Invalid header value char: b'Authorization:
Bearer sk-…'``), and a traceback can quote any string it passed through. So the final text
of each line — message and traceback alike — loses credentials before it is written:
the values of ``Authorization``/``api-key``-like headers, bearer tokens, ``sk-``-style
keys, and every upstream key the proxy was configured with.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import IO

REDACTED = "[redacted]"
_PATTERNS = [
    # a credential header as written in a request, a repr or a dict: the whole value goes
    (re.compile(r"(?i)((?:proxy-)?authorization|x-api-key|api-key)(['\"]?\s*[:=]\s*['\"]?)[^\r\n'\",}]+"),
     rf"\1\2{REDACTED}"),
    (re.compile(r"(?i)\b(bearer|basic)\s+[^\s'\",}]+"), rf"\1 {REDACTED}"),
    (re.compile(r"\bsk-[A-Za-z0-9_\-]{4,}"), f"sk-{REDACTED}"),
]  # fmt: skip
_secrets: set[str] = set()


def hide(*secrets: str) -> None:
    """Redact these exact strings too (the upstream keys, which follow no pattern)."""
    _secrets.update(s for s in secrets if s)


def redact(text: str) -> str:
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    for secret in _secrets:
        text = text.replace(secret, REDACTED)
    return text


class RedactingFormatter(logging.Formatter):
    """A formatter whose every line, traceback included, has been through ``redact``."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def configure(stream: IO[str] = sys.stderr, level: int = logging.WARNING) -> None:
    """Send every logger's lines at ``level`` and above to ``stream``, redacted."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(RedactingFormatter("%(message)s"))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h.formatter, RedactingFormatter)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
