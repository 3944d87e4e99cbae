"""Rate limits and the retry budget: token buckets and a sliding window. No I/O, no clock.

Share, concurrency and rate are three different limits ([FAIR-GPU], docs/design.md §6):
weights set the share, ``max_in_flight`` the concurrency (in the scheduler), and these set
the rate.
Every method takes ``now`` from the caller's clock, so tests and the simulator drive time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


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

    def wait(self, tokens: float, now: float) -> float:
        waits = [b.wait(n, now) for b, n in self._buckets(tokens)]
        return max(waits, default=0.0)

    def take(self, tokens: float, now: float) -> None:
        for bucket, amount in self._buckets(tokens):
            bucket.take(amount, now)

    def give_back(self, tokens: float, now: float) -> None:
        for bucket, amount in self._buckets(tokens):
            bucket.give_back(amount, now)

    def too_large(self, tokens: float) -> TokenBucket | None:
        """The bucket that ``tokens`` would overflow even when full, if any."""
        return self.tokens if self.tokens is not None and not self.tokens.fits(tokens) else None

    def _buckets(self, tokens: float) -> list[tuple[TokenBucket, float]]:
        pairs = [(self.requests, 1.0), (self.tokens, tokens)]
        return [(bucket, amount) for bucket, amount in pairs if bucket is not None]


MAX_AMOUNT = 1e18  # far beyond any bucket; a bound that keeps every sum finite


def _check_amount(amount: float) -> None:
    if isinstance(amount, bool) or not 0 <= amount <= MAX_AMOUNT:  # NaN fails too
        raise ValueError(f"a token amount must be a number in [0, {MAX_AMOUNT:g}], got {amount!r}")


@dataclass(slots=True)
class RetryBudget:
    """Retries may not exceed ``ratio`` of the requests of the last ``window_s`` seconds."""

    ratio: float
    window_s: float = 60.0
    _requests: deque[float] = field(default_factory=deque)
    _retries: deque[float] = field(default_factory=deque)

    def record_request(self, now: float) -> None:
        self._requests.append(now)

    def try_retry(self, now: float) -> bool:
        """Spend one retry if the budget allows it now."""
        for times in (self._requests, self._retries):
            while times and times[0] <= now - self.window_s:
                times.popleft()
        if len(self._retries) + 1 > self.ratio * len(self._requests) + 1e-9:  # 0.29·100 ≈ 28.99…
            return False
        self._retries.append(now)
        return True
