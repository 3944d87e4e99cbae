"""Rate limits and the retry budget: token buckets and a sliding window. No I/O, no clock.

Share, concurrency and rate are three different limits ([FAIR-GPU], docs/design.md §6):
weights set the share, ``max_in_flight`` the concurrency (in the scheduler), and these set
the rate.
Every method takes ``now`` from the caller's clock, so tests and the simulator drive time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from .errors import ApiError


@dataclass(slots=True)
class TokenBucket:
    """``per_minute`` tokens a minute, bursting up to ``burst_s`` seconds' worth; starts full.

    A take larger than the burst waits for a full bucket and leaves it in debt, so the
    average rate still holds for requests bigger than one burst. Callers that must never
    wait years refuse what does not ``fit`` first. Amounts are checked before anything
    changes: a NaN or an infinity would leave the bucket unusable for everyone.
    """

    per_minute: float
    burst_s: float = 60.0
    capacity: float = field(init=False)
    level: float = field(init=False)
    updated: float = 0.0

    def __post_init__(self) -> None:
        self.capacity = max(1.0, self.per_minute * self.burst_s / 60.0)
        self.level = self.capacity

    def fits(self, amount: float) -> bool:
        """Whether ``amount`` is at most what a full bucket holds."""
        return amount <= self.capacity

    def wait(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` tokens may be taken (0 when they may be taken now)."""
        _check_amount(amount)
        self._refill(now)
        missing = min(amount, self.capacity) - self.level
        return max(0.0, missing * 60.0 / self.per_minute)

    def take(self, amount: float, now: float) -> None:
        """Take ``amount`` tokens; callers check ``wait`` first."""
        _check_amount(amount)
        self._refill(now)
        self.level -= amount

    def give_back(self, amount: float, now: float) -> None:
        """Return tokens taken for work that was never done (never above a full bucket)."""
        _check_amount(amount)
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)

    def state(self, now: float) -> BucketState:
        """What the bucket holds at ``now``, as the ``x-ratelimit-*`` headers say it."""
        self._refill(now)
        reset_s = (self.capacity - self.level) * 60.0 / self.per_minute
        return BucketState(self.per_minute, math.floor(max(0.0, self.level)), max(0.0, reset_s))

    def _refill(self, now: float) -> None:
        if now > self.updated:
            gained = (now - self.updated) * self.per_minute / 60.0
            self.level = min(self.capacity, self.level + gained)
            self.updated = now


@dataclass(slots=True)
class Rate:
    """A request-per-minute and a token-per-minute bucket that admit or wait together."""

    requests: TokenBucket | None
    tokens: TokenBucket | None

    @classmethod
    def of(
        cls,
        requests_per_minute: float | None,
        tokens_per_minute: float | None,
        burst_s: float = 60.0,
    ) -> Rate:
        """Buckets for the limits that are set; ``burst_s`` is how much may go at once."""
        return cls(
            TokenBucket(requests_per_minute, burst_s) if requests_per_minute else None,
            TokenBucket(tokens_per_minute, burst_s) if tokens_per_minute else None,
        )

    # each bucket spelled out, not looped over: these run for every request admitted

    def wait(self, tokens: float, now: float) -> float:
        found = self.binding(tokens, now)
        return 0.0 if found is None else found[0]

    def take(self, tokens: float, now: float) -> None:
        if self.requests is not None:
            self.requests.take(1.0, now)
        if self.tokens is not None:
            self.tokens.take(tokens, now)

    def give_back(self, tokens: float, now: float) -> None:
        if self.requests is not None:
            self.requests.give_back(1.0, now)
        if self.tokens is not None:
            self.tokens.give_back(tokens, now)

    def binding(self, tokens: float, now: float) -> tuple[float, Which] | None:
        """The longest wait before ``tokens`` (and one request) may be taken, and which
        bucket it is; None when they may be taken now."""
        found: tuple[float, Which] | None = None
        if self.requests is not None and (wait := self.requests.wait(1.0, now)) > 0:
            found = (wait, "requests")
        if self.tokens is not None and (wait := self.tokens.wait(tokens, now)) > 0:
            found = (wait, "tokens") if found is None or wait > found[0] else found
        return found

    def headers(self, now: float) -> dict[str, str]:
        """The ``x-ratelimit-*`` headers of these buckets at ``now``."""
        return ratelimit_headers(
            None if self.requests is None else self.requests.state(now),
            None if self.tokens is None else self.tokens.state(now),
        )

    def too_large(self, tokens: float) -> TokenBucket | None:
        """The bucket that ``tokens`` would overflow even when full, if any."""
        return self.tokens if self.tokens is not None and not self.tokens.fits(tokens) else None


Which = Literal["requests", "tokens"]


class BucketState(NamedTuple):
    """A bucket as a client is told of it: its limit a minute, the whole tokens it has
    left, and the seconds until it is full again. (A tuple: made on the hot path.)"""

    per_minute: float
    remaining: int
    reset_s: float


# (limit, remaining, reset) header names, for requests and for tokens
_NAMES = {
    which: tuple(f"x-ratelimit-{what}-{which}" for what in ("limit", "remaining", "reset"))
    for which in ("requests", "tokens")
}


def ratelimit_headers(requests: BucketState | None, tokens: BucketState | None) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, for the buckets
    there are (docs/design.md §6, Rate limits)."""
    headers: dict[str, str] = {}
    if requests is not None:
        limit, remaining, reset = _NAMES["requests"]
        headers[limit] = _limit(requests.per_minute)
        headers[remaining] = str(requests.remaining)
        headers[reset] = format_reset(requests.reset_s)
    if tokens is not None:
        limit, remaining, reset = _NAMES["tokens"]
        headers[limit] = _limit(tokens.per_minute)
        headers[remaining] = str(tokens.remaining)
        headers[reset] = format_reset(tokens.reset_s)
    return headers


_LIMITS: dict[float, str] = {}  # a config's few limits, written once each


def _limit(per_minute: float) -> str:
    written = _LIMITS.get(per_minute)
    if written is None:
        if per_minute == int(per_minute):
            written = str(int(per_minute))
        else:  # a fraction as a decimal, never an exponent (1e-07 a minute: as it is)
            written = f"{per_minute:.6f}".rstrip("0").rstrip(".")
            written = repr(per_minute) if written == "0" else written
        if len(_LIMITS) < 4096:
            _LIMITS[per_minute] = written
    return written


def format_reset(seconds: float) -> str:
    """A wait as OpenAI writes its ``x-ratelimit-reset-*`` (Go's durations): ``0s``,
    ``120ms``, ``1s``, ``1.5s``, ``6m0s``, ``2m59.56s``, ``1h0m0s``; rounded up to the
    millisecond, so that a client that waits that long finds the tokens there."""
    ms = math.ceil(seconds * 1000 - 1e-6) if seconds > 0 else 0
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    rest = ms % 60_000
    secs = f"{rest // 1000}s" if not rest % 1000 else f"{rest / 1000:.3f}".rstrip("0") + "s"
    if ms < 60_000:
        return secs
    hours, minutes = divmod(ms // 60_000, 60)
    return f"{hours}h{minutes}m{secs}" if hours else f"{minutes}m{secs}"


def rate_limited(
    which: Which, owner: str, setting: str, per_minute: float, wait: float, headers: dict[str, str]
) -> ApiError:
    """The 429 of a bucket: its code names the limit (``rpm`` or ``tpm``), its message whose
    limit it is and its config field (``org 'a'``, ``rpm``), ``Retry-After`` is the wait."""
    code = "rpm" if which == "requests" else "tpm"
    message = (
        f"Rate limit reached: {owner} allows {_limit(per_minute)} {which} per minute "
        f"({setting}). Try again in {format_reset(wait)}."
    )
    return ApiError(429, message, code=code, retry_after=wait, headers=headers)


MAX_AMOUNT = 1e18  # far beyond any bucket; a bound that keeps every sum finite


def _check_amount(amount: float) -> None:
    if isinstance(amount, bool) or not 0 <= amount <= MAX_AMOUNT:  # NaN fails too
        raise ValueError(f"a token amount must be a number in [0, {MAX_AMOUNT:g}], got {amount!r}")


@dataclass(slots=True)
class RetryBudget:
    """Retries may not exceed ``ratio`` of the requests of the last ``window_s`` seconds.

    Counted in one-second buckets, so a flow's memory is O(window) however many requests it
    makes (one timestamp each grew without bound for a flow that never retried). Counts
    err on the safe side: a request at ``t`` counts in second ``floor(t)``, a retry in
    second ``ceil(t)``, and a second counts while it is inside the window, so a request
    never counts longer than it should and a retry never shorter; with whole-second times
    both are exact.
    """

    ratio: float
    window_s: float = 60.0
    _buckets: deque[list[int]] = field(default_factory=deque)  # [second, requests, retries]

    def record_request(self, now: float) -> None:
        self._forget(now)
        self._bucket(math.floor(now))[1] += 1

    def try_retry(self, now: float) -> bool:
        """Spend one retry if the budget allows it now."""
        self._forget(now)
        requests = sum(n for _, n, _ in self._buckets)
        retries = sum(n for _, _, n in self._buckets)
        if retries + 1 > self.ratio * requests + 1e-9:  # 0.29·100 ≈ 28.99…
            return False
        self._bucket(math.ceil(now))[2] += 1
        return True

    def _bucket(self, second: int) -> list[int]:
        """The bucket of ``second``, kept in order (it is one of the last two, or new)."""
        buckets = self._buckets
        for bucket in reversed(buckets):
            if bucket[0] == second:
                return bucket
            if bucket[0] < second:
                break
        bucket = [second, 0, 0]
        if buckets and buckets[-1][0] > second:  # a request's floor after a retry's ceil
            buckets.insert(len(buckets) - 1, bucket)
        else:
            buckets.append(bucket)
        return bucket

    def _forget(self, now: float) -> None:
        """Drop the seconds outside the window: a second ``s`` counts while ``s > now - window``."""
        while self._buckets and self._buckets[0][0] <= now - self.window_s:
            self._buckets.popleft()

    def __len__(self) -> int:
        """How many buckets it holds: at most ``window_s`` + 2, whatever the traffic."""
        return len(self._buckets)
