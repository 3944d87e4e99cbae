"""The fault matrix of issue 17: what an upstream can do wrong, through the real proxy and the
``openai`` SDK, and after each fault the pool whole (every slot free, and the next burst
reaches the pool's full concurrency). Then a hosted provider's pool, served by the stand-in
of ``tests/support/provider_double.py``.

Rows covered elsewhere are not tested again here; where each row is tested:

| fault: what the client gets                                       | stream        | JSON         |
|-------------------------------------------------------------------|---------------|--------------|
| hangs before its headers: 504 `upstream_timeout` in first_byte_s  | [1]           | [1], [a]     |
| stalls mid-answer: ended within `idle_s`, slot freed              | [b], [2]      | [c]          |
| closes mid-body: the stream cut cleanly, counted once             | [d], [e], [3] | [f], [3]     |
| garbage instead of HTTP: 502                                      | [4]           | [g]          |
| 503 + Retry-After: retried within the budget, then passed through | [5]           | [5], [h]     |
| gzip: decoded, usage read                                         | [i], [j], [6] | [i]-[l], [6] |
| CRLF events: relayed as they arrive, usage read                   | [m], [7]      | (no events)  |

Here (each also shows the pool whole after, and the request counted once):

- [1] test_a_backend_hanging_before_its_headers_is_a_504[stream, json]
- [2] test_a_stream_stalling_mid_way_ends_as_upstream_timeout (its error code, counted once)
- [3] test_a_backend_hanging_up_mid_body_is_counted_once[stream, json] (a retry budget to
  spare: the stream is not retried, the JSON answer is, once)
- [4] test_garbage_instead_of_http_is_a_502_before_a_stream_starts
- [5] test_a_503_is_retried_within_the_budget_then_passed_through[stream, json]
- [6] test_gzip_answers_leave_the_pool_whole[stream, json]
- [7] test_crlf_streams_leave_the_pool_whole

Elsewhere:

- [a] test_proxy.py::test_first_byte_timeout_is_504 (a slow vLLM double; upstream closed)
- [b] test_poison.py::test_a_stream_the_backend_breaks_off_ends_with_an_error_event
  [goes-silent] (kept words, error event, whole)
- [c] test_poison.py::test_a_body_the_backend_stops_sending_is_a_504_within_idle_s
- [d] test_poison.py::test_a_stream_the_backend_breaks_off_ends_with_an_error_event
  [closes-mid-stream] (and the bad-chunk ones)
- [e] test_observability.py::test_a_stream_cut_by_a_dying_backend_is_counted_and_logged_as_failed
- [f] test_poison.py::test_a_backend_answering_garbage_is_a_502_and_is_taken_out[early-close]
- [g] test_poison.py::test_a_backend_answering_garbage_is_a_502_and_is_taken_out (7 kinds)
- [h] test_admission_through_the_proxy.py::
  test_retries_of_503s_land_on_healthy_capacity_within_budget (many clients, two backends)
- [i] test_relay_upstreams.py::test_a_gzipping_provider_under_v1_is_relayed_decoded_with_its_headers
- [j] test_relay_upstreams.py::test_a_gzip_stream_that_breaks_off_ends_with_an_error_event
- [k] test_relay_upstreams.py::test_a_deflated_answer_is_decoded_in_either_flavour
- [l] test_relay_upstreams.py::test_a_coding_the_proxy_cannot_read_is_a_502_not_undecodable_bytes
- [m] test_sse_framing.py::test_crlf_events_arrive_as_sent_without_the_usage_asked_for_the_client

The provider pool (passive health, the default with `upstream_key_env`):
test_a_provider_pool_serves_chats_with_usage_and_the_providers_headers and
test_a_providers_429_with_retry_after_ms_is_retried_then_passed_through_with_its_headers;
the stand-in itself: test_the_stand_in_behaves_like_a_hosted_api.

"Counted once": `sfq_requests_total` of the client's flow, all outcomes together, grows by
exactly one per request, retries or not, and the access log has one line for it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import openai
import pytest
from provider_double import (
    PROVIDER_KEY,
    RATE_LIMIT_HEADERS,
    USAGE,
    WORDS,
    ProviderDouble,
)
from proxy_lab import MODEL, AccessLines, Lab, Served, eventually, leftovers, proxy_config
from test_poison import assert_whole as assert_whole_on_sim

CHAT = [{"role": "user", "content": "hi"}]
ENV = {"PROVIDER_KEY": PROVIDER_KEY}
FLOW = {"org": "A", "class": "batch", "pool": "sim"}
ANSWER = "".join(WORDS)
TOKENS = (USAGE["prompt_tokens"], USAGE["completion_tokens"])  # the stand-in's usage
MODES = pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])


async def provider_pool(
    lab: Lab, provider: ProviderDouble, *, slots: int = 2, **options: Any
) -> Served:
    """A proxy whose pool ``sim`` is ``provider`` alone, written as a provider's URL is (with
    ``/v1``) and with its key: a passive pool. ``options`` go to ``proxy_config``'s pool
    (``timeouts``, ``health``…) or, for ``retry``, to the top level."""
    port = await lab.serve(provider.app())
    retry = options.pop("retry", None)
    top = {"retry": retry} if retry else {}
    pool = {"upstream_key_env": "PROVIDER_KEY", **options}
    url = f"http://127.0.0.1:{port}/v1"
    return await lab.proxy(proxy_config([url], slots=slots, pool=pool, environ=ENV, **top))


async def assert_whole(lab: Lab, served: Served, provider: ProviderDouble, slots: int) -> None:
    """Nothing is left behind, and a burst of ``slots`` requests (of another org) is in
    flight at ``provider`` all at once: every slot was free."""
    await eventually(lambda: not leftovers(served))
    provider.hold_until(slots)
    client = lab.client(served, "B")
    replies = await asyncio.gather(
        *(client.chat.completions.create(model=MODEL, messages=CHAT) for _ in range(slots))
    )
    assert [r.choices[0].message.content for r in replies] == [ANSWER] * slots
    assert provider.max_in_flight == slots  # every slot was free: none leaked
    assert not leftovers(served)


def requests_counted(served: Served, outcome: str | None = None) -> float:
    """``sfq_requests_total`` of org A's flow: of ``outcome``, or of all outcomes."""
    if outcome is not None:
        value = served.state.metrics.registry.get_sample_value(
            "sfq_requests_total", {**FLOW, "outcome": outcome}
        )
        return value or 0.0
    return served.state.metrics.totals("requests").get(("A", "batch", "sim"), 0.0)


async def counted_once(served: Served, access_log: AccessLines, outcome: str) -> dict[str, Any]:
    """Org A's one request was counted once, as ``outcome``, and logged once; its line."""
    await eventually(lambda: requests_counted(served) >= 1)
    assert requests_counted(served) == requests_counted(served, outcome) == 1
    lines = [line for line in await access_log() if line["org"] == "A"]
    assert len(lines) == 1, lines
    assert lines[0]["outcome"] == outcome
    return lines[0]


async def read_all(stream: Any, got: list[str] | None = None) -> list[str]:
    """The content of a stream's chunks, into ``got`` (kept when the stream raises)."""
    got = [] if got is None else got
    async for chunk in stream:
        if chunk.choices:
            got.append(chunk.choices[0].delta.content or "")
    return got


# -- hangs before its headers -----------------------------------------------------------------


@MODES
async def test_a_backend_hanging_before_its_headers_is_a_504(
    lab: Lab, access_log: AccessLines, stream: bool
) -> None:
    provider = ProviderDouble()
    served = await provider_pool(lab, provider, timeouts={"connect_s": 1, "first_byte_s": 0.5})
    provider.misbehave("hang")
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as timed_out:
        await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT, stream=stream)
    assert time.monotonic() - started < 30  # first_byte_s, not the double's 60 s of silence
    assert (timed_out.value.status_code, timed_out.value.body["code"]) == (504, "upstream_timeout")
    assert "0.5 s" in timed_out.value.body["message"]
    await eventually(lambda: provider.hung_up == 1)  # the proxy closed the upstream request
    line = await counted_once(served, access_log, "failed")
    assert line["status"] == 504
    await assert_whole(lab, served, provider, 2)


# -- stalls mid-answer ------------------------------------------------------------------------


async def test_a_stream_stalling_mid_way_ends_as_upstream_timeout(
    lab: Lab, access_log: AccessLines
) -> None:
    """The client keeps the words it got, then the stream ends with an error event whose code
    is ``upstream_timeout`` (the SDK raises it), within ``idle_s``; counted once."""
    provider = ProviderDouble()
    timeouts = {"connect_s": 1, "first_byte_s": 10, "idle_s": 0.5}
    served = await provider_pool(lab, provider, timeouts=timeouts)
    provider.misbehave("stall")
    stream = await lab.client(served).chat.completions.create(
        model=MODEL, messages=CHAT, stream=True
    )
    got: list[str] = []
    with pytest.raises(openai.APIError, match="broke off") as cut:
        await read_all(stream, got)
    assert got == ["", WORDS[0]]
    assert cut.value.body["code"] == "upstream_timeout"
    assert cut.value.body["type"] == "upstream_error"
    await eventually(lambda: provider.hung_up == 1)
    line = await counted_once(served, access_log, "failed")
    assert line["status"] == 200  # its headers had been sent
    await assert_whole(lab, served, provider, 2)


# -- closes mid-body --------------------------------------------------------------------------


@MODES
async def test_a_backend_hanging_up_mid_body_is_counted_once(
    lab: Lab, access_log: AccessLines, stream: bool
) -> None:
    """With a retry budget to spare: a JSON answer cut mid-body reached no one, so it is
    retried and answered; a stream cut after its first word is not (the client has it), and
    ends cleanly with an ``upstream_cut`` error event. Either way the request is counted
    once, and the stand-in saw what the retries say."""
    provider = ProviderDouble()
    retry = {"max_attempts": 3, "budget_ratio": 1.0, "backoff_base_s": 0.01, "backoff_max_s": 0.05}
    served = await provider_pool(lab, provider, retry=retry)
    provider.misbehave("cut")
    client = lab.client(served)
    if stream:
        got: list[str] = []
        answer = await client.chat.completions.create(model=MODEL, messages=CHAT, stream=True)
        with pytest.raises(openai.APIError, match="broke off") as cut:
            await read_all(answer, got)
        assert got == ["", WORDS[0]]
        assert cut.value.body["code"] == "upstream_cut"
        line = await counted_once(served, access_log, "failed")
        assert (line["status"], line["retries"]) == (200, 0)
        assert len(provider.chats()) == 1
    else:
        chat = await client.chat.completions.create(model=MODEL, messages=CHAT)
        assert chat.choices[0].message.content == ANSWER
        line = await counted_once(served, access_log, "completed")
        assert (line["status"], line["retries"]) == (200, 1)
        assert (line["prompt_tokens"], line["completion_tokens"]) == TOKENS  # the retry's
        assert len(provider.chats()) == 2
    await assert_whole(lab, served, provider, 2)


# -- garbage instead of HTTP ------------------------------------------------------------------


async def test_garbage_instead_of_http_is_a_502_before_a_stream_starts(
    lab: Lab, access_log: AccessLines
) -> None:
    """A stream asked of a backend that does not speak HTTP: a 502 (nothing had started),
    counted once; the backend is taken out, the pool whole."""
    garbage = await lab.raw(b"SSH-2.0-OpenSSH_9.6\r\n")
    sim = await lab.backend()
    pool = {"health": {"interval_s": 0.1, "cooldown_s": 60, "timeout_s": 5}}
    served = await lab.proxy(
        proxy_config([garbage, sim.url], slots=2, pool=pool, retry={"max_attempts": 1})
    )
    with pytest.raises(openai.InternalServerError) as failed:
        await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT, stream=True)
    assert (failed.value.status_code, failed.value.body["code"]) == (502, "bad_gateway")
    line = await counted_once(served, access_log, "failed")
    assert line["status"] == 502
    assert not served.state.pools["sim"].placement.backends[0].healthy
    await assert_whole_on_sim(lab, served, sim, 2)


# -- 503 + Retry-After ------------------------------------------------------------------------


@MODES
async def test_a_503_is_retried_within_the_budget_then_passed_through(
    lab: Lab, access_log: AccessLines, stream: bool
) -> None:
    """A budget of one retry per request: the first request's 503 is retried (no sooner than
    its Retry-After) and refused again, and the budget is spent, so the client gets the
    provider's 503 with its Retry-After; the next request's one 503 is retried and answered.
    Each is counted once."""
    provider = ProviderDouble()
    retry = {"max_attempts": 3, "budget_ratio": 1.0, "backoff_base_s": 0.01, "backoff_max_s": 0.05}
    served = await provider_pool(lab, provider, retry=retry)
    client = lab.client(served)
    provider.refuse(2, status=503, retry_after="1")
    with pytest.raises(openai.InternalServerError) as refused:
        await client.chat.completions.create(model=MODEL, messages=CHAT, stream=stream)
    assert refused.value.status_code == 503
    assert refused.value.response.headers["Retry-After"] == "1"
    assert refused.value.body["message"] == "The server is overloaded or not ready yet."
    assert len(provider.chats()) == 2  # the first try and one retry: the budget's
    registry = served.state.metrics.registry
    assert registry.get_sample_value("sfq_retries_total", {**FLOW, "reason": "503"}) == 1
    assert registry.get_sample_value("sfq_retry_budget_refusals_total", FLOW) == 1
    line = await counted_once(served, access_log, "upstream_error")
    assert (line["status"], line["retries"]) == (503, 1)

    provider.refuse(1, status=503, retry_after="1")
    answer = await client.chat.completions.create(model=MODEL, messages=CHAT, stream=stream)
    if stream:
        assert "".join(await read_all(answer)) == ANSWER
    else:
        assert answer.choices[0].message.content == ANSWER
    assert len(provider.chats()) == 4  # refused once more, then answered
    await eventually(lambda: requests_counted(served) == 2)
    assert requests_counted(served, "completed") == 1
    assert registry.get_sample_value("sfq_retries_total", {**FLOW, "reason": "503"}) == 2
    await assert_whole(lab, served, provider, 2)


# -- gzip, CRLF -------------------------------------------------------------------------------


@MODES
async def test_gzip_answers_leave_the_pool_whole(
    lab: Lab, access_log: AccessLines, stream: bool
) -> None:
    """A provider that gzips whatever it is asked: decoded, usage read, counted once."""
    provider = ProviderDouble(coding="gzip")
    served = await provider_pool(lab, provider)
    client = lab.client(served)
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, stream=stream
    )
    assert "Content-Encoding" not in raw.headers
    if stream:
        assert "".join(await read_all(raw.parse())) == ANSWER
    else:
        assert raw.parse().choices[0].message.content == ANSWER
    assert [r.headers.get("Accept-Encoding") for r in provider.chats()] == ["identity"]
    line = await counted_once(served, access_log, "completed")
    assert (line["prompt_tokens"], line["completion_tokens"]) == TOKENS
    await assert_whole(lab, served, provider, 2)


async def test_crlf_streams_leave_the_pool_whole(lab: Lab, access_log: AccessLines) -> None:
    provider = ProviderDouble(crlf=True)
    served = await provider_pool(lab, provider)
    stream = await lab.client(served).chat.completions.create(
        model=MODEL, messages=CHAT, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ANSWER
    assert all(c.usage is None and c.choices for c in chunks)  # the proxy's usage chunk: gone
    line = await counted_once(served, access_log, "completed")
    assert (line["prompt_tokens"], line["completion_tokens"]) == TOKENS
    await assert_whole(lab, served, provider, 2)


# -- a hosted provider's pool -----------------------------------------------------------------


async def test_a_provider_pool_serves_chats_with_usage_and_the_providers_headers(
    lab: Lab, access_log: AccessLines
) -> None:
    """Passive (no probe of the missing ``/health``), the proxy's key never sent upstream
    but the provider's; JSON and streamed chats (with and without the client's own usage
    chunk) answered with the provider's rate-limit headers, their usage in the access log
    and the metrics."""
    provider = ProviderDouble()
    served = await provider_pool(lab, provider)
    assert served.state.pools["sim"].spec.health.mode == "passive"
    client = lab.client(served)
    raw_json = await client.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT)
    assert raw_json.parse().usage.completion_tokens == 5
    raw_stream = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, stream=True
    )
    chunks = [chunk async for chunk in raw_stream.parse()]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ANSWER
    assert all(c.usage is None for c in chunks)  # not asked for by the client
    with_usage = await client.chat.completions.create(
        model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True}
    )
    last = [chunk async for chunk in with_usage][-1]
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == TOKENS

    for raw in (raw_json, raw_stream):
        for name, value in RATE_LIMIT_HEADERS.items():
            assert raw.headers.get(name) == value, name
        assert raw.headers.get("openai-processing-ms") == "42"
    lines = await access_log()
    assert [(line["outcome"], line["prompt_tokens"], line["completion_tokens"])
            for line in lines] == [("completed", *TOKENS)] * 3  # fmt: skip
    for raw, line, sent in zip((raw_json, raw_stream), lines, provider.chats(), strict=False):
        # the proxy's own id, sent upstream too, in place of the provider's ``req_…``
        assert raw.headers["x-request-id"] == line["request_id"] == sent.headers["X-Request-Id"]
    registry = served.state.metrics.registry
    assert registry.get_sample_value("sfq_completion_tokens_total", FLOW) == 15
    assert registry.get_sample_value("sfq_prompt_tokens_total", FLOW) == 33
    assert requests_counted(served, "completed") == 3

    chats = provider.chats()
    assert len(chats) == 3
    assert all(r.keyed for r in chats)  # the provider's key, not the client's
    assert [r.headers.get("Accept-Encoding") for r in chats] == ["identity"] * 3
    asked = [r.json().get("stream_options") for r in chats]
    assert asked[1:] == [{"include_usage": True}] * 2  # the proxy asks for it
    assert provider.probes() == []
    await assert_whole(lab, served, provider, 2)


async def test_a_providers_429_with_retry_after_ms_is_retried_then_passed_through_with_its_headers(
    lab: Lab, access_log: AccessLines
) -> None:
    provider = ProviderDouble()
    retry = {"max_attempts": 3, "budget_ratio": 1.0, "backoff_base_s": 0.01, "backoff_max_s": 0.05}
    served = await provider_pool(lab, provider, retry=retry)
    provider.refuse(2, status=429, retry_after_ms="250")
    with pytest.raises(openai.RateLimitError) as limited:
        await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT)
    headers = limited.value.response.headers
    assert headers["retry-after-ms"] == "250"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-limit-requests"] == "500"
    assert "Retry-After" in headers
    assert limited.value.body["code"] == "rate_limit_exceeded"
    assert len(provider.chats()) == 2  # the first try and the one retry the budget allows
    registry = served.state.metrics.registry
    assert registry.get_sample_value("sfq_retries_total", {**FLOW, "reason": "429"}) == 1
    assert registry.get_sample_value("sfq_retry_budget_refusals_total", FLOW) == 1
    line = await counted_once(served, access_log, "upstream_error")
    assert (line["status"], line["retries"]) == (429, 1)
    await assert_whole(lab, served, provider, 2)


# -- the stand-in itself ----------------------------------------------------------------------


async def test_the_stand_in_behaves_like_a_hosted_api(lab: Lab) -> None:
    """Called directly: its key or an OpenAI-style 401, no ``/health``, gzip when the request
    allows it, the provider's headers, 429s when told, usage in a stream when asked."""
    provider = ProviderDouble()
    base = f"http://127.0.0.1:{await lab.serve(provider.app())}"
    http = await lab.http()
    async with http.get(f"{base}/health") as r:
        assert (r.status, (await r.json())["error"]["code"]) == (401, "invalid_api_key")
    key = {"Authorization": f"Bearer {PROVIDER_KEY}"}
    async with http.get(f"{base}/health", headers=key) as r:
        assert r.status == 404
    body = {"model": MODEL, "messages": CHAT}
    async with http.post(f"{base}/v1/chat/completions", json=body, headers=key) as r:
        assert r.headers["Content-Encoding"] == "gzip"  # aiohttp asks for gzip, and decodes
        assert (await r.json())["usage"] == USAGE
        assert (
            r.headers["x-ratelimit-remaining-tokens"]
            == RATE_LIMIT_HEADERS["x-ratelimit-remaining-tokens"]
        )
        assert r.headers["openai-processing-ms"] == "42"
        assert r.headers["x-request-id"].startswith("req_")
    async with http.post(
        f"{base}/v1/chat/completions",
        json=body,
        headers={**key, "Accept-Encoding": "identity"},
    ) as r:
        assert "Content-Encoding" not in r.headers
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=PROVIDER_KEY, max_retries=0)
    try:
        provider.refuse(1, retry_after="2", retry_after_ms="1500")
        with pytest.raises(openai.RateLimitError) as limited:
            await client.chat.completions.create(model=MODEL, messages=CHAT)
        assert limited.value.response.headers["retry-after"] == "2"
        assert limited.value.response.headers["retry-after-ms"] == "1500"
        stream = await client.chat.completions.create(
            model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 5
    finally:
        await client.close()
    assert [r.path for r in provider.received] == ["/health", "/health"] + [
        "/v1/chat/completions"
    ] * 4
    assert provider.chats()[-1].json()["stream_options"] == {"include_usage": True}
