"""The admin page (docs/admin-page.md): a static shell with strict headers, the dispatch
order it shows explained by the meters alone, and, in Debian's headless chromium driven by
Selenium, a live proxy's flow on screen and a key revoked through the page."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from proxy_lab import KEYS, MODEL, Lab, Served, eventually, keep_asking, proxy_config
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import Select, WebDriverWait
from server_process import free_port
from tools import need_tool
from wall import Wall

from sfq_proxy.config import Config
from sfq_proxy.core.flows import org_and_class
from sfq_proxy.sim.server import SimBackend

ADMIN = "sk-admin-page-test"
# the page's screenshot with its charts, for a human to look at (git ignores the folder)
SCREENSHOT = Path(__file__).resolve().parents[2] / "test-artifacts" / "admin-page.png"
# a backend's name is free text in the config (orgs, classes and aliases are names)
XSS = "<img src=x onerror=alert(1)>"
CHAT = [{"role": "user", "content": "hi"}]
Rows = list[list[str]]


def page_config(sim: SimBackend, tmp_path: Path, **fields: Any) -> Config:
    """One 1-slot pool, the admin key ``ADMIN``, and a key store in ``tmp_path``."""
    fields.setdefault("key_store_file", str(tmp_path / "keys.json"))
    return proxy_config(
        [sim.url], slots=1, admin_key_env="ADMIN", environ={"ADMIN": ADMIN}, **fields
    )


async def admin(
    http: aiohttp.ClientSession, served: Served, method: str, path: str, body: Any = None
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with http.request(method, served.url + path, json=body, headers=headers) as r:
        return r.status, await r.json()


async def hold_a_queue(lab: Lab, sim: SimBackend, served: Served) -> list[asyncio.Task[Any]]:
    """C's request holds the pool's slot in the held backend and three of A's wait behind
    it; returns their tasks (the backend must be released for them to end)."""
    sim.hold()

    def ask(org: str) -> asyncio.Task[Any]:
        create = lab.client(served, org).chat.completions.create
        return asyncio.create_task(create(model=MODEL, messages=CHAT, max_tokens=2))

    tasks = [ask("C")]
    await eventually(lambda: served.state.pools["sim"].scheduler.running == 1, within=10)
    tasks += [ask("A") for _ in range(3)]
    await eventually(lambda: served.queue().backlog("A/batch") == 3, within=10)
    return tasks


# -- the shell, without a browser ------------------------------------------------------------


async def test_the_shell_holds_no_data_and_keeps_to_its_own_files(lab: Lab, tmp_path: Path) -> None:
    sim = await lab.backend()
    served = await lab.proxy(page_config(sim, tmp_path))
    await lab.client(served, "A").chat.completions.create(model=MODEL, messages=CHAT)
    http = await lab.http()
    async with http.get(f"{served.url}/admin", allow_redirects=False) as r:
        assert (r.status, r.headers["Location"]) == (308, "admin/")  # works under a prefix
    files = {}
    for name, kind in [("", "text/html"), ("admin.js", "text/javascript"),
                       ("admin.css", "text/css"), ("favicon.svg", "image/svg+xml")]:  # fmt: skip
        async with http.get(f"{served.url}/admin/{name}") as r:  # no admin key: no data
            assert (r.status, r.content_type, r.charset) == (200, kind, "utf-8")
            assert r.headers["Content-Security-Policy"].startswith("default-src 'self';")
            assert r.headers["X-Content-Type-Options"] == "nosniff"
            assert r.headers["Cache-Control"] == "no-store"
            assert r.headers["X-Frame-Options"] == "DENY"
            files[name] = await r.text()
    for text in files.values():
        for secret in [ADMIN, *KEYS.values(), "A/batch", sim.url[7:]]:
            assert secret not in text
    html, script = files[""], files["admin.js"]
    assert re.findall(r"<script\b[^>]*>(.*?)</script>", html, re.S) == [""]  # admin.js only
    assert re.search(r"""\s(style|on\w+)\s*=|(src|href)="(https?:|//)""", html) is None
    for unsafe in ["innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                   "localStorage", "document.cookie", "console."]:  # fmt: skip
        assert unsafe not in script
    async with http.post(f"{served.url}/admin/") as r:
        assert (r.status, r.headers["Allow"]) == (405, "GET, HEAD")
    async with http.get(f"{served.url}/admin/nope") as r:
        assert (r.status, (await r.json())["error"]["code"]) == (404, "not_found")
    async with http.get(f"{served.url}/admin/state") as r:
        assert r.status == 401  # the data still needs the key


async def test_the_state_explains_the_dispatch_order_from_the_meters(
    lab: Lab, tmp_path: Path
) -> None:
    """Weights A 3, B 1: each dispatch is the smallest start tag then, its finish tag is
    start + cost / weight and its flow's next start, ``v`` never passes it, and the shares
    of the window are the costs dispatched."""
    sim = await lab.backend()
    served = await lab.proxy(page_config(sim, tmp_path, orgs={"A": {"weight": 3}}))
    sim.hold()
    chat = [lab.client(served, org).chat.completions.create for org in "CAB"]
    tasks = [asyncio.create_task(chat[0](model=MODEL, messages=CHAT, max_tokens=2))]
    await eventually(lambda: served.state.pools["sim"].scheduler.running == 1, within=10)
    for n in range(8):
        ask = chat[1 + n % 2](model=MODEL, messages=CHAT * (n + 1), max_tokens=2)
        tasks.append(asyncio.create_task(ask))
    await eventually(lambda: len(served.queue()) == 8, within=10)
    sim.release()
    await asyncio.gather(*tasks)
    status, state = await admin(await lab.http(), served, "GET", "/admin/state")
    assert status == 200
    pool = state["pools"]["sim"]
    recent = pool["recent_dispatches"]
    served_costs = pool["costs"]
    assert [d["flow"][0] for d in recent].count("A") == 4
    queued = recent[1:]  # after the blocker, every choice was made among waiting flows
    finish: dict[str, float] = {}
    for d in recent:
        assert d["weight"] == served.state.config.flow_weight(*org_and_class(d["flow"]))
        assert d["finish_tag"] == pytest.approx(d["start_tag"] + d["cost"] / d["weight"])
        assert d["v"] <= d["start_tag"] + 1e-6
        assert d["backend"] == sim.url[7:]
        assert d["age_s"] >= 0
        if d["flow"] in finish:  # its meter moved on by the true-up of what ran between
            moved = served_costs[d["flow"]]
            assert d["start_tag"] >= finish[d["flow"]] - 1e-5 or moved["actual"] < moved["charged"]
        finish[d["flow"]] = d["finish_tag"]
    starts = [d["start_tag"] for d in queued]
    assert starts == sorted(starts)  # the smallest meter went first, every time
    costs: dict[str, float] = {}
    for d in recent:
        costs[d["flow"]] = costs.get(d["flow"], 0) + d["cost"]
    shares = pool["served_recent"]
    assert shares["window_s"] == 300
    total = sum(costs.values())
    assert shares["shares"] == {f: pytest.approx(c / total) for f, c in sorted(costs.items())}


async def test_flows_carry_their_weight_lag_and_queue(lab: Lab, tmp_path: Path) -> None:
    sim = await lab.backend()
    served = await lab.proxy(page_config(sim, tmp_path, orgs={"A": {"weight": 2.5}}))
    tasks = await hold_a_queue(lab, sim, served)
    status, state = await admin(await lab.http(), served, "GET", "/admin/state")
    flows = {f["flow"]: f for f in state["pools"]["sim"]["flows"]}
    assert status == 200
    assert flows["A/batch"]["queued"] == 3
    assert flows["A/batch"]["weight"] == served.state.config.flow_weight("A", "batch") == 2.5
    v = state["pools"]["sim"]["virtual_time"]
    assert flows["A/batch"]["lag"] == pytest.approx(flows["A/batch"]["meter"] - v)
    sim.release()
    answers = await asyncio.gather(*tasks)
    status, state = await admin(await lab.http(), served, "GET", "/admin/state")
    # each flow's estimates charged beside the costs its answers' usage trued them up to
    costs = state["pools"]["sim"]["costs"]
    used = [a.usage.prompt_tokens + a.usage.completion_tokens for a in answers]
    assert costs["A/batch"]["actual"] == sum(used[1:])  # input and output weights are 1
    assert costs["C/interactive"]["actual"] == used[0]
    assert costs["A/batch"]["charged"] != costs["A/batch"]["actual"]


@pytest.mark.redis
async def test_with_shared_state_the_recent_dispatches_are_this_processs_untagged(
    lab: Lab, tmp_path: Path, redis_url: str
) -> None:
    """Redis decides a shared pool's order and returns no tags: the page says so."""
    sim = await lab.backend()
    state = {"redis": redis_url, "lease_ttl_s": 30}
    served = await lab.proxy(page_config(sim, tmp_path, state=state, key_store_file=None))
    for org in "AC":
        await lab.client(served, org).chat.completions.create(model=MODEL, messages=CHAT)
    status, state = await admin(await lab.http(), served, "GET", "/admin/state")
    assert status == 200
    pool = state["pools"]["sim"]
    recent = [
        (d["flow"], d["start_tag"], d["finish_tag"], d["v"]) for d in pool["recent_dispatches"]
    ]
    assert recent == [("A/batch", None, None, None), ("C/interactive", None, None, None)]
    assert set(pool["served_recent"]["shares"]) == {"A/batch", "C/interactive"}

    async def sampled() -> bool:  # the charts' history: this process's grants, sampled
        _, history = await admin(await lab.http(), served, "GET", "/admin/history")
        points = history["pools"]["sim"]["recent"]
        return sum(p["dispatches"] for p in points) == 2 and {
            f for p in points for f in p["served"]
        } == {"A/batch", "C/interactive"}

    await eventually(sampled, within=5)


# -- in a real browser ------------------------------------------------------------------------


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    """Debian's chromium, headless, through its chromedriver (both from ``make tools``);
    its console kept, to be read with ``get_log("browser")``."""
    chromium, chromedriver = need_tool("chromium"), need_tool("chromedriver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage"]:
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(chromedriver))
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver: WebDriver, ready: Callable[[WebDriver], Any]) -> Any:
    """What ``ready`` returns once it is truthy (the page polls every 2 s)."""
    return WebDriverWait(driver, 20).until(ready)


def sign_in(driver: WebDriver, url: str, key: str) -> None:
    driver.get(f"{url}/admin/")
    wait(driver, expected_conditions.element_to_be_clickable((By.ID, "admin-key")))
    driver.find_element(By.ID, "admin-key").send_keys(key)
    driver.find_element(By.CSS_SELECTOR, "#login button").click()


def rows(driver: WebDriver, section: str) -> Rows:
    """The text of each body row of the section's tables, read in one go."""
    script = """return [...document.querySelectorAll(`#${arguments[0]} tbody tr`)]
                .map((tr) => [...tr.cells].map((td) => td.textContent));"""
    found: Rows = driver.execute_script(script, section)
    return found


def rows_when(driver: WebDriver, section: str, ready: Callable[[Rows], bool]) -> Rows:
    return wait(driver, lambda d: (found := rows(d, section)) and ready(found) and found)


def marked(driver: WebDriver, status: str) -> list[str]:
    """The ids of the keys whose row is marked ``status`` (its class and its badge)."""
    script = """return [...document.querySelectorAll(`#keys tr.key.${arguments[0]}`)]
                .filter((tr) => tr.querySelector(`.badge.${arguments[0]}`))
                .map((tr) => tr.cells[0].textContent);"""
    found: list[str] = driver.execute_script(script, status)
    return found


def revoke(driver: WebDriver, key_id: str) -> None:
    """Click the key's Revoke button and confirm; wait until the list marks it revoked."""
    driver.find_element(By.CSS_SELECTOR, f'button.revoke[data-id="{key_id}"]').click()
    wait(driver, expected_conditions.alert_is_present()).accept()
    wait(driver, lambda d: key_id in marked(d, "revoked"))


def errors(driver: WebDriver) -> list[dict[str, Any]]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


async def test_the_page_shows_a_live_flow_and_a_key_revoked_there_stops_working(
    lab: Lab, tmp_path: Path, browser: WebDriver
) -> None:
    sim = await lab.backend()
    backends = [{"url": sim.url, "slots": 1, "name": XSS}]
    served = await lab.proxy(page_config(sim, tmp_path, pool={"backends": backends}))
    http = await lab.http()
    body = {"alias": "ci-bot", "org": "A", "classes": ["batch"]}
    status, made = await admin(http, served, "POST", "/admin/keys", body)
    assert status == 201
    key_id, secret = made["key"]["id"], made["secret"]
    tenant = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=secret, max_retries=0)
    await tenant.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    tasks = await hold_a_queue(lab, sim, served)

    await asyncio.to_thread(sign_in, browser, served.url, ADMIN)
    flows = await asyncio.to_thread(rows_when, browser, "flows", lambda rs: len(rs) >= 2)
    [a_batch] = [row for row in flows if row[0] == "A/batch"]
    assert a_batch[1] == "1"  # weight
    assert a_batch[4:6] == ["3", "yes"]  # queued, eligible
    costs = served.state.state()["sim"]["costs"]["A/batch"]  # the tenant's one request
    assert a_batch[7:9] == [f"{costs['charged']:.0f}", f"{costs['actual']:.0f}"]
    recent = await asyncio.to_thread(rows, browser, "recent")
    assert [row[1] for row in recent] == ["A/batch", "C/interactive"]  # newest last
    dispatched = served.state.pools["sim"].state()["recent_dispatches"]
    for row, d in zip(recent, dispatched, strict=True):
        shown = [float(cell) for cell in row[5:8]]  # v before, start tag, finish tag
        assert shown == pytest.approx([d["v"], d["start_tag"], d["finish_tag"]], abs=1e-3)
    assert {row[2] for row in recent} == {XSS}  # the backend's name as text, not markup
    pools = await asyncio.to_thread(rows, browser, "pools")
    assert pools == [[XSS, "healthy", "1 / 1"]]
    keys = await asyncio.to_thread(rows_when, browser, "keys", lambda rs: len(rs) == 5)
    [shown] = [row for row in keys if row[0] == key_id]
    assert shown[1:4] == ["ci-bot", "A", "batch"]
    assert sum(row[-1] == "read-only (config file)" for row in keys) == 4
    no_images = "return document.querySelectorAll('img').length"
    assert await asyncio.to_thread(browser.execute_script, no_images) == 0
    usage = await asyncio.to_thread(rows_when, browser, "usage", lambda rs: len(rs) >= 1)
    assert {row[0] for row in usage} >= {"A"}

    await asyncio.to_thread(revoke, browser, key_id)
    assert await asyncio.to_thread(marked, browser, "revoked") == [key_id]  # listed, marked
    with pytest.raises(openai.AuthenticationError) as refused:
        await tenant.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert refused.value.status_code == 401
    assert await asyncio.to_thread(errors, browser) == []  # no console error all along
    stored = "return [sessionStorage.length, document.cookie, location.href]"
    assert await asyncio.to_thread(browser.execute_script, stored) == [
        1, "", f"{served.url}/admin/"
    ]  # fmt: skip
    sim.release()
    await asyncio.gather(*tasks)
    await tenant.close()


async def test_a_wrong_key_is_said_and_forgotten_and_a_failing_endpoint_stays_in_its_section(
    lab: Lab, tmp_path: Path, browser: WebDriver
) -> None:
    sim = await lab.backend()
    served = await lab.proxy(page_config(sim, tmp_path, key_store_file=None))
    await asyncio.to_thread(sign_in, browser, served.url, KEYS["A"])

    def refused(driver: WebDriver) -> str | bool:
        text: str = driver.find_element(By.ID, "status").text
        return "refused (401)" in text and text

    assert "Incorrect admin key" in await asyncio.to_thread(wait, browser, refused)
    assert await asyncio.to_thread(browser.execute_script, "return sessionStorage.length") == 0
    assert not await asyncio.to_thread(lambda: browser.find_element(By.ID, "panels").is_displayed())

    await asyncio.to_thread(sign_in, browser, served.url, ADMIN)

    def failed(driver: WebDriver) -> str | bool:
        text: str = driver.find_element(By.ID, "key-action").text
        return bool(text) and text

    create = await asyncio.to_thread(browser.find_element, By.ID, "new-key")
    for name, value in [("alias", "ci-bot"), ("org", "A")]:
        field = await asyncio.to_thread(create.find_element, By.NAME, name)
        await asyncio.to_thread(field.send_keys, value)
    await asyncio.to_thread(create.submit)
    message = await asyncio.to_thread(wait, browser, failed)
    assert "no key store" in message  # the admin API's keys are off: 409, said under the form
    assert "(409)" in message
    pools = await asyncio.to_thread(rows_when, browser, "pools", bool)
    assert pools == [[sim.url[7:], "healthy", "0 / 1"]]  # the other sections go on


async def test_a_key_made_on_the_page_shows_its_secret_once_and_works(
    lab: Lab, tmp_path: Path, browser: WebDriver
) -> None:
    """Org B is kept to pool ``sim`` of two: the key made for it lists no pool, and the page
    shows what it may use in fact; past its expiry, the page marks it expired."""
    sim = await lab.backend()
    pools = {
        name: {"models": [model], "backends": [{"url": sim.url, "slots": 1}]}
        for name, model in (("sim", MODEL), ("other", "other-model"))
    }
    config = page_config(sim, tmp_path, pools=pools, orgs={"B": {"pools": ["sim"]}})
    wall = Wall(time.time())
    served = await lab.proxy(config, wall=wall)
    await asyncio.to_thread(sign_in, browser, served.url, ADMIN)

    def create() -> str:
        form = browser.find_element(By.ID, "new-key")
        for name, value in [("alias", "nightly"), ("org", "B"), ("classes", " batch ,"),
                            ("expires_days", "1.5")]:  # fmt: skip
            form.find_element(By.NAME, name).send_keys(value)
        form.find_element(By.CSS_SELECTOR, "button").click()
        secret: str = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#secret code").text)
        browser.find_element(By.CSS_SELECTOR, "#secret button").click()
        return secret

    secret = await asyncio.to_thread(create)
    assert secret.startswith("sk-sfq-")
    page = "return [document.documentElement.outerHTML, JSON.stringify(sessionStorage)]"
    html, storage = await asyncio.to_thread(browser.execute_script, page)
    assert secret not in html  # shown once: "Done" took it off the page
    assert secret not in storage
    keys = await asyncio.to_thread(rows_when, browser, "keys", lambda rs: len(rs) == 5)
    [made] = [row for row in keys if row[1] == "nightly"]
    assert made[2:6] == ["B", "batch", "sim (by org B)", "all"]  # its own list: none
    assert [row[4] for row in keys if row[0] == "B#1"] == ["sim (by org B)"]
    assert [row[4] for row in keys if row[0] == "A#0"] == ["all"]
    status, listed = await admin(await lab.http(), served, "GET", "/admin/keys")
    [record] = [k for k in listed["keys"] if k["alias"] == "nightly"]
    created, expires = (datetime.fromisoformat(record[f]) for f in ("created", "expires"))
    assert status == 200
    assert (expires - created).total_seconds() == pytest.approx(1.5 * 86400, abs=1)
    tenant = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=secret, max_retries=0)
    reply = await tenant.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=2
    )
    assert reply.http_response.status_code == 200
    assert await asyncio.to_thread(marked, browser, "expired") == []
    wall.now += 2 * 86400
    with pytest.raises(openai.AuthenticationError):
        await tenant.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    await tenant.close()
    expired = await asyncio.to_thread(wait, browser, lambda d: marked(d, "expired"))
    assert expired == [record["id"]]
    assert await asyncio.to_thread(errors, browser) == []


# what the page drew: each chart's kind, its points, its series' names and path data, and
# the labels of its shaded spans
DRAWN = """return [...document.querySelectorAll('#charts figure.chart')].map((f) => ({
  kind: f.dataset.chart, points: Number(f.dataset.points),
  series: Object.fromEntries([...f.querySelectorAll('path.series')]
    .map((p) => [p.dataset.series, p.getAttribute('d')])),
  bands: [...f.querySelectorAll('rect.down-band')].map((r) => r.textContent),
}));"""
PLOT_BOTTOM, PLOT_TOP = 150 - 22, 10  # admin.js's PLOT: the y of 0 and of the chart's top


def last_y(path: str) -> float:
    """The y of a path's last point (``M x,y L x,y …``)."""
    return float(path.replace("h0.5", "").split("L")[-1].split(",")[-1])


async def test_the_charts_draw_two_orgs_shares_queue_waits_and_slots_from_live_traffic(
    lab: Lab, tmp_path: Path, browser: WebDriver, capsys: pytest.CaptureFixture[str]
) -> None:
    """A (weight 3) and B (weight 1) backlogged on 2 slots: the page draws each flow's
    served share beside its entitled one (about 3/4 for A), the queue, the waits and the
    backends' load, with the one that does not answer shaded as down, read back from the
    SVG; a screenshot goes to ``SCREENSHOT``."""
    sim = await lab.backend()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: its probes fail
    backends = [{"url": sim.url, "slots": 2, "name": "gpu-1"},
                {"url": dead, "slots": 1, "name": "gpu-2"}]  # fmt: skip
    config = page_config(sim, tmp_path, orgs={"A": {"weight": 3}}, pool={"backends": backends})
    served = await lab.proxy(config)
    gpu_2 = served.state.pools["sim"].placement.backends[1]
    await eventually(lambda: not gpu_2.healthy, within=5)
    stop = asyncio.Event()
    loads = [keep_asking(lab, served, org, 4, stop, max_tokens=40) for org in "AB"]
    load = asyncio.gather(*loads)

    def drawn(driver: WebDriver) -> list[dict[str, Any]] | bool:
        charts: list[dict[str, Any]] = driver.execute_script(DRAWN)
        return len(charts) == 4 and all(c["points"] >= 6 for c in charts) and charts

    try:
        await asyncio.to_thread(browser.set_window_size, 1500, 1100)
        await asyncio.to_thread(sign_in, browser, served.url, ADMIN)
        charts = {c["kind"]: c for c in await asyncio.to_thread(wait, browser, drawn)}
    finally:
        stop.set()
        answered = await load
    assert all(n > 0 for n in answered)
    shares = charts["shares"]["series"]
    assert set(shares) == {f"{f}/batch {what}" for f in "AB" for what in ("served", "entitled")}
    assert all(path.count("L") >= 4 for path in shares.values())  # lines, not a dot

    def share(series: str) -> float:  # the y of its newest point, back to a fraction
        return (PLOT_BOTTOM - last_y(shares[series])) / (PLOT_BOTTOM - PLOT_TOP)

    print(f"A/batch on the chart: served {share('A/batch served'):.2f}, "
          f"entitled {share('A/batch entitled'):.2f}")  # fmt: skip
    assert share("A/batch entitled") == pytest.approx(0.75, abs=0.03)
    assert share("A/batch served") == pytest.approx(0.75, abs=0.15)
    assert share("B/batch served") == pytest.approx(1 - share("A/batch served"), abs=0.02)
    assert set(charts["queue"]["series"]) == {"queued"}
    assert set(charts["wait"]["series"]) == {"p50", "p99"}
    assert set(charts["backends"]["series"]) == {
        f"gpu-{n} {what}" for n in (1, 2) for what in ("in flight", "slots")
    }
    bands = charts["backends"]["bands"]
    assert len(bands) >= 6
    assert set(bands) == {"gpu-2 down"}  # a span a point, gpu-1 never
    assert all(len(path) > 10 for c in charts.values() for path in c["series"].values())

    def window(choice: str, caption: str) -> None:
        """Show the series ``choice``; wait for the share chart to say it is drawn so."""
        Select(browser.find_element(By.ID, "chart-window")).select_by_value(choice)
        shares = "#charts figure[data-chart=shares] figcaption"
        wait(browser, lambda d: caption in d.find_element(By.CSS_SELECTOR, shares).text)

    await asyncio.to_thread(window, "since_start", "per point")  # a point each (merged) span
    await asyncio.to_thread(window, "recent", "trailing 10 s")
    SCREENSHOT.parent.mkdir(exist_ok=True)
    assert await asyncio.to_thread(browser.save_screenshot, str(SCREENSHOT))
    with capsys.disabled():  # in the test's output, passed or not
        print(f"\nthe admin page's screenshot: {SCREENSHOT}")
    assert await asyncio.to_thread(errors, browser) == []  # no console error: the CSP held
