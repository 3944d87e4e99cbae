"""The life of one inference request: admit, wait in line, relay, and maybe retry.

Retries happen only while nothing has reached the client (connect error, or a backend's
429/502/503). A retry goes back to the *head of its own flow*, waits for that flow's turn
by meter like any request, is charged again when dispatched, waits a backoff with full
jitter first (at least the backend's ``Retry-After``), and draws on the flow's retry
budget. Out of attempts, budget or time, the client gets the upstream's own error.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random

from aiohttp import web

from .classify import CLASS_HEADER, Flow, classify
from .errors import ApiError
from .proxy import FLOW, PROXY, Proxy
from .relay import UpstreamUnreachable, forward
from .request import InferenceRequest, Kind, parse
from .scheduler import Ticket

RETRYABLE = frozenset({429, 502, 503})
TIMEOUT_HEADER = "X-Request-Timeout"
IDEMPOTENCY_HEADER = "Idempotency-Key"


def handler(kind: Kind):
    async def handle(request: web.Request) -> web.StreamResponse:
        proxy = request.app[PROXY]
        key = proxy.auth.identify(request.headers.get("Authorization"))
        inference = parse(kind, await _read_body(request, proxy.config.limits.max_body_bytes))
        flow = classify(proxy.config, key, request.headers.get(CLASS_HEADER), inference.model)
        request[FLOW] = flow
        timeout = _client_timeout(request)
        pool = proxy.pools[flow.pool]
        if not pool.placement.any_healthy():
            cooldown = pool.spec.health.cooldown_s
            raise ApiError(503, f"Pool '{flow.pool}' has no healthy backend.", retry_after=cooldown)
        estimate = pool.cost.estimate(inference)
        cls = proxy.config.classes[flow.cls]
        ticket = Ticket(
            org=flow.org,
            cls=flow.cls,
            cost=estimate.cost,
            weight=proxy.config.flow_weight(flow.org, flow.cls),
            tokens=estimate.input_tokens + estimate.max_tokens,
            priority=cls.priority,
        )
        queued = pool.scheduler.waiting(ticket)
        idempotency_key = request.headers.get(IDEMPOTENCY_HEADER)
        now = proxy.clock()
        proxy.admission.admit(flow, ticket.tokens, queued, idempotency_key, now)
        try:
            expires_at, expiry = _deadline(now, cls.max_queue_age_s, timeout)
            return await _serve(proxy, request, ticket, inference, expires_at, expiry)
        finally:
            proxy.admission.done(flow, idempotency_key)

    return handle


async def _serve(
    proxy: Proxy,
    request: web.Request,
    ticket: Ticket,
    inference: InferenceRequest,
    expires_at: float | None,
    expiry: ApiError | None,
) -> web.StreamResponse:
    flow: Flow = request[FLOW]
    pool = proxy.pools[flow.pool]
    labels = (flow.org, flow.cls, flow.pool)
    retry = proxy.config.retry
    assert proxy.session is not None
    response: web.StreamResponse | None = None
    for attempt in range(1, retry.max_attempts + 1):
        queued_at = proxy.clock()
        try:
            backend = await pool.acquire(
                ticket, expires_at=expires_at, expiry=expiry, front=attempt > 1
            )
        except asyncio.CancelledError:
            proxy.count(flow, "cancelled_queued")
            raise
        proxy.metrics.queue_wait.labels(*labels).observe(proxy.clock() - queued_at)
        if not ticket.priority:
            proxy.metrics.cost_charged.labels(*labels).inc(ticket.cost / ticket.weight)
        try:
            response = await forward(proxy.session, pool, backend, request, inference)
        except UpstreamUnreachable:
            response = None
        except asyncio.CancelledError:
            proxy.count(flow, "cancelled_running")
            raise
        finally:
            pool.release(ticket)
        if response is not None and response.status not in RETRYABLE:
            break
        reason = "unreachable" if response is None else str(response.status)
        delay = _backoff(attempt, retry.backoff_base_s, retry.backoff_max_s, response)
        if attempt == retry.max_attempts:
            break
        if expires_at is not None and proxy.clock() + delay >= expires_at:
            break
        if not proxy.admission.may_retry(flow, proxy.clock()):
            proxy.metrics.retry_refusals.labels(*labels).inc()
            break
        proxy.metrics.retries.labels(*labels, reason).inc()
        await asyncio.sleep(delay)
    if response is None:
        proxy.count(flow, "failed")
        raise ApiError(502, f"No backend of pool '{flow.pool}' could be reached.")
    proxy.count(flow, "completed" if response.status < 400 else f"upstream_{response.status}")
    return response


def _backoff(attempt: int, base: float, cap: float, response: web.StreamResponse | None) -> float:
    """Full jitter (uniform in [0, min(cap, base·2^(attempt−1))]), at least the Retry-After."""
    delay = random.uniform(0.0, min(cap, base * 2 ** (attempt - 1)))
    retry_after = response.headers.get("Retry-After") if response is not None else None
    if retry_after is not None:
        with contextlib.suppress(ValueError):  # an HTTP date: not worth parsing here
            delay = max(delay, float(retry_after))
    return delay


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


def _deadline(
    now: float, max_queue_age_s: float | None, timeout: float | None
) -> tuple[float | None, ApiError | None]:
    """The earlier of the class's queue-age limit (429) and the client's deadline (504)."""
    candidates = []
    if max_queue_age_s is not None:
        message = f"Waited longer than this class's {max_queue_age_s:g} s queue limit."
        candidates.append((now + max_queue_age_s, ApiError(429, message, code="queue_age")))
    if timeout is not None:
        message = f"The request's {TIMEOUT_HEADER} of {timeout:g} s passed before it was served."
        candidates.append((now + timeout, ApiError(504, message, code="deadline")))
    if not candidates:
        return None, None
    return min(candidates, key=lambda c: c[0])


async def _read_body(request: web.Request, limit: int) -> bytes:
    too_large = ApiError(413, f"The body is larger than the {limit} bytes allowed.")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
