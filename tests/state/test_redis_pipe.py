"""The pipelined connection of the hot path (``sfq_proxy/state/redis_resp.py``) against a real
redis-server, and against servers that stall or speak garbage.

Every reply must reach its own caller, whatever the concurrency, cancellations and replies
split across reads; a lost, stalled or lying server fails the calls in flight with redis-py's
exceptions (which the proxy already handles) and the next call connects again."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis
from redis.exceptions import ConnectionError, RedisError, ResponseError, TimeoutError
from redis_server import running_redis

from sfq_proxy.state.redis_functions import DISPATCH
from sfq_proxy.state.redis_resp import Pipe

pytestmark = pytest.mark.redis


async def test_many_concurrent_calls_each_get_their_own_reply(redis_url: str) -> None:
    pipe = Pipe.from_url(redis_url)
    assert pipe is not None
    replies = await asyncio.gather(*(pipe.execute("ECHO", f"call {i}") for i in range(2000)))
    assert replies == [f"call {i}".encode() for i in range(2000)]
    await pipe.aclose()


async def test_a_caller_that_leaves_does_not_shift_the_replies(redis_url: str) -> None:
    """A cancelled call's reply still arrives in its turn and is dropped; the calls after
    it get theirs."""
    pipe = Pipe.from_url(redis_url)
    assert pipe is not None
    await pipe.execute("PING")
    slow = asyncio.ensure_future(pipe.execute("BLPOP", "nothing-here", "0.2"))
    after = asyncio.ensure_future(pipe.execute("ECHO", "after"))
    await asyncio.sleep(0.05)
    slow.cancel()
    assert await after == b"after"  # pipelined: answered once BLPOP timed out
    assert await pipe.execute("ECHO", "next") == b"next"
    await pipe.aclose()


async def test_big_replies_split_across_reads_and_nested_arrays(redis_url: str) -> None:
    pipe = Pipe.from_url(redis_url)
    assert pipe is not None
    big = "x" * 3_000_000  # many reads of the socket
    assert await pipe.execute("SET", "big", big) == b"OK"
    got, missing, numbers = await asyncio.gather(
        pipe.execute("GET", "big"), pipe.execute("GET", "none"), pipe.execute("RPUSH", "l", 1, 2.5)
    )
    assert got == big.encode()
    assert missing is None
    assert numbers == 2
    assert await pipe.execute("LRANGE", "l", 0, -1) == [b"1", b"2.5"]
    await pipe.aclose()


async def test_an_error_reply_raises_and_the_pipe_goes_on(redis_url: str) -> None:
    pipe = Pipe.from_url(redis_url)
    assert pipe is not None
    with pytest.raises(ResponseError, match="unknown command"):
        await pipe.execute("NO-SUCH-COMMAND")
    assert await pipe.execute("ECHO", "still here") == b"still here"
    await pipe.aclose()


async def test_the_function_library_loads_through_the_pipe(redis_url: str) -> None:
    """A Redis without the library: the first call loads it, as through redis-py."""
    pipe = Pipe.from_url(redis_url)
    assert pipe is not None
    reply = await DISPATCH.call(pipe, "sfq:{p}:", "pump", "nobody", "[]")
    assert reply == [-1]  # a holder Redis does not know
    await pipe.aclose()


async def test_credentials_and_database_from_the_url() -> None:
    with running_redis() as server:
        with redis.Redis.from_url(server.url) as admin:
            admin.config_set("requirepass", "s3cret")
        pipe = Pipe.from_url(f"redis://:s3cret@127.0.0.1:{server.port}/3")
        assert pipe is not None
        await pipe.execute("SET", "k", "in three")
        with redis.Redis(port=server.port, password="s3cret", db=3) as check:
            assert check.get("k") == b"in three"
        wrong = Pipe.from_url(f"redis://:wrong@127.0.0.1:{server.port}/0")
        assert wrong is not None
        with pytest.raises(RedisError, match=r"WRONGPASS|invalid"):
            await wrong.execute("PING")
        await pipe.aclose()
        await wrong.aclose()


async def test_a_restarted_redis_fails_the_calls_in_flight_then_serves_again() -> None:
    with running_redis() as server:
        pipe = Pipe.from_url(server.url)
        assert pipe is not None
        in_flight = asyncio.ensure_future(pipe.execute("BLPOP", "nothing-here", "5"))
        await asyncio.sleep(0.1)
        await asyncio.to_thread(server.restart)
        with pytest.raises(ConnectionError):
            await in_flight
        assert await pipe.execute("ECHO", "back") == b"back"
        await pipe.aclose()


async def test_a_stalled_redis_times_out_then_the_pipe_reconnects() -> None:
    with running_redis() as server:
        pipe = Pipe.from_url(server.url, timeout_s=0.3)
        assert pipe is not None
        await pipe.execute("PING")
        server.pause()
        try:
            started = asyncio.get_running_loop().time()
            with pytest.raises(TimeoutError):
                await pipe.execute("PING")
            assert asyncio.get_running_loop().time() - started < 2
        finally:
            server.resume()
        assert await pipe.execute("ECHO", "thawed") == b"thawed"
        await pipe.aclose()


async def test_nothing_listening_is_a_connection_error() -> None:
    async with _server(lambda r, w: _never(w)) as port:
        pass  # closed: the port is free again
    pipe = Pipe("127.0.0.1", port, connect_timeout_s=0.5)
    with pytest.raises(ConnectionError, match="Error connecting"):
        await pipe.execute("PING")


async def test_a_server_speaking_garbage_fails_the_call_not_the_next_connection() -> None:
    replies = iter([b"hello there\r\n", b"+PONG\r\n"])

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reply = next(replies)
        while await reader.read(1024):
            writer.write(reply)

    async with _server(answer) as port:
        pipe = Pipe("127.0.0.1", port)
        with pytest.raises(ConnectionError, match="no RESP reply"):
            await pipe.execute("PING")
        assert await pipe.execute("PING") == b"PONG"  # a new connection, a sane server
        await pipe.aclose()


def test_only_plain_urls_take_the_pipe() -> None:
    assert Pipe.from_url("redis://h:1/2") is not None
    assert Pipe.from_url("rediss://u:p@h/0") is not None
    assert Pipe.from_url("unix:///run/redis.sock") is None
    assert Pipe.from_url("redis://h:1/0?ssl_cert_reqs=none") is None


async def _never(writer: asyncio.StreamWriter) -> None:
    writer.close()


@contextlib.asynccontextmanager
async def _server(
    handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[int]:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield port
    finally:
        server.close()
