"""Budgets on keys made through the admin API, through the real proxy and the official SDK: a
key's token budget stops it (429 ``budget_exceeded``, naming its alias) and no other key of
its org; an update raises or clears it for the next request; the gauge shows it until the
key is revoked; it is kept with the key (a file, Redis) and holds on every replica; a bad
budget is a 400 naming its field; the CLI sets it; and an API key named like a key of a
replica's file is refused there rather than share that key's budget."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from proxy_lab import KEYS, MODEL, Lab, Served, eventually, sample, scrape
from test_admin_keys import admin, chat, cli, create, keys_config, stored
from test_budgets import assert_refused_for_the_day
from wall import DEC_1, LATE, Wall

from sfq_proxy.sim.server import SimBackend

CHAT = [{"role": "user", "content": "spend my budget"}]
DAY_100 = [{"period": "day", "tokens": 100}]


async def ask(served: Served, secret: str, user: str) -> Any:
    """One request with ``secret``; ``user`` tells the backend's log whose it was."""
    async with openai.AsyncOpenAI(
        base_url=f"{served.url}/v1", api_key=secret, max_retries=0
    ) as client:
        return await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=8, user=user
        )


async def refused(served: Served, secret: str) -> openai.RateLimitError:
    with pytest.raises(openai.RateLimitError) as caught:
        await ask(served, secret, "refused")
    return caught.value


def spent(sim: SimBackend, user: str) -> int:
    """The tokens the backend counted for ``user``'s requests."""
    return sum(r.prompt_tokens + r.completion_tokens for r in sim.stats.log if r.user == user)


async def spend_until_refused(
    sim: SimBackend, served: Served, secret: str, user: str, limit: int
) -> int:
    """Requests with ``secret`` until one is refused: each admitted one started under
    ``limit`` (by the backend's count), the refused one found it used up."""
    for _ in range(100):
        before = spent(sim, user)
        try:
            await ask(served, secret, user)
        except openai.RateLimitError:
            assert before >= limit
            return before
        assert before < limit
    raise AssertionError("never refused")


async def patch(
    http: aiohttp.ClientSession, served: Served, key_id: str, budgets: Any
) -> dict[str, Any]:
    status, answer = await admin(
        http, served, "PATCH", f"/admin/keys/{key_id}", {"budgets": budgets}
    )
    assert status == 200, answer
    return dict(answer["key"])


@pytest.fixture
async def file_store(lab: Lab, tmp_path: Path) -> tuple[SimBackend, Served, aiohttp.ClientSession]:
    """A proxy keeping API keys in a file, on a clock at 23:00:30 UTC."""
    sim = await lab.backend()
    config = keys_config([sim.url], key_store_file=str(tmp_path / "keys.json"))
    return sim, await lab.proxy(config, wall=Wall(LATE)), await lab.http()


async def test_a_keys_token_budget_stops_it_and_no_other_key_of_its_org(
    file_store: tuple[SimBackend, Served, aiohttp.ClientSession],
) -> None:
    sim, served, http = file_store
    status, answer = await admin(
        http, served, "POST", body={"alias": "capped", "org": "T", "budgets": DAY_100}
    )
    assert status == 201, answer
    assert answer["key"]["budgets"] == [{"period": "day", "tokens": 100, "warn_at": 0.8}]
    capped = answer["secret"]
    _, free = await create(http, served, alias="free")  # the same org, T
    used = await spend_until_refused(sim, served, capped, "capped", 100)
    assert_refused_for_the_day(await refused(served, capped), "key 'capped'", used)
    served_before = len(sim.stats.log)
    for _ in range(3):
        await ask(served, free, "free")
        await refused(served, capped)
    assert len(sim.stats.log) == served_before + 3  # a refusal reaches no backend


async def test_an_update_raises_or_clears_a_budget_for_the_next_request(
    file_store: tuple[SimBackend, Served, aiohttp.ClientSession],
) -> None:
    sim, served, http = file_store
    key_id, secret = await create(http, served, alias="capped", budgets=DAY_100)
    used = await spend_until_refused(sim, served, secret, "capped", 100)
    raised = await patch(http, served, key_id, [{"period": "day", "tokens": used + 1}])
    assert raised["budgets"] == [{"period": "day", "tokens": used + 1, "warn_at": 0.8}]
    await ask(served, secret, "capped")  # at once: what was used stays, the limit moved
    await refused(served, secret)
    assert (await patch(http, served, key_id, None))["budgets"] == []
    await ask(served, secret, "capped")
    await patch(http, served, key_id, DAY_100)  # back under a budget: still used up
    await refused(served, secret)
    assert (await patch(http, served, key_id, []))["budgets"] == []
    await ask(served, secret, "capped")
    # a change of anything else keeps the budgets
    await patch(http, served, key_id, [{"period": "month", "tokens": 10**6, "warn_at": 0.5}])
    status, answer = await admin(
        http, served, "PATCH", f"/admin/keys/{key_id}", {"classes": ["batch"]}
    )
    assert status == 200, answer
    assert answer["key"]["budgets"] == [{"period": "month", "tokens": 10**6, "warn_at": 0.5}]


async def test_the_gauge_shows_a_keys_budget_under_its_alias_until_it_is_revoked(
    lab: Lab, file_store: tuple[SimBackend, Served, aiohttp.ClientSession]
) -> None:
    sim, served, http = file_store
    key_id, secret = await create(
        http, served, alias="metered", budgets=[{"period": "month", "tokens": 1000}]
    )
    await ask(served, secret, "metered")
    labels = {"org": "T", "key": "metered", "period": "month", "unit": "tokens"}
    ratio = sample(await scrape(lab, served), "sfq_budget_used_ratio", **labels)
    assert ratio == spent(sim, "metered") / 1000
    await admin(http, served, "DELETE", f"/admin/keys/{key_id}")
    assert sample(await scrape(lab, served), "sfq_budget_used_ratio", **labels) is None
    assert served.state.usage is not None
    assert served.state.usage.ledger.budgets == []  # a revoked key's budgets go with it


async def test_a_keys_budgets_are_kept_in_its_file_and_listed_after_a_restart(
    lab: Lab, tmp_path: Path
) -> None:
    sim = await lab.backend()
    path = tmp_path / "keys.json"
    config = keys_config([sim.url], key_store_file=str(path))
    http = await lab.http()
    first = await lab.proxy(config, wall=Wall(DEC_1))
    budgets = [
        {"period": "day", "tokens": 40, "warn_at": 0.8},
        {"period": "month", "tokens": 900, "warn_at": 0.9},
    ]
    key_id, secret = await create(http, first, alias="kept", budgets=budgets)
    assert json.loads(path.read_text())["keys"][0]["budgets"] == budgets
    assert secret not in path.read_text()
    second = await lab.proxy(config, wall=Wall(DEC_1))
    _, listing = await admin(http, second, "GET")
    [kept] = [key for key in listing["keys"] if key["id"] == key_id]
    assert kept["budgets"] == budgets
    assert [key["budgets"] for key in listing["keys"] if key["source"] == "config"] == [[]] * 4
    await spend_until_refused(sim, second, secret, "kept", 40)


@pytest.mark.parametrize(
    ("budgets", "field"),
    [
        ([{"period": "day", "tokens": 0}], "budgets[0].tokens"),
        ([{"period": "day", "tokens": -5}], "budgets[0].tokens"),
        ([{"period": "day", "tokens": 10**30}], "budgets[0].tokens"),
        ([{"period": "day", "tokens": 10, "money": 1}], "budgets[0]"),
        ([{"period": "week", "tokens": 10}], "budgets[0].period"),
        ([{"period": "day", "tokens": 10, "warn_at": 0}], "budgets[0].warn_at"),
        ([{"period": "day", "money": 5}], "budgets[0].money"),  # the lab's pool has no price
        ([{"period": "day", "tokens": 1}, {"period": "day", "tokens": 2}], "budgets"),
        ("lots", "budgets"),
    ],
)
async def test_a_bad_budget_is_a_400_naming_the_field_and_changes_nothing(
    file_store: tuple[SimBackend, Served, aiohttp.ClientSession], budgets: Any, field: str
) -> None:
    _, served, http = file_store
    body = {"alias": "bad", "org": "T", "budgets": budgets}
    status, answer = await admin(http, served, "POST", body=body)
    assert (status, answer["error"]["code"]) == (400, "invalid_request"), answer
    assert f"{field}:" in answer["error"]["message"]
    assert stored(served) == {}
    key_id, _ = await create(http, served, alias="good", budgets=DAY_100)
    before = stored(served)[key_id]
    path = f"/admin/keys/{key_id}"
    status, answer = await admin(http, served, "PATCH", path, {"budgets": budgets})
    assert (status, answer["error"]["code"]) == (400, "invalid_request"), answer
    assert f"{field}:" in answer["error"]["message"]
    assert stored(served)[key_id] == before


async def test_a_nan_budget_is_a_400(
    file_store: tuple[SimBackend, Served, aiohttp.ClientSession],
) -> None:
    _, served, http = file_store
    raw = b'{"alias": "x", "org": "T", "budgets": [{"period": "day", "tokens": NaN}]}'
    status, _ = await admin(http, served, "POST", raw=raw)
    assert status == 400
    assert stored(served) == {}


async def test_the_cli_sets_lists_and_clears_a_keys_budgets(
    file_store: tuple[SimBackend, Served, aiohttp.ClientSession],
) -> None:
    sim, served, _ = file_store
    code, out, err = await cli(
        served, "create", "--alias", "cli-capped", "--org", "T",
        "--budget", "day:tokens=60", "--budget", "month:tokens=100000:warn=0.9",
    )  # fmt: skip
    assert code == 0, err
    assert "budgets day:tokens=60:warn=0.8,month:tokens=100000:warn=0.9" in out
    secret = next(w for w in out.split() if w.startswith("sk-sfq-"))
    key_id = next(w for w in out.split() if w.startswith("k_"))
    code, out, _ = await cli(served, "list")
    assert code == 0
    [line] = [line for line in out.splitlines() if "cli-capped" in line]
    assert "day:tokens=60:warn=0.8,month:tokens=100000:warn=0.9" in line.split()
    await spend_until_refused(sim, served, secret, "cli-capped", 60)
    code, _, err = await cli(served, "update", key_id, "--budget", "day:tokens=1000000")
    assert code == 0, err
    await ask(served, secret, "cli-capped")
    code, out, err = await cli(served, "update", key_id, "--no-budgets")
    assert (code, stored(served)[key_id].budgets) == (0, ()), err
    [line] = [line for line in (await cli(served, "list"))[1].splitlines() if key_id in line]
    assert line.split()[6] == "-"
    code, _, err = await cli(served, "update", key_id, "--budget", "day:tokens=0")
    assert (code, "budgets[0].tokens" in err) == (1, True), err
    for bad in ("week:tokens=5", "day:tokens=-5", "day:money=nan", "day:tokens=5:warn="):
        code, _, err = await cli(served, "update", key_id, "--budget", bad)
        assert (code, "--budget" in err) == (2, True), (bad, err)
    code, _, err = await cli(served, "update", key_id, "--budget", "day:tokens=5", "--no-budgets")
    assert (code, "--no-budgets" in err) == (2, True), err
    assert stored(served)[key_id].budgets == ()


@pytest.mark.redis
async def test_a_budget_set_through_one_replica_holds_on_the_other(
    lab: Lab, redis_url: str
) -> None:
    """Set on proxy 1, the budget reaches proxy 2 with the key; proxy 2 counts proxy 1's
    usage once both have flushed (each flush: within flush_s of each other), as an org's."""
    sim = await lab.backend()
    state = {"redis": redis_url, "lease_ttl_s": 30}
    config = keys_config([sim.url], state=state, usage={"flush_s": 3600})
    wall = Wall(DEC_1 + 10)
    one, two = await lab.proxy(config, wall=wall), await lab.proxy(config, wall=wall)
    http = await lab.http()
    key_id, secret = await create(
        http, one, alias="everywhere", budgets=[{"period": "day", "tokens": 50}]
    )
    await eventually(lambda: key_id in stored(two), 1.0)
    await spend_until_refused(sim, one, secret, "everywhere", 50)
    await ask(two, secret, "everywhere")  # not yet written: proxy 2 knows only its own
    assert one.state.usage is not None
    assert two.state.usage is not None
    await one.state.usage.flush()
    await two.state.usage.flush()
    err = await refused(two, secret)
    assert "key 'everywhere'" in err.response.json()["error"]["message"]
    # raised through proxy 2: proxy 1 admits it again once it hears
    await patch(http, two, key_id, [{"period": "day", "tokens": 10**6}])
    await eventually(lambda: stored(one)[key_id].budgets[0].tokens == 10**6, 1.0)
    await ask(one, secret, "everywhere")


@pytest.mark.redis
async def test_an_api_key_named_like_a_replicas_file_key_is_refused_there(
    lab: Lab, redis_url: str
) -> None:
    """Aliases are unique against the file's names of the replica that makes the key; a
    replica whose file has a key of that name (a config not rolled out everywhere yet)
    refuses the API key rather than count it against that key's budget."""
    sim = await lab.backend()
    state = {"redis": redis_url, "lease_ttl_s": 30}
    one = await lab.proxy(keys_config([sim.url], state=state))
    named = {"key": KEYS["A"], "org": "A", "classes": ["batch"], "name": "twin",
             "budgets": [{"period": "day", "tokens": 10**6}]}  # fmt: skip
    two = await lab.proxy(keys_config([sim.url], state=state, keys=[named]))
    http = await lab.http()
    status, answer = await admin(http, two, "POST", body={"alias": "twin", "org": "T"})
    assert (status, "alias" in answer["error"]["message"]) == (400, True)
    key_id, secret = await create(http, one, alias="twin", budgets=DAY_100)
    await eventually(lambda: key_id in stored(two), 1.0)
    assert await chat(one, secret) == "ok"
    assert await chat(two, secret) == "401 invalid_api_key"
    assert two.state.usage is not None
    [budget] = two.state.usage.ledger.budgets  # the file's key's own, and no other
    assert (budget.name, budget.org, budget.spec.tokens) == ("twin", "A", 10**6)
