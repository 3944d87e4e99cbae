"""Access per key through the real proxy (docs/access.md): a key limited to some pools or
models is refused the others with a 403 that costs its org nothing, and sees only its own
in /v1/models."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from proxy_lab import KEYS, MODEL, Lab, Served, config_yaml

from sfq_proxy.config import load_config, parse_config
from sfq_proxy.sim.server import SimBackend

PAID = "paid-model"  # the paid provider's model, in pool "paid"
CHAT = [{"role": "user", "content": "hi"}]
ADMIN_KEY = "sk-admin-access"


def access_yaml(
    sim: SimBackend, paid: SimBackend, a_pools: list[str] | None, **options: Any
) -> str:
    """Pools ``sim`` (MODEL) and ``paid`` (PAID); A's key limited to ``a_pools``, B's key
    unrestricted, C's key to the model PAID alone."""
    health = {"interval_s": 0.1, "cooldown_s": 0.2, "timeout_s": 5}
    pools = {
        name: {"models": [model], "health": health, "backends": [{"url": url, "slots": 4}]}
        for name, model, url in (("sim", MODEL, sim.url), ("paid", PAID, paid.url))
    }
    pools["paid"]["extra_paths"] = [{"path": "/v1/rerank", "cost": {"fixed": 50}}]
    keys = [
        {"key": KEYS["A"], "org": "A", "classes": ["batch"], "pools": a_pools},
        {"key": KEYS["B"], "org": "B", "classes": ["batch"]},
        {"key": KEYS["C"], "org": "C", "classes": ["interactive"], "models": [PAID]},
    ]
    return config_yaml([sim.url], keys=keys, pools=pools, **options)


async def two_pools(lab: Lab, **options: Any) -> tuple[SimBackend, SimBackend, Served]:
    """The two backends and a proxy in front of them, A limited to pool ``sim``."""
    sim, paid = await lab.backend(), await lab.backend(models=[PAID])
    config = parse_config(access_yaml(sim, paid, ["sim"], **options), environ={})
    return sim, paid, await lab.proxy(config)


async def ask(lab: Lab, served: Served, org: str, model: str, **options: Any) -> Any:
    return await lab.client(served, org).chat.completions.create(
        model=model, messages=CHAT, max_tokens=4, **options
    )


async def test_a_key_limited_to_one_pool_is_refused_the_other_and_served_on_its_own(
    lab: Lab,
) -> None:
    """The refusal comes before any limit is consulted: with an rpm of 1, two refused
    requests (one a stream) leave A's one request of the minute to the allowed call."""
    sim, paid, served = await two_pools(lab, orgs={"A": {"rpm": 1}})
    for stream in (False, True):
        with pytest.raises(openai.PermissionDeniedError) as info:
            await ask(lab, served, "A", PAID, stream=stream)
        assert info.value.status_code == 403
        assert info.value.body["code"] == "model_not_allowed"
        assert info.value.body["message"] == (
            "This key may not use the model 'paid-model' (pool 'paid'); it may use: pools 'sim'."
        )
    assert served.queue("paid").flows() == []  # never queued, never charged
    reply = await ask(lab, served, "A", MODEL)
    assert reply.choices[0].message.content
    assert paid.stats.requests_seen == 0  # nothing of A reached the paid provider
    assert [r.model for r in sim.stats.log] == [MODEL]
    await ask(lab, served, "B", PAID)  # an unrestricted key is served on both pools
    assert paid.stats.requests_seen == 1


async def test_a_key_limited_to_one_model_is_refused_the_rest(lab: Lab) -> None:
    sim, paid, served = await two_pools(lab)
    with pytest.raises(openai.PermissionDeniedError) as info:
        await ask(lab, served, "C", MODEL)
    assert info.value.body["message"].endswith("it may use: models 'paid-model'.")
    await ask(lab, served, "C", PAID)
    assert (sim.stats.requests_seen, paid.stats.requests_seen) == (0, 1)


async def test_an_extra_path_of_a_pool_the_key_may_not_use_is_refused_before_the_backend(
    lab: Lab,
) -> None:
    """Another door into the same pool: the pool's extra paths are held to the same rule."""
    _, paid, served = await two_pools(lab)
    http = await lab.http()
    body = {"model": PAID, "query": "q", "documents": ["d"]}
    headers = {"Authorization": f"Bearer {KEYS['A']}"}
    async with http.post(f"{served.url}/v1/rerank", json=body, headers=headers) as r:
        assert r.status == 403
        assert (await r.json())["error"]["code"] == "model_not_allowed"
    assert paid.stats.requests_seen == 0


async def test_models_lists_only_what_the_key_may_use_and_hides_the_rest(lab: Lab) -> None:
    _, _, served = await two_pools(lab)
    listed = {
        org: sorted([m.id async for m in lab.client(served, org).models.list()]) for org in "ABC"
    }
    assert listed == {"A": [MODEL], "B": sorted([MODEL, PAID]), "C": [PAID]}
    assert (await lab.client(served, "A").models.retrieve(MODEL)).owned_by == "sim"
    with pytest.raises(openai.NotFoundError) as info:  # as if it did not exist
        await lab.client(served, "A").models.retrieve(PAID)
    assert info.value.body["code"] == "model_not_found"
    assert info.value.body["message"] == (
        "The model 'paid-model' does not exist or is not served here."
    )
    assert (await lab.client(served, "B").models.retrieve(PAID)).owned_by == "paid"


async def test_a_reload_that_narrows_a_keys_pools_holds_from_the_next_request(
    lab: Lab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADMIN_KEY", ADMIN_KEY)
    sim, paid, served, reload_with = await reloadable(lab, tmp_path, None)
    await ask(lab, served, "A", PAID)
    status, _ = await reload_with(["sim"])
    assert status == 200
    with pytest.raises(openai.PermissionDeniedError):
        await ask(lab, served, "A", PAID)
    assert [m.id async for m in lab.client(served, "A").models.list()] == [MODEL]
    await ask(lab, served, "A", MODEL)
    assert (paid.stats.requests_seen, sim.stats.requests_seen) == (1, 1)


async def test_a_reload_with_a_misspelt_pool_is_refused_and_changes_nothing(
    lab: Lab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADMIN_KEY", ADMIN_KEY)
    _, _, served, reload_with = await reloadable(lab, tmp_path, ["sim"])
    status, answer = await reload_with(["sims"])
    assert status == 400
    message = answer["error"]["message"]
    assert "keys[0].pools[0]: pool 'sims' is not defined; did you mean 'sim'?" in message
    with pytest.raises(openai.PermissionDeniedError):  # still limited to sim
        await ask(lab, served, "A", PAID)
    await ask(lab, served, "A", MODEL)


Reload = Callable[[list[str] | None], Awaitable[tuple[int, Any]]]


async def reloadable(
    lab: Lab, tmp_path: Path, pools: list[str] | None
) -> tuple[SimBackend, SimBackend, Served, Reload]:
    """A proxy on a config file whose key A may use ``pools`` (None: any), and a function
    that rewrites the file with other pools and asks it to reload (its status and answer)."""
    sim, paid = await lab.backend(), await lab.backend(models=[PAID])
    path = tmp_path / "config.yaml"
    path.write_text(access_yaml(sim, paid, pools, admin_key_env="ADMIN_KEY"))
    served = await lab.proxy(load_config(path), config_path=path)

    async def reload_with(new_pools: list[str] | None) -> tuple[int, Any]:
        path.write_text(access_yaml(sim, paid, new_pools, admin_key_env="ADMIN_KEY"))
        http = await lab.http()
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with http.post(f"{served.url}/admin/reload", headers=headers) as r:
            return r.status, await r.json()

    return sim, paid, served, reload_with
