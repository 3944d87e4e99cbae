"""A stream whose server reports no usage (llama-cpp-python) has its output tokens counted
from its events, the same however the bytes are cut into chunks and however many of the
last ones are kept uncounted as the stream's tail."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from sfq_proxy.http.sse import TokenEvents


def _event(delta: bytes, finish: bytes = b"null") -> bytes:
    """An event as llama-cpp-python 0.3.36 writes it (Python's json.dumps, spaces in)."""
    return (
        b'data: {"id": "chatcmpl-1", "model": "tiny", "object": "chat.completion.chunk", '
        b'"choices": [{"index": 0, "delta": ' + delta + b', "logprobs": null, '
        b'"finish_reason": ' + finish + b"}]}\r\n\r\n"
    )


# a chat stream of 5 tokens: the role alone, five token events (one of them decodes to
# nothing), the finishing event, [DONE]; a token's text may hold the marks escaped
CHAT = b"".join(
    [
        _event(b'{"role": "assistant"}'),
        *(_event(b'{"content": "%s"}' % text) for text in [b"a", b"", b' \\"role\\"', b"b", b"c"]),
        _event(b"{}", b'"length"'),
        b"data: [DONE]\r\n\r\n",
    ]
)
COMPLETION = b"".join(
    [
        *(
            b'data: {"id": "cmpl-1", "choices": [{"text": "%s", "index": 0, "logprobs": null, '
            b'"finish_reason": null}]}\n\n' % text
            for text in [b"", b" class", b"invalid"]
        ),
        b'data: {"id": "cmpl-1", "choices": [{"text": "", "finish_reason": "length"}]}\n\n',
        b"data: [DONE]\n\n",
    ]
)


def _fed(data: bytes, cuts: list[int], tail_bytes: int = 16384) -> TokenEvents:
    counter = TokenEvents(tail_bytes)
    bounds = [0, *sorted(set(cuts)), len(data)]
    for start, end in itertools.pairwise(bounds):
        counter.feed(data[start:end])
    return counter


def _count(data: bytes, cuts: list[int]) -> int:
    return _fed(data, cuts).tokens


def test_a_chat_stream_counts_its_token_events_not_its_role_or_finishing_event() -> None:
    assert _count(CHAT, []) == 5


def test_a_completion_stream_counts_each_token_event() -> None:
    assert _count(COMPLETION, []) == 3


@given(st.lists(st.integers(0, len(CHAT)), max_size=40))
def test_the_count_does_not_depend_on_where_chunks_are_cut(cuts: list[int]) -> None:
    assert _count(CHAT, cuts) == 5


def test_a_byte_at_a_time_counts_the_same() -> None:
    assert _count(COMPLETION, list(range(len(COMPLETION)))) == 3


@given(st.lists(st.integers(0, len(CHAT)), max_size=40), st.integers(1, len(CHAT) + 1))
def test_chunks_that_left_the_tail_and_those_still_in_it_count_alike(
    cuts: list[int], tail_bytes: int
) -> None:
    counter = _fed(CHAT, cuts, tail_bytes)
    assert counter.tail() == CHAT[-tail_bytes:]
    assert counter.tokens == 5
    assert counter.tokens == 5  # read twice: nothing counted twice


def test_tokens_read_mid_stream_then_more_chunks_count_once() -> None:
    counter = TokenEvents(64)
    half = len(CHAT) // 2
    counter.feed(CHAT[:half])
    early = counter.tokens  # a client that hangs up is billed this much
    counter.feed(CHAT[half:])
    assert 0 < early < 5
    assert counter.tokens == 5
