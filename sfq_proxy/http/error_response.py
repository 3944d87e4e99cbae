"""An :class:`~sfq_proxy.core.errors.ApiError` as the HTTP response a client gets."""

from __future__ import annotations

from aiohttp import web

from ..core.errors import ApiError


def error_response(error: ApiError) -> web.Response:
    """The OpenAI-style JSON error, with its status and ``Retry-After`` where it has one."""
    return web.json_response(error.body(), status=error.status, headers=error.headers())
