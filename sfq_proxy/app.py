"""The HTTP front end: the routes, and the one place where rejections become responses.

Inference requests go through ``inference.py``; every decision is made by a sans-I/O
piece (``classify``, ``cost``, ``admission``, the pool's ``Scheduler``) and every rejection
is an :class:`ApiError`, turned into an OpenAI-style JSON error by the middleware.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .accesslog import REQUEST_ID_HEADER
from .config import Config, ConfigError
from .errors import ApiError
from .inference import handler
from .proxy import FLOW, PROXY, RECORD, Clock, Proxy
from .request import Kind

log = logging.getLogger(__name__)


def build_app(
    config: Config, *, clock: Clock = time.monotonic, config_path: Path | None = None
) -> web.Application:
    """The proxy as an aiohttp application; raises ConfigError if a tokenizer won't load.

    ``config_path`` is the file a reload reads again.
    """
    proxy = Proxy.from_config(config, clock, config_path)
    app = web.Application(client_max_size=config.limits.max_body_bytes, middlewares=[_errors])
    app[PROXY] = proxy
    app.cleanup_ctx.append(proxy.lifecycle)
    for kind in Kind:
        app.router.add_post(kind.value, handler(kind))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/admin/state", _admin_state)
    app.router.add_post("/admin/reload", _admin_reload)
    return app


@web.middleware
async def _errors(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
    """Every rejection leaves as an OpenAI-style JSON error, aiohttp's own included, and
    every finished inference request is counted once, by its outcome."""
    proxy = request.app[PROXY]
    try:
        response = await handler(request)
    except ApiError as err:
        response = err.response()
        _count(proxy, request, "rejected" if err.reason else "failed", err.reason)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return ApiError(exc.status, exc.reason).response()
    except asyncio.CancelledError:
        record = request.get(RECORD)
        if record is not None:
            _count(proxy, request, record.outcome or "cancelled_queued")
        raise
    else:
        record = request.get(RECORD)
        if record is not None and record.outcome:
            _count(proxy, request, record.outcome)
    if RECORD in request and not response.prepared:
        response.headers[REQUEST_ID_HEADER] = request[RECORD].request_id
    return response


def _count(proxy: Proxy, request: web.Request, outcome: str, reason: str | None = None) -> None:
    flow = request.get(FLOW)
    record = request.get(RECORD)
    org = flow.org if flow else (record.org or "" if record else "")
    key = (org, flow.cls, flow.pool) if flow else (org, "", "")
    proxy.metrics.count(key, "requests", outcome)
    if reason:
        proxy.metrics.count(key, "rejections", reason)


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
    proxy = _admin(request)
    return web.json_response({"pools": proxy.state()})


async def _admin_reload(request: web.Request) -> web.Response:
    proxy = _admin(request)
    try:
        warnings = proxy.reload_from_file()
    except ConfigError as err:
        log.warning("reload refused, nothing changed:\n%s", err)
        raise ApiError(400, f"Invalid configuration, nothing changed: {err}") from None
    return web.json_response({"reloaded": True, "warnings": warnings})


def _admin(request: web.Request) -> Proxy:
    """The proxy, for a request that carries the admin key."""
    proxy = request.app[PROXY]
    digest = proxy.config.admin_digest()
    if digest is None:
        raise ApiError(403, "The admin API is off: set admin_key_env in the config.")
    token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(hashlib.sha256(token.encode()).digest(), digest):
        raise ApiError(401, "Incorrect admin key.")
    return proxy
