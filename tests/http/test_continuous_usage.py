"""A pool's ``cost.continuous_usage`` through the real proxy and the simulated vLLM: a stream
asks for the usage on every chunk, so a client that leaves mid-stream is billed the
engine's own prompt and the tokens generated so far; without it, its estimated prompt and
the token events relayed (docs/design.md §3, rule 3)."""

from __future__ import annotations

from typing import Any

import pytest
from proxy_lab import MODEL, AccessLines, Lab, Served, eventually, proxy_config

ADMIN = {"Authorization": "Bearer sk-admin-continuous"}
ENV = {"ADMIN_KEY": "sk-admin-continuous"}
# 1 input token by chars/4 for the proxy; the simulated server adds its template's 4
CHAT = [{"role": "user", "content": "hi"}]


async def served_with(lab: Lab, continuous: bool) -> Served:
    sim = await lab.backend(max_num_seqs=1)
    config = proxy_config(
        [sim.url], admin_key_env="ADMIN_KEY", environ=ENV,
        # a small output ratio: a client that leaves pays the output it was priced at at
        # least (4 of the 4000 asked for), so the tokens generated so far show above it
        pool={"cost": {"continuous_usage": continuous, "output_ratio": 0.001}},
    )  # fmt: skip
    return await lab.proxy(config)


async def leave_after(lab: Lab, served: Served, tokens: int) -> list[Any]:
    """A's stream of up to 4000 tokens, read for ``tokens`` of them: the usages it saw."""
    stream = await lab.client(served, "A").chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4000, stream=True
    )
    seen, usages = 0, []
    async for chunk in stream:
        usages.append(chunk.usage)
        seen += sum(1 for choice in chunk.choices if choice.delta.content)
        if seen == tokens:
            break
    await stream.close()
    return usages


async def hung_up(access_log: AccessLines) -> dict[str, Any]:
    async def logged() -> bool:
        return any(line.get("outcome") == "cancelled_running" for line in await access_log())

    await eventually(logged, within=5.0)
    lines = [line for line in await access_log() if line.get("outcome") == "cancelled_running"]
    assert len(lines) == 1
    return lines[0]


async def billed(lab: Lab, served: Served) -> tuple[int, int]:
    http = await lab.http()
    async with http.get(f"{served.url}/admin/usage", headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
        [row] = (await resp.json())["rows"]
    return row["prompt_tokens"], row["completion_tokens"]


async def test_a_client_that_leaves_pays_the_engines_prompt_and_tokens_so_far(
    lab: Lab, access_log: AccessLines
) -> None:
    served = await served_with(lab, continuous=True)
    usages = await leave_after(lab, served, 10)
    assert all(usage is not None for usage in usages)  # on every chunk the client saw
    assert (usages[-1].prompt_tokens, usages[-1].completion_tokens) == (5, 10)
    line = await hung_up(access_log)
    assert line["prompt_tokens"] == 5  # the engine's, not the estimate's 1
    assert 10 <= line["completion_tokens"] < 4000  # as the last usage relayed said
    assert await billed(lab, served) == (5, line["completion_tokens"])


async def test_without_it_a_client_that_leaves_pays_its_estimated_prompt(
    lab: Lab, access_log: AccessLines
) -> None:
    served = await served_with(lab, continuous=False)
    usages = await leave_after(lab, served, 10)
    assert all(usage is None for usage in usages)
    line = await hung_up(access_log)
    assert line["prompt_tokens"] == 1  # the estimate
    assert 10 <= line["completion_tokens"] < 4000  # the token events relayed
    assert await billed(lab, served) == (1, line["completion_tokens"])


@pytest.mark.parametrize("asked", [False, True])
async def test_the_usage_only_chunk_is_dropped_unless_asked_the_chunks_keep_theirs(
    lab: Lab, asked: bool
) -> None:
    served = await served_with(lab, continuous=True)
    options = {"stream_options": {"include_usage": True}} if asked else {}
    stream = await lab.client(served, "A").chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, stream=True, **options
    )
    chunks = [chunk async for chunk in stream]
    assert all(chunk.usage is not None for chunk in chunks)  # documented: they reach the client
    assert (chunks[-1].choices == []) is asked  # the usage-only chunk, if asked for
    assert chunks[-1].usage.completion_tokens == 3
