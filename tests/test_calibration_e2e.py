"""Calibration through the real proxy: usage seen for every request, estimates that learn."""

from __future__ import annotations

import json
import re

from e2e import KEYS, MODEL, Lab, proxy_config

CHAT = [{"role": "user", "content": "Tell me about fair queueing."}]


async def _events(lab: Lab, url: str, key: str | None, body: dict) -> list[bytes]:
    """The raw SSE events of a streamed answer, with the one volatile field blanked."""
    http = await lab.http()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        raw = await r.read()
    return [re.sub(rb'"created":\d+', b'"created":0', e) for e in raw.split(b"\n\n") if e]


async def test_stream_usage_is_asked_for_and_stripped_unless_the_client_wanted_it(
    lab: Lab,
) -> None:
    direct, behind = await lab.backend(seed=5), await lab.backend(seed=5)
    served = await lab.proxy(proxy_config([behind.url]))
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "stream": True}
    # both servers see their first request, so they generate the same answer
    expected = await _events(lab, direct.url, None, body)
    got = await _events(lab, served.url, KEYS["A"], body)
    assert got == expected  # byte for byte: no usage chunk the client did not ask for
    assert not any(b'"usage"' in event for event in got)
    labels = {"org": "A", "class": "batch", "pool": "sim"}
    registry = served.state.metrics.registry
    assert registry.get_sample_value("sfq_completion_tokens_total", labels) == 6
    assert (
        registry.get_sample_value("sfq_prompt_tokens_total", labels) == behind.stats.prompt_tokens
    )

    asked = {**body, "stream_options": {"include_usage": True}}
    events = await _events(lab, served.url, KEYS["A"], asked)
    usage = json.loads(events[-2].removeprefix(b"data: "))
    assert (usage["choices"], usage["usage"]["completion_tokens"]) == ([], 6)
    assert registry.get_sample_value("sfq_completion_tokens_total", labels) == 12
