"""Usage you can bill from, through the real proxy: what ``GET /admin/usage`` says equals what
the simulated backends themselves counted, per org, key, pool and model, for JSON and
streamed answers; it survives a restart on the same SQLite file, folds by step, exports as
CSV, refuses bad parameters by name, and two proxies on one Redis add into one account."""

from __future__ import annotations

import csv
import io
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from proxy_lab import KEYS, MODEL, AccessLines, Lab, Served, config_yaml, proxy_config
from redis.exceptions import RedisError
from redis_server import RedisServer

from sfq_proxy.config import Config, ConfigError, parse_config
from sfq_proxy.core.usage import Counts
from sfq_proxy.http.app import build_app
from sfq_proxy.http.proxy import PROXY
from sfq_proxy.runner.server import bound_url, running
from sfq_proxy.sim.server import SimBackend
from sfq_proxy.state.usage_store import SqliteStore

OTHER_MODEL = "sim-mistral"
ADMIN = {"Authorization": "Bearer sk-admin-usage"}
ENV = {"ADMIN_KEY": "sk-admin-usage"}
CHAT = [{"role": "user", "content": "count my tokens, please"}]
DEC_1 = 1_764_547_200  # 2025-12-01T00:00:00Z
Tally = Counter[tuple[str, str, str, str]]  # (org, key, pool, model) → what was used


class Wall:
    """A Unix-time clock the test moves."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def two_pools(sims: list[SimBackend], **fields: Any) -> Config:
    """Orgs A, B, C (proxy_lab's keys) on two pools: ``sim`` serves MODEL, ``mistral``
    OTHER_MODEL (priced), with the admin API on."""
    yaml_text = config_yaml(
        [sims[0].url],
        admin_key_env="ADMIN_KEY",
        pools={
            "sim": {"models": [MODEL], "backends": [{"url": sims[0].url, "slots": 4}]},
            "mistral": {
                "models": [OTHER_MODEL],
                "backends": [{"url": sims[1].url, "slots": 4}],
                "prices": {"*": {"prompt_per_1m": 2.0, "completion_per_1m": 6.0}},
            },
        },
        **fields,
    )
    return parse_config(yaml_text, environ=ENV)


async def workload(lab: Lab, served: Served) -> None:
    """JSON and streamed requests of A and B to both models; the user field names the org
    (the backends' log says whose each request was)."""
    for org, model, stream, tokens in [
        ("A", MODEL, False, 7), ("A", MODEL, True, 5), ("A", OTHER_MODEL, False, 11),
        ("A", OTHER_MODEL, True, 3), ("B", MODEL, False, 9), ("B", OTHER_MODEL, True, 4),
        ("B", MODEL, True, 6),
    ]:  # fmt: skip
        client = lab.client(served, org)
        ask: dict[str, Any] = {"model": model, "messages": CHAT, "max_tokens": tokens, "user": org}
        if stream:  # without stream_options: the proxy asks for the usage itself
            chunks = await client.chat.completions.create(**ask, stream=True)
            assert [c async for c in chunks]
        else:
            await client.chat.completions.create(**ask)


def served_by(sims: list[SimBackend], pools: list[str]) -> Tally:
    """What the backends counted: requests, prompt and completion tokens per (org, pool)."""
    tally: Tally = Counter()
    for sim, pool in zip(sims, pools, strict=True):
        for rec in sim.stats.log:
            org = str(rec.user)
            tally[(org, "requests", pool, rec.model)] += 1
            tally[(org, "prompt_tokens", pool, rec.model)] += rec.prompt_tokens
            tally[(org, "completion_tokens", pool, rec.model)] += rec.completion_tokens
    return tally


def reported(rows: list[dict[str, Any]]) -> Tally:
    tally: Tally = Counter()
    for row in rows:
        for name in ("requests", "prompt_tokens", "completion_tokens"):
            tally[(row["org"], name, row["pool"], row["model"])] += row[name]
    return tally


async def usage(lab: Lab, served: Served, status: int = 200, **params: str) -> Any:
    http = await lab.http()
    async with http.get(f"{served.url}/admin/usage", params=params, headers=ADMIN) as resp:
        assert resp.status == status, await resp.text()
        if resp.content_type == "text/csv":
            return await resp.text()
        return await resp.json()


async def test_usage_is_what_the_backends_counted_per_org_key_pool_and_model(lab: Lab) -> None:
    sims = [await lab.backend(), await lab.backend(models=[OTHER_MODEL])]
    served = await lab.proxy(two_pools(sims))
    await workload(lab, served)
    answer = await usage(lab, served, group_by="org,key,pool,model")
    rows = answer["rows"]
    assert reported(rows) == served_by(sims, ["sim", "mistral"])
    assert answer["group_by"] == ["org", "key", "pool", "model"]
    assert answer["step"] is None
    assert {row["key"] for row in rows} == {"A#0", "B#1"}  # the keys' names, never a secret
    assert not any(secret in str(answer) for secret in KEYS.values())
    for row in rows:
        assert row["charged_cost"] > 0
        assert row["actual_cost"] > 0
        if row["pool"] == "sim":  # no price table: no money
            assert row["money"] is None
        else:
            expected = (2.0 * row["prompt_tokens"] + 6.0 * row["completion_tokens"]) / 1e6
            assert row["money"] == pytest.approx(expected)
    by_org = (await usage(lab, served))["rows"]  # group_by defaults to org
    assert [(r["org"], r["requests"]) for r in by_org] == [("A", 4), ("B", 3)]


async def test_a_refused_request_counts_nothing(lab: Lab) -> None:
    sims = [await lab.backend(), await lab.backend(models=[OTHER_MODEL])]
    served = await lab.proxy(two_pools(sims))
    http = await lab.http()
    bad = {"model": "no-such-model", "messages": CHAT}
    headers = {"Authorization": f"Bearer {KEYS['A']}"}
    async with http.post(f"{served.url}/v1/chat/completions", json=bad, headers=headers) as r:
        assert r.status == 404
    async with http.post(f"{served.url}/v1/chat/completions", json={"model": MODEL}) as r:
        assert r.status == 401
    assert (await usage(lab, served))["rows"] == []


async def test_usage_survives_a_restart_on_its_sqlite_file(lab: Lab, tmp_path: Path) -> None:
    sims = [await lab.backend(), await lab.backend(models=[OTHER_MODEL])]
    config = two_pools(sims, usage={"file": str(tmp_path / "usage.db"), "flush_s": 3600})
    for _ in range(2):  # the second life adds to what the first one wrote at its end
        async with running(config) as runner:
            await workload(lab, Served(bound_url(runner), runner.app[PROXY]))
    async with running(config) as runner:
        answer = await usage(lab, Served(bound_url(runner), runner.app[PROXY]),
                             group_by="org,pool,model")  # fmt: skip
    assert reported(answer["rows"]) == served_by(sims, ["sim", "mistral"])
    assert sum(r["requests"] for r in answer["rows"]) == 14


async def test_steps_fold_by_utc_hour_day_and_month_and_csv_has_the_same_rows(lab: Lab) -> None:
    sims = [await lab.backend(), await lab.backend(models=[OTHER_MODEL])]
    wall = Wall(DEC_1 - 60)  # 2025-11-30T23:59:00Z
    served = await lab.proxy(two_pools(sims), wall=wall)
    client = lab.client(served, "A")
    for now in (DEC_1 - 60, DEC_1 + 60, DEC_1 + 3600 + 5, DEC_1 + 86400):
        wall.now = now
        await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    span = {"since": "2025-11-30T00:00:00Z", "until": str(DEC_1 + 2 * 86400)}
    starts = {}
    for step in ("hour", "day", "month"):
        rows = (await usage(lab, served, step=step, **span))["rows"]
        starts[step] = [(r["start"], r["requests"]) for r in rows]
    assert starts["hour"] == [
        ("2025-11-30T23:00:00Z", 1), ("2025-12-01T00:00:00Z", 1),
        ("2025-12-01T01:00:00Z", 1), ("2025-12-02T00:00:00Z", 1),
    ]  # fmt: skip
    assert starts["day"] == [
        ("2025-11-30T00:00:00Z", 1), ("2025-12-01T00:00:00Z", 2), ("2025-12-02T00:00:00Z", 1)
    ]  # fmt: skip
    # a month's step starts no earlier than the query's since
    assert starts["month"] == [("2025-11-30T00:00:00Z", 1), ("2025-12-01T00:00:00Z", 3)]
    wall.now = DEC_1 + 86400 + 10
    today = await usage(lab, served)  # since: today's start (UTC), until: now
    assert today["since"] == "2025-12-02T00:00:00Z"
    assert [r["requests"] for r in today["rows"]] == [1]
    as_json = await usage(lab, served, step="day", group_by="org,model", **span)
    as_csv = await usage(lab, served, step="day", group_by="org,model", format="csv", **span)
    parsed = list(csv.DictReader(io.StringIO(as_csv)))
    assert list(parsed[0]) == [
        "start", "org", "model", "requests", "prompt_tokens", "completion_tokens",
        "charged_cost", "actual_cost", "money",
    ]  # fmt: skip
    assert [
        {k: str(v) if v is not None else "" for k, v in row.items()} for row in as_json["rows"]
    ] == parsed


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"group_by": "team"}, "group_by"),
        ({"group_by": "org,org"}, "group_by"),
        ({"group_by": ""}, "group_by"),
        ({"since": "yesterday"}, "since"),
        ({"since": "nan"}, "since"),
        ({"until": "-5"}, "until"),
        ({"until": "1e400"}, "until"),
        ({"since": "2025-12-02T00:00:00Z", "until": "2025-12-01T00:00:00Z"}, "until"),
        ({"since": "0", "until": "100000000"}, "since"),
        ({"step": "week"}, "step"),
        ({"format": "xml"}, "format"),
    ],
)
async def test_bad_parameters_are_400_naming_the_parameter(
    lab: Lab, params: dict[str, str], named: str
) -> None:
    sims = [await lab.backend(), await lab.backend(models=[OTHER_MODEL])]
    served = await lab.proxy(two_pools(sims))
    answer = await usage(lab, served, 400, **params)
    assert answer["error"]["type"] == "invalid_request_error"
    assert f"'{named}'" in answer["error"]["message"]


async def test_usage_needs_the_admin_key(lab: Lab) -> None:
    sims = [await lab.backend(), await lab.backend(models=[OTHER_MODEL])]
    served = await lab.proxy(two_pools(sims))
    http = await lab.http()
    for headers, status in (({}, 401), ({"Authorization": f"Bearer {KEYS['A']}"}, 401)):
        async with http.get(f"{served.url}/admin/usage", headers=headers) as resp:
            assert resp.status == status
            assert (await resp.json())["error"]["code"] == "invalid_api_key"


async def test_the_access_log_names_the_key_and_the_time(lab: Lab, access_log: AccessLines) -> None:
    sims = [await lab.backend(), await lab.backend(models=[OTHER_MODEL])]
    served = await lab.proxy(two_pools(sims), wall=Wall(DEC_1))
    await lab.client(served, "B").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    [line] = [line for line in await access_log() if line.get("org") == "B"]
    assert line["key"] == "B#1"
    assert line["ts"].endswith("Z")
    assert line["ts"][:4].isdigit()
    assert line["prompt_tokens"] == sims[0].stats.log[0].prompt_tokens
    assert KEYS["B"] not in str(line)


@pytest.mark.redis
async def test_two_proxies_on_one_redis_add_into_one_account(lab: Lab, redis_url: str) -> None:
    sims = [await lab.backend(), await lab.backend(models=[OTHER_MODEL])]
    config = two_pools(sims, state={"redis": redis_url}, usage={"flush_s": 3600})
    first, second = await lab.proxy(config), await lab.proxy(config)
    await workload(lab, first)
    await workload(lab, second)
    await first.state.usage.flush()  # the other replica's rows reach Redis at its flush
    answer = await usage(lab, second, group_by="org,key,pool,model")
    assert reported(answer["rows"]) == served_by(sims, ["sim", "mistral"])
    assert sum(r["requests"] for r in answer["rows"]) == 14


def test_proxy_config_is_unchanged_by_the_usage_section() -> None:
    """The default: usage in the process only, written every 5 s."""
    config = proxy_config(["http://127.0.0.1:9"])
    assert (config.usage.file, config.usage.flush_s, config.usage.retention_days) == (
        None, 5.0, 400,
    )  # fmt: skip


@pytest.mark.parametrize("damage", ["missing directory", "not a database"])
async def test_an_unusable_usage_file_stops_the_start_naming_usage_file(
    tmp_path: Path, damage: str
) -> None:
    path = tmp_path / "usage.db"
    if damage == "missing directory":
        path = tmp_path / "nowhere" / "usage.db"
    else:
        path.write_bytes(b"this is no SQLite file, but a tenant's garbage" * 100)
    config = proxy_config(["http://127.0.0.1:9"], usage={"file": str(path)})
    with pytest.raises(ConfigError) as caught:
        build_app(config)
    [(where, message)] = caught.value.errors
    assert where == "usage.file"
    assert message.startswith("cannot use it as a SQLite file")


async def test_a_reload_cannot_move_the_usage_file(lab: Lab, tmp_path: Path) -> None:
    sims = [await lab.backend(), await lab.backend(models=[OTHER_MODEL])]
    served = await lab.proxy(two_pools(sims, usage={"file": str(tmp_path / "a.db")}))
    moved = two_pools(sims, usage={"file": str(tmp_path / "b.db"), "flush_s": 1})
    assert served.state.reload(moved) == ["usage.file cannot change by a reload: restart to use it"]
    assert not (tmp_path / "b.db").exists()


@pytest.mark.redis
async def test_a_write_cut_by_a_lost_redis_is_written_once_later(
    lab: Lab, redis_url: str, redis_server: RedisServer
) -> None:
    """Redis stops answering while a flush writes (it gets the write, its answer comes too
    late): the flush fails, its rows stay counted (budgets see them), and the next flush
    sends the batch again under its id, which Redis applies once."""
    sims = [await lab.backend(), await lab.backend(models=[OTHER_MODEL])]
    state = {"redis": redis_url, "lease_ttl_s": 30}  # the pause must not lapse the leases
    config = two_pools(sims, state=state, usage={"flush_s": 3600})
    served = await lab.proxy(config)
    book = served.state.usage
    assert book is not None
    await workload(lab, served)
    redis_server.pause()
    try:
        with pytest.raises((RedisError, TimeoutError)):
            await book.flush()
        answer = await usage(lab, served, 503)  # a query: an OpenAI-style 503
        assert answer["error"]["message"] == "The usage store did not answer; try again."
    finally:
        redis_server.resume()
    assert book.ledger.writing  # still counted, not yet read back
    await book.flush()
    await book.flush()  # nothing left to write twice
    answer = await usage(lab, served, group_by="org,key,pool,model")
    assert reported(answer["rows"]) == served_by(sims, ["sim", "mistral"])


async def test_sqlite_applies_a_batch_once_and_forgets_its_id_after_a_day(tmp_path: Path) -> None:
    """A flush cancelled while its thread commits is sent again: the file adds it once."""
    wall = Wall(DEC_1)
    store = SqliteStore(tmp_path / "usage.db", wall)
    rows = {(DEC_1, "A", "A#0", "sim", MODEL): Counts(1, 10, 5)}
    for _ in range(2):
        await store.add("batch-1", rows)
    assert [c.prompt_tokens for _, c in await store.rows(DEC_1, DEC_1 + 3600)] == [10]
    wall.now += 86400 + 1  # an id is remembered for a day, then forgotten
    await store.add("batch-2", rows)
    await store.add("batch-1", rows)
    assert [c.requests for _, c in await store.rows(DEC_1, DEC_1 + 3600)] == [3]
    await store.close()
