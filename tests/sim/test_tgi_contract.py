"""Hugging Face TGI behind the real proxy, through the official openai SDK: its Messages API
as its documents and router code describe it (the double, tests/support/tgi_double.py, cites them).

What passes as it is: answers, streams with their finishing event, usage (asked for by the
proxy when the client did not), the ``/health`` probe, TGI's 422s. What differs from vLLM:
a streamed request that fails TGI's validation is a 200 with the error inside the stream;
``n`` is ignored; the ``max_tokens`` the proxy writes into a body can be refused where the
body as sent would not be (see the last tests).
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from proxy_lab import KEYS, MODEL, AccessLines, Lab, Served, eventually, proxy_config
from tgi_double import CHAT_PATH, FINGERPRINT, WORDS, TgiDouble

CHAT = [{"role": "user", "content": "Say something fair."}]
PROMPT_TOKENS = 3 + 3 + 1  # the double's template: 3 per message, 1 per word, 1 to answer
GENERATED = len(WORDS) + 1  # the words, then the EOS token (generated, so counted)
LABELS = {"org": "A", "class": "batch", "pool": "sim"}


async def tgi_proxy(
    lab: Lab, tgi: TgiDouble | None = None, pool: dict[str, Any] | None = None
) -> tuple[TgiDouble, Served]:
    tgi = tgi or TgiDouble()
    port = await lab.serve(tgi.app())
    pool = {"family": "tgi", **(pool or {})}
    return tgi, await lab.proxy(proxy_config([f"http://127.0.0.1:{port}"], pool=pool))


def tokens(served: Served, name: str) -> float | None:
    return served.state.metrics.registry.get_sample_value(f"sfq_{name}_tokens_total", LABELS)


async def test_a_chat_arrives_intact_with_tgis_usage(lab: Lab, access_log: AccessLines) -> None:
    tgi, served = await tgi_proxy(lab)
    raw = await lab.client(served).chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT
    )
    chat = raw.parse()
    assert chat.choices[0].message.content == "".join(WORDS)
    assert chat.choices[0].finish_reason == "stop"  # eos_token, as format(true) says it
    assert (chat.id, chat.model, chat.system_fingerprint) == ("", MODEL, FINGERPRINT)
    assert chat.usage is not None
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (PROMPT_TOKENS, GENERATED)
    assert raw.headers["x-generated-tokens"] == str(GENERATED)  # TGI's headers are relayed
    assert tgi.chats()[0]["max_tokens"] == 512  # the proxy's default, written in
    [line] = await access_log()
    assert (line["status"], line["outcome"]) == (200, "completed")
    assert (line["prompt_tokens"], line["completion_tokens"]) == (PROMPT_TOKENS, GENERATED)
    assert tokens(served, "completion") == GENERATED


async def test_a_stream_ends_with_its_finishing_event_and_the_proxy_gets_the_usage(
    lab: Lab, access_log: AccessLines
) -> None:
    tgi, served = await tgi_proxy(lab)
    stream = await lab.client(served).chat.completions.create(
        model=MODEL, messages=CHAT, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert tgi.chats()[0]["stream_options"] == {"include_usage": True}  # asked by the proxy
    assert all(c.choices and c.usage is None for c in chunks)  # TGI's usage chunk taken out
    assert [c.choices[0].delta.content for c in chunks] == [*WORDS, ""]  # EOS: content ""
    assert all(c.choices[0].delta.role == "assistant" for c in chunks)  # TGI: on every one
    assert [c.choices[0].finish_reason for c in chunks] == [None] * len(WORDS) + ["stop"]
    [line] = await access_log()
    assert (line["status"], line["outcome"]) == (200, "completed")
    assert (line["prompt_tokens"], line["completion_tokens"]) == (PROMPT_TOKENS, GENERATED)
    assert tokens(served, "completion") == GENERATED


async def test_a_stream_asking_for_usage_gets_tgis_usage_chunk(lab: Lab) -> None:
    _, served = await tgi_proxy(lab)
    stream = await lab.client(served).chat.completions.create(
        model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    *tokens_, usage = chunks
    assert [c.choices[0].finish_reason for c in tokens_][-1] == "stop"
    assert usage.choices == []
    assert usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (
        PROMPT_TOKENS,
        GENERATED,
    )
    assert tokens(served, "completion") == GENERATED


async def test_the_stream_reaches_the_client_as_axum_frames_it(lab: Lab) -> None:
    """``data: <json>`` lines ending in LF, each event ended by an empty line, ``[DONE]``."""
    _, served = await tgi_proxy(lab)
    http = await lab.http()
    body = {"model": MODEL, "messages": CHAT, "stream": True, "max_tokens": 2}
    headers = {"Authorization": f"Bearer {KEYS['A']}"}
    async with http.post(f"{served.url}{CHAT_PATH}", json=body, headers=headers) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        raw = await response.read()
    assert b"\r" not in raw
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == list(WORDS[:2])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" in c and c["usage"] is None for c in chunks)  # null, not absent


async def test_the_health_probe_follows_tgis_health_route(lab: Lab) -> None:
    tgi, served = await tgi_proxy(lab)
    backend = served.state.pools["sim"].placement.backends[0]
    await eventually(lambda: "/health" in tgi.probes())
    assert backend.healthy
    tgi.healthy = False  # 503 {"error": "unhealthy", "error_type": "healthcheck"}
    await eventually(lambda: not backend.healthy)
    with pytest.raises(openai.APIStatusError) as refused:
        await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT)
    assert refused.value.status_code == 503
    tgi.healthy = True
    await eventually(lambda: backend.healthy, within=5)
    chat = await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT)
    assert chat.choices[0].finish_reason == "stop"


async def test_a_tgi_behind_its_api_key_is_probed_and_served(lab: Lab) -> None:
    """``--api-key`` guards the generation routes only (a bare 401 without it); a keyed
    pool is passive unless told, so ``mode: active`` probes ``/health``, key or not."""
    tgi = TgiDouble(api_key="hf-secret")
    port = await lab.serve(tgi.app())
    pool = {"upstream_key_env": "TGI_KEY", "health": {"mode": "active", "interval_s": 0.05}}
    config = proxy_config([f"http://127.0.0.1:{port}"], pool=pool, environ={"TGI_KEY": "hf-secret"})
    served = await lab.proxy(config)
    await eventually(lambda: "/health" in tgi.probes())
    chat = await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT)
    assert chat.choices[0].message.content == "".join(WORDS)
    assert set(tgi.authorizations) == {"Bearer hf-secret"}  # probes and chats alike
    assert served.state.pools["sim"].placement.backends[0].healthy


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"temperature": -1.0}, "`temperature` must be strictly positive"),
        ({"max_tokens": 1020}, "`inputs` tokens + `max_new_tokens` must be <= 1024. Given: "
                               f"{PROMPT_TOKENS} `inputs` tokens and 1020 `max_new_tokens`"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ],
)  # fmt: skip
async def test_tgis_validation_errors_reach_the_client_with_their_status(
    lab: Lab, access_log: AccessLines, options: dict[str, Any], message: str
) -> None:
    _, served = await tgi_proxy(lab, TgiDouble(max_total_tokens=1024, max_input_tokens=1023))
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT, **options)
    assert refused.value.status_code == 422
    assert refused.value.response.json() == {
        "error": f"Input validation error: {message}",
        "error_type": "validation",
    }
    [line] = await access_log()
    assert line["status"] == 422


async def test_a_huge_max_tokens_is_checked_as_1024(lab: Lab) -> None:
    """TGI checks ``min(max_tokens, 1024)`` against the context: a request whose limit
    exceeds it is served (and re-queued every 1024 tokens), not refused as vLLM does."""
    _, served = await tgi_proxy(lab)
    chat = await lab.client(served).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=100_000
    )
    assert chat.choices[0].finish_reason == "stop"


async def test_a_streamed_request_tgi_refuses_is_a_200_with_the_error_inside(
    lab: Lab, access_log: AccessLines
) -> None:
    """Validation runs inside TGI's stream: the status is 200, the error an event (always
    "http_status_code": 422), then ``[DONE]``. The SDK raises on that event."""
    _, served = await tgi_proxy(lab)
    stream = await lab.client(served).chat.completions.create(
        model=MODEL, messages=CHAT, stream=True, top_p=1.0
    )
    with pytest.raises(openai.APIError) as failed:
        _ = [chunk async for chunk in stream]
    assert failed.value.body == {
        "message": "Input validation error: `top_p` must be > 0.0 and < 1.0",
        "http_status_code": 422,
    }
    [line] = await access_log()
    # what the proxy saw: a whole stream, without usage or a finishing event, whose one
    # event is an error: no completion, a failure of its own reason
    assert (line["status"], line["outcome"], line["reason"]) == (200, "failed", "error_event")
    assert line["completion_tokens"] is None
    assert tokens(served, "completion") in (None, 0.0)


async def test_an_error_before_tgis_stream_starts_is_a_422(lab: Lab) -> None:
    """``try_into_generate`` (templates, tools) runs before the stream: a JSON 422."""
    _, served = await tgi_proxy(lab)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        await lab.client(served).chat.completions.create(
            model=MODEL, messages=CHAT, stream=True, tools=[tool],
            response_format={"type": "json_object"},
        )  # fmt: skip
    assert refused.value.response.json() == {
        "error": "Tool error: Grammar and tools are mutually exclusive",
        "error_type": "tool_error",
    }


async def test_tgi_ignores_n(lab: Lab) -> None:
    """``n`` is "UNUSED" in TGI: one choice comes back (the proxy charged two)."""
    _, served = await tgi_proxy(lab)
    chat = await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT, n=2)
    assert len(chat.choices) == 1


# --- family differences: what the proxy writes into a body, TGI may refuse ----------------


async def test_the_injected_max_tokens_is_refused_by_a_small_context_tgi(lab: Lab) -> None:
    """Without ``max_tokens`` TGI gives the request what its context leaves (auto
    max_new_tokens); the proxy writes ``max_tokens: 512`` (``default_max_tokens``) in, and
    TGI checks input + 512 against ``--max-total-tokens`` 512: a 422 the client's own body
    would not have had. ``inject_max_tokens: false`` sends the body as it came."""
    tgi, served = await tgi_proxy(lab, TgiDouble(max_total_tokens=512, max_input_tokens=511))
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT)
    assert refused.value.response.json() == {
        "error": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 512. "
        f"Given: {PROMPT_TOKENS} `inputs` tokens and 512 `max_new_tokens`",
        "error_type": "validation",
    }
    assert tgi.chats()[0]["max_tokens"] == 512

    small = TgiDouble(max_total_tokens=512, max_input_tokens=511)
    tgi, served = await tgi_proxy(lab, small, pool={"cost": {"inject_max_tokens": False}})
    chat = await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT)
    assert chat.choices[0].finish_reason == "stop"
    assert "max_tokens" not in tgi.chats()[0]


async def test_a_null_max_completion_tokens_is_replaced_not_duplicated(lab: Lab) -> None:
    """TGI reads ``max_completion_tokens`` as an alias of ``max_tokens``, and serde refuses
    a field given twice: filling a ``null`` token limit by writing ``max_tokens`` beside the
    client's ``max_completion_tokens: null`` was a 422 TGI does not give to the same body
    sent straight. The proxy now leaves the null field out and writes its own."""
    tgi = TgiDouble()
    port = await lab.serve(tgi.app())
    served = await lab.proxy(proxy_config([f"http://127.0.0.1:{port}"]))
    http = await lab.http()
    body = {"model": MODEL, "messages": CHAT, "max_completion_tokens": None}
    async with http.post(f"http://127.0.0.1:{port}{CHAT_PATH}", json=body) as response:
        assert response.status == 200
    answer = await lab.client(served).chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=None
    )
    assert answer.choices[0].finish_reason is not None
    # the proxy's chat, the last one received (a health probe may come after it)
    sent = [body for _, path, body in tgi.received if path == CHAT_PATH][-1]
    assert b"max_completion_tokens" not in sent
    assert b'"max_tokens":512' in sent
