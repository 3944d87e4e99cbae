"""An org's intake limits shared by every process with ``state: redis``: its rpm and tpm
token buckets, and its live Idempotency-Keys (``state/admission.lua``). Without them each
replica would give every org its whole rate again, the failure seen with several
independent instances of other gateways.

What needs no sharing stays in ``core/admission.py``: the queue cap is counted in the pool's
own call (``SharedPool``), a request too big for a full bucket is refused from the config
alone, and a retry budget is a ratio of a flow's requests, which per process bounds the sum
as well. An org without ``rpm``/``tpm`` and a request without an Idempotency-Key cost no
call to Redis; on one Redis (not a Cluster) the others' admission is carried by the pool's
submit, in the same call (``Intake``).

While Redis cannot be reached, ``when_unreachable: fail_closed`` refuses (503); ``local``
goes on with buckets of this process's own at the org's rate divided by the replicas alive
at the last heartbeat (the division of the slots), and Idempotency-Keys seen here only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from ..config import Config, OrgSpec
from ..core.errors import ApiError
from ..core.flows import Flow
from ..core.limits import BucketState, Rate, Which, rate_limited, ratelimit_headers
from .redis_batcher import Batcher
from .redis_functions import ADMISSION, Caller, shielded

log = logging.getLogger(__name__)


class SharedLimits:
    def __init__(self, redis: Caller, config: Config, replicas: Callable[[], int]) -> None:
        """``replicas``: how many share the state, as of the last heartbeat."""
        self._redis = redis
        self.config = config
        self._replicas = replicas
        self._keys: set[tuple[str, str]] = set()  # (org, key digest) live in this process
        self._background: set[asyncio.Task[object]] = set()
        # while Redis is lost (when_unreachable: local): (org, rpm, tpm, replicas) → bucket
        self._alone: dict[tuple[str, str, str, int], Rate] = {}
        self._lost = False  # the last call found Redis unreachable (logged once per outage)
        self._batchers: dict[str, Batcher] = {}  # per org (the orgs of the config and keys)
        self._cluster = isinstance(redis, RedisCluster)  # an org's keys on a shard of their own

    @property
    def _ttl_ms(self) -> int:
        assert self.config.state is not None
        return round(self.config.state.lease_ttl_s * 1000)

    def _limits(self, org: str) -> tuple[str, str]:
        spec = self.config.org(org)
        return (f"{spec.rpm:.17g}" if spec.rpm else "", f"{spec.tpm:.17g}" if spec.tpm else "")

    def intake(self, flow: Flow, tokens: float, idempotency_key: str | None) -> Intake:
        """The request's admission by its org's limits, to decide (``Intake``)."""
        return Intake(self, flow, tokens, self._admit_args(flow, tokens, idempotency_key))

    async def admit(self, flow: Flow, tokens: float, args: tuple[str, ...]) -> dict[str, str]:
        """Take the request's share of its org's buckets, and claim its Idempotency-Key, in
        one step (``args``: ``admit``'s arguments); raise the rejection (409, 429 with the
        wait, 503 without Redis). Returns the ``x-ratelimit-*`` headers of the org's buckets
        after the take, as Redis holds them (as this process holds them while Redis is lost,
        ``when_unreachable: local``)."""
        if not args:
            return {}
        digest = args[3]
        try:
            reply = await self._call(flow.org, "admit", *args)
        except RedisError as err:
            reply, headers = self._admit_alone(flow.org, tokens, digest, err)
            return self.verdict(flow, reply, digest, headers)
        return self.verdict(flow, reply, digest)

    def carried(self, org: str, args: tuple[str, ...]) -> tuple[str, ...]:
        """What a pool's submit carries to decide an admission (``args``) in its own call:
        the org's key prefix, then the arguments; one round trip where there would be two.
        Empty when there is nothing to decide, or on a Redis Cluster, where the org's keys
        and the pool's are on different shards."""
        return () if not args or self._cluster else (_prefix(org), *args)

    def _admit_args(
        self, flow: Flow, tokens: float, idempotency_key: str | None
    ) -> tuple[str, ...]:
        """``admission.lua``'s admit arguments: rpm, tpm, tokens, key digest, ttl (ms); empty
        for an org without ``rpm``/``tpm`` and a request without an Idempotency-Key."""
        rpm, tpm = self._limits(flow.org)
        if not (rpm or tpm or idempotency_key):
            return ()
        digest = _digest(idempotency_key) if idempotency_key else ""
        return (rpm, tpm, f"{tokens:.17g}", digest, str(self._ttl_ms))

    def verdict(
        self, flow: Flow, reply: list[int], digest: str, headers: dict[str, str] | None = None
    ) -> dict[str, str]:
        """The headers of an admission's reply (``headers``: the reply was this process's,
        Redis being lost), or its rejection raised."""
        if headers is None:
            headers = _headers(self.config.org(flow.org), reply[-4:]) if len(reply) > 4 else {}
        if reply[0] == 409:
            raise ApiError(409, "A request with this Idempotency-Key is already queued or running.")
        if reply[0] == 429:
            wait_ms, which = reply[1], _WHICH[reply[2]]
            spec = self.config.org(flow.org)
            per_minute = (spec.rpm if which == "requests" else spec.tpm) or 0.0
            setting = "rpm" if which == "requests" else "tpm"
            owner = f"org '{flow.org}'"
            raise rate_limited(which, owner, setting, per_minute, wait_ms / 1000, headers)
        if digest:
            self._keys.add((flow.org, digest))
        return headers

    async def retry(self, flow: Flow, tokens: float) -> bool:
        """Whether the org's buckets give a retry its tokens now (taken if so)."""
        rpm, tpm = self._limits(flow.org)
        if not (rpm or tpm):
            return True
        try:
            reply = await self._call(flow.org, "retry", rpm, tpm, f"{tokens:.17g}")
        except RedisError as err:
            try:
                return self._admit_alone(flow.org, tokens, "", err)[0][0] == 200
            except ApiError:
                return False
        return bool(reply[0] == 1)

    def refund(self, flow: Flow, tokens: float) -> None:
        """Give back what ``admit`` took for a request that generated nothing upstream."""
        rpm, tpm = self._limits(flow.org)
        if rpm or tpm:
            self._later(self._call(flow.org, "refund", rpm, tpm, f"{tokens:.17g}"))

    def release(self, flow: Flow, digest: str) -> None:
        """The request is over: its Idempotency-Key (``digest``; '': none) may be used again."""
        if digest:
            self._keys.discard((flow.org, digest))
            self._later(self._call(flow.org, "done", digest))

    async def renew_forever(self, interval_s: float) -> None:
        """Keep this process's live Idempotency-Keys alive: a key outlives a crashed
        process by one lease TTL at most."""
        while True:
            await asyncio.sleep(interval_s)
            by_org: dict[str, list[str]] = {}
            for org, digest in self._keys:
                by_org.setdefault(org, []).append(digest)
            for org, digests in by_org.items():
                with contextlib.suppress(RedisError):  # the next beat tries again
                    await self._call(org, "renew", self._ttl_ms, *digests)

    async def _call(self, org: str, op: str, *args: object) -> list[int]:
        """The call; an outage is logged once at its start and once at its end, not at
        every request that meets it."""
        try:
            reply: list[int] = await shielded(self._batcher(org).call((op, *args)))
        except RedisError as err:
            if not self._lost:
                self._lost = True
                log.warning("org limits in Redis unreachable: %s", err)
            raise
        if self._lost:
            self._lost = False
            self._alone.clear()  # the next outage starts with full buckets
            log.warning("org limits in Redis reachable again")
        return reply

    def _batcher(self, org: str) -> Batcher:
        """The org's calls: one on the way at a time, those made meanwhile leave together."""
        batcher = self._batchers.get(org)
        if batcher is None:
            send = functools.partial(ADMISSION.call_all, self._redis, _prefix(org))
            batcher = self._batchers[org] = Batcher(send)
        return batcher

    def _admit_alone(
        self, org: str, tokens: float, digest: str, err: RedisError
    ) -> tuple[list[int], dict[str, str]]:
        """Redis did not answer: refuse (503), or decide here with this process's part of
        the org's rate; the reply as Redis would give it (200, 409, or 429, the wait and
        the bucket), and the ``x-ratelimit-*`` headers of this process's buckets."""
        state = self.config.state
        if state is None or state.when_unreachable != "local":
            raise ApiError(
                503, "The shared limits cannot be reached; retry shortly.",
                code="state_unavailable", retry_after=1.0,
            ) from err  # fmt: skip
        if digest and (org, digest) in self._keys:
            return [409], {}
        rate = self._alone_rate(org)
        if rate is None:
            return [200], {}
        now = time.monotonic()
        found = rate.binding(tokens, now)
        if found is not None:
            wait, which = found
            reply = [429, max(1, round(wait * 1000)), 1 if which == "requests" else 2]
            return reply, rate.headers(now)
        rate.take(tokens, now)
        return [200], rate.headers(now)

    def _alone_rate(self, org: str) -> Rate | None:
        spec, replicas = self.config.org(org), max(1, self._replicas())
        if not (spec.rpm or spec.tpm):
            return None
        key = (org, *self._limits(org), replicas)
        rate = self._alone.get(key)
        if rate is None:
            rpm = spec.rpm / replicas if spec.rpm else None
            tpm = spec.tpm / replicas if spec.tpm else None
            rate = self._alone[key] = Rate.of(rpm, tpm)
        return rate

    def _later(self, work: Awaitable[object]) -> None:
        async def quietly() -> None:
            with contextlib.suppress(RedisError):  # missed: the bucket refills, the key expires
                await work

        task = asyncio.ensure_future(quietly())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class Intake:
    """One request's admission by its org's shared limits, decided on its own call
    (``decide``) or carried by its pool's submit, which gives ``settle`` the reply in the
    same round trip. Until it is admitted nothing was taken, so nothing is refunded or
    released for it; one admitted after its request ended (its client left while the
    submit was on its way) is undone at once."""

    def __init__(
        self, limits: SharedLimits, flow: Flow, tokens: float, args: tuple[str, ...]
    ) -> None:
        self._limits = limits
        self.flow, self.tokens = flow, tokens
        self._args = args  # admission.lua's admit arguments; empty: nothing to decide
        self.admitted = False
        self.headers: dict[str, str] = {}  # the org's x-ratelimit-* after the take
        self._ended = False

    @property
    def _digest(self) -> str:
        """Its Idempotency-Key as Redis holds it ('': none)."""
        return self._args[3] if self._args else ""

    def carried(self) -> tuple[str, ...]:
        """What the pool's submit carries to decide it (``SharedLimits.carried``)."""
        return self._limits.carried(self.flow.org, self._args)

    async def decide(self) -> None:
        """On its own call; raises the rejection."""
        self.headers = await self._limits.admit(self.flow, self.tokens, self._args)
        self.admitted = True

    def settle(self, reply: list[int]) -> None:
        """The reply of the admission that a submit carried; raises the rejection."""
        self.headers = self._limits.verdict(self.flow, reply, self._digest)
        self.admitted = True
        if self._ended:
            self.refund()
            self._limits.release(self.flow, self._digest)

    def refund(self) -> None:
        """Its request generated nothing upstream: the tokens go back, if they were taken."""
        if self.admitted:
            self._limits.refund(self.flow, self.tokens)

    def end(self) -> None:
        """Its request is over: its Idempotency-Key may be used again."""
        self._ended = True
        if self.admitted:
            self._limits.release(self.flow, self._digest)


_WHICH: dict[int, Which] = {1: "requests", 2: "tokens"}


def _prefix(org: str) -> str:
    """Every key of an org's limits starts so: ``org:<org>`` as the hash tag keeps them in
    one cluster slot."""
    return f"sfq:{{org:{org}}}:"


def _headers(spec: OrgSpec, state: list[int]) -> dict[str, str]:
    """The ``x-ratelimit-*`` headers of what ``admission.lua`` reported of the org's
    buckets: whole tokens left and ms until full, for requests then tokens (-1: none)."""
    requests = tokens = None
    if spec.rpm and state[0] >= 0:
        requests = BucketState(spec.rpm, state[0], state[1] / 1000)
    if spec.tpm and state[2] >= 0:
        tokens = BucketState(spec.tpm, state[2], state[3] / 1000)
    return ratelimit_headers(requests, tokens)


def _digest(idempotency_key: str) -> str:
    """The key as Redis holds it: fixed length, whatever the client sent."""
    return hashlib.sha256(idempotency_key.encode("utf-8", "surrogatepass")).hexdigest()
