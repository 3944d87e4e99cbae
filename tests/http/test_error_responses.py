"""Every rejection of docs/design.md §6 that the front end makes: status and OpenAI-style body."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from proxy_lab import KEYS, MODEL, Lab, Served, eventually, proxy_config

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def _post(lab: Lab, served: Served, body: bytes | dict[str, Any], **headers: str) -> tuple:
    """POST to /v1/chat/completions; return (status, error object, Retry-After)."""
    http = await lab.http()
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {KEYS['A']}", **headers}
    async with http.post(f"{served.url}/v1/chat/completions", data=data, headers=headers) as r:
        payload = await r.json()
        return r.status, payload.get("error"), r.headers.get("Retry-After")


@pytest.fixture
async def served(lab: Lab) -> Served:
    sim = await lab.backend()
    return await lab.proxy(proxy_config([sim.url], limits={"max_body_bytes": 4096}))


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"{not json", "JSON"),
        (b"[1, 2]", "object"),
        ({"messages": CHAT["messages"]}, "'model'"),
        ({"model": MODEL}, "'messages'"),
        ({**CHAT, "messages": []}, "'messages'"),
        ({**CHAT, "max_tokens": 0}, "'max_tokens'"),
        ({**CHAT, "max_tokens": "ten"}, "'max_tokens'"),
        ({**CHAT, "stream": "yes"}, "'stream'"),
    ],
)
async def test_400_for_a_body_that_cannot_be_routed_or_priced(
    lab: Lab, served: Served, body: bytes | dict[str, Any], field: str
) -> None:
    status, error, _ = await _post(lab, served, body)
    assert status == 400
    assert error["type"] == "invalid_request_error"
    assert field in error["message"]


@pytest.mark.parametrize("authorization", ["", "Bearer ", "Basic abc", "Bearer sk-wrong"])
async def test_401_without_a_known_key(lab: Lab, served: Served, authorization: str) -> None:
    status, error, _ = await _post(lab, served, CHAT, Authorization=authorization)
    assert (status, error["code"]) == (401, "invalid_api_key")
    assert "sk-wrong" not in error["message"]


async def test_401_through_the_sdk(lab: Lab, served: Served) -> None:
    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await client.chat.completions.create(**CHAT)
    await client.close()


async def test_403_for_a_class_the_key_may_not_use(lab: Lab, served: Served) -> None:
    status, error, _ = await _post(lab, served, CHAT, **{"X-Workload-Class": "system"})
    assert (status, error["type"]) == (403, "permission_error")
    client = lab.client(served, "B")  # B's key allows batch only
    with pytest.raises(openai.PermissionDeniedError):
        await client.chat.completions.create(
            **CHAT, extra_headers={"X-Workload-Class": "interactive"}
        )


async def test_404_for_a_model_no_pool_serves(lab: Lab, served: Served) -> None:
    status, error, _ = await _post(lab, served, {**CHAT, "model": "gpt-17"})
    assert (status, error["code"]) == (404, "model_not_found")
    with pytest.raises(openai.NotFoundError):
        await lab.client(served).chat.completions.create(**{**CHAT, "model": "gpt-17"})


async def test_404_and_405_of_aiohttp_are_openai_errors_too(lab: Lab, served: Served) -> None:
    http = await lab.http()
    async with http.get(f"{served.url}/v1/nothing") as r:
        assert r.status == 404
        error = (await r.json())["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "not_found")
    async with http.post(f"{served.url}/v1/models/{MODEL}") as r:  # a route with a parameter
        assert (r.status, r.headers["Allow"]) == (405, "GET, HEAD")
    async with http.get(f"{served.url}/v1/chat/completions") as r:
        assert (r.status, r.headers["Allow"]) == (405, "POST")
        assert (await r.json())["error"]["code"] == "method_not_allowed"
    async with http.post(f"{served.url}/metrics") as r:
        assert (r.status, r.headers["Allow"]) == (405, "GET, HEAD")


async def test_413_for_a_body_over_the_limit(lab: Lab, served: Served) -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    status, error, _ = await _post(lab, served, big)
    assert (status, error["code"]) == (413, "request_too_large")


async def test_413_when_the_body_is_streamed_without_a_length(lab: Lab, served: Served) -> None:
    http = await lab.http()

    async def chunks():
        for _ in range(10):
            yield b" " * 1000

    headers = {"Authorization": f"Bearer {KEYS['A']}"}
    async with http.post(f"{served.url}/v1/chat/completions", data=chunks(), headers=headers) as r:
        assert r.status == 413
        assert (await r.json())["error"]["code"] == "request_too_large"


async def test_503_when_the_pool_has_no_healthy_backend(lab: Lab) -> None:
    sim = await lab.backend()
    served = await lab.proxy(proxy_config([sim.url]))
    sim.faults.health_status = 503
    backend = served.state.pools["sim"].placement.backends[0]
    await eventually(lambda: not backend.healthy)
    status, error, retry_after = await _post(lab, served, CHAT)
    assert (status, error["type"]) == (503, "service_unavailable")
    assert retry_after is not None
    http = await lab.http()
    async with http.get(f"{served.url}/readyz") as r:
        assert r.status == 503
    sim.faults.health_status = 200
    await eventually(lambda: backend.healthy)
    status, _, _ = await _post(lab, served, CHAT)
    assert status == 200
