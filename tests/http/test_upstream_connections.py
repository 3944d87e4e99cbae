"""The relay's connections to the backends (``http/upstream.py``), on real sockets: one
kept alive and reused, and one never reused when its answer says or shows it cannot serve
another (``Connection: close``, HTTP/1.0, a body not read to its end, bytes beyond the
answer, idle past the keep-alive); a header value cannot write headers of its own."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from sfq_proxy.http.upstream import Upstreams

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

Answerer = Callable[[int, bytes], bytes]  # (connection number, request head) → what is sent


class Backend:
    """A raw HTTP/1.1 server: each request read to its body's end is answered with
    ``answer(connection number, request head)``; after an answer that says
    ``Connection: close`` or is HTTP/1.0, the connection is closed."""

    def __init__(self, answer: Answerer) -> None:
        self.answer = answer
        self.connections = 0
        self.heads: list[bytes] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                self.heads.append(head)
                answer = self.answer(number, head)
                writer.write(answer)
                await writer.drain()
                if b"Connection: close" in answer or answer.startswith(b"HTTP/1.0"):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@asynccontextmanager
async def backend(answer: Answerer = lambda n, head: OK) -> AsyncIterator[tuple[Backend, str]]:
    double = Backend(answer)
    server = await asyncio.start_server(double.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield double, f"http://127.0.0.1:{port}"
    finally:
        server.close()


async def post(upstreams: Upstreams, url: str, headers: dict[str, str] | None = None) -> bytes:
    answer = await upstreams.post(url + "/v1/chat/completions", b"{}", headers or {}, 1.0)
    try:
        return await answer.read()
    finally:
        answer.release()


async def test_one_connection_serves_request_after_request() -> None:
    upstreams = Upstreams()
    async with backend() as (double, url):
        for _ in range(5):
            assert await post(upstreams, url) == b"{}"
    upstreams.close()
    assert double.connections == 1
    assert double.heads[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:")


async def test_an_answer_that_says_close_is_not_reused() -> None:
    closing = OK.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
    upstreams = Upstreams()
    async with backend(lambda n, head: closing) as (double, url):
        for _ in range(3):
            assert await post(upstreams, url) == b"{}"
    assert double.connections == 3


async def test_a_body_left_unread_closes_its_connection() -> None:
    big = b"HTTP/1.1 200 OK\r\nContent-Length: 200000\r\n\r\n" + b"x" * 200000
    upstreams = Upstreams()
    async with backend(lambda n, head: big) as (double, url):
        answer = await upstreams.post(url + "/v1/x", b"{}", {}, 1.0)
        assert answer.status == 200
        answer.release()  # without reading: its bytes are still coming
        assert len(await post(upstreams, url)) == 200000
    assert double.connections == 2


@pytest.mark.parametrize(
    ("extra", "first"),
    [
        (OK, b'{"n":1}'),
        (b"HTTP/1.1 200 OK\r\nContent-Le", b'{"n":1}'),
        (b"garbage\r\n\r\n", None),  # in the answer's own bytes: that answer is lost too
    ],
    ids=["a whole answer", "half an answer", "garbage"],
)
async def test_bytes_beyond_an_answer_never_reach_the_next_request(
    extra: bytes, first: bytes | None
) -> None:
    """A backend that sends more than its answer (a second answer, part of one, or
    garbage): the next request on that backend gets its own answer, never those bytes."""
    upstreams = Upstreams()

    def answer(number: int, head: bytes) -> bytes:
        body = b'{"n":%d}' % len(double.heads)
        after = extra if len(double.heads) == 1 else b""  # the first answer's only
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body) + after

    async with backend(answer) as (double, url):
        if first is None:
            with pytest.raises(aiohttp.ClientError):
                await post(upstreams, url)
        else:
            assert await post(upstreams, url) == first
        await asyncio.sleep(0.05)  # the extra bytes are in
        assert await post(upstreams, url) == b'{"n":2}'


async def test_an_http_1_0_answer_is_read_to_its_close_and_not_reused() -> None:
    old = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{}"  # no length
    upstreams = Upstreams()
    async with backend(lambda n, head: old) as (double, url):
        assert await post(upstreams, url) == b"{}"
        assert await post(upstreams, url) == b"{}"
    assert double.connections == 2


async def test_an_informational_answer_is_skipped() -> None:
    early = b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n" + OK
    upstreams = Upstreams()
    async with backend(lambda n, head: early) as (_double, url):
        answer = await upstreams.post(url + "/v1/x", b"{}", {}, 1.0)
        assert answer.status == 200
        assert await answer.read() == b"{}"
        answer.release()


async def test_a_connection_idle_past_the_keepalive_is_not_reused() -> None:
    upstreams = Upstreams(keepalive_s=0.05)
    async with backend() as (double, url):
        await post(upstreams, url)
        await asyncio.sleep(0.1)
        await post(upstreams, url)
    assert double.connections == 2


async def test_a_connection_the_backend_closed_while_idle_is_not_reused() -> None:
    upstreams = Upstreams()
    async with backend() as (double, url):
        await post(upstreams, url)
        double.answer = lambda n, head: OK.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
        await post(upstreams, url)  # answered, then closed by the backend
        await asyncio.sleep(0.05)
        double.answer = lambda n, head: OK
        assert await post(upstreams, url) == b"{}"
    assert double.connections == 2


async def test_a_line_break_in_a_header_value_sends_nothing() -> None:
    upstreams = Upstreams()
    async with backend() as (double, url):
        with pytest.raises(ValueError, match="framing"):
            await post(upstreams, url, {"X-Request-Id": "a\r\nAuthorization: Bearer stolen"})
        assert await post(upstreams, url) == b"{}"
    assert len(double.heads) == 1
    assert b"stolen" not in double.heads[0]


async def test_a_refused_connection_is_a_client_error() -> None:
    async with backend() as (_, url):
        pass  # closed: nothing listens there any more
    with pytest.raises(aiohttp.ClientConnectionError, match="Cannot connect"):
        await post(Upstreams(), url)


async def test_an_answer_that_is_not_http_is_a_client_error() -> None:
    async with backend(lambda n, head: b"SSH-2.0-OpenSSH_9.2\r\n\r\n") as (_, url):
        with pytest.raises(aiohttp.ClientError):
            await post(Upstreams(), url)


@pytest.fixture
def certificate(tmp_path: Path) -> Path:
    """A self-signed certificate for 127.0.0.1 (its key beside it), made by openssl."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert


async def test_an_https_backend_is_verified_against_the_trusted_certificates(
    certificate: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A provider's https: its certificate is checked (a backend that cannot show one the
    host trusts is not sent the request, nor the upstream key)."""
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(certificate, certificate.with_name("key.pem"))
    double = Backend(lambda n, head: OK)
    server = await asyncio.start_server(double.serve, "127.0.0.1", 0, ssl=tls)
    url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        with pytest.raises(aiohttp.ClientConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            await post(Upstreams(), url)  # signed by nobody the host trusts
        assert double.heads == []
        monkeypatch.setenv("SSL_CERT_FILE", str(certificate))  # now the host trusts it
        upstreams = Upstreams()
        assert await post(upstreams, url) == b"{}"
        assert await post(upstreams, url) == b"{}"
        upstreams.close()
    finally:
        server.close()
    assert len(double.heads) == 2
    assert double.connections == 1  # the refused handshake never got to HTTP
