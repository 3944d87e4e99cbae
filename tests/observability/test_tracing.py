"""OpenTelemetry traces (observability/tracing.py, docs/tracing.md) through the real proxy,
exported over OTLP/HTTP to a real receiver that decodes them as a collector does: one span
per request, the access record's fields as its attributes, the client's trace continued
and the proxy's span sent upstream; a dead collector never holds an answer or the exit."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

import openai
import pytest
from aiohttp import web
from otlp_receiver import ERROR, SERVER, UNSET, OtlpReceiver
from provider_double import USAGE, ProviderDouble
from proxy_lab import (
    KEYS,
    MODEL,
    AccessLines,
    Lab,
    Served,
    config_yaml,
    eventually,
    proxy_config,
    serve_process,
)

from sfq_proxy.observability import logs
from sfq_proxy.runner.server import bound_url, running

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{CLIENT_SPAN}-01"
PROMPT = "the words of a private prompt"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5}
# an access line's field, and the span attribute that must say the same
SAME = {
    "request_id": "sfq.request_id",
    "org": "sfq.org",
    "key": "sfq.key",
    "class": "sfq.class",
    "pool": "sfq.pool",
    "backend": "sfq.backend",
    "outcome": "sfq.outcome",
    "reason": "sfq.reason",
    "cost": "sfq.cost.charged",
    "cost_actual": "sfq.cost.actual",
    "queue_wait_s": "sfq.queue_wait_s",
    "upstream_s": "sfq.upstream_s",
    "retries": "sfq.retries",
    "model": "gen_ai.request.model",
    "status": "http.response.status_code",
    "prompt_tokens": "gen_ai.usage.input_tokens",
    "completion_tokens": "gen_ai.usage.output_tokens",
}


def context(headers: Any) -> tuple[str, str, bool]:
    """An upstream request's ``traceparent``: its trace id, parent id, and whether sampled
    (a new trace's flags may also say its id is random, W3C Trace Context level 2)."""
    version, trace_id, parent, flags = headers["traceparent"].split("-")
    assert version == "00"
    return trace_id, parent, bool(int(flags, 16) & 1)


def tracing(port: int, **options: Any) -> dict[str, Any]:
    return {"endpoint": f"http://127.0.0.1:{port}/v1/traces", "schedule_delay_s": 0.05, **options}


async def tracing_proxy(
    lab: Lab, tracing_options: dict[str, Any], **options: Any
) -> tuple[OtlpReceiver, ProviderDouble, int, Served]:
    """A proxy tracing to a receiver, in front of a provider's stand-in (on that port)."""
    receiver = OtlpReceiver()
    collector = await lab.serve(receiver.app())
    provider = ProviderDouble(key=None)
    port = await lab.serve(provider.app())
    config = proxy_config(
        [f"http://127.0.0.1:{port}/v1"],
        pool={"family": "openai"},
        tracing=tracing(collector, **tracing_options),
        **options,
    )
    return receiver, provider, port, await lab.proxy(config)


async def test_each_request_is_one_span_with_its_record_continuing_the_clients_trace(
    lab: Lab, access_log: AccessLines
) -> None:
    receiver, provider, port, served = await tracing_proxy(
        lab,
        {},
        orgs={"B": {"rpm": 1}},
        retry={"budget_ratio": 1, "backoff_base_s": 0.01, "backoff_max_s": 0.01},
    )
    a, b = lab.client(served, "A"), lab.client(served, "B")
    client_trace = {"traceparent": TRACEPARENT, "tracestate": "vendor=opaque"}
    await a.chat.completions.create(**CHAT, extra_headers=client_trace)
    provider.refuse(1, status=503)  # retried once, then served
    await a.chat.completions.create(**CHAT)
    provider.misbehave("cut", times=3)  # the backend hangs up mid-answer, each attempt
    with pytest.raises(openai.APIError):
        await a.chat.completions.create(**CHAT)
    await b.chat.completions.create(**CHAT)
    with pytest.raises(openai.RateLimitError):  # B's rpm of 1
        await b.chat.completions.create(**CHAT)
    with pytest.raises(openai.AuthenticationError):
        await a.chat.completions.create(
            **CHAT, extra_headers={**client_trace, "Authorization": "Bearer sk-nope"}
        )

    lines = await access_log()
    await eventually(lambda: len(receiver.spans) >= len(lines), within=10)
    await asyncio.sleep(0.2)  # a second span of some request would be here by now
    spans = receiver.by_request()  # one span per request
    assert len(lines) == 6
    assert set(spans) == {line["request_id"] for line in lines}
    for line in lines:  # the span says what the access line says
        span = spans[line["request_id"]]
        said = {f: span.attributes.get(a) for f, a in SAME.items()}
        assert said == {f: line[f] for f in SAME}, line["request_id"]
        assert (span.kind, span.name, span.trace_id) == (
            SERVER,
            "POST /v1/chat/completions",
            line["trace_id"],
        )
        assert span.attributes["http.request.method"] == "POST"
        assert span.attributes["url.path"] == "/v1/chat/completions"
        assert 0 < span.start_ns <= span.end_ns <= time.time_ns()
    traced, retried, cut, b_ok, limited, refused = (spans[line["request_id"]] for line in lines)

    # the client's trace goes on: the proxy's span is its child, and the backend's parent
    assert (traced.trace_id, traced.parent_span_id) == (TRACE, CLIENT_SPAN)
    first, second, *others = provider.chats()
    assert first.headers["traceparent"] == f"00-{TRACE}-{traced.span_id}-01"
    assert first.headers["tracestate"] == "vendor=opaque"
    # without one, the proxy's span starts a trace, and every attempt carries it
    assert retried.parent_span_id == ""
    assert retried.trace_id not in (TRACE, traced.trace_id)
    assert [context(r.headers) for r in (second, others[0])] == [
        (retried.trace_id, retried.span_id, True)
    ] * 2
    backend = f"127.0.0.1:{port}"
    assert retried.attributes["sfq.retries"] == 1
    assert retried.status == UNSET
    for span in (traced, retried, b_ok):
        assert span.attributes["sfq.outcome"] == "completed"
        assert span.attributes["sfq.backend"] == backend
        assert span.attributes["gen_ai.usage.input_tokens"] == USAGE["prompt_tokens"]
        assert span.attributes["gen_ai.usage.output_tokens"] == USAGE["completion_tokens"]
        assert span.attributes["sfq.cost.charged"] > 0
        assert span.attributes["sfq.cost.actual"] > 0
        assert span.attributes["sfq.queue_wait_s"] >= 0
    assert (traced.attributes["sfq.org"], traced.attributes["sfq.class"]) == ("A", "batch")
    assert traced.attributes["sfq.pool"] == "sim"
    # a failure is an error; a refusal (the client's fault) is not, and has its own span
    assert (cut.attributes["sfq.outcome"], cut.status) == ("failed", ERROR)
    assert cut.attributes["error.type"] == cut.status_message == cut.attributes["sfq.reason"]
    assert (limited.attributes["sfq.outcome"], limited.status) == ("rejected", UNSET)
    assert limited.attributes["http.response.status_code"] == 429
    assert (refused.attributes["http.response.status_code"], refused.status) == (401, UNSET)
    assert refused.parent_span_id == CLIENT_SPAN
    assert "sfq.org" not in refused.attributes
    assert {s.resource["service.name"] for s in spans.values()} == {"sfq-proxy"}
    assert {s.resource["process.pid"] for s in spans.values()} == {os.getpid()}
    sent = b"".join(receiver.bodies)  # never a prompt, never a key
    assert PROMPT.encode() not in sent
    assert b"sk-" not in sent
    assert b_ok.attributes["sfq.key"] == "B#1"


async def test_sample_ratio_zero_keeps_no_trace_not_even_one_a_client_sampled(lab: Lab) -> None:
    """``sample_ratio: 0`` keeps no span: neither of the proxy's own traces nor of a client's
    that its ``traceparent`` flags sampled (a client does not raise the ratio, even one that
    is refused its key). Unsampled, the context still goes upstream (flags 00)."""
    receiver, provider, _, served = await tracing_proxy(lab, {"sample_ratio": 0})
    client = lab.client(served)
    for _ in range(3):
        await client.chat.completions.create(**CHAT)
    await client.chat.completions.create(**CHAT, extra_headers={"traceparent": TRACEPARENT})
    with pytest.raises(openai.AuthenticationError):
        await client.chat.completions.create(
            **CHAT, extra_headers={"traceparent": TRACEPARENT, "Authorization": "Bearer sk-nope"}
        )
    await asyncio.sleep(0.3)  # a kept span would have been exported by now (every 0.05 s)
    assert receiver.spans == []
    unsampled = [context(r.headers) for r in provider.chats()]
    assert [sampled for *_, sampled in unsampled] == [False] * 4
    assert len({trace_id for trace_id, *_ in unsampled[:3]}) == 3  # a trace of its own each
    assert unsampled[3][0] == TRACE  # the client's trace goes on, unsampled


async def test_a_clients_trace_is_kept_at_the_ratio_whatever_its_flag_and_trace_id(
    lab: Lab,
) -> None:
    """The ratio is the operator's: a client's trace is kept by the proxy's own draw, not by
    its ``traceparent``'s flag (sampled or not) nor by its trace id, which the client writes
    (a ratio sampler keeps an id whose low 64 bits are zeros at any ratio above 0). Of 30
    such traces per flag at 0.5, all kept or none has a chance of 2 in a billion."""
    receiver, _, _, served = await tracing_proxy(lab, {"sample_ratio": 0.5})
    client = lab.client(served)
    ids = {flags: [f"{flags}{i:014x}{'0' * 16}" for i in range(1, 31)] for flags in ("01", "00")}
    for flags, trace_ids in ids.items():
        for trace_id in trace_ids:
            traceparent = f"00-{trace_id}-{CLIENT_SPAN}-{flags}"
            await client.chat.completions.create(**CHAT, extra_headers={"traceparent": traceparent})

    def kept(flags: str) -> int:
        return sum(span.trace_id in ids[flags] for span in receiver.spans)

    await eventually(lambda: kept("01") > 0 and kept("00") > 0, within=10)
    await asyncio.sleep(0.3)  # the rest are exported by now (every 0.05 s)
    assert 0 < kept("01") < 30
    assert 0 < kept("00") < 30
    print(f"kept at 0.5: {kept('01')} of 30 flagged sampled, {kept('00')} of 30 not")


async def test_a_tracestate_the_sdk_cannot_parse_is_dropped_without_a_log_line(
    lab: Lab, caplog: pytest.LogCaptureFixture
) -> None:
    """A client's text is never logged per request: OpenTelemetry warns of each tracestate
    member it cannot parse, quoting it; the proxy keeps the trace and drops the state."""
    receiver, provider, _, served = await tracing_proxy(lab, {})
    state = "vendor=opaque,CLIENT TEXT=" + "x" * 200
    caplog.set_level(logging.DEBUG)
    await lab.client(served).chat.completions.create(
        **CHAT, extra_headers={"traceparent": TRACEPARENT, "tracestate": state}
    )
    await eventually(lambda: len(receiver.spans) == 1, within=10)
    assert receiver.spans[0].parent_span_id == CLIENT_SPAN
    (sent,) = provider.chats()
    assert "tracestate" not in sent.headers
    assert "CLIENT TEXT" not in caplog.text


async def test_the_collectors_header_values_never_reach_the_log(lab: Lab) -> None:
    """A collector (or a gateway before it) that refuses the export quoting the token it was
    sent: the exporter logs the refusal's reason, and the proxy's log shows it redacted, as
    it does an upstream key (the value follows no pattern the redaction knows)."""
    token = "otlp-tok-3f9a1c"
    quoted: list[str] = []

    async def refuse(request: web.Request) -> web.Response:
        quoted.append(request.headers["X-Otlp-Token"])
        return web.Response(status=400, reason=f"token {request.headers['X-Otlp-Token']} unknown")

    app = web.Application()
    app.router.add_post("/v1/traces", refuse)
    collector = await lab.serve(app)
    backend = await lab.backend()
    config = proxy_config(
        [backend.url],
        environ={"OTLP_TOKEN": token},
        tracing=tracing(collector, headers_env={"X-Otlp-Token": "OTLP_TOKEN"}),
    )
    written = io.StringIO()
    handler = logging.StreamHandler(written)
    handler.setFormatter(logs.RedactingFormatter("text"))
    logging.getLogger().addHandler(handler)
    try:
        served = await lab.proxy(config)
        await lab.client(served).chat.completions.create(**CHAT)
        await eventually(lambda: "Failed to export" in written.getvalue(), within=10)
    finally:
        logging.getLogger().removeHandler(handler)
    assert quoted == [token]  # the collector was sent it, and said it back
    assert token not in written.getvalue()
    assert f"token {logs.REDACTED} unknown" in written.getvalue()


async def test_a_dead_collector_neither_delays_answers_nor_holds_the_exit(lab: Lab) -> None:
    """A collector that takes connections and never answers: exports hang for their whole
    ``export_timeout_s`` in the exporter's thread, the small queue fills and drops spans;
    answers come at once all the same, and the proxy stops within its drain's bound."""
    hung: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hung.append(writer)
        await reader.read()  # until the exporter gives up and hangs up

    dead = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    dead_port = dead.sockets[0].getsockname()[1]
    backend = await lab.backend()
    config = proxy_config(
        [backend.url],
        drain_timeout_s=1,
        tracing=tracing(
            dead_port,
            export_timeout_s=30,
            schedule_delay_s=0.01,
            max_queue_size=4,
            max_export_batch_size=2,
        ),
    )
    async with running(config) as runner:
        client = openai.AsyncOpenAI(
            base_url=f"{bound_url(runner)}/v1", api_key=KEYS["A"], max_retries=0
        )
        chat = {**CHAT, "max_tokens": 2}
        await client.chat.completions.create(**chat)
        await eventually(lambda: bool(hung), within=10)  # an export hangs now
        began = time.monotonic()
        for _ in range(4):
            await asyncio.gather(*(client.chat.completions.create(**chat) for _ in range(10)))
        answered = time.monotonic() - began
        await client.close()
        stopping = time.monotonic()
    stopped = time.monotonic() - stopping
    dead.close()
    for writer in hung:
        writer.close()
    print(f"40 answers in {answered:.2f} s, stopped in {stopped:.2f} s, a hung export of 30 s")
    # generous bounds: each export hangs for 30 s, and would hold these as long
    assert answered < 10
    assert stopped < config.drain_timeout_s + 1


async def test_each_worker_exports_its_own_spans_and_the_last_leave_at_the_drain(
    lab: Lab, redis_url: str, tmp_path: Any
) -> None:
    """``serve --workers 2``: a provider per worker (its pid in the resource), and spans that
    wait for a batch every 60 s all reach the collector when SIGTERM drains the workers."""
    receiver = OtlpReceiver()
    collector = await lab.serve(receiver.app())
    backend = await lab.backend()
    text = config_yaml(
        [backend.url],
        state={"redis": redis_url},
        tracing=tracing(collector, schedule_delay_s=60),
    )
    proc, url = await serve_process(text, tmp_path, workers=2)
    try:
        # a connection each: the kernel spreads them over the workers' sockets
        clients = [
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["A"], max_retries=0)
            for _ in range(20)
        ]
        await asyncio.gather(*(c.chat.completions.create(**CHAT) for c in clients))
        await asyncio.gather(*(c.close() for c in clients))
        assert receiver.spans == []  # held for the batch
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    spans = receiver.by_request()
    assert len(spans) == 20
    assert len({s.resource["process.pid"] for s in spans.values()}) == 2
    assert {s.attributes["sfq.outcome"] for s in spans.values()} == {"completed"}


@pytest.mark.parametrize(
    "tracing_yaml", ["", "tracing: {enabled: false, endpoint: http://x:4318/v1/traces}\n"]
)
def test_without_tracing_its_packages_are_never_imported(tmp_path: Any, tracing_yaml: str) -> None:
    """Off, tracing costs nothing: not even the import of the trace SDK and its exporter (a
    proxy built and its handlers loaded, in a fresh interpreter). redis-py imports
    OpenTelemetry's metrics SDK by itself when it is installed: not ours to count."""
    path = tmp_path / "config.yaml"
    path.write_text(config_yaml(["http://127.0.0.1:9"]) + tracing_yaml)
    script = (
        "import sys\n"
        "from sfq_proxy.config import load_config\n"
        "from sfq_proxy.http.app import build_app\n"
        "from sfq_proxy.http.proxy import Proxy\n"
        f"proxy = Proxy.from_config(load_config({str(path)!r}), clock=lambda: 0.0)\n"
        "assert proxy.tracing is None\n"
        "ours = ('sfq_proxy.observability.tracing', 'opentelemetry.sdk.trace', "
        "'opentelemetry.exporter')\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(ours))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
