"""What of an upstream's answer reaches the client: its body decoded, its end-to-end headers.

The proxy asks upstream for ``identity`` (it reads usage from the bytes); an upstream that
compresses anyway with gzip or deflate is decoded as it arrives, so the client gets a body
it can read, and a body is never sent on with its encoding header dropped. Any other coding
is an answer the proxy cannot read (``UndecodableAnswer``).
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

ACCEPT_ENCODING = "identity"
# Upstream response headers not passed on (every other one is): hop-by-hop ones (RFC 9110
# §7.6.1, and any the upstream's Connection header names), what aiohttp sets for the body
# it sends (Content-Length; Content-Encoding, as the body is always sent decoded), the
# proxy's own Date and Server, and the provider origin's state and policy, which would
# land on the proxy's origin and so on every tenant (cookies, Alt-Svc, HSTS).
DROPPED_HEADERS = frozenset(
    (
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
        "proxy-connection", "te", "trailer", "trailers", "transfer-encoding", "upgrade",
        "content-length", "content-encoding", "date", "server",
        "set-cookie", "set-cookie2", "alt-svc", "strict-transport-security",
    )
)  # fmt: skip
# the proxy's own rate-limit headers, as core/limits.py names them (lowercase)
RATELIMIT_REQUESTS = "x-ratelimit-limit-requests"
RATELIMIT_TOKENS = "x-ratelimit-limit-tokens"
# one compressed answer decoded: far beyond any real answer (a 100k-token stream is ~20 MB)
MAX_INFLATED_BYTES = 256 * 1024 * 1024


class UndecodableAnswer(Exception):
    """The answer's Content-Encoding is not one the proxy can decode."""


class UpstreamGarbled(aiohttp.ClientPayloadError):
    """The backend's compressed body does not decompress, or breaks off mid-way."""


class Inflater:
    """Undoes a ``gzip`` or ``deflate`` Content-Encoding chunk by chunk.

    ``deflate`` is zlib data by the RFC and raw deflate from some servers; they are told
    apart by the first byte, as aiohttp does. Each gzip member is inflated in turn. An
    answer that inflates beyond ``limit`` bytes is a bomb, not an answer: it is cut there.
    """

    def __init__(self, coding: str, limit: int = MAX_INFLATED_BYTES) -> None:
        self._coding = coding
        self._left = limit
        self._wbits = 0  # chosen at the first byte; an empty body is then no error
        self._zlib: zlib._Decompress | None = None

    def feed(self, chunk: bytes) -> bytes:
        if not chunk:
            return b""
        if self._zlib is None:
            if self._coding != "deflate":
                self._wbits = 16 + zlib.MAX_WBITS
            elif chunk[0] & 0x0F == 8 and chunk[0] >> 4 <= 7:  # a zlib header
                self._wbits = zlib.MAX_WBITS
            else:
                self._wbits = -zlib.MAX_WBITS
            self._zlib = zlib.decompressobj(self._wbits)
        try:
            out = self._zlib.decompress(chunk, self._left + 1)  # all, unless over the limit
            self._left -= len(out)
            # the next gzip member (a limit of 0 would be none: stop once over it)
            while self._left >= 0 and self._zlib.eof and self._zlib.unused_data:
                rest = self._zlib.unused_data
                self._zlib = zlib.decompressobj(self._wbits)
                more = self._zlib.decompress(rest, self._left + 1)
                self._left -= len(more)
                out += more
        except zlib.error as exc:
            raise UpstreamGarbled(f"bad {self._coding} data: {exc}") from None
        if self._left < 0:
            raise UpstreamGarbled(f"the {self._coding} data inflates beyond the limit")
        return out

    def close(self) -> bytes:
        """What is left; raises if the compressed data ended before its end."""
        if self._zlib is None:
            return b""
        out = self._zlib.flush()
        if not self._zlib.eof:
            raise UpstreamGarbled(f"the {self._coding} data breaks off")
        return out


class Headed(Protocol):
    """An answer as far as its headers (``upstream.Answer``)."""

    @property
    def headers(self) -> CIMultiDictProxy[str]: ...


def inflater_for(upstream: Headed) -> Inflater | None:
    """How to decode the answer's body, or None when it is plain. The proxy asks for
    ``identity``; an upstream that compresses anyway with gzip or deflate is decoded, so
    the client gets a body it can read and the proxy its usage. Any other coding (br,
    zstd, several at once) is an answer the proxy cannot read: ``UndecodableAnswer``."""
    if "Content-Encoding" not in upstream.headers:
        return None
    codings = [
        coding
        for value in upstream.headers.getall("Content-Encoding")
        for part in value.split(",")
        if (coding := part.strip().lower()) and coding != "identity"
    ]
    if not codings:
        return None
    if len(codings) == 1 and codings[0] in ("gzip", "x-gzip", "deflate"):
        return Inflater(codings[0])
    raise UndecodableAnswer(f"Content-Encoding {', '.join(codings)} cannot be decoded")


def response_headers(upstream: Headed, own_headers: Mapping[str, str]) -> CIMultiDict[str]:
    """The upstream's end-to-end headers, repeated ones kept, then the proxy's own, which
    replace any of the same name. When the proxy's own say the org's rate limits
    (``x-ratelimit-*``), the upstream's of that family are all left out: they describe the
    provider's limits on the key every tenant shares, and two sources under one name would
    mislead (docs/design.md §6, Rate limits)."""
    named = {
        token.strip().lower()
        for value in upstream.headers.getall("Connection", ())
        for token in value.split(",")
    }
    own_limits = RATELIMIT_REQUESTS in own_headers or RATELIMIT_TOKENS in own_headers
    headers: CIMultiDict[str] = CIMultiDict()
    for name, value in upstream.headers.items():
        lower = name.lower()
        if lower not in DROPPED_HEADERS and lower not in named:
            if own_limits and lower.startswith("x-ratelimit-"):
                continue
            headers.add(name, value)
    headers.update(own_headers)
    return headers


async def decoded(chunks: AsyncIterator[bytes], inflater: Inflater) -> AsyncIterator[bytes]:
    """The stream's chunks as they come, decoded by ``inflater`` (none empty)."""
    async for chunk in chunks:
        if data := inflater.feed(chunk):
            yield data
    if data := inflater.close():
        yield data
