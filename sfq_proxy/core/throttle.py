"""A provider's own rate-limit answers slow its pool's dispatch. No I/O, no clock.

Hosted APIs say when they are over their limit: a 429 with ``retry-after-ms`` and/or
``retry-after`` (seconds), and on every answer ``x-ratelimit-remaining-requests`` /
``-tokens`` with ``x-ratelimit-reset-requests`` / ``-tokens`` (a duration such as ``1s``,
``6m0s``, ``20ms``). Their limits are per key, and a pool shares one upstream key, so the
feedback acts on the whole pool (docs/design.md §6, "Provider feedback"):

- a 429 **pauses** dispatch until its retry-after (``retry-after-ms`` wins over
  ``retry-after``; without one, a backoff that doubles per 429 in a row) and **halves** the
  pool's rate factor, at most once per round of requests (a 429 of a request sent before
  the last cut was sent at the old rate, and does not cut again);
- an answer whose remaining requests or tokens are 0 **holds** dispatch until its reset;
- the factor grows back by ``recover_per_s`` a second once the pause is over, up to 1;
  while it is below 1 a pool with a configured ``rate`` spaces its dispatches evenly at
  ``rate × factor`` (no burst);
- every pause is bounded by ``max_pause_s``, whatever a header says (NaN, ``inf``,
  negative, ``1e308``, ``999999h``, garbage), and the factor never goes below
  ``min_factor``: a lying provider can slow the pool, never freeze it.

The throttle only decides *when* the next dispatch may happen; the scheduler still decides
*which* request it is, so queued requests keep their order.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from .limits import Rate

# reasons, as counted in ``sfq_upstream_throttled_total{pool,reason}``
RATE_LIMITED = "429"
REQUESTS_EXHAUSTED = "remaining_requests"
TOKENS_EXHAUSTED = "remaining_tokens"

_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|us|µs|ns|h|m|s)")
MAX_PAUSE_S = 60.0  # the longest any provider header may hold a pool, or a retry
_MAX_HEADER_CHARS = 64  # longer values are not durations or counts any provider sends


def seconds(value: str | None) -> float | None:
    """A ``retry-after`` in seconds (a number), or None if absent or not a finite number
    ≥ 0 (an HTTP-date is None: the core has no wall clock)."""
    number = _number(value)
    return number if number is not None and number >= 0 else None


def duration(value: str | None) -> float | None:
    """A reset as providers write it, in seconds: ``1s``, ``6m0s``, ``20ms``, ``1h2m3.5s``,
    or a bare number of seconds; None if absent or malformed."""
    if value is None or len(value) > _MAX_HEADER_CHARS:
        return None
    text = value.strip()
    plain = seconds(text)
    if plain is not None:
        return plain
    total, end = 0.0, 0
    for part in _PART.finditer(text):
        if part.start() != end:
            return None
        total += float(part.group(1)) * _UNITS[part.group(2)]
        end = part.end()
    return total if end == len(text) and end > 0 and math.isfinite(total) else None


def retry_after(headers: Mapping[str, str]) -> float | None:
    """A refusal's retry-after in seconds: ``retry-after-ms`` if valid, else ``retry-after``
    (as OpenAI's SDK reads them); None if neither is a finite number ≥ 0."""
    millis = seconds(headers.get("retry-after-ms"))
    return millis / 1000.0 if millis is not None else seconds(headers.get("retry-after"))


def _number(value: str | None) -> float | None:
    if value is None or len(value) > _MAX_HEADER_CHARS:
        return None
    try:
        number = float(value.strip())
    except ValueError:
        return None
    return number if math.isfinite(number) else None


@dataclass(slots=True)
class Throttle:
    """One pool's provider feedback: a pause, and a factor on its configured rate."""

    max_pause_s: float = MAX_PAUSE_S
    backoff_base_s: float = 1.0  # a 429 without retry-after: 1, 2, 4 … s, up to the max
    exhausted_hold_s: float = 1.0  # remaining 0 without a (valid) reset
    min_factor: float = 1 / 16
    recover_per_s: float = 0.05  # a halved factor is whole again 10 s after its pause
    paused_until: float = 0.0
    throttled: Counter[str] = field(default_factory=Counter)  # reason → how many times
    _factor: float = 1.0  # the factor at ``_since``
    _since: float = 0.0  # from when it grows back
    _last_cut: float = -math.inf  # when it was last halved
    _in_a_row: int = 0  # 429s in a row (no other answer between)
    _next_at: float = 0.0  # the pacing's next dispatch, while the factor is below 1

    def factor(self, now: float) -> float:
        """The share of the configured rate the pool dispatches at now, in [min_factor, 1]."""
        grown = self._factor + self.recover_per_s * max(0.0, now - self._since)
        return min(1.0, grown)

    def wait(self, now: float) -> float:
        """Seconds until the next dispatch may happen (0: now). A pause's part is at most
        ``max_pause_s``, as ``_pause`` set it: ``(now + hold) - now`` can round above
        ``hold`` by an ulp when ``now`` is large."""
        pause = min(self.max_pause_s, self.paused_until - now)
        return max(0.0, pause, self._next_at - now)

    def dispatched(self, tokens: float, now: float, rate: Rate | None) -> None:
        """A request was dispatched: below a factor of 1, the next waits its share of the
        reduced rate (one request's time, or its tokens' time, whichever is longer)."""
        factor = self.factor(now)
        if rate is None or factor >= 1.0:
            return
        spacing = 0.0
        if rate.requests is not None:
            spacing = 60.0 / rate.requests.per_minute
        if rate.tokens is not None:
            spacing = max(spacing, tokens * 60.0 / rate.tokens.per_minute)
        self._next_at = now + min(self.max_pause_s, spacing / factor)

    def observe(
        self, status: int, headers: Mapping[str, str], sent_at: float, now: float
    ) -> str | None:
        """An answer's status and headers (case-insensitive, as aiohttp's, or lower-case),
        for a request sent at ``sent_at``; returns why dispatch is now held, if it is."""
        if status == 429:
            return self._rate_limited(headers, sent_at, now)
        self._in_a_row = 0
        reason = None
        for kind, why in (("requests", REQUESTS_EXHAUSTED), ("tokens", TOKENS_EXHAUSTED)):
            remaining = _number(headers.get(f"x-ratelimit-remaining-{kind}"))
            if remaining is not None and remaining <= 0:
                reset = duration(headers.get(f"x-ratelimit-reset-{kind}"))
                self._pause(self.exhausted_hold_s if reset is None else reset, now)
                reason = reason or why
        if reason is not None:
            self.throttled[reason] += 1
        return reason

    def _rate_limited(self, headers: Mapping[str, str], sent_at: float, now: float) -> str:
        self.throttled[RATE_LIMITED] += 1
        fresh = sent_at >= self._last_cut  # sent after the last cut: the rate is still too high
        if fresh:
            self._in_a_row += 1
        after = retry_after(headers)
        if after is None:
            after = self.backoff_base_s * 2.0 ** min(max(0, self._in_a_row - 1), 32)
        self._pause(after, now)
        if fresh:
            self._factor = max(self.min_factor, self.factor(now) / 2.0)
            self._since = self.paused_until
            self._last_cut = now
        return RATE_LIMITED

    def _pause(self, seconds_: float, now: float) -> None:
        """Hold dispatch for ``seconds_``, at most ``max_pause_s`` from now; never shortens
        a pause already running."""
        hold = min(self.max_pause_s, max(0.0, seconds_))
        self.paused_until = max(self.paused_until, now + hold)

    def state(self, now: float, rate: Rate | None) -> dict[str, object]:
        """For ``/admin/state``: the pause left, the factor and the rate it gives."""
        factor = self.factor(now)
        requests = rate.requests if rate is not None else None
        tokens = rate.tokens if rate is not None else None
        return {
            "paused_for_s": max(0.0, self.paused_until - now),
            "rate_factor": factor,
            "effective_requests_per_minute": requests.per_minute * factor if requests else None,
            "effective_tokens_per_minute": tokens.per_minute * factor if tokens else None,
            "throttled": dict(self.throttled),
        }
