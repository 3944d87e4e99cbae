"""The usage chunk the proxy asked for is dropped byte-exactly, however the stream is cut."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sfq_proxy.http.relay import Relayed, _UsageStripper, read_usage

TOKEN = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}'
FINISH = b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}'
FP = b'"system_fingerprint":"vllm-0.32.0-x"'
USAGE = (
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2},' + FP + b"}"
)
DONE = b"data: [DONE]"


def sse(*events: bytes) -> bytes:
    return b"".join(e + b"\n\n" for e in events)


# What vLLM sends with include_usage, and what it would have sent without it
ASKED = sse(TOKEN, TOKEN, FINISH, USAGE, DONE)
WANTED = sse(TOKEN, TOKEN, FINISH[:-1] + b"," + FP + b"}", DONE)


def strip(chunks: list[bytes]) -> bytes:
    stripper = _UsageStripper()
    return b"".join(stripper.feed(chunk) for chunk in chunks) + stripper.close()


def test_whole_stream_in_one_chunk() -> None:
    assert strip([ASKED]) == WANTED


@given(st.lists(st.integers(0, len(ASKED)), max_size=12))
def test_any_cut_of_the_stream_gives_the_same_bytes(cuts: list[int]) -> None:
    edges = [0, *sorted(cuts), len(ASKED)]
    assert strip([ASKED[a:b] for a, b in itertools.pairwise(edges)]) == WANTED


def test_token_events_are_not_held_back() -> None:
    stripper = _UsageStripper()
    assert stripper.feed(sse(TOKEN)) == sse(TOKEN)  # at once: time to first token intact
    assert stripper.feed(sse(FINISH)) == b""  # held until we know whether usage follows
    assert stripper.feed(sse(DONE)) == sse(FINISH, DONE)  # no usage chunk: unchanged


def usage_of(data: bytes) -> tuple[int | None, int | None]:
    relayed = Relayed(response=None, upstream_s=0.0, tail=data)  # type: ignore[arg-type]
    read_usage(relayed)
    return relayed.prompt_tokens, relayed.completion_tokens


def test_usage_is_read_from_the_streams_tail() -> None:
    assert usage_of(ASKED) == (3, 2)
    assert usage_of(sse(TOKEN, FINISH, DONE)) == (None, None)


def test_usage_is_the_last_usage_object_not_the_word_nor_a_null() -> None:
    word = b'data: {"choices":[{"delta":{"content":"usage"},"finish_reason":null}],"usage":null}'
    spaced = b'data: {"choices": [], "usage" : {"prompt_tokens": 7, "completion_tokens": 1}}'
    assert usage_of(sse(TOKEN, spaced, word, DONE)) == (7, 1)


def test_usage_of_a_json_answer() -> None:
    body = b'{"choices":[{"message":{"content":"\\"usage\\": {}"}}],"usage":{"prompt_tokens":5,'
    assert usage_of(body + b'"completion_tokens":9,"total_tokens":14}}') == (5, 9)
    assert usage_of(b'{"choices":[],"usage":{"prompt_tokens":') == (None, None)  # cut short


@pytest.mark.parametrize(
    "usage",
    [
        b'{"prompt_tokens": -3, "completion_tokens": 1e400}',
        b'{"prompt_tokens": true, "completion_tokens": "2"}',
        b'{"prompt_tokens": 10000000000000, "completion_tokens": 2.5}',
        b'{"prompt_tokens": null, "completion_tokens": [2]}',
        b"[" * 3000 + b"]" * 3000,  # nested past the decoder's recursion limit
    ],
)
def test_usage_that_is_not_token_counts_is_not_read(usage: bytes) -> None:
    """A backend that lies in its usage must not reach calibration or the token counters."""
    assert usage_of(b'{"choices": [], "usage": ' + usage + b"}") == (None, None)
