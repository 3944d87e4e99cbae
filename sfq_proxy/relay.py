"""Forward one dispatched request to its backend and relay the answer as it arrives."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from .errors import ApiError
from .placement import Backend
from .pool import Pool
from .request import InferenceRequest

# Upstream response headers worth passing on; hop-by-hop and length headers are not.
_PASS_HEADERS = ("Content-Type", "X-Request-Id", "Retry-After")


class UpstreamUnreachable(Exception):
    """The backend failed before the client was sent anything: retrying elsewhere is safe."""


async def forward(
    session: aiohttp.ClientSession,
    pool: Pool,
    backend: Backend,
    client: web.Request,
    inference: InferenceRequest,
) -> web.StreamResponse:
    """Send ``inference`` to ``backend`` and relay its answer to ``client``.

    Streams are relayed chunk by chunk; anything else is passed through unchanged with
    its status. The upstream connection is closed at once when the client goes away
    (the handler is cancelled), which makes vLLM abort the generation.
    """
    upstream = await _open(session, pool, backend, inference)
    try:
        if upstream.status >= 500:
            pool.report_failure(backend)
        headers = {h: upstream.headers[h] for h in _PASS_HEADERS if h in upstream.headers}
        if not (inference.stream and upstream.status == 200):
            try:
                body = await upstream.read()
            except aiohttp.ClientError as exc:  # died before answering: the client saw nothing
                pool.report_failure(backend)
                raise UpstreamUnreachable(str(exc)) from exc
            return web.Response(status=upstream.status, body=body, headers=headers)
        response = web.StreamResponse(status=200, headers=headers)
        response.headers["Cache-Control"] = "no-cache"
        await response.prepare(client)
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except aiohttp.ClientPayloadError:  # the backend died mid-stream
            pool.report_failure(backend)
            raise
        await response.write_eof()
        return response
    except BaseException:
        upstream.close()
        raise
    finally:
        upstream.release()


async def _open(
    session: aiohttp.ClientSession, pool: Pool, backend: Backend, inference: InferenceRequest
) -> aiohttp.ClientResponse:
    """POST the client's bytes; return once the response headers are in."""
    headers = {"Content-Type": "application/json"}
    if pool.upstream_key:
        headers["Authorization"] = f"Bearer {pool.upstream_key}"
    timeouts = pool.spec.timeouts
    try:
        async with asyncio.timeout(timeouts.first_byte_s):
            return await session.post(
                backend.url + inference.kind.value,
                data=inference.raw,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_s),
            )
    except aiohttp.ClientConnectionError as exc:  # refused, reset, connect timeout, ...
        pool.report_failure(backend)
        raise UpstreamUnreachable(str(exc)) from exc
    except TimeoutError:
        raise ApiError(
            504,
            f"The backend sent nothing within {timeouts.first_byte_s:g} s.",
            code="upstream_timeout",
        ) from None
