"""Keys made through the admin API, through the real proxy and the official SDK: a key works
at once with its org and classes, stops at its revocation or expiry, survives a restart (a
file in memory mode, Redis when shared), and no answer, file or log holds its secret."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import redis
from proxy_lab import KEYS, MODEL, AccessLines, Lab, Served, eventually, proxy_config
from redis_server import need_redis_server, running_redis_cluster
from wall import DEC_1, Wall

from sfq_proxy.config import Config, ConfigError
from sfq_proxy.core.keys import REVOKED_KEPT_S
from sfq_proxy.http.app import build_app
from sfq_proxy.state.key_store import BY_ID, REVOKED, USED

ADMIN = "sk-admin-keys-test"
ENV = {"SFQ_ADMIN_KEY": ADMIN}
CHAT = [{"role": "user", "content": "hi"}]


def keys_config(urls: list[str], **options: Any) -> Config:
    """The lab's config with an admin key (``ADMIN``) and ``options`` (``key_store_file``…)."""
    return proxy_config(urls, environ=ENV, admin_key_env="SFQ_ADMIN_KEY", **options)


async def admin(
    http: aiohttp.ClientSession,
    served: Served,
    method: str,
    path: str = "/admin/keys",
    body: Any = None,
    *,
    key: str | None = ADMIN,
    raw: bytes | None = None,
) -> tuple[int, Any]:
    """An admin API call: its status and JSON answer."""
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    async with http.request(method, served.url + path, data=data, headers=headers) as r:
        return r.status, await r.json()


async def create(http: aiohttp.ClientSession, served: Served, **fields: Any) -> tuple[str, str]:
    """A new key of org T (by default) made through the API: its id and its secret."""
    status, answer = await admin(http, served, "POST", body={"org": "T", **fields})
    assert status == 201, answer
    return answer["key"]["id"], answer["secret"]


async def chat(served: Served, secret: str, cls: str | None = None) -> str:
    """One request with ``secret``: "ok", or the status and code it was refused with."""
    headers = {"X-Workload-Class": cls} if cls else {}
    async with openai.AsyncOpenAI(
        base_url=f"{served.url}/v1", api_key=secret, max_retries=0, default_headers=headers
    ) as client:
        try:
            await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5)
        except openai.APIStatusError as err:
            body = err.body if isinstance(err.body, dict) else {}
            return f"{err.status_code} {body.get('code')}"
    return "ok"


def stored(served: Served) -> dict[str, Any]:
    """The proxy's snapshot of its key store, by id."""
    assert served.state.keys is not None
    return dict(served.state.keys.records)


def last_flow(served: Served) -> str:
    return served.state.pools["sim"].recent[-1].flow


@pytest.fixture
async def store(lab: Lab, tmp_path: Path) -> tuple[Served, aiohttp.ClientSession]:
    """A proxy keeping API keys in a file, and a session to call it."""
    sim = await lab.backend()
    served = await lab.proxy(keys_config([sim.url], key_store_file=str(tmp_path / "keys.json")))
    return served, await lab.http()


async def test_a_key_made_through_the_api_works_at_once_and_stops_at_its_revocation(
    store: tuple[Served, aiohttp.ClientSession],
) -> None:
    served, http = store
    key_id, secret = await create(http, served, alias="ci-bot", classes=["interactive"])
    assert secret.startswith("sk-sfq-")
    assert key_id.startswith("k_")
    assert await chat(served, secret) == "ok"
    assert last_flow(served) == "T/interactive"
    assert await chat(served, secret, cls="batch") == "403 forbidden"  # not granted
    assert await admin(http, served, "DELETE", f"/admin/keys/{key_id}") == (
        200, {"revoked": key_id},
    )  # fmt: skip
    assert await chat(served, secret) == "401 invalid_api_key"  # the very next request
    status, answer = await admin(http, served, "DELETE", f"/admin/keys/{key_id}")
    assert (status, answer["error"]["code"]) == (404, "key_not_found")


async def test_the_list_shows_what_a_key_is_and_never_its_secret(
    store: tuple[Served, aiohttp.ClientSession],
) -> None:
    served, http = store
    key_id, secret = await create(
        http, served, alias="nightly", classes=["batch"], models=[MODEL], expires_in_s=3600
    )
    status, listing = await admin(http, served, "GET")
    assert status == 200
    (mine,) = [k for k in listing["keys"] if k["id"] == key_id]
    assert mine["last_used"] is None
    assert await chat(served, secret) == "ok"
    status, listing = await admin(http, served, "GET")
    text = json.dumps(listing)
    assert secret not in text
    assert secret[7:] not in text
    assert hashlib.sha256(secret.encode()).hexdigest() not in text
    assert all(KEYS[org] not in text for org in KEYS)
    (mine,) = [k for k in listing["keys"] if k["id"] == key_id]
    assert {k: mine[k] for k in ("alias", "org", "classes", "pools", "models", "source")} == {
        "alias": "nightly", "org": "T", "classes": ["batch"], "pools": None,
        "models": [MODEL], "source": "api",
    }  # fmt: skip
    assert mine["created"].endswith("Z")
    assert mine["expires"] > mine["created"]
    assert mine["last_used"] is not None
    yaml_keys = [k for k in listing["keys"] if k["source"] == "config"]
    assert [k["id"] for k in yaml_keys] == ["A#0", "B#1", "C#2", "ops#3"]
    assert yaml_keys[0]["last_used"] is None
    assert yaml_keys[0]["created"] is None


async def test_the_list_shows_what_a_key_may_use_in_fact_and_marks_expired_and_revoked_keys(
    lab: Lab, tmp_path: Path
) -> None:
    """Org T is kept to pool ``sim``: its key that lists no pool is refused the other pool's
    model (403), and the list says it may use ``sim`` only. A key past its expiry and a
    revoked one are marked; the revoked one is listed (its alias free for a new key) until
    ``REVOKED_KEPT_S`` has passed, then forgotten at the next revocation."""
    other = "other-model"
    sim = await lab.backend(models=[MODEL, other])
    pools = {
        name: {"models": [model], "backends": [{"url": sim.url, "slots": 2}]}
        for name, model in (("sim", MODEL), ("other", other))
    }
    config = keys_config(
        [sim.url], key_store_file=str(tmp_path / "keys.json"), pools=pools,
        orgs={"T": {"pools": ["sim"], "keys_from_api": True}},
    )  # fmt: skip
    wall = Wall(DEC_1)
    served = await lab.proxy(config, wall=wall)
    http = await lab.http()
    narrowed, secret = await create(http, served, alias="narrowed")
    expiring, expiring_secret = await create(http, served, alias="brief", expires_in_s=60)

    async def listed() -> dict[str, dict[str, Any]]:
        status, listing = await admin(http, served, "GET")
        assert status == 200
        return {key["id"]: key for key in listing["keys"]}

    keys = await listed()
    assert (keys[narrowed]["pools"], keys[narrowed]["models"]) == (None, None)  # as it lists
    assert keys[narrowed]["access"] == {  # as it is held
        "classes": ["interactive", "batch"], "pools": ["sim"], "models": None,
    }  # fmt: skip
    assert keys["A#0"]["access"] == {
        "classes": ["batch", "interactive"], "pools": None, "models": None,
    }  # fmt: skip
    assert {keys[i]["status"] for i in (narrowed, expiring, "A#0")} == {"active"}
    async with openai.AsyncOpenAI(
        base_url=f"{served.url}/v1", api_key=secret, max_retries=0
    ) as client:
        with pytest.raises(openai.PermissionDeniedError):
            await client.chat.completions.create(model=other, messages=CHAT, max_tokens=2)
    assert await chat(served, secret) == "ok"

    wall.now += 61
    assert await chat(served, expiring_secret) == "401 key_expired"
    assert (await listed())[expiring]["status"] == "expired"
    assert await admin(http, served, "DELETE", f"/admin/keys/{narrowed}") == (
        200, {"revoked": narrowed},
    )  # fmt: skip
    keys = await listed()
    assert (keys[narrowed]["status"], keys[narrowed]["revoked"]) == (
        "revoked",
        "2025-12-01T00:01:01Z",
    )
    assert await chat(served, secret) == "401 invalid_api_key"
    for method in ("PATCH", "DELETE"):
        status, answer = await admin(http, served, method, f"/admin/keys/{narrowed}", {})
        assert (status, answer["error"]["code"]) == (404, "key_not_found")
    again, _ = await create(http, served, alias="narrowed")  # the alias is free again
    assert (await listed())[again]["status"] == "active"

    wall.now += REVOKED_KEPT_S + 1
    await admin(http, served, "DELETE", f"/admin/keys/{expiring}")
    keys = await listed()
    assert narrowed not in keys  # revoked long ago: forgotten
    assert keys[expiring]["status"] == "revoked"


async def test_a_key_a_reload_left_without_a_class_is_listed_inactive(
    lab: Lab, tmp_path: Path
) -> None:
    sim = await lab.backend()
    file_key = [{"key": KEYS["A"], "org": "A", "classes": ["batch"]}]

    def config(*classes: str) -> Config:
        return keys_config(
            [sim.url], key_store_file=str(tmp_path / "keys.json"), keys=file_key,
            classes={name: {"weight": 1} for name in classes},
        )  # fmt: skip

    served = await lab.proxy(config("batch", "nightly"))
    http = await lab.http()
    key_id, secret = await create(http, served, alias="nightly-bot", classes=["nightly"])
    assert await chat(served, secret) == "ok"
    served.state.reload(config("batch"))  # the class is gone: the key works no more
    assert await chat(served, secret) == "401 invalid_api_key"
    _, listing = await admin(http, served, "GET")
    (key,) = [k for k in listing["keys"] if k["id"] == key_id]
    assert (key["status"], key["classes"], key["access"]["classes"]) == (
        "inactive", ["nightly"], [],
    )  # fmt: skip
    assert [k["status"] for k in listing["keys"] if k["source"] == "config"] == ["active"]


async def test_no_log_holds_a_keys_secret(
    store: tuple[Served, aiohttp.ClientSession],
    access_log: AccessLines,
    caplog: pytest.LogCaptureFixture,
) -> None:
    served, http = store
    caplog.set_level(logging.DEBUG)
    key_id, secret = await create(http, served, alias="logged", classes=["batch"])
    assert await chat(served, secret) == "ok"
    await admin(http, served, "DELETE", f"/admin/keys/{key_id}")
    assert await chat(served, secret) == "401 invalid_api_key"
    lines = await access_log()
    assert [(line.get("org"), line.get("key")) for line in lines][:1] == [("T", "logged")]
    text = json.dumps(lines) + caplog.text
    assert secret not in text
    assert hashlib.sha256(secret.encode()).hexdigest() not in text


async def test_a_body_too_large_for_a_key_is_a_413(
    store: tuple[Served, aiohttp.ClientSession],
) -> None:
    served, http = store
    raw = json.dumps({"alias": "x", "org": "T", "models": ["m" * 200] * 400}).encode()
    status, answer = await admin(http, served, "POST", raw=raw)
    assert (status, answer["error"]["code"]) == (413, "request_too_large")


async def test_an_update_narrows_a_keys_classes_for_the_next_request(
    store: tuple[Served, aiohttp.ClientSession],
) -> None:
    served, http = store
    key_id, secret = await create(http, served, alias="app", classes=["interactive", "batch"])
    assert await chat(served, secret, cls="batch") == "ok"
    status, answer = await admin(
        http, served, "PATCH", f"/admin/keys/{key_id}", {"classes": ["interactive"]}
    )
    assert (status, answer["key"]["classes"], answer["key"]["alias"]) == (
        200, ["interactive"], "app",
    )  # fmt: skip
    assert "secret" not in answer
    assert await chat(served, secret, cls="batch") == "403 forbidden"
    assert await chat(served, secret) == "ok"


async def test_a_key_expires_by_the_proxys_wall_clock(lab: Lab, tmp_path: Path) -> None:
    sim = await lab.backend()
    now = [1_800_000_000.0]
    config = keys_config([sim.url], key_store_file=str(tmp_path / "keys.json"))
    served = await lab.proxy(config, wall=lambda: now[0])
    http = await lab.http()
    key_id, secret = await create(http, served, alias="temp", expires_in_s=60)
    assert await chat(served, secret) == "ok"
    now[0] += 59.5
    assert await chat(served, secret) == "ok"
    now[0] += 0.5
    assert await chat(served, secret) == "401 key_expired"
    # an expiry in the past is refused; one set again makes it work
    status, answer = await admin(
        http, served, "PATCH", f"/admin/keys/{key_id}", {"expires_at": "2020-01-01T00:00:00Z"}
    )
    assert status == 400
    assert "expires_at" in answer["error"]["message"]
    status, answer = await admin(
        http, served, "PATCH", f"/admin/keys/{key_id}", {"expires_at": None}
    )
    assert (status, answer["key"]["expires"]) == (200, None)
    assert await chat(served, secret) == "ok"


async def test_the_files_keys_are_read_only_through_the_api(
    store: tuple[Served, aiohttp.ClientSession],
) -> None:
    served, http = store
    for method in ("PATCH", "DELETE"):
        status, answer = await admin(http, served, method, "/admin/keys/A%230", {"org": "B"})
        assert (status, answer["error"]["code"]) == (409, "read_only")
        assert "config file" in answer["error"]["message"]
    assert await chat(served, KEYS["A"]) == "ok"


async def test_the_key_api_needs_the_admin_key(
    store: tuple[Served, aiohttp.ClientSession],
) -> None:
    served, http = store
    for key in (None, "sk-wrong", KEYS["A"]):
        for method, path in (("GET", "/admin/keys"), ("POST", "/admin/keys"),
                             ("DELETE", "/admin/keys/A%230")):  # fmt: skip
            status, answer = await admin(http, served, method, path, {"org": "T"}, key=key)
            assert (status, answer["error"]["type"]) == (401, "authentication_error")
    status, answer = await admin(http, served, "PUT", "/admin/keys")
    assert status == 405
    assert "GET, POST" in answer["error"]["message"]
    status, answer = await admin(http, served, "PUT", "/admin/keys/k_1")
    assert status == 405
    assert "DELETE, PATCH" in answer["error"]["message"]


async def test_without_an_admin_key_or_a_store_the_key_api_says_why(lab: Lab) -> None:
    sim = await lab.backend()
    http = await lab.http()
    off = await lab.proxy(proxy_config([sim.url]))
    status, answer = await admin(http, off, "GET")
    assert status == 403
    assert "admin_key_env" in answer["error"]["message"]
    no_store = await lab.proxy(keys_config([sim.url]))
    status, answer = await admin(http, no_store, "POST", body={"alias": "x", "org": "T"})
    assert (status, answer["error"]["code"]) == (409, "key_store_off")
    assert "key_store_file" in answer["error"]["message"]
    status, answer = await admin(http, no_store, "GET")  # the file's keys, still listed
    assert status == 200
    assert len(answer["keys"]) == 4


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"alias": "x", "org": "T", "secret": "mine"}, "secret: unknown field"),
        ({"org": "T"}, "alias: required"),
        ({"alias": "x", "org": "T", "classes": ["gold"]}, "classes[0]: class 'gold'"),
        ({"alias": "x", "org": "T", "classes": []}, "classes: must not be empty"),
        ({"alias": "x", "org": "T/admin"}, "org: must start with a letter"),
        ({"alias": "x", "org": "T", "pools": ["nope"]}, "pools[0]: pool 'nope'"),
        ({"alias": "x", "org": "T", "models": ["gpt-9"]}, "models[0]: no pool serves"),
        ({"alias": "x", "org": "T", "expires_in_s": -5}, "expires_in_s: must be > 0"),
        ({"alias": "x", "org": "T", "expires_in_s": 1e30}, "expires_in_s: must be <="),
        ({"alias": "x", "org": "T", "expires_in_s": 5, "expires_at": None}, "not both"),
        ({"alias": "x", "org": "T", "expires_at": "tomorrow"}, "expires_at"),
        ({"alias": "x", "org": "T", "expires_at": "2099-01-01T00:00:00"}, "timezone"),
        ({"alias": "x" * 65, "org": "T"}, "alias"),
        ({"alias": "x", "org": "T", "classes": "batch"}, "classes: expected a list"),
        ({"alias": "x", "org": None}, "org: required"),
        ([{"alias": "x"}], "expected a mapping"),
    ],
)
async def test_a_bad_request_is_a_400_naming_the_field(
    store: tuple[Served, aiohttp.ClientSession], body: Any, field: str
) -> None:
    served, http = store
    status, answer = await admin(http, served, "POST", body=body)
    assert (status, answer["error"]["code"]) == (400, "invalid_request"), answer
    assert field in answer["error"]["message"]
    assert not served.state.keys or not served.state.keys.records  # nothing was made


@pytest.mark.parametrize(
    "raw", [b"not json", b'{"alias": "x", "org": "T", "expires_in_s": NaN}', b"", b"\xff\xfe"]
)
async def test_a_body_that_is_not_json_is_a_400(
    store: tuple[Served, aiohttp.ClientSession], raw: bytes
) -> None:
    served, http = store
    status, answer = await admin(http, served, "POST", raw=raw)
    assert status == 400, answer


async def test_an_alias_names_one_key_only(lab: Lab, tmp_path: Path) -> None:
    sim = await lab.backend()
    config = keys_config(
        [sim.url],
        key_store_file=str(tmp_path / "keys.json"),
        keys=[{"key": KEYS["A"], "org": "A", "classes": ["batch"], "name": "alpha"}],
    )
    served, http = await lab.proxy(config), await lab.http()
    status, answer = await admin(http, served, "POST", body={"alias": "alpha", "org": "T"})
    assert status == 400
    assert "alias" in answer["error"]["message"]
    first, _ = await create(http, served, alias="beta")
    status, answer = await admin(http, served, "POST", body={"alias": "beta", "org": "T"})
    assert status == 400
    assert "alias" in answer["error"]["message"]
    other, _ = await create(http, served, alias="gamma")
    status, answer = await admin(http, served, "PATCH", f"/admin/keys/{other}", {"alias": "beta"})
    assert status == 400
    status, _ = await admin(http, served, "PATCH", f"/admin/keys/{first}", {"alias": "beta"})
    assert status == 200  # its own alias is no clash


async def test_a_key_survives_a_restart_on_the_same_file(lab: Lab, tmp_path: Path) -> None:
    sim = await lab.backend()
    path = tmp_path / "keys.json"
    config = keys_config([sim.url], key_store_file=str(path))
    http = await lab.http()
    first = await lab.proxy(config)
    key_id, secret = await create(http, first, alias="kept", classes=["batch"])
    revoked_id, revoked = await create(http, first, alias="gone")
    # none revoked: the fields an older version reads, and only those (it refuses others)
    assert set(json.loads(path.read_text())) == {"keys", "last_used"}
    await admin(http, first, "DELETE", f"/admin/keys/{revoked_id}")
    assert await chat(first, secret) == "ok"
    await first.state.save_last_used()
    text = path.read_text()
    assert secret not in text
    assert revoked not in text
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["keys.json"]  # no temp file left
    # the revoked key is out of "keys", which older versions read as the keys in force
    assert [k["id"] for k in json.loads(text)["keys"]] == [key_id]
    second = await lab.proxy(config)
    assert await chat(second, secret) == "ok"
    assert await chat(second, revoked) == "401 invalid_api_key"
    _, listing = await admin(http, second, "GET")
    kept, gone = [k for k in listing["keys"] if k["source"] == "api"]
    assert (kept["id"], kept["alias"], kept["last_used"] is not None) == (key_id, "kept", True)
    assert (gone["id"], gone["status"]) == (revoked_id, "revoked")  # the file kept its mark


@pytest.mark.parametrize(
    "text", ["{not json", '{"keys": [{"id": "k_1"}], "last_used": {}}', "[]", '"keys"']
)
def test_a_damaged_key_file_refuses_to_start(tmp_path: Path, text: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(text)
    config = keys_config(["http://127.0.0.1:9"], key_store_file=str(path))
    with pytest.raises(ConfigError) as caught:
        build_app(config)
    ((where, message),) = caught.value.errors
    assert where == "key_store_file"
    assert str(path) in message


async def test_a_reload_keeps_the_stores_keys_and_fails_on_a_clashing_name(
    lab: Lab, tmp_path: Path
) -> None:
    sim = await lab.backend()
    served = await lab.proxy(keys_config([sim.url], key_store_file=str(tmp_path / "k.json")))
    http = await lab.http()
    _, secret = await create(http, served, alias="alpha")
    served.state.reload(keys_config([sim.url], key_store_file=str(tmp_path / "k.json")))
    assert await chat(served, secret) == "ok"  # a reload keeps the store's keys
    clashing = keys_config(
        [sim.url],
        key_store_file=str(tmp_path / "k.json"),
        keys=[{"key": KEYS["A"], "org": "A", "classes": ["batch"], "name": "alpha"}],
    )
    with pytest.raises(ConfigError) as caught:
        served.state.reload(clashing)
    assert caught.value.errors[0][0] == "keys[0].name"
    assert served.state.config.keys[0].name is None  # nothing changed
    assert await chat(served, secret) == "ok"


@pytest.mark.redis
async def test_two_proxies_on_one_redis_share_the_keys(lab: Lab, redis_url: str) -> None:
    sim = await lab.backend()
    config = keys_config([sim.url], state={"redis": redis_url, "lease_ttl_s": 30})
    one, two = await lab.proxy(config), await lab.proxy(config)
    http = await lab.http()
    key_id, secret = await create(http, one, alias="shared", classes=["batch"])
    assert await chat(one, secret) == "ok"
    await eventually(lambda: key_id in stored(two), 1.0)
    assert await chat(two, secret) == "ok"
    _, listing = await admin(http, two, "GET")
    assert [k["alias"] for k in listing["keys"] if k["source"] == "api"] == ["shared"]
    # an update made on the second proxy reaches the first
    status, _ = await admin(http, two, "PATCH", f"/admin/keys/{key_id}", {"classes": ["batch"]})
    assert status == 200
    assert await admin(http, one, "DELETE", f"/admin/keys/{key_id}") == (
        200, {"revoked": key_id},
    )  # fmt: skip
    assert await chat(one, secret) == "401 invalid_api_key"
    await eventually(lambda: stored(two)[key_id].revoked is not None, 1.0)
    _, listing = await admin(http, two, "GET")
    assert [k["status"] for k in listing["keys"] if k["id"] == key_id] == ["revoked"]
    status, answer = await admin(
        http, two, "PATCH", f"/admin/keys/{key_id}", {"classes": ["batch"]}
    )
    assert (status, answer["error"]["code"]) == (404, "key_not_found")  # Redis's script says so
    await create(http, two, alias="shared")  # the revoked key's alias is free
    assert await chat(two, secret) == "401 invalid_api_key"
    # a proxy started afterwards reads the keys from Redis
    later_id, later = await create(http, two, alias="later")
    three = await lab.proxy(config)
    assert await chat(three, later) == "ok"
    assert later_id in stored(three)


def test_key_store_file_is_refused_with_redis() -> None:
    with pytest.raises(ConfigError) as caught:
        keys_config(["http://127.0.0.1:9"], key_store_file="k.json",
                    state={"redis": "redis://127.0.0.1:1"})  # fmt: skip
    assert "key_store_file" in [path for path, _ in caught.value.errors]


async def cli(served: Served, *args: str) -> tuple[int, str, str]:
    """``sfq-proxy keys ...`` in a subprocess, against ``served``."""
    command = [sys.executable, "-m", "sfq_proxy.cli", "keys", *args[:1],
               "--url", served.url, "--admin-key-env", "SFQ_ADMIN_KEY", *args[1:]]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **ENV},
    )
    out, err = await process.communicate()
    return process.returncode or 0, out.decode(), err.decode()


async def test_the_cli_manages_keys_end_to_end(
    store: tuple[Served, aiohttp.ClientSession],
) -> None:
    served, _ = store
    code, out, err = await cli(
        served, "create", "--alias", "from-cli", "--org", "T", "--classes", "batch,interactive",
        "--expires-in", "30d",
    )  # fmt: skip
    assert code == 0, err
    secret = next(w for w in out.split() if w.startswith("sk-sfq-"))
    key_id = next(w for w in out.split() if w.startswith("k_"))
    assert await chat(served, secret, cls="interactive") == "ok"
    code, out, _ = await cli(served, "list")
    assert code == 0
    assert "from-cli" in out
    assert "A#0" in out
    assert secret not in out
    code, out, err = await cli(served, "update", key_id, "--classes", "batch")
    assert code == 0, err
    assert await chat(served, secret, cls="interactive") == "403 forbidden"
    code, out, err = await cli(served, "update", "A#0", "--classes", "batch")
    assert code == 1
    assert "config file" in err
    code, out, err = await cli(served, "create", "--alias", "bad", "--org", "T",
                               "--classes", "gold")  # fmt: skip
    assert code == 1
    assert "class 'gold'" in err
    code, out, err = await cli(served, "revoke", key_id)
    assert code == 0, err
    assert await chat(served, secret) == "401 invalid_api_key"


@pytest.mark.redis
async def test_redis_lists_a_revoked_key_until_it_is_forgotten(lab: Lab, redis_url: str) -> None:
    sim = await lab.backend()
    wall = Wall(DEC_1)
    config = keys_config([sim.url], state={"redis": redis_url, "lease_ttl_s": 30})
    served = await lab.proxy(config, wall=wall)
    http = await lab.http()
    old, old_secret = await create(http, served, alias="old")
    recent, _ = await create(http, served, alias="recent")
    kept, secret = await create(http, served, alias="kept")
    assert [await chat(served, s) for s in (old_secret, secret)] == ["ok", "ok"]
    await served.state.save_last_used()
    await admin(http, served, "DELETE", f"/admin/keys/{old}")
    with redis.Redis.from_url(redis_url) as client:
        # what a replica of an older version reads as the keys in force: not the revoked one
        assert sorted(client.hkeys(BY_ID)) == sorted([recent.encode(), kept.encode()])
        assert client.hkeys(REVOKED) == [old.encode()]
        assert sorted(client.hkeys(USED)) == sorted([old.encode(), kept.encode()])
    wall.now += REVOKED_KEPT_S + 1
    await admin(http, served, "DELETE", f"/admin/keys/{recent}")
    await served.state.keys.refresh()  # as Redis holds them
    _, listing = await admin(http, served, "GET")
    assert {k["id"]: k["status"] for k in listing["keys"] if k["source"] == "api"} == {
        recent: "revoked",
        kept: "active",
    }
    with redis.Redis.from_url(redis_url) as client:
        assert client.hkeys(REVOKED) == [recent.encode()]
        assert client.hkeys(BY_ID) == [kept.encode()]
        assert client.hkeys(USED) == [kept.encode()]


@pytest.mark.redis
async def test_the_keys_are_shared_through_a_redis_cluster(lab: Lab) -> None:
    need_redis_server()
    sim = await lab.backend()
    with running_redis_cluster() as cluster:
        owner = cluster.owner(BY_ID)
        entry = next(node for node in cluster.nodes if node is not owner)  # a redirection away
        state = {"redis": f"redis://127.0.0.1:{entry.port}", "cluster": True, "lease_ttl_s": 30}
        config = keys_config([sim.url], state=state)
        async with contextlib.AsyncExitStack() as stack:
            inner = Lab(stack)  # its proxies stop before the cluster does
            first, second = await inner.proxy(config), await inner.proxy(config)
            http = await lab.http()
            key_id, secret = await create(http, first, alias="clustered")
            await eventually(lambda: key_id in stored(second), 1.0)
            assert await chat(second, secret) == "ok"
            await admin(http, first, "DELETE", f"/admin/keys/{key_id}")
            await eventually(lambda: stored(second)[key_id].revoked is not None, 1.0)
            assert await chat(second, secret) == "401 invalid_api_key"
        with owner.client() as client:  # kept, marked revoked: in the owner's slot too
            assert (client.hlen(BY_ID), client.hlen(REVOKED)) == (0, 1)
