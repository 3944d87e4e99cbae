"""Authentication (bearer key → key entry) and classification (→ flow org/class/pool)."""

from __future__ import annotations

import hashlib

import pytest

from sfq_proxy.config import Config, ResolvedKey, parse_config
from sfq_proxy.core.errors import ApiError
from sfq_proxy.core.flows import CLASS_HEADER, Authenticator, Flow, classify, credential

PLAIN = "sk-plain-product"
HASHED = "sk-hashed-ops"
FROM_ENV = "sk-env-analytics"
CONFIG = f"""
keys:
  - {{key: {PLAIN}, org: product, classes: [interactive, batch]}}
  - {{key_sha256: "{hashlib.sha256(HASHED.encode()).hexdigest().upper()}",
      org: ops, classes: [system, interactive]}}
  - {{key_env: ANALYTICS_KEY, org: analytics, classes: [batch]}}
pools:  # each with more slots than the system class's max_in_flight (4)
  llama-8b:
    models: [meta-llama/Llama-3.1-8B-Instruct, llama-alias]
    backends: [{{url: "http://127.0.0.1:8001", slots: 8}}]
  provider-a:
    models: [gpt-4o-mini]
    backends: [{{url: "https://provider.example/v1", slots: 8}}]
"""
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
NOW = 1_800_000_000.0  # the Unix time identify is given


@pytest.fixture(scope="module")
def config() -> Config:
    # a trailing newline, as in a secret mounted from a file, is stripped
    return parse_config(CONFIG, environ={"ANALYTICS_KEY": FROM_ENV + "\n"})


@pytest.fixture(scope="module")
def auth(config: Config) -> Authenticator:
    return Authenticator(config.resolved_keys())


def key_of(config: Config, org: str) -> ResolvedKey:
    (key,) = [k for k in config.resolved_keys() if k.org == org]
    return key


def authorization(header: str | None) -> dict[str, str]:
    """Request headers with this ``Authorization`` (none for None)."""
    return {} if header is None else {"Authorization": header}


def unauthorized(auth: Authenticator, header: str | dict[str, str] | None) -> ApiError:
    with pytest.raises(ApiError) as info:
        auth.identify(header if isinstance(header, dict) else authorization(header), NOW)
    err = info.value
    assert (err.status, err.type, err.code) == (401, "authentication_error", "invalid_api_key")
    return err


# -- Authenticator ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("secret", "index", "org", "classes"),
    [
        (PLAIN, 0, "product", ("interactive", "batch")),
        (HASHED, 1, "ops", ("system", "interactive")),
        (FROM_ENV, 2, "analytics", ("batch",)),
    ],
    ids=["key", "key_sha256", "key_env"],
)
def test_right_key_resolves_to_its_entry(
    auth: Authenticator, secret: str, index: int, org: str, classes: tuple[str, ...]
) -> None:
    key = auth.identify(authorization(f"Bearer {secret}"), NOW)
    assert key == ResolvedKey(index, org, classes, hashlib.sha256(secret.encode()).digest())


@pytest.mark.parametrize("header", [f"bearer {PLAIN}", f"BEARER {PLAIN}", f"Bearer   {PLAIN}  "])
def test_scheme_is_case_insensitive_and_spaces_are_trimmed(
    auth: Authenticator, header: str
) -> None:
    assert auth.identify(authorization(header), NOW).org == "product"


@pytest.mark.parametrize(
    "header",
    [None, "", "Bearer", "Bearer ", "Bearer    ", PLAIN, f"Basic {PLAIN}", f"Token {PLAIN}"],
)
def test_missing_or_malformed_authorization_is_401(auth: Authenticator, header: str | None) -> None:
    err = unauthorized(auth, header)
    assert err.message == "Missing API key: send 'Authorization: Bearer <key>'."
    assert PLAIN not in err.message


@pytest.mark.parametrize(
    "secret",
    [
        "sk-wrong",
        PLAIN.upper(),
        PLAIN + "x",
        FROM_ENV + "\n" + "x",
        hashlib.sha256(HASHED.encode()).hexdigest(),  # the digest is not the key
        "ANALYTICS_KEY",  # nor is the variable's name
    ],
)
def test_wrong_key_is_401_and_not_echoed(auth: Authenticator, secret: str) -> None:
    err = unauthorized(auth, f"Bearer {secret}")
    assert err.message == "Incorrect API key provided."
    assert secret.strip() not in err.message
    assert secret.strip() not in str(err)


@pytest.mark.parametrize("name", ["api-key", "x-api-key"])
def test_api_key_and_x_api_key_carry_a_key_too(auth: Authenticator, name: str) -> None:
    """Azure OpenAI's and Anthropic-style clients send the key alone, in these headers."""
    assert auth.identify({name: f"  {PLAIN} "}, NOW).org == "product"
    assert unauthorized(auth, {name: "sk-wrong"}).message == "Incorrect API key provided."
    assert "Missing" in unauthorized(auth, {name: "   "}).message


@pytest.mark.parametrize(
    ("headers", "org"),
    [
        ({"Authorization": f"Bearer {PLAIN}", "api-key": HASHED}, "product"),
        ({"Authorization": f"Bearer {PLAIN}", "x-api-key": HASHED}, "product"),
        ({"api-key": HASHED, "x-api-key": PLAIN}, "ops"),
        ({"x-api-key": HASHED}, "ops"),
    ],
)
def test_the_first_key_header_present_decides(
    auth: Authenticator, headers: dict[str, str], org: str
) -> None:
    """Authorization first, then api-key, then x-api-key (docs/design.md §2)."""
    assert auth.identify(headers, NOW).org == org
    assert credential(headers) == (PLAIN if org == "product" else HASHED)


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": "Basic abc", "api-key": PLAIN},  # a request gets one guess
        {"Authorization": "", "x-api-key": PLAIN},
        {"Authorization": "Bearer sk-wrong", "api-key": PLAIN},
        {"api-key": "sk-wrong", "x-api-key": PLAIN},
    ],
)
def test_a_later_header_is_never_a_second_guess(
    auth: Authenticator, headers: dict[str, str]
) -> None:
    unauthorized(auth, headers)


def test_no_keys_rejects_everyone() -> None:
    assert unauthorized(Authenticator([]), f"Bearer {PLAIN}").message == (
        "Incorrect API key provided."
    )


# -- classify ---------------------------------------------------------------------------------


def test_default_class_is_first_listed(config: Config) -> None:
    flow = classify(config, key_of(config, "product"), None, LLAMA)
    assert flow == Flow(org="product", cls="interactive", pool="llama-8b")
    assert flow.id == "product/interactive"
    assert classify(config, key_of(config, "ops"), "", "gpt-4o-mini") == Flow(
        "ops", "system", "provider-a"
    )


@pytest.mark.parametrize(
    ("org", "requested", "model", "expected"),
    [
        ("product", "batch", LLAMA, Flow("product", "batch", "llama-8b")),
        ("product", "interactive", "llama-alias", Flow("product", "interactive", "llama-8b")),
        ("ops", "interactive", "gpt-4o-mini", Flow("ops", "interactive", "provider-a")),
        ("analytics", "batch", LLAMA, Flow("analytics", "batch", "llama-8b")),
    ],
)
def test_allowed_requested_class_is_used(
    config: Config, org: str, requested: str, model: str, expected: Flow
) -> None:
    assert classify(config, key_of(config, org), requested, model) == expected


@pytest.mark.parametrize(
    ("org", "requested"),
    [
        ("analytics", "interactive"),
        ("analytics", "system"),
        ("product", "system"),
        ("product", "Batch"),
        ("product", "nonexistent"),
    ],
)
def test_class_not_allowed_is_403(config: Config, org: str, requested: str) -> None:
    with pytest.raises(ApiError) as info:
        classify(config, key_of(config, org), requested, LLAMA)
    err = info.value
    assert (err.status, err.code) == (403, "forbidden")
    assert err.message == f"This key may not use workload class '{requested}'."
    assert PLAIN not in err.message
    assert FROM_ENV not in err.message


@pytest.mark.parametrize("model", ["gpt-4o", "META-LLAMA/Llama-3.1-8B-Instruct", ""])
def test_unknown_model_is_404(config: Config, model: str) -> None:
    with pytest.raises(ApiError) as info:
        classify(config, key_of(config, "product"), None, model)
    err = info.value
    assert (err.status, err.code) == (404, "model_not_found")
    assert err.message == f"The model '{model}' does not exist or is not served here."
    assert PLAIN not in err.message


def test_class_is_checked_before_model(config: Config) -> None:
    with pytest.raises(ApiError) as info:
        classify(config, key_of(config, "analytics"), "system", "no-such-model")
    assert info.value.status == 403


def test_flow_id_is_org_and_class() -> None:
    assert Flow(org="a", cls="b", pool="p").id == "a/b"
    assert Flow(org="a", cls="b", pool="p").id == Flow(org="a", cls="b", pool="q").id
    assert Flow(org="a", cls="b", pool="p") != Flow(org="a", cls="b", pool="q")
    assert CLASS_HEADER == "X-Workload-Class"
