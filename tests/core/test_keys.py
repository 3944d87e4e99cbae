"""Keys of the admin API, without a server: the checks of a create or update request, the
record as a store writes it and reads it back, what the Authenticator looks it up as, and
the file store's atomic writes and its refusal of a damaged file."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sfq_proxy.config import Config, ConfigError, parse_config
from sfq_proxy.core.errors import ApiError
from sfq_proxy.core.flows import Authenticator
from sfq_proxy.core.keys import (
    MAX_LIFETIME_S,
    REVOKED_KEPT_S,
    KeyRecord,
    changed_record,
    clashes,
    in_force,
    key_id,
    new_record,
    record_from_json,
    record_to_json,
    resolved,
)
from sfq_proxy.core.usage import Budget, budgets_of
from sfq_proxy.state.key_store import FileKeyStore

NOW = 1_800_000_000.0
SECRET = "sk-sfq-test-secret"
DIGEST = hashlib.sha256(SECRET.encode()).digest()
CONFIG = """
keys:
  - {key: sk-file, org: product, classes: [interactive, batch], name: product-app}
orgs:
  limited: {pools: [small], keys_from_api: true}
pools:
  big:
    models: [llama-70b]
    backends: [{url: "http://127.0.0.1:8001", slots: 8}]
  small:
    models: [llama-8b, llama-1b]
    backends: [{url: "http://127.0.0.1:8002", slots: 4}]  # no room for the system band
"""


@pytest.fixture(scope="module")
def config() -> Config:
    return parse_config(CONFIG, environ={})


def body(**fields: Any) -> bytes:
    return json.dumps({"alias": "bot", "org": "team", **fields}).encode()


def refused(call: Any, *args: Any) -> str:
    """The message of the 400 ``call(*args)`` raises."""
    with pytest.raises(ApiError) as caught:
        call(*args)
    assert (caught.value.status, caught.value.code) == (400, "invalid_request")
    return caught.value.message


def test_a_new_record_takes_the_request_and_defaults_to_the_fair_queued_classes(
    config: Config,
) -> None:
    record = new_record(body(), config, {}, DIGEST, NOW)
    assert record.id == key_id(DIGEST) == "k_" + DIGEST.hex()[:12]
    assert (record.alias, record.org, record.classes) == ("bot", "team", ("interactive", "batch"))
    assert (record.created, record.expires, record.pools, record.models) == (NOW, None, None, None)
    timed = new_record(body(expires_in_s=60, models=["llama-8b"]), config, {}, DIGEST, NOW)
    assert (timed.expires, timed.models) == (NOW + 60, ("llama-8b",))
    at = new_record(body(expires_at="2030-01-01T01:00:00+01:00"), config, {}, DIGEST, NOW)
    assert at.expires == 1_893_456_000.0  # 2030-01-01T00:00:00Z


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"classes": ["system"]}, "classes: classes.system"),  # the band caps are unset
        ({"classes": ["gold"]}, "classes[0]: class 'gold' is not defined"),
        ({"pools": ["huge"]}, "pools[0]: pool 'huge' is not defined"),
        ({"models": ["llama-7b"]}, "models[0]: no pool serves model 'llama-7b'"),
        ({"org": "limited", "models": ["llama-70b"]}, "org: could use no model"),
        ({"alias": "product-app"}, "alias: another key has this name"),
        ({"alias": "a b"}, "alias: must start with a letter or digit"),
        ({"expires_in_s": 0}, "expires_in_s: must be > 0"),
        ({"expires_in_s": MAX_LIFETIME_S + 1}, "expires_in_s: must be <="),
        ({"expires_at": "1999-01-01T00:00:00Z"}, "expires_at: must be in the future"),
        ({"expires_at": 1_900_000_000}, "expires_at"),
        ({"id": "k_000000000000"}, "id: unknown field"),
        ({"classes": ["batch"] * 33}, "classes: "),
        ({"budgets": [{"period": "day", "tokens": 0}]}, "budgets[0].tokens: must be > 0"),
        ({"budgets": [{"period": "day", "tokens": 1.5}]}, "budgets[0].tokens"),
        ({"budgets": [{"period": "day", "tokens": "9"}]}, "budgets[0].tokens"),
        ({"budgets": [{"period": "day", "tokens": 10**16}]}, "budgets[0].tokens: must be <="),
        ({"budgets": [{"period": "week", "tokens": 9}]}, "budgets[0].period"),
        ({"budgets": [{"period": "day"}]}, "budgets[0]: needs exactly one of tokens, money"),
        ({"budgets": [{"period": "day", "tokens": 9, "money": 1}]}, "budgets[0]: needs exactly"),
        ({"budgets": [{"period": "day", "tokens": 9, "warn_at": 1}]}, "budgets[0].warn_at"),
        ({"budgets": [{"period": "day", "tokens": 9, "cap": 1}]}, "budgets[0].cap: unknown"),
        ({"budgets": [{"period": "day", "money": 5}]}, "budgets[0].money: a money budget needs"),
        ({"budgets": [{"period": "day", "tokens": n} for n in (1, 2)]}, "budgets: has two"),
        ({"budgets": {"period": "day", "tokens": 9}}, "budgets: "),
        ({"budgets": [{"period": p, "tokens": 9} for p in ("day", "month") * 3]}, "budgets: "),
    ],
)
def test_a_request_the_config_could_not_hold_is_refused_naming_the_field(
    config: Config, fields: dict[str, Any], says: str
) -> None:
    assert says in refused(new_record, body(**fields), config, {}, DIGEST, NOW)


def test_the_default_classes_leave_out_a_priority_class(config: Config) -> None:
    assert "system" in config.classes
    assert "system" not in new_record(body(), config, {}, DIGEST, NOW).classes


def test_an_update_changes_what_it_names_and_null_lifts_a_restriction(config: Config) -> None:
    record = new_record(body(pools=["small"], expires_in_s=60), config, {}, DIGEST, NOW)
    later = NOW + 10
    changed = changed_record(record, b'{"classes": ["batch"]}', config, {}, later)
    assert (changed.classes, changed.pools, changed.expires) == (("batch",), ("small",), NOW + 60)
    lifted = changed_record(record, b'{"pools": null, "expires_at": null}', config, {}, later)
    assert (lifted.pools, lifted.expires, lifted.created) == (None, None, NOW)
    renewed = changed_record(record, b'{"expires_in_s": 100}', config, {}, later)
    assert renewed.expires == later + 100
    for null in ("alias", "org", "classes"):
        message = refused(changed_record, record, f'{{"{null}": null}}'.encode(), config, {}, NOW)
        assert f"{null}: must not be null" in message


def test_a_keys_budgets_are_set_kept_and_cleared_by_its_requests(config: Config) -> None:
    day = {"period": "day", "tokens": 100_000, "warn_at": 0.5}
    record = new_record(body(budgets=[day]), config, {}, DIGEST, NOW)
    assert [b.model_dump() for b in record.budgets] == [{**day, "money": None}]
    assert new_record(body(), config, {}, DIGEST, NOW).budgets == ()
    kept = changed_record(record, b'{"classes": ["batch"]}', config, {}, NOW)
    assert kept.budgets == record.budgets
    month = b'{"budgets": [{"period": "month", "tokens": 7}]}'
    assert [b.tokens for b in changed_record(record, month, config, {}, NOW).budgets] == [7]
    for cleared in (b'{"budgets": null}', b'{"budgets": []}'):
        assert changed_record(record, cleared, config, {}, NOW).budgets == ()


def test_a_money_budget_is_taken_where_a_pool_has_prices() -> None:
    prices = "    prices: {'*': {prompt_per_1m: 1.0, completion_per_1m: 2.0}}\n"
    priced = parse_config(
        CONFIG.replace("    models: [llama-70b]\n", "    models: [llama-70b]\n" + prices),
        environ={},
    )
    money = {"period": "month", "money": 50}
    record = new_record(body(budgets=[money]), priced, {}, DIGEST, NOW)
    assert [(b.period, b.money, b.tokens) for b in record.budgets] == [("month", 50.0, None)]


def test_an_alias_is_unique_among_the_stores_keys_but_its_own(config: Config) -> None:
    first = new_record(body(), config, {}, DIGEST, NOW)
    records = {first.id: first}
    other = hashlib.sha256(b"other").digest()
    assert "alias" in refused(new_record, body(), config, records, other, NOW)
    assert changed_record(first, b'{"alias": "bot"}', config, records, NOW) == first


def test_a_record_resolves_within_its_orgs_access_and_the_configs_classes(config: Config) -> None:
    record = new_record(body(org="limited", classes=["batch"]), config, {}, DIGEST, NOW)
    key = resolved(record, config)
    assert key is not None
    assert (key.org, key.classes, key.digest, key.name) == ("limited", ("batch",), DIGEST, "bot")
    assert (key.pools, key.models, key.managed) == (frozenset({"small"}), None, True)
    gone = KeyRecord(**{**record.__dict__, "classes": ("retired",)})
    assert resolved(gone, config) is None  # a reload removed its only class


def test_a_record_goes_to_json_and_back_with_its_digest_never_a_secret(config: Config) -> None:
    record = new_record(body(models=["llama-8b"], expires_in_s=5), config, {}, DIGEST, NOW)
    data = record_to_json(record)
    assert SECRET not in json.dumps(data)
    assert record_from_json(json.loads(json.dumps(data))) == record


def test_a_records_budgets_go_to_json_and_back(config: Config) -> None:
    budgets = [
        {"period": "day", "tokens": 500},
        {"period": "month", "tokens": 9000, "warn_at": 0.9},
    ]
    record = new_record(body(budgets=budgets), config, {}, DIGEST, NOW)
    data = json.loads(json.dumps(record_to_json(record), allow_nan=False))
    assert data["budgets"] == [{**budgets[0], "warn_at": 0.8}, budgets[1]]  # no null unit
    assert record_from_json(data) == record
    older = {name: value for name, value in data.items() if name != "budgets"}
    assert record_from_json(older).budgets == ()  # written before keys had budgets


@pytest.mark.parametrize(
    "change",
    [
        {"id": "k_000000000000"},  # not the digest's
        {"digest": "zz" * 32},
        {"created": math.inf},
        {"expires": 1e20},  # past the year 9999: could not be written out
        {"alias": "../etc"},
        {"classes": []},
        {"extra": 1},
        {"budgets": [{"period": "day"}]},
        {"budgets": [{"period": "day", "tokens": -1}]},
        {"budgets": None},
    ],
)
def test_a_malformed_stored_record_is_refused(config: Config, change: dict[str, Any]) -> None:
    data = {**record_to_json(new_record(body(), config, {}, DIGEST, NOW)), **change}
    with pytest.raises(ValueError, match=r"\w"):
        record_from_json(data)


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=200),
        st.recursive(
            st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=20),
            lambda inner: (
                st.lists(inner, max_size=4)
                | st.dictionaries(
                    st.sampled_from(
                        [
                            "alias",
                            "org",
                            "classes",
                            "pools",
                            "models",
                            "expires_at",
                            "expires_in_s",
                            "budgets",
                            "period",
                            "tokens",
                            "money",
                            "warn_at",
                        ]
                    )
                    | st.text(max_size=8),
                    inner,
                    max_size=6,
                )
            ),
            max_leaves=12,
        ).map(lambda value: json.dumps(value).encode()),
    )
)
def test_any_body_makes_a_valid_record_or_a_400(body_bytes: bytes) -> None:
    config = parse_config(CONFIG, environ={})
    try:
        record: KeyRecord | ApiError = new_record(body_bytes, config, {}, DIGEST, NOW)
    except ApiError as err:
        record = err
    if isinstance(record, ApiError):
        assert record.status == 400
        return
    assert record_from_json(json.loads(json.dumps(record_to_json(record)))) == record
    assert record.expires is None or record.expires > NOW


def test_the_authenticator_refuses_an_expired_key_and_notes_when_keys_were_used(
    config: Config,
) -> None:
    record = new_record(body(expires_in_s=60), config, {}, DIGEST, NOW)
    key = resolved(record, config)
    assert key is not None
    auth = Authenticator(config.resolved_keys(), [key])
    headers = {"Authorization": f"Bearer {SECRET}"}
    assert auth.identify(headers, NOW + 59) is key
    assert auth.last_used == {DIGEST: NOW + 59}
    with pytest.raises(ApiError) as caught:
        auth.identify(headers, NOW + 60)
    assert (caught.value.status, caught.value.code) == (401, "key_expired")
    assert auth.last_used == {DIGEST: NOW + 59}  # a refused request is no use
    auth.reconfigure(config.resolved_keys(), [])  # revoked, by a reload's resolution
    with pytest.raises(ApiError) as caught:
        auth.identify(headers, NOW)
    assert caught.value.code == "invalid_api_key"
    assert auth.identify({"Authorization": "Bearer sk-file"}, NOW).org == "product"


def test_a_file_key_named_like_an_api_alias_is_a_clash(config: Config) -> None:
    record = new_record(body(alias="product-2"), config, {}, DIGEST, NOW)
    assert clashes(config, [record]) is None
    renamed = parse_config(CONFIG.replace("name: product-app", "name: product-2"), environ={})
    clash = clashes(renamed, [record])
    assert clash is not None
    assert clash.errors == [("keys[0].name", f"is the alias of key {record.id} of the admin API")]


def test_a_key_in_force_brings_its_budgets_under_its_alias_and_a_clash_is_out(
    config: Config,
) -> None:
    """Budgets count by name: an API key named like a key of the file (another replica's
    config on the same Redis let it in) is not in force here, so it can share nothing."""
    budget = {"period": "day", "tokens": 10}
    record = new_record(body(alias="product-2", budgets=[budget]), config, {}, DIGEST, NOW)
    [(found, key)] = in_force([record], config)
    assert (found, key.name) == (record, "product-2")
    [own] = budgets_of(config, [found])
    assert own == Budget("key", "product-2", record.budgets[0], "team")
    renamed = parse_config(CONFIG.replace("name: product-app", "name: product-2"), environ={})
    assert in_force([record], renamed) == []
    assert budgets_of(renamed, [r for r, _ in in_force([record], renamed)]) == []
    retired = KeyRecord(**{**record.__dict__, "classes": ("retired",)})
    assert in_force([retired], config) == []


def test_a_revoked_key_is_out_of_force_and_frees_its_alias(config: Config) -> None:
    """A revoked record is only listed: not looked up, no clash with the file's names, and
    a new key may take its alias."""
    record = new_record(body(alias="product-app-2"), config, {}, DIGEST, NOW)
    revoked = replace(record, revoked=NOW + 1)
    assert in_force([revoked], config) == []
    renamed = parse_config(CONFIG.replace("name: product-app", "name: product-app-2"), environ={})
    assert clashes(renamed, [revoked]) is None
    assert clashes(renamed, [record]) is not None
    other = hashlib.sha256(b"another").digest()
    again = new_record(body(alias="product-app-2"), config, {record.id: revoked}, other, NOW + 2)
    assert again.alias == "product-app-2"
    assert "alias" in refused(new_record, body(alias="product-app-2"), config,
                              {record.id: record}, other, NOW + 2)  # fmt: skip


def test_the_file_store_forgets_revoked_keys_after_a_while_and_reads_older_files(
    config: Config, tmp_path: Path
) -> None:
    path = tmp_path / "keys.json"
    store = FileKeyStore(path)
    first, second, third = (
        new_record(body(alias=f"k{n}"), config, {}, hashlib.sha256(b"%d" % n).digest(), NOW)
        for n in range(3)
    )
    for record in (first, second, third):
        asyncio.run(store.create(record))
    assert asyncio.run(store.revoke(first.id, NOW + 1)) is True
    written = json.loads(path.read_text())  # out of the keys in force, which older ones read
    assert [key["id"] for key in written["keys"]] == [second.id, third.id]
    assert written["revoked"] == [{"revoked": NOW + 1, "key": record_to_json(first)}]
    assert asyncio.run(store.revoke(second.id, NOW + 1 + REVOKED_KEPT_S)) is True  # kept still
    assert set(FileKeyStore(path).records) == {first.id, second.id, third.id}
    assert asyncio.run(store.revoke(third.id, NOW + 2 + REVOKED_KEPT_S)) is True
    assert set(FileKeyStore(path).records) == {second.id, third.id}  # first forgotten
    older = {"keys": [record_to_json(first)], "last_used": {}}  # a file of an older proxy
    path.write_text(json.dumps(older))
    assert FileKeyStore(path).records == {first.id: first}


def test_the_file_store_writes_atomically_and_reads_back(config: Config, tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    store = FileKeyStore(path)
    assert store.records == {}  # no file yet: no key
    record = new_record(body(), config, {}, DIGEST, NOW)
    asyncio.run(store.create(record))
    asyncio.run(store.save_last_used({record.id: NOW + 5, "k_gone": NOW}))
    asyncio.run(store.save_last_used({record.id: NOW + 1}))  # an older time changes nothing
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert sorted(os.listdir(tmp_path)) == ["keys.json"]
    again = FileKeyStore(path)
    assert again.records == {record.id: record}
    assert asyncio.run(again.last_used()) == {record.id: NOW + 5}
    assert asyncio.run(again.revoke(record.id, NOW + 9)) is True
    assert asyncio.run(again.revoke(record.id, NOW + 10)) is False  # revoked already
    revoked = replace(record, revoked=NOW + 9)
    assert FileKeyStore(path).records == {record.id: revoked}  # listed as revoked


def test_a_write_that_fails_changes_nothing(
    config: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileKeyStore(tmp_path / "keys.json")
    record = new_record(body(), config, {}, DIGEST, NOW)

    def full_disk(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(ApiError) as caught:
        asyncio.run(store.create(record))
    assert (caught.value.status, caught.value.code) == (503, "key_store_unavailable")
    assert store.records == {}
    assert os.listdir(tmp_path) == []  # the temp file is gone too


def test_a_store_file_in_a_missing_directory_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        FileKeyStore(tmp_path / "missing" / "keys.json")
    assert caught.value.errors[0][0] == "key_store_file"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{",
        "null",
        '{"keys": {}, "last_used": {}}',
        '{"keys": [], "last_used": {"k_1": "yesterday"}}',
        '{"keys": [], "last_used": {}, "secrets": []}',
        "[" * 100_000,
    ],
)
def test_a_damaged_file_is_a_config_error_naming_it(tmp_path: Path, text: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        FileKeyStore(path)
    ((where, message),) = caught.value.errors
    assert where == "key_store_file"
    assert str(path) in message
