"""The HTTP front end: the routes, and where rejections become OpenAI-style JSON errors.

Inference requests go through ``inference.py``; every decision is made by a sans-I/O
piece (``classify``, ``cost``, ``admission``, the pool's ``Scheduler``) and every rejection
is an :class:`ApiError`. There is no middleware: aiohttp wraps every request in two more
coroutines when there is one, which is CPU on every request and memory for every queued
one. Each handler answers its own errors, and unrouted paths get a route of their own.
"""

from __future__ import annotations

import functools
import hmac
import logging
import time
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..config import Config, ConfigError
from ..core.errors import ApiError
from ..core.flows import key_digest
from ..core.inference_request import Kind
from .error_response import error_response
from .handler import Handler, handler
from .runtime import PROXY, Clock, Proxy

log = logging.getLogger(__name__)


def build_app(
    config: Config, *, clock: Clock = time.monotonic, config_path: Path | None = None
) -> web.Application:
    """The proxy as an aiohttp application; raises ConfigError if a tokenizer won't load.

    ``config_path`` is the file a reload reads again.
    """
    proxy = Proxy.from_config(config, clock, config_path)
    app = web.Application(client_max_size=config.limits.max_body_bytes)
    app[PROXY] = proxy
    app.cleanup_ctx.append(proxy.lifecycle)
    app.on_shutdown.append(proxy.shutting_down)
    for kind in Kind:
        app.router.add_post(kind.value, handler(kind))
    app.router.add_get("/v1/models", _answering_errors(_models))
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/admin/state", _answering_errors(_admin_state))
    app.router.add_post("/admin/reload", _answering_errors(_admin_reload))
    allowed: dict[str, set[str]] = {}
    for route in app.router.routes():
        assert route.resource is not None  # every route added through the router has one
        allowed.setdefault(route.resource.canonical, set()).add(route.method)
    app.router.add_route("*", "/{path:.*}", _unrouted(allowed))
    return app


def _answering_errors(serve: Handler) -> Handler:
    """``serve``, with its ApiError turned into the error response."""

    @functools.wraps(serve)
    async def answer(request: web.Request) -> web.StreamResponse:
        try:
            return await serve(request)
        except ApiError as err:
            return error_response(err)

    return answer


def _unrouted(allowed: dict[str, set[str]]) -> Handler:
    """What answers a path no route serves (404), or serves for other methods (405)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        methods = allowed.get(request.path)
        if methods is None:
            return error_response(ApiError(404, f"No such endpoint: {request.path}"))
        message = f"{request.method} is not allowed here; use {', '.join(sorted(methods))}."
        response = error_response(ApiError(405, message))
        response.headers["Allow"] = ", ".join(sorted(methods))
        return response

    return answer


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
    ready = any(p.ready() for p in request.app[PROXY].pools.values())
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
    if not hmac.compare_digest(key_digest(token), digest):
        raise ApiError(401, "Incorrect admin key.")
    return proxy
