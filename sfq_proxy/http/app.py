"""The HTTP front end: the routes, and where rejections become OpenAI-style JSON errors.

Inference requests go through ``handler.py``; every decision is made by a sans-I/O
piece (``classify``, ``cost``, ``admission``, the pool's ``Scheduler``) and every rejection
is an :class:`ApiError`. There is no middleware: aiohttp wraps every request in two more
coroutines when there is one, which is CPU on every request and memory for every queued
one. Each handler answers its own errors, and unrouted paths get a route of their own,
which also serves the pools' ``extra_paths``: they are read from the live config, so a
reload may change them.
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
from ..core.errors import ApiError, cut
from ..core.flows import credential, key_digest, may_use
from ..core.inference_request import Kind
from ..observability.history import SERIES
from . import admin_keys, admin_page
from .admin_usage import usage_handler
from .error_response import error_response
from .handler import Handler, handler
from .proxy import PROXY, Clock, Proxy

log = logging.getLogger(__name__)


def build_app(
    config: Config,
    *,
    clock: Clock = time.monotonic,
    config_path: Path | None = None,
    wall: Clock = time.time,
) -> web.Application:
    """The proxy as an aiohttp application; raises ConfigError if a tokenizer won't load.

    ``config_path`` is the file a reload reads again; ``wall`` is the Unix-time clock
    (key expiry, usage periods, budgets), which tests replace.
    """
    proxy = Proxy.from_config(config, clock, config_path, wall)
    app = web.Application(client_max_size=config.limits.max_body_bytes)
    app[PROXY] = proxy
    app.cleanup_ctx.append(proxy.lifecycle)
    app.on_shutdown.append(proxy.shutting_down)
    for kind in Kind:
        if kind is not Kind.EXTRA:
            app.router.add_post(kind.value, handler(kind))
    app.router.add_get("/v1/models", _answering_errors(_models))
    app.router.add_get("/v1/models/{model:.+}", _answering_errors(_model))
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/admin/state", _answering_errors(_admin_state))
    app.router.add_get("/admin/history", _answering_errors(_admin_history))
    app.router.add_post("/admin/reload", _answering_errors(_admin_reload))
    for method, path, serve in admin_keys.ROUTES:
        app.router.add_route(method, path, _answering_errors(_as_admin(serve)))
    app.router.add_get("/admin/usage", _answering_errors(usage_handler(_admin)))
    admin_page.add_routes(app)  # before the catch-all route below, which would take /admin/
    allowed: dict[str, set[str]] = {}
    for route in app.router.routes():
        assert route.resource is not None  # every route added through the router has one
        canonical = route.resource.canonical
        if "{" in canonical:  # a path with a parameter: by its prefix, then "{"
            canonical = canonical[: canonical.index("{") + 1]
        allowed.setdefault(canonical, set()).add(route.method)
    app.router.add_route("*", "/{path:.*}", _unrouted(allowed, handler(Kind.EXTRA)))
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


def _unrouted(allowed: dict[str, set[str]], extra: Handler) -> Handler:
    """What answers a path no route serves: one of the pools' ``extra_paths`` (``extra``,
    for a POST), else 404 ``not_found``, or 405 for a path served with other methods."""

    async def answer(request: web.Request) -> web.StreamResponse:
        path = request.path
        if any(p.extra_path(path) for p in request.app[PROXY].config.pools.values()):
            if request.method == "POST":
                return await extra(request)
            methods = {"POST"}
        else:
            methods = allowed.get(path) or _by_prefix(allowed, path)
        if not methods:
            return error_response(ApiError(404, f"No such endpoint: {cut(path)}", code="not_found"))
        message = f"{request.method} is not allowed here; use {', '.join(sorted(methods))}."
        response = error_response(ApiError(405, message))
        response.headers["Allow"] = ", ".join(sorted(methods))
        return response

    return answer


def _by_prefix(allowed: dict[str, set[str]], path: str) -> set[str]:
    """The methods of a route with a parameter whose prefix ``path`` has (``/v1/models/{``);
    a route without one (``/admin/``) is not a prefix of anything."""
    for prefix, methods in allowed.items():
        if prefix.endswith("/{") and path.startswith(prefix[:-1]) and len(path) >= len(prefix):
            return methods
    return set()


async def _models(request: web.Request) -> web.Response:
    """The models the caller's key may use (docs/access.md), not every model served."""
    proxy = request.app[PROXY]
    key = proxy.auth.identify(request.headers, proxy.wall())
    models = [
        _model_object(model, pool)
        for pool, spec in proxy.config.pools.items()
        for model in spec.models
        if may_use(key, model, pool)
    ]
    return web.json_response({"object": "list", "data": models})


async def _model(request: web.Request) -> web.Response:
    """One model of ``/v1/models``, or 404 ``model_not_found``. A model the key may not use
    gets the same 404 as one nobody serves: a tenant learns nothing of what others run
    (a request for it says 403, once the key has been shown to know its name)."""
    proxy = request.app[PROXY]
    key = proxy.auth.identify(request.headers, proxy.wall())
    model = request.match_info["model"]
    pool = proxy.config.pool_for_model(model)
    if pool is None or not may_use(key, model, pool):
        raise ApiError(404, f"The model '{cut(model)}' does not exist or is not served here.")
    return web.json_response(_model_object(model, pool))


def _model_object(model: str, pool: str) -> dict[str, object]:
    return {"id": model, "object": "model", "created": 0, "owned_by": pool}


async def _metrics(request: web.Request) -> web.Response:
    """The metrics; with ``metrics_key_env`` set, only to a request that shows its key."""
    proxy = request.app[PROXY]
    digest = proxy.config.metrics_digest()
    if digest is not None and not _shows(request, digest):
        message = "/metrics needs its key (metrics_key_env): send 'Authorization: Bearer <key>'."
        return error_response(ApiError(401, message))
    body = generate_latest(proxy.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    ready = any(p.ready() for p in request.app[PROXY].pools.values())
    return web.json_response({"ready": ready}, status=200 if ready else 503)


async def _admin_state(request: web.Request) -> web.Response:
    proxy = _admin(request)
    return web.json_response({"pools": proxy.state()})


async def _admin_history(request: web.Request) -> web.Response:
    """The admin page's charts: each pool's samples (``observability/history.py``), both
    series or the one ``?series=`` names (what the page shows: half the bytes)."""
    proxy = _admin(request)
    series = request.query.getall("series", list(SERIES))
    if not set(series) <= set(SERIES):
        raise ApiError(400, f"series must be one of: {', '.join(SERIES)}.")
    pools = {name: history.view(series) for name, history in proxy.history.items()}
    return web.json_response({"now": proxy.wall(), "pools": pools})


async def _admin_reload(request: web.Request) -> web.Response:
    proxy = _admin(request)
    try:
        warnings = proxy.reload_from_file()
    except ConfigError as err:
        log.warning("reload refused, nothing changed:\n%s", err)
        raise ApiError(400, f"Invalid configuration, nothing changed: {err}") from None
    return web.json_response({"reloaded": True, "warnings": warnings})


def _as_admin(serve: admin_keys.AdminHandler) -> Handler:
    """``serve``, called with the proxy once the request has shown the admin key."""

    async def answer(request: web.Request) -> web.StreamResponse:
        return await serve(_admin(request), request)

    return answer


def _admin(request: web.Request) -> Proxy:
    """The proxy, for a request that carries the admin key."""
    proxy = request.app[PROXY]
    digest = proxy.config.admin_digest()
    if digest is None:
        raise ApiError(403, "The admin API is off: set admin_key_env in the config.")
    if not _shows(request, digest):
        raise ApiError(401, "Incorrect admin key.")
    return proxy


def _shows(request: web.Request, digest: bytes) -> bool:
    """Whether the key ``request`` carries (as a client's is read: ``credential``) is the
    one whose SHA-256 is ``digest``; compared in constant time."""
    token = credential(request.headers) or ""
    return hmac.compare_digest(key_digest(token), digest)
