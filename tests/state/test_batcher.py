"""``state/redis_batcher.py``: calls made while one is on its way leave together, in order, and
whatever happens to one caller or one batch reaches exactly the calls it concerns."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sfq_proxy.state.redis_batcher import Batcher, Call


class Server:
    """A function that answers each call with its operation's name in capitals, after the
    test lets the batch through (``land``); it remembers every batch it was sent."""

    def __init__(self) -> None:
        self.batches: list[list[Call]] = []
        self.gates: list[asyncio.Future[None]] = []
        self.fail: BaseException | None = None

    async def send(self, calls: list[Call]) -> list[Any]:
        self.batches.append(list(calls))
        gate = asyncio.get_running_loop().create_future()
        self.gates.append(gate)
        await gate
        if self.fail is not None:
            raise self.fail
        return [str(call[0]).upper() for call in calls]

    async def land(self) -> None:
        """Let the oldest batch on its way through, and the loop run what follows it."""
        await turns()
        next(gate for gate in self.gates if not gate.done()).set_result(None)
        await turns()


async def turns() -> None:
    """A few turns of the loop: what was started runs up to its next wait."""
    for _ in range(5):
        await asyncio.sleep(0)


async def made(batcher: Batcher, *names: str) -> list[asyncio.Future[Any]]:
    """Calls named ``names``, made one after the other, each running up to its wait."""
    calls = []
    for name in names:
        calls.append(asyncio.ensure_future(batcher.call((name,))))
        await turns()
    return calls


async def test_calls_made_while_one_is_on_its_way_leave_together_in_order() -> None:
    server = Server()
    batcher = Batcher(server.send)
    first = asyncio.ensure_future(batcher.call(("a",)))
    await asyncio.sleep(0)
    rest = [asyncio.ensure_future(batcher.call((name, 1))) for name in "bcd"]
    await asyncio.sleep(0)
    assert server.batches == [[("a",)]]  # the others wait for it to land
    await server.land()
    assert server.batches == [[("a",)], [("b", 1), ("c", 1), ("d", 1)]]
    await server.land()
    assert [await f for f in (first, *rest)] == ["A", "B", "C", "D"]
    later = asyncio.ensure_future(batcher.call(("e",)))  # nothing on the way: leaves at once
    await server.land()
    assert await later == "E"
    assert server.batches[-1] == [("e",)]


@given(st.lists(st.integers(1, 6), min_size=1, max_size=8))
def test_every_caller_gets_its_own_reply_whatever_the_waves(waves: list[int]) -> None:
    async def main() -> None:
        server = Server()
        batcher = Batcher(server.send)
        calls: list[asyncio.Future[Any]] = []
        for wave in waves:  # each wave made while the previous batch is on its way
            calls += [
                asyncio.ensure_future(batcher.call((f"op{len(calls) + i}",))) for i in range(wave)
            ]
            await asyncio.sleep(0)
            await server.land()
        while not all(call.done() for call in calls):
            await server.land()
        assert [call.result() for call in calls] == [f"OP{i}" for i in range(len(calls))]
        sent = [call for batch in server.batches for call in batch]
        assert sent == [(f"op{i}",) for i in range(len(calls))]  # each once, in order

    asyncio.run(main())


async def test_a_failed_batch_fails_each_of_its_calls_and_the_next_ones_go_on() -> None:
    server = Server()
    batcher = Batcher(server.send)
    first, *batch = await made(batcher, "a", "b", "c")
    await server.land()
    assert await first == "A"
    server.fail = ConnectionError("lost")
    await server.land()
    for call in batch:
        with pytest.raises(ConnectionError, match="lost"):
            await call
    server.fail = None
    after = asyncio.ensure_future(batcher.call(("d",)))
    await server.land()
    assert await after == "D"


async def test_a_caller_that_leaves_has_its_call_sent_and_the_others_their_replies() -> None:
    server = Server()
    batcher = Batcher(server.send)
    leader, *waiting = await made(batcher, "a", "b", "c", "d")
    waiting[1].cancel()  # c's client left while its call waited
    leader.cancel()  # and a's while its own was on the way
    await turns()
    assert leader.cancelled()
    assert server.batches == [[("a",)], [("b",), ("c",), ("d",)]]  # c is sent all the same
    await server.land()
    assert await waiting[0] == "B"
    assert await waiting[2] == "D"
    assert waiting[1].cancelled()


async def test_a_call_carries_at_most_most_operations() -> None:
    """A burst larger than a call may carry leaves in several, in order."""
    server = Server()
    batcher = Batcher(server.send)
    calls = [asyncio.ensure_future(batcher.call((f"op{i}",))) for i in range(2 * Batcher.MOST + 3)]
    while not all(call.done() for call in calls):
        await server.land()
    assert [len(batch) for batch in server.batches] == [1, Batcher.MOST, Batcher.MOST, 2]
    assert [call.result() for call in calls] == [f"OP{i}" for i in range(len(calls))]
