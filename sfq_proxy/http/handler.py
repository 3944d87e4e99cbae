"""The life of one inference request: admit, wait in line, relay, and maybe retry.

Retries happen only while nothing has reached the client (connect error, or a backend's
429/502/503). A retry goes back to the *head of its own flow*, waits for that flow's turn
by meter like any request, is charged again when dispatched, waits a backoff with full
jitter first (at least the backend's ``Retry-After``), and pays like a request: from the
flow's retry budget and the org's and pool's rate buckets. Out of attempts, budget, rate or
time, the client gets the upstream's own error.

Whatever fails while a request is served, its slot, its queue entry and its idempotency key
are given back: the relay answers the backend's faults itself, a bug before the answer
starts is an OpenAI-style 500, and a failure to *count* an answer never changes it.
Rate tokens come back when the request generated nothing upstream (never dispatched, no
backend reached, or a 4xx), so a request the backend refused at once costs its org nothing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache, partial

from aiohttp import web

from ..config import AffinitySpec, Config, ExtraCostSpec
from ..core.affinity import request_key
from ..core.cost import Estimate
from ..core.errors import ApiError, Expiry
from ..core.flows import CLASS_HEADER, Flow, classify
from ..core.inference_request import InferenceRequest, Kind, parse, parse_extra, with_priority
from ..core.placement import Backend
from ..core.scheduler import Ticket
from ..core.throttle import MAX_PAUSE_S, retry_after
from ..observability.access_log import REQUEST_ID_HEADER, AccessRecord
from ..observability.metrics import Key, Metrics
from ..state.pool import QUEUE_DEADLINE, Pool
from ..state.redis_limits import Intake
from . import body
from .client_watch import CLIENT_CUT
from .drain import ANSWERING, absorbed, cut_error, is_cut
from .error_response import error_response
from .parse_worker import WORKER
from .proxy import PROXY, Proxy
from .relay import (
    COST_HEADER,
    OUT_OF_TIME,
    QUEUE_WAIT_HEADER,
    STREAM_TOKENS,
    Relayed,
    UpstreamFailed,
    backend_failed,
    deliver,
    error_event,
    fault_code,
    forward,
    last_usage,
    read_usage,
)
from .trace_context import trace_context

log = logging.getLogger(__name__)
RETRYABLE = frozenset({429, 502, 503})
TIMEOUT_HEADER = "X-Request-Timeout"
IDEMPOTENCY_HEADER = "Idempotency-Key"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
EndSpan = Callable[[AccessRecord], None]  # ends a request's span (observability/tracing.py)


def handler(kind: Kind) -> Handler:
    """The handler of ``kind``'s route (of any extra path, for ``Kind.EXTRA``)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        """Serve one request; whatever becomes of it, it is counted once and logged once."""
        proxy = request.app[PROXY]
        record = AccessRecord.for_request(request.headers)
        record.trace_id, trace = trace_context(request.headers)
        end_span = None
        if proxy.tracing is not None:  # its span, whose context goes upstream (docs/tracing.md)
            end_span, record.trace_id, trace = proxy.tracing.start(
                request.method, request.path, kind, trace
            )
        arrived = proxy.clock()  # for sfq_request_duration_seconds
        running = proxy.drain.enter()  # ended by the drain at drain_timeout_s (drain.py)
        try:
            return await _admit_and_serve(proxy, request, kind, record, trace)
        except ApiError as err:  # a rejection; or a failure, the error's code its reason
            record.status = err.status
            record.outcome = record.outcome or ("rejected" if err.reason else "failed")
            record.reason = err.reason if record.outcome == "rejected" else err.code
            response = error_response(err)
            response.headers[REQUEST_ID_HEADER] = record.request_id
            return response
        except asyncio.CancelledError as cancelled:
            # the client left; or the drain's cut once the answer started (the relay ends
            # a stream with an error event; here, only closing the connection is left)
            if request.get(ANSWERING) or not absorbed(cancelled):
                record.outcome = record.outcome or "cancelled_queued"
                raise
            error = cut_error()  # the drain ended it before its answer started: a 503
            record.status, record.outcome, record.reason = error.status, "failed", error.code
            response = error_response(error)
            response.headers[REQUEST_ID_HEADER] = record.request_id
            return response
        except Exception:  # a bug: the answer has not started (the relay ends its own)
            log.exception("request %s failed", record.request_id)
            error = ApiError(500, "The proxy failed to serve this request.")
            record.status, record.outcome, record.reason = 500, "failed", error.code
            response = error_response(error)
            response.headers[REQUEST_ID_HEADER] = record.request_id
            return response
        finally:
            proxy.drain.exit(running)
            # once the answer is written (aiohttp writes it when this returns; the loop runs
            # callbacks in order, so before any later request): counting is not the
            # client's wait
            seconds = proxy.clock() - arrived
            asyncio.get_running_loop().call_soon(_settle, proxy, record, seconds, end_span)

    return handle


def _settle(proxy: Proxy, record: AccessRecord, seconds: float, end_span: EndSpan | None) -> None:
    """A finished request's metrics, bill, access line and span."""
    _count(proxy, record, seconds)
    if proxy.usage is not None:  # what reached a backend is billed
        proxy.usage.record(record)
    record.emit()
    if end_span is not None:
        end_span(record)


def _count(proxy: Proxy, record: AccessRecord, seconds: float) -> None:
    if record.outcome is None:
        return
    key = (record.org or "", record.cls or "", record.pool or "")
    proxy.metrics.count(key, "requests", record.outcome)
    if record.backend is not None:  # dispatched: end to end, as its client waited
        proxy.metrics.observe(key, "request_duration_seconds", seconds)
    if record.reason and record.outcome in ("rejected", "failed"):
        counter = "rejections" if record.outcome == "rejected" else "failures"
        proxy.metrics.count(key, counter, record.reason)


async def _admit_and_serve(
    proxy: Proxy,
    request: web.Request,
    kind: Kind,
    record: AccessRecord,
    trace: Mapping[str, str],
) -> web.StreamResponse:
    key = proxy.auth.identify(request.headers, proxy.wall())
    record.org, record.key = key.org, key.name
    raw = await _read_body(request, proxy, key.org)
    config = proxy.config
    if len(raw) > config.limits.parse_in_loop_bytes:  # parsed off the loop (parse_worker.py)
        inference = await WORKER.parse(config, key.org, kind, raw, request.path)
    elif kind is Kind.EXTRA:
        rule_of = partial(_extra_cost, config, request.path)
        inference = parse_extra(raw, request.path, rule_of, config.owns_priority)
    else:
        usage, affinity = config.reports_stream_usage, config.affinity_for_model
        continuous, owns_priority = config.continuous_usage, config.owns_priority
        inference = parse(kind, raw, usage, affinity, config.limits, continuous, owns_priority)
    record.model = inference.model
    flow = classify(proxy.config, key, request.headers.get(CLASS_HEADER), inference.model)
    record.cls, record.pool = flow.cls, flow.pool
    if proxy.usage is not None:  # before any queue or rate token: a refusal costs nothing
        proxy.usage.check(flow.org, key.name)
    timeout = _client_timeout(request)
    pool = proxy.pools[flow.pool]
    if not pool.placement.any_healthy():
        cooldown = pool.spec.health.cooldown_s
        raise ApiError(503, f"Pool '{flow.pool}' has no healthy backend.", retry_after=cooldown)
    cls = proxy.config.classes[flow.cls]
    inference, estimate = pool.cost.price(inference, flow.org, cls.max_request_tokens)
    inference = with_priority(inference, config.engine_priority(flow.cls, inference.model))
    inference.text = None  # queued, it holds its body, not its prompt twice
    bucket, max_overtaken = cls.overtaking(estimate.cost)  # size buckets (design.md §3)
    ticket = Ticket(
        org=flow.org,
        cls=flow.cls,
        cost=estimate.cost,
        weight=proxy.config.flow_weight(flow.org, flow.cls),
        tokens=estimate.input_tokens + estimate.max_tokens,
        priority=cls.priority,
        affinity=_affinity_key(pool.spec.affinity, flow.org, request, inference),
        bucket=bucket,
        max_overtaken=max_overtaken,
        size=len(raw) + (0 if inference.raw is raw else len(inference.raw)),  # as held
    )
    record.cost = estimate.cost
    queued = pool.waiting(ticket)
    idempotency_key = request.headers.get(IDEMPOTENCY_HEADER)
    now = proxy.clock()
    limits = proxy.admission.admit(flow, ticket.tokens, queued, idempotency_key, now)
    intake = None  # the org's shared limits: decided here, or by the submit (``carry``)
    if proxy.limits is not None:
        intake = proxy.limits.intake(flow, ticket.tokens, idempotency_key)
        if not pool.carry(ticket, intake):
            await intake.decide()
    headers = _Headers(limits, trace, intake)
    try:
        proxy.metrics.seen(flow.key)
        bounds = _bounds(now, cls.max_queue_age_s, cls.max_request_s, timeout)
        return await _serve(
            proxy, request, flow, record, ticket, inference, estimate, bounds, headers
        )
    except ApiError as err:  # admitted: its answer says the org's limits like any other
        err.extra_headers = {**headers.limits, **err.extra_headers}
        raise
    finally:
        proxy.admission.done(flow, idempotency_key)
        if intake is not None:
            intake.end()


async def _serve(
    proxy: Proxy,
    request: web.Request,
    flow: Flow,
    record: AccessRecord,
    ticket: Ticket,
    inference: InferenceRequest,
    estimate: Estimate,
    bounds: _Bounds,
    headers: _Headers,
) -> web.StreamResponse:
    pool = proxy.pools[flow.pool]
    expires_at, expiry = bounds.queue
    key = flow.key
    metrics = proxy.metrics
    retry = proxy.config.retry
    relayed: Relayed | None = None
    for attempt in range(1, retry.max_attempts + 1):
        queued_at = proxy.clock()
        try:
            backend = await pool.acquire(
                ticket, expires_at=expires_at, expiry=expiry, front=attempt > 1
            )
        except BaseException:  # expired or cancelled in line: this attempt generated nothing
            record.queue_wait_s += proxy.clock() - queued_at  # the access log says how long
            _refund(proxy, flow, ticket.tokens, headers.intake)
            raise
        waited = proxy.clock() - queued_at
        record.queue_wait_s += waited
        if proxy.usage is not None:
            _within_budget(proxy, flow, ticket, record, estimate, headers.intake)
        record.backend = backend.name
        metrics.observe(key, "queue_wait_seconds", waited)
        metrics.placed(flow.pool, backend.name, ticket.placed)
        if not ticket.priority:
            metrics.count(key, "cost_charged", amount=ticket.cost)  # the cost, not cost/weight
        relayed, generated = None, True
        slot = _Slot(pool, ticket, backend, estimate, metrics, key)
        try:
            relayed = await forward(
                proxy.upstreams, pool, backend, request, inference, record.request_id,
                {
                    REQUEST_ID_HEADER: record.request_id,
                    QUEUE_WAIT_HEADER: f"{record.queue_wait_s:.6f}",
                    COST_HEADER: "0" if ticket.priority else f"{ticket.cost:.6g}",
                    **headers.limits,
                },
                on_headers=partial(metrics.first_byte, flow.pool, backend.name),
                expires_at=bounds.life[0], expiry=bounds.life[1], on_upstream_end=slot.settle,
                upstream_headers=headers.trace,
                answer_buffer=proxy.config.limits.answer_buffer_bytes,
            )  # fmt: skip
            generated = not _refused(relayed)
            slot.settle(relayed)
        except UpstreamFailed as failure:
            generated = failure.answer is not None  # a 504: the backend had the request
            if failure.counts:
                pool.report_failure(backend)
            if failure.answer is not None:
                raise failure.answer from None
        except ApiError:  # dispatched: the request's bound passed
            record.outcome = "failed"
            raise
        except asyncio.CancelledError as cancelled:  # the client left, or was cut
            _left(proxy, flow, record, request, estimate, slot, by_client=not is_cut(cancelled))
            raise
        except ConnectionResetError:  # the client hung up as we wrote: a cancellation too
            _left(proxy, flow, record, request, estimate, slot)
            raise asyncio.CancelledError from None
        finally:
            slot.release(refund=not generated)
        status = None if relayed is None else relayed.response.status
        if status is not None and status not in RETRYABLE:
            break
        delay = _backoff(attempt, retry.backoff_base_s, retry.backoff_max_s, relayed)
        if attempt == retry.max_attempts:
            break
        if expires_at is not None and proxy.clock() + delay >= expires_at:
            break
        if not await _may_retry(proxy, flow, ticket.tokens):
            metrics.count(key, "retry_budget_refusals")
            break
        metrics.count(key, "retries", "unreachable" if status is None else str(status))
        record.retries += 1
        await asyncio.sleep(delay)
    if _refused(relayed):
        _refund(proxy, flow, ticket.tokens, headers.intake)
    if relayed is None:
        raise ApiError(502, f"No backend of pool '{flow.pool}' gave an answer.")
    try:  # a whole answer is sent now, its client watched as a stream's is
        await deliver(request, relayed, pool.spec.timeouts.client_write_s)
    except (asyncio.CancelledError, ConnectionResetError) as gone:
        _left(proxy, flow, record, request, estimate, slot, by_client=not is_cut(gone))
        if isinstance(gone, asyncio.CancelledError):
            raise
        raise asyncio.CancelledError from None
    # counted once the answer is written, before the request is settled (``handle``)
    asyncio.get_running_loop().call_soon(_count_answer, proxy, flow, record, estimate, relayed)
    return relayed.response


def _within_budget(
    proxy: Proxy,
    flow: Flow,
    ticket: Ticket,
    record: AccessRecord,
    estimate: Estimate,
    intake: Intake | None,
) -> None:
    """Its budgets checked again as it leaves the queue, counting what runs (its own
    estimate is reserved until it ends): refused now, it gives its slot back unsent, having
    cost nothing, and gets the budget's 429."""
    assert proxy.usage is not None
    try:
        proxy.usage.dispatched(record, estimate.input_tokens, estimate.max_tokens)
    except ApiError:
        proxy.pools[flow.pool].release(ticket, refund=True, actual=0.0)
        _refund(proxy, flow, ticket.tokens, intake)
        raise


def _left(
    proxy: Proxy,
    flow: Flow,
    record: AccessRecord,
    request: web.Request,
    estimate: Estimate,
    slot: _Slot,
    *,
    by_client: bool = True,
) -> None:
    """The client of a dispatched request left before its answer's end, or the proxy cut it
    for not reading (``CLIENT_CUT``: failed, that its reason; else ``cancelled_running``);
    not ``by_client``: the drain's deadline ended it (failed, ``shutting_down``).

    Billed (docs/usage-and-budgets.md) its estimate at least: its prompt as estimated, and
    as completion the output it was priced at (max_tokens × its output ratio); more when
    the backend reported more (its answer's end was read: the slot was given back with it),
    or, before any usage came, sent more tokens (or, with a pool's ``cost.continuous_usage``,
    said in the last chunk relayed that it had read a longer prompt). Leaving never lowers
    a bill, nor dodges a budget. Its slot's true-up is the work: what the backend reported
    when it did, else the same floor. The drain's cut is not the client's doing: its
    prompt as estimated and the tokens sent."""
    done = slot.done
    if done is not None:  # its answer's end was read: counted as if the client had stayed
        _count_answer(proxy, flow, record, estimate, done)
        if record.outcome != "completed":  # the backend's failure came first
            return
    else:
        counted = request.get(STREAM_TOKENS)
        record.prompt_tokens = estimate.input_tokens
        record.completion_tokens = 0 if counted is None else counted.tokens
        # a stream whose chunks carry the usage so far (a pool's cost.continuous_usage):
        # the engine's counts in the last of them, its prompt as it really was
        so_far = None if counted is None else last_usage(counted.tail())
        if so_far is not None:
            prompt, completion = so_far
            record.prompt_tokens = record.prompt_tokens if prompt is None else prompt
            # at least the events relayed: with n > 1, vLLM counts a chunk's own choice only
            record.completion_tokens = max(record.completion_tokens, completion or 0)
    if by_client:  # leaving never lowers a bill
        priced = math.ceil(estimate.output_tokens - 1e-6)
        record.prompt_tokens = max(record.prompt_tokens or 0, estimate.input_tokens)
        record.completion_tokens = max(record.completion_tokens or 0, priced)
    if done is None:
        slot.release(
            refund=False, billed=(record.prompt_tokens or 0, record.completion_tokens or 0)
        )
    cut = request.get(CLIENT_CUT) if by_client else "shutting_down"
    record.outcome, record.reason = ("failed", cut) if cut else ("cancelled_running", None)


@dataclass(frozen=True, slots=True)
class _Headers:
    """What an admitted request's exchange carries besides its body: the org's
    ``x-ratelimit-*`` as of its admission (to the client), and its trace context
    (upstream); ``intake``: its admission by the shared limits, when there are."""

    own_limits: Mapping[str, str]  # the in-memory admission's
    trace: Mapping[str, str]
    intake: Intake | None

    @property
    def limits(self) -> Mapping[str, str]:
        """The shared ones once the admission is decided (by the submit, if it carried it)."""
        return self.own_limits if self.intake is None else self.intake.headers


def _extra_cost(config: Config, path: str, model: str) -> ExtraCostSpec | None:
    """The cost rule for ``path`` of ``model``'s pool; None when that pool does not list
    the path (or no pool serves the model)."""
    pool = config.pool_for_model(model)
    extra = None if pool is None else config.pools[pool].extra_path(path)
    return None if extra is None else extra.cost


def _refund(proxy: Proxy, flow: Flow, tokens: float, intake: Intake | None) -> None:
    """A request that generated nothing gives its tokens back (to the shared buckets too,
    if its admission there took them)."""
    proxy.admission.refund(flow, tokens, proxy.clock())
    if intake is not None:
        intake.refund()


async def _may_retry(proxy: Proxy, flow: Flow, tokens: float) -> bool:
    """A retry pays like a request: its flow's retry budget and its org's buckets."""
    if proxy.limits is not None and not await proxy.limits.retry(flow, tokens):
        return False
    if proxy.admission.may_retry(flow, tokens, proxy.clock()):
        return True
    if proxy.limits is not None:  # the budget said no: the tokens go back
        proxy.limits.refund(flow, tokens)
    return False


def _count_answer(
    proxy: Proxy, flow: Flow, record: AccessRecord, estimate: Estimate, relayed: Relayed
) -> None:
    """Usage, metrics, access log and calibration. The answer is the backend's: a failure
    to count it is logged, and never changes what the client gets."""
    try:  # its usage was read when its slot was given back (``_Slot.settle``)
        _account(proxy, flow, record, relayed)
        if relayed.response.status == 200 and relayed.fault is None:
            proxy.pools[flow.pool].cost.observe(
                estimate, flow.org, relayed.prompt_tokens, relayed.completion_tokens
            )
    except Exception:
        log.exception("request %s: its answer could not be counted", record.request_id)


class _Slot:
    """A dispatched attempt's slot, given back once: as soon as its backend is done with
    (judged first, so that the next dispatch knows its health), else when the attempt ends.

    Given back, its flow's charge is trued up to what the attempt really cost
    (docs/design.md §3): the usage the backend reported; without a report (a stream cut, a
    client gone, a server that reports none), the estimate at least, and more when the
    tokens the backend sent say so. So the estimate orders dispatch, and the backend's own
    count decides what a flow paid: a field the estimator does not read buys nothing, nor
    does leaving before the end."""

    def __init__(
        self,
        pool: Pool,
        ticket: Ticket,
        backend: Backend,
        estimate: Estimate,
        metrics: Metrics,
        key: Key,
    ) -> None:
        self._pool, self._ticket, self._backend = pool, ticket, backend
        self._estimate, self._metrics, self._key = estimate, metrics, key
        self._held = True
        self.done: Relayed | None = None  # the answer it was given back with, if it was

    def settle(self, relayed: Relayed) -> None:
        if not self._held:
            return
        self._held = False
        self.done = relayed
        try:
            read_usage(relayed)
            if backend_failed(relayed):
                self._pool.report_failure(self._backend)
            else:
                self._pool.report_success(self._backend)
        finally:
            served = self._served(relayed.prompt_tokens, relayed.completion_tokens)
            self._pool.release(self._ticket, refund=_refused(relayed), actual=served)

    def release(self, *, refund: bool, billed: tuple[int, int] | None = None) -> None:
        """Given back without an answer's usage: ``billed``, the (prompt, completion)
        tokens of a client that left (``_left``), if it did."""
        if self._held:
            self._held = False
            served = self._served(None, None if billed is None else billed[1], billed)
            self._pool.release(self._ticket, refund=refund, actual=served)

    def _served(
        self, prompt: int | None, completion: int | None, billed: tuple[int, int] | None = None
    ) -> float | None:
        """What the attempt cost, for its flow's true-up (None: a band request, never
        charged)."""
        if self._ticket.priority:
            return None
        cost, estimate = self._pool.cost, self._estimate
        served = cost.actual(prompt, completion)
        if served is None:  # no report: never less than the estimate
            asked = estimate.input_tokens if billed is None else billed[0]
            served = max(estimate.cost, cost.actual(asked, completion) or 0.0)
        owed = served - estimate.cost  # sfq_cost_trued_up_total, by direction
        if owed:
            self._metrics.count(self._key, "cost_trued_up", "up" if owed > 0 else "down", abs(owed))
        return served


def _refused(relayed: Relayed | None) -> bool:
    """Whether the upstream answered without generating anything: a 4xx, or no answer."""
    return relayed is None or 400 <= relayed.response.status < 500


def _account(proxy: Proxy, flow: Flow, record: AccessRecord, relayed: Relayed) -> None:
    """What the answer tells the metrics and the access log."""
    status = relayed.response.status
    record.status, record.upstream_s = status, relayed.upstream_s
    record.prompt_tokens, record.completion_tokens = (
        relayed.prompt_tokens,
        relayed.completion_tokens,
    )
    key, metrics = flow.key, proxy.metrics
    if relayed.fault is not None:
        record.outcome, record.reason = "failed", fault_code(relayed.fault)
    elif status < 400 and error_event(relayed):
        record.outcome, record.reason = "failed", "error_event"
    elif status < 400:
        record.outcome = "completed"
    else:
        record.outcome = "upstream_error"
        metrics.count(key, "upstream_errors", str(status))
    if relayed.first_chunk_s is not None:
        metrics.observe(key, "time_to_first_token_seconds", relayed.first_chunk_s)
    metrics.count(key, "prompt_tokens", amount=relayed.prompt_tokens or 0)
    metrics.count(key, "completion_tokens", amount=relayed.completion_tokens or 0)
    if status == 200 and relayed.fault is None:
        actual = proxy.pools[flow.pool].cost.actual(
            relayed.prompt_tokens, relayed.completion_tokens
        )
        if actual is not None:
            record.cost_actual = actual
            metrics.count(key, "cost_actual", amount=actual)


def _backoff(attempt: int, base: float, cap: float, relayed: Relayed | None) -> float:
    """Full jitter (uniform in [0, min(cap, base·2^(attempt−1))]), at least the upstream's
    retry-after (``retry-after-ms`` first; an HTTP date is not read), at most
    ``MAX_PAUSE_S``: a huge or garbled one cannot park the request (core/throttle.py)."""
    delay = random.uniform(0.0, min(cap, base * 2 ** (attempt - 1)))
    after = retry_after(relayed.response.headers) if relayed is not None else None
    if after is not None:
        delay = max(delay, min(MAX_PAUSE_S, after))
    return delay


def _affinity_key(
    spec: AffinitySpec | None, org: str, request: web.Request, inference: InferenceRequest
) -> str | None:
    """The ticket's affinity key (docs/design.md §5, Affinity): a digest, never the text."""
    if spec is None:
        return None
    header = request.headers.get(spec.session_header) if spec.session_header else None
    return request_key(org, header, inference.affinity_user, inference.affinity_prefix)


def _client_timeout(request: web.Request) -> float | None:
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        timeout = float(value)
    except ValueError:
        timeout = math.nan
    if not (math.isfinite(timeout) and timeout > 0):
        raise ApiError(400, f"'{TIMEOUT_HEADER}' must be a positive number of seconds.")
    return timeout


Bound = tuple[float | None, Expiry]  # when (on the proxy's clock), and the answer then


@dataclass(frozen=True, slots=True)
class _Bounds:
    queue: Bound  # while queued (retries included): the earliest bound of all
    life: Bound  # once dispatched: the request's whole-life bound, from admission


def _bounds(
    now: float, max_queue_age_s: float | None, max_request_s: float | None, timeout: float | None
) -> _Bounds:
    """A request's bounds from its admission ``now``. Its life is bounded by the smaller of its
    class's ``max_request_s`` and its client's ``X-Request-Timeout`` (504 ``deadline``: the
    client can shorten the operator's bound, never lengthen it); its wait in the queue also
    by the class's ``max_queue_age_s`` (429 ``queue_age``), the earlier applying."""
    life: Bound = (None, OUT_OF_TIME)
    queue: Bound = (None, QUEUE_DEADLINE)
    seconds: float | None
    if timeout is not None and (max_request_s is None or timeout <= max_request_s):
        seconds, what = timeout, f"The request's {TIMEOUT_HEADER}"
    else:
        seconds, what = max_request_s, "This class's max_request_s"
    if seconds is not None:
        at = now + seconds
        on_life, on_queue = _deadline(what, seconds)
        life, queue = (at, on_life), (at, on_queue)
    if max_queue_age_s is not None and (queue[0] is None or now + max_queue_age_s < queue[0]):
        queue = (now + max_queue_age_s, _queue_age(max_queue_age_s))
    return _Bounds(queue=queue, life=life)


@lru_cache(maxsize=256)  # a class's bound, or a client's timeout: few values in use at once
def _deadline(what: str, seconds: float) -> tuple[Expiry, Expiry]:
    """The 504s of a bound of ``seconds`` named ``what``: once dispatched, and while queued."""
    return (
        Expiry(504, f"{what} of {seconds:g} s passed before the answer's end.", code="deadline"),
        Expiry(504, f"{what} of {seconds:g} s passed before it was served.", code="deadline"),
    )


@lru_cache(maxsize=64)
def _queue_age(seconds: float) -> Expiry:
    message = f"Waited longer than this class's queue limit (max_queue_age_s {seconds:g} s)."
    return Expiry(429, message, code="queue_age")


async def _read_body(request: web.Request, proxy: Proxy, org: str) -> bytes:
    """The body as sent. A compressed one is refused: the server does not inflate bodies
    (a small one can inflate to gigabytes), and the proxy forwards exactly what it read.
    It is read in time and within the queue memory, as ``org``'s (``body.py``)."""
    if request.headers.get("Content-Encoding", "identity").lower() != "identity":
        raise ApiError(415, "Compressed request bodies are not accepted; send plain JSON.")
    limits = proxy.config.limits
    if request.content_length is not None and request.content_length > limits.max_body_bytes:
        raise body.too_large(limits.max_body_bytes)
    assert proxy.memory is not None  # made with the proxy
    return await body.read(request, limits, proxy.memory, org)
