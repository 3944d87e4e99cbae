"""The proxy's own log lines (not the access log): where they go, how they look, and what
never appears.

**Shape.** Both logs of a process, this one (stderr) and the access log (stdout), share one
format, chosen once by :func:`choose` (``sfq-proxy serve --log-format``, or
``SFQ_LOG_FORMAT``): ``json``, one object per line, ``{"ts", "level", "logger", "msg"}`` and
``"exc"`` when there is a traceback; or ``text``, ``<ts> <LEVEL> <logger>: <msg>`` with the
traceback on the lines below. Chosen by nobody, it is ``text`` when stdout and stderr are
both terminals and ``json`` otherwise, decided once for the process, never line by line.
``ts`` is RFC 3339 in UTC with milliseconds (``2025-05-01T12:00:00.123Z``). The banners
scripts wait for (``announcement``) follow the format of stdout too.

**Redaction.** Every line is redacted as it is formatted, whichever logger wrote it:
aiohttp's server logs a malformed header *with its value* (``Invalid header value char:
b'Authorization: Bearer sk-…'``), and a traceback can quote any string it passed through.
So the final text of each line — message and traceback alike — loses credentials before it
is written: the values of ``Authorization``/``api-key``-like headers, bearer tokens,
``sk-``-style keys, every upstream key the proxy was configured with, and the collector's
header values (``tracing.headers_env``). A JSON line has
each of its texts redacted before it is encoded, so that JSON escaping can neither hide a
secret from the patterns nor be cut in two by a replacement.

**Bounds.** A line quotes what a client sent only through ``core.errors.cut``, and aiohttp's
own lines quote what it could not parse (a request line or a header, up to 8 KiB) as it
was: so each line of a message or a traceback is cut to ``LINE_CHARS`` characters, once
redacted (a cut first could leave half a secret the redaction no longer knows). The
proxy's own lines, code lines of a traceback included, are far shorter.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import IO, Literal

from ..core.errors import cut

REDACTED = "[redacted]"
_PATTERNS = [
    # a credential header as written in a request, a repr or a dict: the whole value goes
    (re.compile(r"(?i)((?:proxy-)?authorization|x-api-key|api-key)(['\"]?\s*[:=]\s*['\"]?)[^\r\n'\",}]+"),
     rf"\1\2{REDACTED}"),
    (re.compile(r"(?i)\b(bearer|basic)\s+[^\s'\",}]+"), rf"\1 {REDACTED}"),
    (re.compile(r"\bsk-[A-Za-z0-9_\-]{4,}"), f"sk-{REDACTED}"),
]  # fmt: skip
_secrets: set[str] = set()
LINE_CHARS = 512  # of each line of a message or traceback

LogFormat = Literal["json", "text"]
FORMATS: tuple[LogFormat, ...] = ("json", "text")
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
DEFAULT_LEVEL = logging.WARNING

_level = DEFAULT_LEVEL
_format: LogFormat | None = None  # None: not chosen yet (terminals decide, see log_format)


def hide(*secrets: str) -> None:
    """Redact these exact strings too (the upstream keys, which follow no pattern)."""
    _secrets.update(s for s in secrets if s)


def redact(text: str) -> str:
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    for secret in _secrets:
        text = text.replace(secret, REDACTED)
    return text


def bounded(text: str) -> str:
    """``text`` with each of its lines cut to ``LINE_CHARS`` characters."""
    if len(text) <= LINE_CHARS:
        return text
    return "\n".join(cut(line, LINE_CHARS) for line in text.split("\n"))


def timestamp(seconds: float) -> str:
    """RFC 3339, UTC, milliseconds: ``2025-05-01T12:00:00.123Z``."""
    millis = int(seconds * 1000)
    second, milli = divmod(millis, 1000)
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(second))}.{milli:03d}Z"


def on_terminals() -> bool:
    """Whether stdout and stderr are both terminals (someone is watching them)."""
    return all(stream is not None and stream.isatty() for stream in (sys.stdout, sys.stderr))


def choose(level: int = DEFAULT_LEVEL, fmt: LogFormat | None = None) -> LogFormat:
    """Fix this process's log level and the format of both its logs; ``fmt`` None: text on
    terminals, else JSON (decided now, once). Forked workers inherit the choice."""
    global _level, _format
    _level = level
    _format = fmt if fmt is not None else ("text" if on_terminals() else "json")
    return _format


def log_format() -> LogFormat:
    """The format both logs use: the one chosen, or what :func:`choose` would choose."""
    if _format is None:
        return "text" if on_terminals() else "json"
    return _format


def announcement(text: str, **fields: str) -> str:
    """A line of stdout for scripts that wait for the proxy (beside the access log, which
    shares its format): ``text`` as it is, or in JSON a line shaped as a log line's (level
    ``info``, logger ``sfq_proxy.runner``, ``text`` its ``msg``) with ``fields`` (``url``)
    beside, so that every line of a JSON stdout parses."""
    if log_format() == "text":
        return text
    line = {"ts": timestamp(time.time()), "level": "info", "logger": "sfq_proxy.runner"}
    return json.dumps(line | {"msg": text} | fields)


class RedactingFormatter(logging.Formatter):
    """A formatter whose every line, traceback included, has been through ``redact``."""

    def __init__(self, fmt: LogFormat = "text") -> None:
        super().__init__()
        self.json = fmt == "json"

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        trace = record.exc_text or ""
        if record.stack_info:
            trace = f"{trace}\n{self.formatStack(record.stack_info)}".lstrip("\n")
        ts = timestamp(record.created)
        if not self.json:
            line = f"{ts} {record.levelname} {record.name}: {message}"
            return bounded(redact(f"{line}\n{trace}" if trace else line))
        fields = {
            "ts": ts,
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": bounded(redact(message)),
        }
        if trace:
            fields["exc"] = bounded(redact(trace))
        return json.dumps(fields)  # ASCII: a stray surrogate of a bad header stays writable


def configure(
    stream: IO[str] = sys.stderr, level: int | None = None, fmt: LogFormat | None = None
) -> None:
    """Send every logger's lines at ``level`` and above to ``stream``, redacted, in ``fmt``
    (each None: as chosen for the process, see :func:`choose`)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(RedactingFormatter(fmt or log_format()))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h.formatter, RedactingFormatter)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(_level if level is None else level)
