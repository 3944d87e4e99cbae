"""The HTTP front end: authenticate → parse → classify → price → queue → relay.

The handlers are thin: every decision is made by a sans-I/O piece (``classify``, ``cost``,
the pool's ``Scheduler``) and every rejection is an :class:`ApiError`, turned into an
OpenAI-style JSON error in one place, the middleware.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .classify import CLASS_HEADER, Authenticator, Flow, classify
from .config import Config
from .errors import ApiError
from .metrics import Metrics
from .pool import Pool
from .relay import UpstreamUnreachable, forward
from .request import InferenceRequest, Kind, parse
from .scheduler import Ticket

Clock = Callable[[], float]
_FLOW = web.RequestKey("flow", Flow)


@dataclass
class Proxy:
    """Everything the handlers share; ``/admin/state`` is its repr."""

    config: Config
    pools: dict[str, Pool]
    auth: Authenticator
    metrics: Metrics
    clock: Clock
    admin_digest: bytes | None
    session: aiohttp.ClientSession | None = None
    _probes: list[asyncio.Task[None]] = field(default_factory=list)

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        """One pooled keep-alive session to the backends, and the health probes."""
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self._probes = [
            asyncio.create_task(p.probe_forever(self.session)) for p in self.pools.values()
        ]
        yield
        for task in self._probes:
            task.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)
        await self.session.close()

    def count(self, flow: Flow | None, outcome: str) -> None:
        labels = (flow.org, flow.cls, flow.pool) if flow else ("", "", "")
        self.metrics.requests.labels(*labels, outcome).inc()

    def state(self) -> dict[str, Any]:
        return {name: pool.state() for name, pool in self.pools.items()}


PROXY = web.AppKey("proxy", Proxy)


def build_app(config: Config, *, clock: Clock = time.monotonic) -> web.Application:
    """The proxy as an aiohttp application; raises ConfigError if a tokenizer won't load."""
    pools = {
        name: Pool(name, spec, clock, config.upstream_key(name))
        for name, spec in config.pools.items()
    }
    proxy = Proxy(
        config=config,
        pools=pools,
        auth=Authenticator(config.resolved_keys()),
        metrics=Metrics(pools),
        clock=clock,
        admin_digest=config.admin_digest(),
    )
    app = web.Application(client_max_size=config.limits.max_body_bytes, middlewares=[_errors])
    app[PROXY] = proxy
    app.cleanup_ctx.append(proxy.lifecycle)
    for kind in Kind:
        app.router.add_post(kind.value, _inference_handler(kind))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/admin/state", _admin_state)
    return app


@web.middleware
async def _errors(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
    """Every rejection leaves as an OpenAI-style JSON error, aiohttp's own included."""
    try:
        return await handler(request)
    except ApiError as err:
        request.app[PROXY].count(request.get(_FLOW), f"rejected_{err.code}")
        return err.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return ApiError(exc.status, exc.reason).response()


def _inference_handler(kind: Kind) -> Callable[[web.Request], Any]:
    async def handle(request: web.Request) -> web.StreamResponse:
        proxy = request.app[PROXY]
        key = proxy.auth.identify(request.headers.get("Authorization"))
        inference = parse(kind, await _read_body(request, proxy.config.limits.max_body_bytes))
        flow = classify(proxy.config, key, request.headers.get(CLASS_HEADER), inference.model)
        request[_FLOW] = flow
        pool = proxy.pools[flow.pool]
        if not pool.placement.any_healthy():
            cooldown = pool.spec.health.cooldown_s
            raise ApiError(503, f"Pool '{flow.pool}' has no healthy backend.", retry_after=cooldown)
        estimate = pool.cost.estimate(inference)
        weight = proxy.config.flow_weight(flow.org, flow.cls)
        ticket = Ticket(flow=flow.id, cost=estimate.cost, weight=weight)
        return await _serve(proxy, request, pool, ticket, inference)

    return handle


async def _serve(
    proxy: Proxy, request: web.Request, pool: Pool, ticket: Ticket, inference: InferenceRequest
) -> web.StreamResponse:
    """Wait for a slot, then relay; a backend that could not be reached means re-queueing
    in the request's own flow (charged again when redispatched), up to max_attempts."""
    flow = request[_FLOW]
    labels = (flow.org, flow.cls, flow.pool)
    assert proxy.session is not None
    for _ in range(proxy.config.retry.max_attempts):
        queued_at = proxy.clock()
        try:
            backend = await pool.acquire(ticket)
        except asyncio.CancelledError:
            proxy.count(flow, "cancelled_queued")
            raise
        proxy.metrics.queue_wait.labels(*labels).observe(proxy.clock() - queued_at)
        proxy.metrics.cost_charged.labels(*labels).inc(ticket.cost / ticket.weight)
        try:
            response = await forward(proxy.session, pool, backend, request, inference)
        except UpstreamUnreachable:
            continue
        except asyncio.CancelledError:
            proxy.count(flow, "cancelled_running")
            raise
        finally:
            pool.release(ticket)
        proxy.count(flow, "completed" if response.status < 400 else f"upstream_{response.status}")
        return response
    proxy.count(flow, "failed")
    raise ApiError(502, f"No backend of pool '{flow.pool}' could be reached.")


async def _read_body(request: web.Request, limit: int) -> bytes:
    too_large = ApiError(413, f"The body is larger than the {limit} bytes allowed.")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None


async def _models(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    proxy.auth.identify(request.headers.get("Authorization"))
    models = [
        {"id": model, "object": "model", "created": 0, "owned_by": pool}
        for pool, spec in proxy.config.pools.items()
        for model in spec.models
    ]
    return web.json_response({"object": "list", "data": models})


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[PROXY].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    ready = any(p.placement.any_healthy() for p in request.app[PROXY].pools.values())
    return web.json_response({"ready": ready}, status=200 if ready else 503)


async def _admin_state(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    if proxy.admin_digest is None:
        raise ApiError(403, "The admin API is off: set admin_key_env in the config.")
    token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(hashlib.sha256(token.encode()).digest(), proxy.admin_digest):
        raise ApiError(401, "Incorrect admin key.")
    return web.json_response({"pools": proxy.state()})
