"""The usage chunk the proxy asked for is dropped byte-exactly, however the stream is cut
and whatever its line endings (server-sent events per the WHATWG rules)."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sfq_proxy.http.relay import Relayed, error_event, read_usage
from sfq_proxy.http.sse import _EVENT_END, _event_ends, ends_event
from sfq_proxy.http.sse import UsageStripper as _UsageStripper

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


def test_usage_of_the_responses_api_in_its_completed_event_or_body() -> None:
    """``input_tokens``/``output_tokens``, in ``response.usage``: the created event's null
    usage is no usage, the last event's is."""
    created = (
        b'event: response.created\ndata: {"response":{"usage":null},"type":"response.created"}'
    )
    completed = (
        b'event: response.completed\ndata: {"response":{"output":[],"usage":{"input_tokens":6,'
        b'"input_tokens_details":{"cached_tokens":0},"output_tokens":4,'
        b'"output_tokens_details":{"reasoning_tokens":0},"total_tokens":10},"user":null},'
        b'"sequence_number":9,"type":"response.completed"}'
    )
    assert usage_of(sse(created, completed)) == (6, 4)
    assert usage_of(b'{"object":"response","usage":{"input_tokens":3,"output_tokens":2}}') == (3, 2)


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


# -- any line endings, per https://html.spec.whatwg.org/multipage/server-sent-events.html ----

CRLF, LF, CR = b"\r\n", b"\n", b"\r"


def framed(*events: bytes, nl: bytes) -> bytes:
    return b"".join(e + nl + nl for e in events)


def parse(stream: bytes) -> list[tuple[bytes, bytes, bytes]]:
    """The events a client sees, as the spec's interpretation gives them: (type, data, id)."""
    events, data, kind, last_id = [], [], b"", b""
    for line in re.split(rb"\r\n|\r|\n", stream)[:-1]:  # an unended line is discarded
        if not line:
            if data:
                events.append((kind or b"message", b"\n".join(data), last_id))
            data, kind = [], b""
        elif not line.startswith(b":"):
            name, _, value = line.partition(b":")
            value = value.removeprefix(b" ")
            if name == b"data":
                data.append(value)
            elif name == b"event":
                kind = value
            elif name == b"id":
                last_id = value
    return events


@pytest.mark.parametrize("nl", [CRLF, CR, LF], ids=["crlf", "cr", "lf"])
def test_any_line_ending_strips_the_usage_event_and_keeps_the_bytes(nl: bytes) -> None:
    asked = framed(TOKEN, TOKEN, FINISH, USAGE, DONE, nl=nl)
    assert strip([asked]) == framed(TOKEN, TOKEN, FINISH[:-1] + b"," + FP + b"}", DONE, nl=nl)


@pytest.mark.parametrize("nl", [CRLF, CR, LF], ids=["crlf", "cr", "lf"])
def test_events_are_relayed_as_they_arrive_whatever_the_line_endings(nl: bytes) -> None:
    """sse-starlette ends events with CRLF CRLF: they used to be held to the stream's end."""
    stripper = _UsageStripper()
    assert stripper.feed(TOKEN + nl + nl) == TOKEN + nl + nl
    assert stripper.feed(TOKEN + nl) == b""  # not ended yet
    assert stripper.feed(nl) == TOKEN + nl + nl
    assert stripper.feed(FINISH + nl + nl) == b""  # held until we know whether usage follows
    assert stripper.feed(USAGE + nl + nl) == b""
    assert stripper.feed(DONE + nl + nl) == framed(FINISH[:-1] + b"," + FP + b"}", DONE, nl=nl)
    assert stripper.close() == b""


def test_a_crlf_cut_between_chunks_is_one_line_ending_not_two() -> None:
    # CR at the end of one chunk, LF at the start of the next: not an empty line
    assert (
        strip([TOKEN + b"\r", b"\n" + TOKEN + b"\r\n\r\n"]) == TOKEN + b"\r\n" + TOKEN + b"\r\n\r\n"
    )
    stripper = _UsageStripper()
    assert stripper.feed(TOKEN + b"\r") == b""
    assert stripper.feed(b"\n") == b""  # one line ended, the event has not
    assert stripper.feed(b"\r") == TOKEN + b"\r\n\r"  # CR: an empty line, the event is out
    assert stripper.feed(b"\n") == b"\n"  # the rest of that CRLF, as it came
    # the LF that ends a dropped event goes with it, whichever chunk it comes in
    asked = framed(TOKEN, FINISH, USAGE, DONE, nl=CRLF)
    at = asked.index(USAGE) + len(USAGE) + 3  # just after USAGE's CR LF CR
    assert (
        strip([asked[:at], asked[at:]])
        == strip([asked])
        == framed(TOKEN, FINISH[:-1] + b"," + FP + b"}", DONE, nl=CRLF)
    )


def test_comments_fields_and_data_without_a_space_pass_untouched() -> None:
    stream = (
        b": ping\r\n\r\n"
        + b"event: message\r\nid: 7\r\n"
        + TOKEN
        + b"\r\n\r\n: keep-alive\n\n"
        + b"id: 8\r\n"
        + FINISH.replace(b"data: ", b"data:")
        + b"\r\nretry: 100\r\n\r\n"
        + b"data:[DONE]\r\n\r\n"
    )
    assert strip([stream]) == stream
    assert strip([stream[i : i + 1] for i in range(len(stream))]) == stream


def test_a_usage_event_on_many_data_lines_with_fields_is_dropped() -> None:
    usage = (
        b'data:{"id":"c","choices":\r\ndata: [],\r\n: a comment in the middle\r\nid: 9\r\n'
        b'data: "usage":{"prompt_tokens":3,"completion_tokens":2},"system_fingerprint":\r\n'
        b'data: "vllm-0.32.0-x"}'
    )
    finish = FINISH[:-3] + b"\r\ndata: }]}\r\nid: 8"  # its data on two lines, then a field
    asked = framed(TOKEN, finish, usage, b"data:[DONE]", nl=CRLF)
    got = strip([asked])
    assert got == framed(TOKEN, finish.replace(b"}]}", b"}]," + FP + b"}"), b"data:[DONE]", nl=CRLF)
    finishing = json.loads(parse(got)[1][1])
    assert finishing["system_fingerprint"] == "vllm-0.32.0-x"
    assert usage_of(asked) == (3, 2)


def test_a_usage_event_that_is_not_json_is_not_dropped() -> None:
    fake = b'data: {"choices": [], "usage": {"prompt_tokens": 3}'  # cut short: not the usage
    asked = sse(TOKEN, FINISH, fake, DONE)
    assert strip([asked]) == asked


def test_a_stream_that_ends_without_an_empty_line() -> None:
    assert (
        strip([sse(TOKEN, FINISH, USAGE) + DONE])
        == sse(TOKEN, FINISH[:-1] + b"," + FP + b"}") + DONE
    )
    assert strip([sse(TOKEN, FINISH) + USAGE + b"\r\n"]) == sse(
        TOKEN, FINISH[:-1] + b"," + FP + b"}"
    )
    assert strip([sse(TOKEN) + b"data: {"]) == sse(TOKEN) + b"data: {"  # the upstream's to send


def test_a_huge_event_is_relayed_whole_once_it_ends() -> None:
    huge = b'data: {"choices":[{"delta":{"content":"' + b"x" * 4_000_000 + b'"}}]}'
    stripper = _UsageStripper()
    pieces = [huge[i : i + 65536] for i in range(0, len(huge), 65536)]
    assert all(stripper.feed(piece) == b"" for piece in pieces)
    assert (
        stripper.feed(b"\r\n\r\n" + TOKEN + b"\r\n\r\n") == huge + b"\r\n\r\n" + TOKEN + b"\r\n\r\n"
    )
    assert stripper.close() == b""


# Streams as vLLM would send them with include_usage, in any framing a server may choose
_SPLIT_AFTER = re.compile(rb"[,:](?=[^\n]*$)")


@st.composite
def framings(draw: st.DrawFn) -> tuple[bytes, list[object]]:
    """A stream with the usage event asked for, in a random framing (line endings, data on
    several lines, comments, ids, data with or without a space), and the events a client
    must get from it once the usage event is dropped."""
    tokens = draw(st.integers(0, 3))
    datas = [TOKEN] * tokens + [FINISH, USAGE, DONE]
    stream: list[bytes] = []  # its lines, b"" for an empty one
    expected = []
    for n, data in enumerate(datas):
        value = data.removeprefix(b"data: ")
        cuts = sorted(
            draw(st.sets(st.sampled_from([m.end() for m in re.finditer(rb"[,:]", value)] or [0]),
                         max_size=3))
        ) if value.startswith(b"{") else []  # fmt: skip
        parts = [value[a:b] for a, b in itertools.pairwise([0, *cuts, len(value)])]
        lines = [draw(st.sampled_from([b"data:", b"data: "])) + part for part in parts]
        if draw(st.booleans()):
            lines.insert(draw(st.integers(0, len(lines))), b"id: %d" % n)
        if draw(st.booleans()):
            lines.insert(draw(st.integers(1, len(lines))), b": ping")
        if draw(st.booleans()):
            stream += [b": keep-alive", b""]
        stream += [*lines, b""]
        if data is not USAGE:
            expected.append(json.loads(value) if value.startswith(b"{") else value.decode())
    expected[-2]["system_fingerprint"] = "vllm-0.32.0-x"  # moved back onto FINISH
    out, ending = [], LF
    for line in stream:  # after a CR, an empty line's LF would make it one CRLF
        ending = draw(st.sampled_from([CR, CRLF] if ending == CR and not line else [LF, CR, CRLF]))
        out.append(line + ending)
    return b"".join(out), expected


@given(framings(), st.lists(st.integers(0, 10_000), max_size=10))
def test_any_framing_and_any_cut_give_the_events_asked_for(
    framing: tuple[bytes, list[object]], cuts: list[int]
) -> None:
    stream, expected = framing
    whole = strip([stream])
    edges = [0, *sorted(c % (len(stream) + 1) for c in cuts), len(stream)]
    assert strip([stream[a:b] for a, b in itertools.pairwise(edges)]) == whole
    got = [json.loads(data) if data.startswith(b"{") else data.decode()
           for _, data, _ in parse(whole)]  # fmt: skip
    assert got == expected
    assert usage_of(stream) == (3, 2)


def test_usage_is_read_from_a_crlf_streams_tail() -> None:
    assert usage_of(framed(TOKEN, FINISH, USAGE, DONE, nl=CRLF)) == (3, 2)
    assert usage_of(framed(TOKEN, FINISH, USAGE, DONE, nl=CR)) == (3, 2)
    split = (
        b'data: {"choices":[],"usage":\r\ndata: {"prompt_tokens":4,\r\n: x\r\n'
        b'data:"completion_tokens":1}}'
    )
    assert usage_of(framed(TOKEN, split, DONE, nl=CRLF)) == (4, 1)


@pytest.mark.parametrize(
    ("sent", "ended"),
    [
        (b"", True),
        (TOKEN + b"\n\n", True),
        (TOKEN + b"\r\n\r\n", True),
        (TOKEN + b"\r\r", True),
        (TOKEN + b"\n\r", True),
        (TOKEN + b"\r\n", False),  # one line ending: the event goes on
        (TOKEN + b"\r", False),
        (TOKEN, False),
    ],
)
def test_where_a_broken_off_stream_needs_an_empty_line_before_its_error_event(
    sent: bytes, ended: bool
) -> None:
    assert ends_event(sent) is ended


@pytest.mark.parametrize(
    ("tail", "expected"),
    [
        (b'data: {"error":{"message":"bad","http_status_code":422}}\n\ndata: [DONE]\n\n', True),
        (b'data:{ "error" : {"message": "x"}}\r\n\r\n', True),
        (b'data: {"choices":[{"delta":{"content":"\\"error\\": no"}}]}\n\n', False),
        (b'data: {"id":"x","error":null}\n\n', False),  # not the event's first member
        (b'{"error": {"message": "a JSON body"}}', False),  # not an event
        # the Responses API's: an error event, or the response failed
        (b'event: error\ndata: {"code":"x","message":"m","type":"error"}\n\n', True),
        (b'x\r\nevent: response.failed\r\ndata: {"response":{}}\r\n\r\n', True),
        (b'event: response.completed\ndata: {"type":"response.completed"}\n\n', False),
        (b'data: {"delta":"\\nevent: error\\n"}\n\n', False),  # an answer's text
    ],
)
def test_an_error_event_is_told_from_a_completion(tail: bytes, expected: bool) -> None:
    relayed = Relayed(response=None, upstream_s=0.0, tail=tail)  # type: ignore[arg-type]
    assert error_event(relayed) is expected


# What the proxy looked for until it leapt between literals: one pattern tried at every byte
_EVERY_BYTE = re.compile(
    rb'(?:^|[\r\n])(?:data: ?\{\s*"error"\s*:|event: ?(?:error|response\.failed)[ \t]*[\r\n])'
)
_PIECES = [b"data:", b"data: ", b"{", b" ", b"\t", b'"error"', b":", b"\n", b"\r", b"event:",
           b"event: ", b"error", b"response.failed", b"response.", b"failed", b"x",
           b"}"]  # fmt: skip


@given(st.lists(st.sampled_from(_PIECES), max_size=30))
def test_an_error_event_is_found_where_the_single_pattern_found_it(pieces: list[bytes]) -> None:
    tail = b"".join(pieces)
    relayed = Relayed(response=None, upstream_s=0.0, tail=tail)  # type: ignore[arg-type]
    assert error_event(relayed) is (_EVERY_BYTE.search(tail) is not None)


@given(st.lists(st.sampled_from([b"\n", b"x", b"data: {}"]), max_size=40), st.data())
def test_events_of_lf_streams_end_where_the_pattern_ends_them(
    pieces: list[bytes], data: st.DataObject
) -> None:
    """An LF-only stream's event ends are found by a plain search (the pattern is tried at
    every byte): at the same places, a run of empty lines going with the event before."""
    text = b"".join(pieces)
    pos = data.draw(st.integers(0, len(text)))
    endpos = data.draw(st.integers(pos, len(text)))
    by_pattern = [found.end() for found in _EVENT_END.finditer(text, pos, endpos)]
    assert _event_ends(text, pos, endpos) == by_pattern
