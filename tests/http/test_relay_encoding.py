"""The decoding of a compressed upstream body and its choice of headers to pass on
(docs/design.md §5, Relay); end to end in tests/http/test_relay_upstreams.py."""

from __future__ import annotations

import gzip
import zlib
from types import SimpleNamespace
from typing import Any

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from sfq_proxy.http.answer import (
    Inflater,
    UndecodableAnswer,
    UpstreamGarbled,
    inflater_for,
    response_headers,
)

BODY = b'data: {"choices":[]}\n\n' * 50


def upstream(*headers: tuple[str, str]) -> Any:
    return SimpleNamespace(headers=CIMultiDictProxy(CIMultiDict(headers)))


def pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def inflate(inflater: Inflater, chunks: list[bytes]) -> bytes:
    return b"".join(inflater.feed(c) for c in chunks) + inflater.close()


@pytest.mark.parametrize("size", [1, 7, 100_000])
@pytest.mark.parametrize(
    ("coding", "wbits"),
    [("gzip", 16 + zlib.MAX_WBITS), ("x-gzip", 16 + zlib.MAX_WBITS),
     ("deflate", zlib.MAX_WBITS), ("deflate", -zlib.MAX_WBITS)],
)  # fmt: skip
def test_gzip_and_both_deflates_decode_however_the_bytes_are_cut(
    coding: str, wbits: int, size: int
) -> None:
    compressor = zlib.compressobj(wbits=wbits)
    packed = compressor.compress(BODY) + compressor.flush()
    assert inflate(Inflater(coding), pieces(packed, size)) == BODY


def test_several_gzip_members_decode_in_turn() -> None:
    packed = gzip.compress(BODY) + gzip.compress(b"more")
    assert inflate(Inflater("gzip"), pieces(packed, 5)) == BODY + b"more"


def test_an_empty_body_is_no_error_but_a_cut_or_corrupt_one_is() -> None:
    assert inflate(Inflater("gzip"), [b""]) == b""
    with pytest.raises(UpstreamGarbled, match="breaks off"):
        inflate(Inflater("gzip"), [gzip.compress(BODY)[:-10]])
    with pytest.raises(UpstreamGarbled, match="bad gzip"):
        inflate(Inflater("gzip"), [b"\x1f\x8b\x08\x00 not gzip at all"])


@pytest.mark.parametrize("size", [1000, 100_000])
def test_a_body_that_inflates_beyond_the_limit_is_cut_there(size: int) -> None:
    packed = gzip.compress(b" " * 100_000)
    assert inflate(Inflater("gzip", limit=100_000), pieces(packed, size)) == b" " * 100_000
    inflater = Inflater("gzip", limit=99_999)
    with pytest.raises(UpstreamGarbled, match="beyond the limit"):
        inflate(inflater, pieces(packed, size))


def test_the_limit_holds_across_gzip_members() -> None:
    packed = gzip.compress(b"a" * 10) + gzip.compress(b"b" * 1000)
    with pytest.raises(UpstreamGarbled, match="beyond the limit"):
        Inflater("gzip", limit=9).feed(packed)
    with pytest.raises(UpstreamGarbled, match="beyond the limit"):
        Inflater("gzip", limit=10).feed(packed)


@pytest.mark.parametrize(
    ("value", "decoded"),
    [(None, None), ("identity", None), ("", None), ("GZIP", "gzip"), ("deflate", "deflate")],
)
def test_what_is_decoded(value: str | None, decoded: str | None) -> None:
    headers = () if value is None else (("Content-Encoding", value),)
    found = inflater_for(upstream(*headers))
    assert (found and found._coding) == decoded


@pytest.mark.parametrize("value", ["br", "zstd", "gzip, br", "gzip, gzip", "compress"])
def test_a_coding_the_proxy_cannot_read_fails_the_answer(value: str) -> None:
    with pytest.raises(UndecodableAnswer, match="cannot be decoded"):
        inflater_for(upstream(("Content-Encoding", value)))


def test_end_to_end_headers_pass_repeated_and_the_proxys_own_win() -> None:
    headers = response_headers(
        upstream(
            ("Content-Type", "application/json"),
            ("x-ratelimit-remaining-tokens", "1000"),
            ("Link", "<a>"),
            ("Link", "<b>"),
            ("X-Request-Id", "req_upstream"),
            ("x-queue-wait", "9"),
            ("Connection", "keep-alive, X-Private, x-other"),
            ("X-Private", "hop"),
            ("X-Other", "hop"),
            ("Keep-Alive", "timeout=5"),
            ("Transfer-Encoding", "chunked"),
            ("Content-Length", "12"),
            ("Content-Encoding", "gzip"),
            ("Date", "Tue, 01 Dec 2026 10:00:00 GMT"),
            ("Server", "upstream"),
            ("Set-Cookie", "a=1"),
            ("Set-Cookie", "b=2"),
            ("Alt-Svc", 'h3=":443"'),
            ("Strict-Transport-Security", "max-age=1"),
            ("TE", "trailers"),
            ("Trailer", "x"),
            ("Upgrade", "h2c"),
            ("Proxy-Authenticate", "Basic"),
        ),
        {"X-Request-Id": "mine", "X-Queue-Wait": "0.1"},
    )
    assert list(headers.items()) == [
        ("Content-Type", "application/json"),
        ("x-ratelimit-remaining-tokens", "1000"),
        ("Link", "<a>"),
        ("Link", "<b>"),
        ("X-Request-Id", "mine"),
        ("X-Queue-Wait", "0.1"),
    ]
