"""Hot reload of the YAML (SIGHUP, POST /admin/reload) without dropping a request."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from proxy_lab import (
    KEYS,
    MODEL,
    Lab,
    Served,
    banner_url,
    config_yaml,
    eventually,
    proxy_config,
)

from sfq_proxy.config import load_config
from sfq_proxy.http.proxy import PROXY
from sfq_proxy.runner.server import bound_url, running

CHAT = [{"role": "user", "content": "hi"}]
ADMIN = {"ADMIN_KEY": "sk-admin-reload"}


@contextlib.asynccontextmanager
async def reloadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, urls: list[str], **options: Any
) -> AsyncIterator[tuple[Served, Path]]:
    """A proxy started from a file, with the admin API on, and that file's path."""
    monkeypatch.setenv("ADMIN_KEY", ADMIN["ADMIN_KEY"])
    path = tmp_path / "config.yaml"
    path.write_text(config_yaml(urls, admin_key_env="ADMIN_KEY", **options))
    async with running(load_config(path), config_path=path) as runner:
        yield Served(bound_url(runner), runner.app[PROXY]), path


async def reload(lab: Lab, served: Served) -> tuple[int, dict]:
    http = await lab.http()
    headers = {"Authorization": f"Bearer {ADMIN['ADMIN_KEY']}"}
    async with http.post(f"{served.url}/admin/reload", headers=headers) as r:
        return r.status, await r.json()


async def test_weights_change_under_load_without_losing_a_request(
    lab: Lab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = await lab.backend(max_num_seqs=1, time_scale=10.0)
    async with reloadable(tmp_path, monkeypatch, [sim.url], slots=1) as (served, path):
        blocker = await lab.client(served, "C").chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=4000, stream=True
        )
        flood = [
            lab.client(served, org).chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=10, user=org
            )
            for _ in range(60)
            for org in "AB"
        ]
        replies = asyncio.gather(*flood, return_exceptions=True)
        queue, recent = served.queue(), served.state.pools["sim"].recent
        await eventually(lambda: len(queue) == 120, within=10)
        await blocker.close()
        await eventually(lambda: len(recent) >= 21, within=10)  # the blocker + 20 at 1:1
        path.write_text(
            config_yaml([sim.url], slots=1, admin_key_env="ADMIN_KEY", orgs={"A": {"weight": 3}})
        )
        meters = (queue.meter("A/batch"), queue.meter("B/batch"))
        status, body = await reload(lab, served)
        assert (status, body["reloaded"]) == (200, True)
        assert (queue.meter("A/batch"), queue.meter("B/batch")) == meters  # nobody jumps
        at = len(recent)
        results = await replies
    assert not [r for r in results if isinstance(r, BaseException)]  # none failed
    assert sim.stats.completed == 120
    assert sim.stats.aborted == 1
    after = [d.flow.split("/")[0] for d in list(recent)[at : at + 40]]
    a = b = 0
    for org in after:
        a, b = a + (org == "A"), b + (org == "B")
        assert abs(a / 3 - b) <= 1 / 3 + 1 + 1, after  # the 3:1 SFQ bound, +1 for the switch
    assert a >= 27, after  # about 30 of 40


async def test_revoked_key_is_refused_while_its_running_request_finishes(
    lab: Lab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = await lab.backend(time_scale=10.0)
    async with reloadable(tmp_path, monkeypatch, [sim.url]) as (served, path):
        running_b = await lab.client(served, "B").chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=200, stream=True
        )
        await eventually(lambda: sim.stats.running == 1)
        text = path.read_text().replace(f"key: {KEYS['B']}", "key: sk-someone-else")
        path.write_text(text)
        assert (await reload(lab, served))[0] == 200
        with pytest.raises(openai.AuthenticationError):
            await lab.client(served, "B").chat.completions.create(model=MODEL, messages=CHAT)
        chunks = [c async for c in running_b]
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 200


async def test_a_removed_backend_gets_nothing_new_and_finishes_its_work(
    lab: Lab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept, removed = await lab.backend(time_scale=10.0), await lab.backend(time_scale=10.0)
    async with reloadable(tmp_path, monkeypatch, [kept.url, removed.url], slots=1) as (
        served, path
    ):  # fmt: skip
        streams = [
            await lab.client(served, org).chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=200, stream=True
            )
            for org in "AB"
        ]
        await eventually(lambda: removed.stats.running == 1 and kept.stats.running == 1)
        path.write_text(config_yaml([kept.url], slots=4, admin_key_env="ADMIN_KEY"))
        assert (await reload(lab, served))[0] == 200
        replies = await asyncio.gather(
            *(lab.client(served).chat.completions.create(model=MODEL, messages=CHAT)
              for _ in range(6))
        )  # fmt: skip
        assert len(replies) == 6
        for stream in streams:  # both in-flight streams run to their end
            assert len([c async for c in stream if c.choices and c.choices[0].delta.content]) == 200
    assert removed.stats.requests_seen == 1
    assert kept.stats.requests_seen == 1 + 6


async def test_a_broken_file_is_refused_with_its_path_and_changes_nothing(
    lab: Lab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = await lab.backend()
    async with reloadable(tmp_path, monkeypatch, [sim.url]) as (served, path):
        path.write_text(config_yaml([sim.url], slots=0, admin_key_env="ADMIN_KEY"))
        status, body = await reload(lab, served)
        assert status == 400
        assert "pools.sim.backends[0].slots: must be > 0" in body["error"]["message"]
        assert served.state.pools["sim"].placement.backends[0].slots == 4
        reply = await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT)
        assert reply.choices


async def test_reload_needs_the_admin_key(lab: Lab) -> None:
    sim = await lab.backend()
    served = await lab.proxy(proxy_config([sim.url]))
    http = await lab.http()
    async with http.post(f"{served.url}/admin/reload") as r:
        assert r.status == 403  # the admin API is off without admin_key_env


async def test_sighup_reloads_the_file_of_sfq_proxy_serve(lab: Lab, tmp_path: Path) -> None:
    sim = await lab.backend()
    path = tmp_path / "config.yaml"
    path.write_text(config_yaml([sim.url]))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sfq_proxy.cli", "serve", "--config", str(path),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        url = banner_url(line)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["C"], max_retries=0)
        await client.chat.completions.create(model=MODEL, messages=CHAT)
        path.write_text(path.read_text().replace(f"key: {KEYS['C']}", "key: sk-rotated"))
        proc.send_signal(signal.SIGHUP)

        async def refused() -> bool:
            try:
                await client.chat.completions.create(model=MODEL, messages=CHAT)
            except openai.AuthenticationError:
                return True
            return False

        await eventually(refused, within=5)
        await client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0


async def test_an_added_backend_takes_requests_after_its_first_good_probe(
    lab: Lab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, added = await lab.backend(), await lab.backend()
    async with reloadable(tmp_path, monkeypatch, [first.url]) as (served, path):
        path.write_text(config_yaml([first.url, added.url], admin_key_env="ADMIN_KEY"))
        assert (await reload(lab, served))[0] == 200
        new = served.state.pools["sim"].placement.backends[1]
        await eventually(lambda: new.healthy)  # after its first good probe
        client = lab.client(served)
        await asyncio.gather(
            *(client.chat.completions.create(model=MODEL, messages=CHAT) for _ in range(8))
        )
    assert added.stats.requests_seen > 0


async def test_a_reload_expands_the_files_variables_again(
    lab: Lab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``${NAME}`` is read from the environment at every load: a reload of the same file
    follows the variable, and one the variable left unset is refused with its path."""
    first, second = await lab.backend(), await lab.backend()
    monkeypatch.setenv("SIM_URL", first.url)
    async with reloadable(tmp_path, monkeypatch, ["${SIM_URL}"]) as (served, _):
        placement = served.state.pools["sim"].placement
        assert [b.url for b in placement.backends] == [first.url]
        monkeypatch.delenv("SIM_URL")
        status, body = await reload(lab, served)
        assert status == 400
        assert (
            "pools.sim.backends[0].url: environment variable SIM_URL is not set"
            in body["error"]["message"]
        )
        monkeypatch.setenv("SIM_URL", second.url)
        assert (await reload(lab, served))[0] == 200
        await eventually(lambda: [b.url for b in placement.backends if b.healthy] == [second.url])
        reply = await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT)
        assert reply.choices
    assert second.stats.requests_seen == 1
