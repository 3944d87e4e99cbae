"""A scenario's trace replay (docs/lab.md, Traces): its section (``TraceSpec``) and the
reading of its CSV, Azure's public LLM inference traces or a simple one, into rows the
scenario turns into requests. Apart from ``scenario.py``, since a file from outside is read
here: every malformed row is a clear error that never quotes the row.
"""

from __future__ import annotations

import csv
import math
import random
import re
from bisect import bisect_right
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from ..config import (
    NAME_PATTERN,
    ConfigError,
    Name,
    NonEmptyStr,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    StrictModel,
)

TraceRow = tuple[float, str, str, int, int, int]


# max_tokens = ceil(output × m): below 1 a client would ask for less than it receives.
Multiplier = Annotated[float, Field(ge=1, allow_inf_nan=False)]


class TraceSpec(StrictModel):
    """A trace replay; ``orgs``, ``zipf_s`` and ``class`` apply to the azure format only."""

    path: NonEmptyStr
    format: Literal["azure", "simple"]
    orgs: PositiveInt = 1
    zipf_s: NonNegativeFloat = 1.0
    cls: Name = Field("batch", alias="class")
    max_tokens_multiplier: Multiplier = 1.0
    compress: PositiveFloat = 1.0
    limit: PositiveInt | None = None


def max_tokens_for(output_tokens: int, multiplier: float) -> int:
    """ceil(output × m), rounded first so that 100 × 1.1 gives 110, not 111."""
    return max(output_tokens, math.ceil(round(output_tokens * multiplier, 9)))


_AZURE_HEADER = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
_SIMPLE_HEADER = ["timestamp_s", "org", "class", "input_tokens", "output_tokens"]
_AZURE_TIME = re.compile(r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?")
NAME_RE = re.compile(NAME_PATTERN)


class _BadRow(ValueError):
    """A malformed trace row; the message never quotes the row."""


def read_trace(trace: TraceSpec, seed: int, base_dir: Path) -> list[TraceRow]:
    """Rows ``(time_s, org, class, input, output, max_tokens)`` in file order."""
    path = Path(trace.path)
    if not path.is_absolute():
        path = base_dir / path
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = [h.strip() for h in next(reader, [])]
            parse = _azure_rows if trace.format == "azure" else _simple_rows
            rows = parse(header, _limited(reader, trace.limit), trace)
    except OSError as exc:
        raise ConfigError([("trace.path", f"cannot read {path}: {exc.strerror}")]) from None
    except (UnicodeDecodeError, csv.Error):
        raise ConfigError([("trace.path", f"{path}: not a UTF-8 CSV file")]) from None
    except _BadRow as exc:
        raise ConfigError([("trace.path", f"{path}: {exc}")]) from None
    if not rows:
        raise ConfigError([("trace.path", f"{path}: no rows")])
    if trace.format == "azure":
        rows = _assign_orgs(rows, trace, seed)
    return rows


def _limited(reader: Iterator[list[str]], limit: int | None) -> Iterator[tuple[int, list[str]]]:
    """``(line number, row)`` for the first ``limit`` data rows (blank lines skipped)."""
    count = 0
    for row in reader:
        if limit is not None and count >= limit:
            return
        if row:
            count += 1
            yield reader.line_num, row  # type: ignore[attr-defined]


def _count(text: str, what: str, line: int) -> int:
    """A token count ≥ 0 from the file, clamped to ≥ 1 (the trace has 0-token outputs)."""
    try:
        value = int(text)
    except ValueError:
        raise _BadRow(f"line {line}: {what} must be an integer") from None
    if value < 0:
        raise _BadRow(f"line {line}: {what} must be >= 0")
    return max(1, value)


def _azure_rows(
    header: list[str], rows: Iterator[tuple[int, list[str]]], trace: TraceSpec
) -> list[TraceRow]:
    """``TIMESTAMP,ContextTokens,GeneratedTokens``; times relative to the earliest row."""
    if header != _AZURE_HEADER:
        raise _BadRow(f"line 1: the header must be {','.join(_AZURE_HEADER)}")
    parsed: list[tuple[datetime, int, int]] = []
    for line, row in rows:
        if len(row) != 3:
            raise _BadRow(f"line {line}: expected 3 columns")
        match = _AZURE_TIME.fullmatch(row[0].strip())
        if match is None:
            raise _BadRow(f"line {line}: TIMESTAMP must look like 2023-11-16 18:15:46.6805900")
        micros = (match[2] or "").ljust(6, "0")[:6]  # datetime keeps 6 digits; the file has 7
        try:
            when = datetime.fromisoformat(f"{match[1]}.{micros}")
        except ValueError:
            raise _BadRow(f"line {line}: TIMESTAMP is not a valid date and time") from None
        inp = _count(row[1], "ContextTokens", line)
        parsed.append((when, inp, _count(row[2], "GeneratedTokens", line)))
    if not parsed:
        return []
    first = min(p[0] for p in parsed)
    m, cls = trace.max_tokens_multiplier, trace.cls
    return [
        ((when - first).total_seconds() / trace.compress, "", cls, inp, out, max_tokens_for(out, m))
        for when, inp, out in parsed
    ]


def _simple_rows(
    header: list[str], rows: Iterator[tuple[int, list[str]]], trace: TraceSpec
) -> list[TraceRow]:
    """``timestamp_s,org,class,input_tokens,output_tokens[,max_tokens]``; timestamps are
    seconds from the start of the scenario (divided by ``compress``)."""
    has_max = header == [*_SIMPLE_HEADER, "max_tokens"]
    if header != _SIMPLE_HEADER and not has_max:
        raise _BadRow(f"line 1: the header must be {','.join(_SIMPLE_HEADER)}[,max_tokens]")
    width = len(header)
    out_rows: list[TraceRow] = []
    for line, row in rows:
        if len(row) != width:
            raise _BadRow(f"line {line}: expected {width} columns")
        cells = [c.strip() for c in row]
        try:
            t = float(cells[0])
        except ValueError:
            raise _BadRow(f"line {line}: timestamp_s must be a number") from None
        if not (t >= 0 and math.isfinite(t)):
            raise _BadRow(f"line {line}: timestamp_s must be >= 0")
        for column, value in (("org", cells[1]), ("class", cells[2])):
            if not NAME_RE.fullmatch(value):
                raise _BadRow(f"line {line}: {column} is not a valid name")
        inp = _count(cells[3], "input_tokens", line)
        out = _count(cells[4], "output_tokens", line)
        if has_max and cells[5]:
            max_tokens = _count(cells[5], "max_tokens", line)
            if max_tokens < out:
                raise _BadRow(f"line {line}: max_tokens must be >= output_tokens")
        else:
            max_tokens = max_tokens_for(out, trace.max_tokens_multiplier)
        out_rows.append((t / trace.compress, cells[1], cells[2], inp, out, max_tokens))
    return out_rows


def _assign_orgs(rows: list[TraceRow], trace: TraceSpec, seed: int) -> list[TraceRow]:
    """Give each row an org ``org-1..org-N`` by a seeded Zipf draw (weight 1/k^zipf_s)."""
    rng = random.Random(f"{seed}:trace:orgs")
    cumulative: list[float] = []
    total = 0.0
    for k in range(1, trace.orgs + 1):
        total += 1.0 / k**trace.zipf_s
        cumulative.append(total)
    names = [f"org-{k}" for k in range(1, trace.orgs + 1)]
    last = len(names) - 1
    picks = [names[min(last, bisect_right(cumulative, rng.random() * total))] for _ in rows]
    return [(row[0], org, *row[2:]) for row, org in zip(rows, picks, strict=True)]
