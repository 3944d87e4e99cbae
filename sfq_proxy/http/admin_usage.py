"""``GET /admin/usage``: who used what, folded by step and group, as JSON or CSV
(docs/usage-and-budgets.md). Every bad parameter is a 400 that names it."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, cast

from aiohttp import web

from ..core.errors import ApiError
from ..core.usage import COUNTERS, DAY, DIMENSIONS, Group, Step, fold, iso, period_start
from ..state.usage_store import UsageBook
from .handler import Handler
from .proxy import Proxy

MAX_SPAN_S = 400 * DAY  # the Redis buckets' default TTL: no query asks for more
STEPS = ("hour", "day", "month")
# the counters as answered; money last, null when unpriced, and priced is internal
FIELDS = [name for name in COUNTERS if name not in ("money", "priced")]


def usage_handler(admin: Callable[[web.Request], Proxy]) -> Handler:
    """The route's handler; ``admin`` checks the admin key and gives the proxy (app.py)."""

    async def usage(request: web.Request) -> web.Response:
        proxy = admin(request)
        assert proxy.usage is not None  # every proxy has its book (Proxy.from_config)
        return await _answer(proxy.usage, proxy.wall(), request.query)

    return usage


async def _answer(book: UsageBook, now: float, query: Mapping[str, str]) -> web.Response:
    """The usage of [since, until), as asked."""
    group_by = _group_by(query.get("group_by", "org"))
    since = _time(query, "since", period_start(now, "day"))
    until = _time(query, "until", now)
    if until < since:
        raise ApiError(400, "'until' must not be before 'since'.")
    if until - since > MAX_SPAN_S:
        raise ApiError(400, f"'since' to 'until' may span at most {MAX_SPAN_S // DAY} days.")
    step = _choice(query, "step", STEPS)
    fmt = _choice(query, "format", ("json", "csv")) or "json"
    rows = await book.rows(since, until)
    groups = fold(rows, group_by, cast(Step | None, step), since)
    records = [_record(g, group_by) for g in groups]
    if fmt == "csv":
        return web.Response(text=_csv(records, group_by), content_type="text/csv")
    return web.json_response({
        "group_by": group_by, "since": iso(since), "until": iso(until), "step": step,
        "rows": records,
    })  # fmt: skip


def _group_by(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",")]
    if not names or any(n not in DIMENSIONS for n in names) or len(set(names)) != len(names):
        raise ApiError(400, f"'group_by' must be distinct names among {', '.join(DIMENSIONS)}.")
    return names


def _time(query: Mapping[str, str], name: str, default: float) -> int:
    """ISO-8601 (UTC unless it says its offset) or Unix seconds, to whole seconds."""
    value = query.get(name)
    if value is None:
        return int(default)
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = datetime.fromisoformat(value)
        except ValueError:
            raise ApiError(400, f"'{name}' must be ISO-8601 or Unix seconds.") from None
        seconds = (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()
    if not (math.isfinite(seconds) and 0 <= seconds < 1e11):
        raise ApiError(400, f"'{name}' must be a time after 1970 and before the year 5000.")
    return int(seconds)


def _choice(query: Mapping[str, str], name: str, allowed: tuple[str, ...]) -> str | None:
    value = query.get(name)
    if value is not None and value not in allowed:
        raise ApiError(400, f"'{name}' must be one of {', '.join(allowed)}.")
    return value


def _record(group: Group, group_by: list[str]) -> dict[str, Any]:
    counts = group.counts
    return {
        "start": iso(group.start),
        **dict(zip(group_by, group.values, strict=True)),
        **{name: getattr(counts, name) for name in FIELDS},
        "money": counts.money if counts.priced else None,
    }


def _csv(records: list[dict[str, Any]], group_by: list[str]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, ["start", *group_by, *FIELDS, "money"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(records)
    return out.getvalue()
