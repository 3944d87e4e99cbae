"""Whether a request may wait at all, and whether a failed one may try again (docs/design.md §5–6).

Sans-I/O: the caller passes the time. Checked in this order, so that a rejected request
never spends rate tokens: a duplicate ``Idempotency-Key`` (409), a full flow queue (429),
a request larger than a full tokens-per-minute bucket (400: it could never be admitted,
and taking it would lock the org or the pool out for as long as it overdraws), then the
org's and the pool's token buckets (429 with the wait as ``Retry-After``). Tokens of a
request that generated nothing upstream are given back (``refund``). With ``state: redis``
the org's buckets and its Idempotency-Keys are shared instead (``state/redis_limits.py``),
and only the rest is checked here.
"""

from __future__ import annotations

from ..config import Config
from .errors import ApiError
from .flows import Flow
from .limits import Rate, RetryBudget, Which, rate_limited


class Admission:
    def __init__(self, config: Config) -> None:
        self._config = config
        self._org_rates = {
            org: Rate.of(spec.rpm, spec.tpm)
            for org, spec in config.orgs.items()
            if spec.rpm or spec.tpm
        }
        # a provider pool's intake is held to its rate here; its dispatch is paced too
        self._pool_rates = {
            name: Rate.of(spec.rate.requests_per_minute, spec.rate.tokens_per_minute)
            for name, spec in config.pools.items()
            if spec.rate
        }
        self._budgets: dict[Flow, RetryBudget] = {}
        self._active: set[tuple[str, str]] = set()  # (org, Idempotency-Key) queued or running
        # with state: redis the org's buckets and keys are shared (state/redis_limits.py):
        # here only what needs no sharing (queue cap, a request too big, retry budgets)
        self._local = config.state is None

    def reconfigure(self, config: Config) -> None:
        """A config reload: new limits; buckets whose limits did not change keep their level,
        and retry budgets and live idempotency keys carry over."""
        fresh = Admission(config)
        for old, new in (
            (self._org_rates, fresh._org_rates),
            (self._pool_rates, fresh._pool_rates),
        ):
            for name, rate in new.items():
                if name in old and _same_limits(old[name], rate):
                    new[name] = old[name]
        self._config = config
        self._org_rates, self._pool_rates = fresh._org_rates, fresh._pool_rates

    def admit(
        self, flow: Flow, tokens: float, queued: int, idempotency_key: str | None, now: float
    ) -> dict[str, str]:
        """Admit a request of ``flow`` (whose queue holds ``queued``) or raise the rejection.
        Returns the ``x-ratelimit-*`` headers of its org's buckets after the take (none when
        the org has no ``rpm``/``tpm``, or they are shared); a 429 of a bucket carries the
        headers of the buckets that refused it (docs/design.md §6, Rate limits)."""
        if idempotency_key is not None and (flow.org, idempotency_key) in self._active:
            raise ApiError(409, "A request with this Idempotency-Key is already queued or running.")
        cap = self._config.classes[flow.cls].max_queue_len
        if cap is not None and queued >= cap:
            raise ApiError(
                429, f"The queue of flow {flow.id} is full (max_queue_len {cap}).",
                code="queue_full", retry_after=1.0,
            )  # fmt: skip
        for rate, owner in zip(self._rates(flow), ("org", "pool"), strict=True):
            if rate is not None and (full := rate.too_large(tokens)) is not None:
                name = flow.org if owner == "org" else flow.pool
                raise ApiError(
                    400, f"This request's {tokens:.0f} estimated tokens exceed the "
                    f"{full.per_minute:g} tokens per minute of {owner} {name}; lower "
                    "max_tokens or the input.", code="tokens_exceed_limit",
                )  # fmt: skip
        paced = self._paced(flow)
        self._refuse_over_rate(flow, paced, tokens, now)
        for rate in paced:
            if rate is not None:
                rate.take(tokens, now)
        self._budget(flow).record_request(now)
        if self._local and idempotency_key is not None:
            self._active.add((flow.org, idempotency_key))
        org_rate = paced[0]
        return {} if org_rate is None else org_rate.headers(now)

    @staticmethod
    def _refuse_over_rate(
        flow: Flow, paced: tuple[Rate | None, Rate | None], tokens: float, now: float
    ) -> None:
        """The 429 of the bucket with the longest wait, the org's or the pool's, if any."""
        worst: tuple[float, int, Which] | None = None
        for index, rate in enumerate(paced):
            found = None if rate is None else rate.binding(tokens, now)
            if found is not None and (worst is None or found[0] > worst[0]):
                worst = (found[0], index, found[1])
        if worst is None:
            return
        wait, index, which = worst
        rate = paced[index]
        assert rate is not None
        bucket = rate.requests if which == "requests" else rate.tokens
        assert bucket is not None
        if index == 0:
            owner, setting = f"org '{flow.org}'", "rpm" if which == "requests" else "tpm"
        else:
            owner, setting = f"pool '{flow.pool}'", f"rate.{which}_per_minute"
        raise rate_limited(which, owner, setting, bucket.per_minute, wait, rate.headers(now))

    def refund(self, flow: Flow, tokens: float, now: float) -> None:
        """Give back what ``admit`` took for a request that generated nothing upstream."""
        for rate in self._paced(flow):
            if rate is not None:
                rate.give_back(tokens, now)

    def _rates(self, flow: Flow) -> tuple[Rate | None, Rate | None]:
        """The org's and the pool's intake buckets, where they have one."""
        return self._org_rates.get(flow.org), self._pool_rates.get(flow.pool)

    def _paced(self, flow: Flow) -> tuple[Rate | None, Rate | None]:
        """The buckets this process takes from: none when they are shared."""
        return self._rates(flow) if self._local else (None, None)

    def done(self, flow: Flow, idempotency_key: str | None) -> None:
        """The admitted request is over, whatever its outcome."""
        if idempotency_key is not None:
            self._active.discard((flow.org, idempotency_key))

    def may_retry(self, flow: Flow, tokens: float, now: float) -> bool:
        """A retry pays like a request: one from the flow's retry budget, and ``tokens``
        from the org's and the pool's buckets, all now or none (it does not wait for
        them: the client then gets the upstream's own answer)."""
        rates = [rate for rate in self._paced(flow) if rate is not None]
        if any(rate.wait(tokens, now) > 0 for rate in rates):
            return False
        if not self._budget(flow).try_retry(now):
            return False
        for rate in rates:
            rate.take(tokens, now)
        return True

    def _budget(self, flow: Flow) -> RetryBudget:
        budget = self._budgets.get(flow)
        if budget is None:
            budget = self._budgets[flow] = RetryBudget(self._config.retry.budget_ratio)
        return budget


def _same_limits(a: Rate, b: Rate) -> bool:
    def per_minute(rate: Rate) -> tuple[float | None, ...]:
        return tuple(
            bucket.per_minute if bucket else None for bucket in (rate.requests, rate.tokens)
        )

    return per_minute(a) == per_minute(b)
