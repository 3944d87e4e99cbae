"""The commands as a user runs them: ``sfq-proxy serve`` and ``sfq-proxy demo`` in a process."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import openai
import yaml
from proxy_lab import KEYS, MODEL, Lab, banner_url, config_yaml, eventually, proxy_config

CHAT = [{"role": "user", "content": "hello"}]


async def _start(
    *args: str, env: dict[str, str] | None = None
) -> tuple[asyncio.subprocess.Process, str]:
    """Run ``sfq-proxy ARGS`` (with ``env`` added to the environment); return the process and
    the URL from its first line."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sfq_proxy.cli", *args, stdout=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
    url = banner_url(line)
    return proc, url


async def test_serve_drains_on_sigterm(lab: Lab, tmp_path: Path) -> None:
    sim = await lab.backend(time_scale=1.0, decode_tokens_per_s=50.0)
    config = proxy_config([sim.url]).model_dump(mode="json", exclude_none=True)
    config["keys"] = [{"key": KEYS["A"], "org": "A", "classes": ["batch"]}]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    proc, url = await _start("serve", "--config", str(path))
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["A"], max_retries=0)
    reply = asyncio.create_task(
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30)
    )
    await eventually(lambda: sim.stats.running == 1, within=10)
    proc.send_signal(signal.SIGTERM)
    assert (await reply).usage.completion_tokens == 30  # drained, not cut
    assert await asyncio.wait_for(proc.wait(), 10) == 0
    await client.close()


async def test_serve_takes_its_backend_url_from_the_environment(lab: Lab, tmp_path: Path) -> None:
    sim = await lab.backend()
    path = tmp_path / "config.yaml"
    path.write_text(config_yaml(["${SIM_URL}"]))
    assert "${SIM_URL}" in path.read_text()
    proc, url = await _start("serve", "--config", str(path), env={"SIM_URL": sim.url})
    try:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["A"], max_retries=0)
        reply = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)
        assert reply.usage.completion_tokens == 3
        assert sim.stats.completed == 1
        await client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0


async def test_demo_serves_its_keys_and_stops_on_ctrl_c() -> None:
    proc, url = await _start("demo")
    try:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-demo-product")
        reply = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)
        assert reply.usage.completion_tokens == 3
        await client.close()
    finally:
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
