"""Budgets through the real proxy, on a clock the test moves: a token budget stops its org at
the first request after it is used up (429 ``budget_exceeded``, its message and Retry-After),
other orgs go on, midnight UTC gives it back; a money budget on a key counts the price table;
a reload changes a budget and keeps what was used; the gauge and its alert rule exist."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from proxy_lab import KEYS, MODEL, Lab, Served, config_yaml, eventually
from wall import DEC_1, LATE, Wall

from sfq_proxy.config import Config, parse_config
from sfq_proxy.sim.server import SimBackend

CHAT = [{"role": "user", "content": "spend my budget"}]
ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"


def budgeted(sim: SimBackend, **fields: Any) -> Config:
    return parse_config(config_yaml([sim.url], **fields), environ={})


def spent(sim: SimBackend, org: str) -> int:
    """The tokens the backend counted for ``org``'s requests (its user field)."""
    return sum(r.prompt_tokens + r.completion_tokens for r in sim.stats.log if r.user == org)


async def ask(lab: Lab, served: Served, org: str, tokens: int = 8) -> Any:
    return await lab.client(served, org).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=tokens, user=org
    )


async def refused(lab: Lab, served: Served, org: str) -> openai.RateLimitError:
    with pytest.raises(openai.RateLimitError) as caught:
        await ask(lab, served, org)
    return caught.value


async def spend_until_refused(
    lab: Lab, served: Served, org: str, used: Callable[[], float], limit: float
) -> float:
    """Requests of ``org`` until one is refused: each admitted one started under ``limit``
    (``used()``: by the backend's count), the refused one found it used up. Returns what
    was used."""
    for _ in range(100):
        before = used()
        try:
            await ask(lab, served, org)
        except openai.RateLimitError:
            assert before >= limit
            return before
        assert before < limit
    raise AssertionError("never refused")


def assert_refused_for_the_day(err: openai.RateLimitError, subject: str, used: int) -> None:
    """A 429 of a 100-token day budget used up at LATE: it names ``subject`` and what it
    used, and says to come back at midnight UTC, 3,570 s away."""
    assert err.response.headers["Retry-After"] == "3570"
    assert err.response.json()["error"] == {
        "message": f"Budget exceeded: {subject} has used {used} of its 100 tokens for the "
        "day; it resets at 2025-12-02T00:00:00Z.",
        "type": "rate_limit_error",
        "code": "budget_exceeded",
    }


async def test_a_token_budget_stops_its_org_and_midnight_gives_it_back(lab: Lab) -> None:
    sim = await lab.backend()
    wall = Wall(LATE)
    budgets = [{"period": "day", "tokens": 100, "warn_at": 0.5}]
    served = await lab.proxy(budgeted(sim, orgs={"A": {"budgets": budgets}}), wall=wall)
    used = await spend_until_refused(lab, served, "A", lambda: spent(sim, "A"), 100)
    assert_refused_for_the_day(await refused(lab, served, "A"), "org 'A'", used)
    served_before = len(sim.stats.log)
    for _ in range(3):  # others are not held back; A's refusals reach no backend
        await ask(lab, served, "B")
        await refused(lab, served, "A")
    assert len(sim.stats.log) == served_before + 3
    metrics = served.state.metrics.registry
    rejected = {"org": "A", "class": "batch", "pool": "sim", "reason": "budget"}
    assert metrics.get_sample_value("sfq_rejections_total", rejected) == 5
    wall.now = DEC_1 + 86400  # midnight UTC: a new day, a new budget
    await ask(lab, served, "A")


async def test_a_money_budget_on_a_key_counts_its_prices(lab: Lab) -> None:
    sim = await lab.backend()
    keys = [
        {"key": KEYS["A"], "org": "A", "classes": ["batch"], "name": "a-prod",
         "budgets": [{"period": "month", "money": 0.001}]},
        {"key": KEYS["B"], "org": "B", "classes": ["batch"]},
    ]  # fmt: skip
    price = {"prompt_per_1m": 10.0, "completion_per_1m": 30.0}  # $0.001 ≈ 40 tokens
    config = budgeted(sim, keys=keys, pool={"prices": {MODEL: price}})
    served = await lab.proxy(config, wall=Wall(DEC_1 + 5))

    def money() -> float:
        return sum(10 * r.prompt_tokens + 30 * r.completion_tokens for r in sim.stats.log) / 1e6

    used = await spend_until_refused(lab, served, "A", money, 0.001)
    err = await refused(lab, served, "A")
    assert err.response.json()["error"]["message"] == (
        f"Budget exceeded: key 'a-prod' has spent {used:.6g} of its money budget of "
        "0.001 for the month; it resets at 2026-01-01T00:00:00Z."
    )
    assert int(err.response.headers["Retry-After"]) == 31 * 86400 - 5
    await ask(lab, served, "B")  # another key, another org


async def test_a_reload_changes_a_budget_and_keeps_what_was_used(lab: Lab) -> None:
    sim = await lab.backend()
    wall = Wall(DEC_1 + 60)

    def with_budget(tokens: int) -> Config:
        orgs = {"A": {"budgets": [{"period": "day", "tokens": tokens}]}}
        return budgeted(sim, orgs=orgs)

    served = await lab.proxy(with_budget(60), wall=wall)
    used = int(await spend_until_refused(lab, served, "A", lambda: spent(sim, "A"), 60))
    served.state.reload(with_budget(used + 1))  # raised just above what was used
    await ask(lab, served, "A")
    await refused(lab, served, "A")
    await served.state.usage.flush()  # written and read back: still counted once
    await refused(lab, served, "A")
    served.state.reload(with_budget(10**6))
    await ask(lab, served, "A")
    served.state.reload(budgeted(sim))  # no budget at all
    await ask(lab, served, "A")


async def test_the_gauge_says_how_much_is_used_and_the_alert_compares_it(lab: Lab) -> None:
    sim = await lab.backend()
    orgs = {"A": {"budgets": [{"period": "day", "tokens": 1000, "warn_at": 0.25}]}}
    served = await lab.proxy(budgeted(sim, orgs=orgs), wall=Wall(DEC_1))
    await ask(lab, served, "A", tokens=20)
    http = await lab.http()
    async with http.get(f"{served.url}/metrics") as resp:
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    labels = {"org": "A", "key": "", "period": "day", "unit": "tokens"}
    [used] = families["sfq_budget_used_ratio"].samples
    [warn] = families["sfq_budget_warn_ratio"].samples
    assert used.labels == labels == warn.labels
    assert used.value == spent(sim, "A") / 1000
    assert warn.value == 0.25
    [rule] = [
        rule
        for group in yaml.safe_load(ALERTS.read_text())["groups"]
        for rule in group["rules"]
        if rule["alert"] == "SfqBudgetNearlySpent"
    ]
    assert "sfq_budget_used_ratio" in rule["expr"]
    assert "sfq_budget_warn_ratio" in rule["expr"]


async def test_the_warning_is_logged_once_per_period(
    lab: Lab, caplog: pytest.LogCaptureFixture
) -> None:
    sim = await lab.backend()
    wall = Wall(DEC_1)
    orgs = {"A": {"budgets": [{"period": "day", "tokens": 10**6, "warn_at": 0.00001}]}}
    served = await lab.proxy(budgeted(sim, orgs=orgs), wall=wall)
    book = served.state.usage
    for _ in range(2):
        await ask(lab, served, "A")
        await book.flush()
    wall.now += 86400
    await ask(lab, served, "A")
    await book.flush()
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("budget:")]
    assert (
        warnings
        == ["budget: org 'A' has used 0% of its tokens budget for the day (warn_at 1e-05)"] * 2
    )


@pytest.mark.redis
async def test_replicas_on_one_redis_share_a_budget_at_their_flush(
    lab: Lab, redis_url: str
) -> None:
    """Proxy 1 uses A's budget up; proxy 2 sees it once proxy 1 has written its usage and
    proxy 2 has read the totals back (each flush: within flush_s of each other)."""
    sim = await lab.backend()
    orgs = {"A": {"budgets": [{"period": "day", "tokens": 50}]}}
    config = budgeted(sim, orgs=orgs, state={"redis": redis_url}, usage={"flush_s": 3600})
    wall = Wall(DEC_1 + 10)
    first, second = await lab.proxy(config, wall=wall), await lab.proxy(config, wall=wall)
    await spend_until_refused(lab, first, "A", lambda: spent(sim, "A"), 50)
    await ask(lab, second, "A")  # not yet written: proxy 2 knows only its own
    assert first.state.usage is not None
    assert second.state.usage is not None
    await first.state.usage.flush()
    await second.state.usage.flush()
    await refused(lab, second, "A")
    await ask(lab, second, "B")


async def hang_up_after(lab: Lab, served: Served, org: str, events: int) -> bool:
    """A stream of up to 400 tokens whose client reads ``events`` token events and leaves:
    the usage chunk at the stream's end never comes. False: refused for ``org``'s budget."""
    http = await lab.http()
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 400, "stream": True, "user": org}
    headers = {"Authorization": f"Bearer {KEYS[org]}"}
    async with http.post(f"{served.url}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status == 429 and (await r.json())["error"]["code"] == "budget_exceeded":
            return False
        assert r.status == 200
        seen = 0
        async for line in r.content:
            seen += line.startswith(b"data: {") and b'"content"' in line
            if seen > events:  # the role's event, then ``events`` tokens
                break
        r.close()  # the connection with it
    return True


async def test_hanging_up_before_the_usage_does_not_dodge_a_budget(lab: Lab) -> None:
    """A client that leaves every stream before its usage chunk is billed its estimate at
    least (its prompt as estimated and its max_tokens, not nothing), so its budget still
    runs out; the backend stopped generating when the proxy closed the connection."""
    sim = await lab.backend(time_scale=1.0, decode_tokens_per_s=100.0)
    served = await lab.proxy(
        budgeted(sim, orgs={"A": {"budgets": [{"period": "day", "tokens": 60}]}}), wall=Wall(LATE)
    )
    hung_up = 0
    while await hang_up_after(lab, served, "A", 5):
        hung_up += 1
        assert hung_up < 20, "hanging up dodged the budget"
        await eventually(lambda: all(r.outcome is not None for r in sim.stats.log), within=5)
    assert hung_up == 1  # billed its prompt and 400 tokens, beyond the 60 of the budget
    assert len(sim.stats.log) == hung_up
    for rec in sim.stats.log:
        assert (rec.outcome, 5 <= rec.completion_tokens < 400) == ("aborted", True)
