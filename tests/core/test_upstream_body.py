"""The body a backend is sent (core/upstream_body.py), for vLLM's engine priority
(docs/design.md §5, Engine priority): a client's ``priority`` is taken out as the body is
read, for a pool whose engine takes one, and its class's ``engine_priority`` is appended;
the common body is not written again; the config's ``classes.<c>.engine_priority``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from sfq_proxy.config import ConfigError, parse_config
from sfq_proxy.core.inference_request import (
    InferenceRequest,
    Kind,
    parse,
    parse_extra,
    with_priority,
)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def owned(_model: str) -> bool:
    return True


def chat(raw: bytes, owns: bool = True) -> InferenceRequest:
    return parse(Kind.CHAT, raw, owns_priority=owned if owns else lambda _m: False)


def body(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"content": "x"}], **fields}).encode()


def members(raw: bytes) -> list[tuple[str, Any]]:
    """The body's top-level members in order, a repeated name kept."""
    pairs: list[tuple[str, Any]] = json.loads(raw, object_pairs_hook=lambda pairs: pairs)
    return pairs


@pytest.mark.parametrize(
    "raw",
    [
        body(priority=-1_000_000),
        body(priority="-5"),  # not even an integer: out all the same
        body(max_tokens=9, priority=None),
        b'{"model":"m","messages":[{"content":"x"}],"priorit\\u0079":-9}',  # an escaped name
        b'{"model":"m","priority":1,"messages":[{"content":"x"}],"priority":-100}',  # twice
    ],
)
def test_a_clients_priority_is_taken_out_for_a_pool_that_owns_it(raw: bytes) -> None:
    sent = chat(raw).raw
    assert "priority" not in json.loads(sent)
    assert b"priorit" not in sent
    assert {name for name, _ in members(sent)} == {name for name, _ in members(raw)} - {"priority"}


def test_elsewhere_the_clients_priority_goes_as_it_came() -> None:
    raw = body(priority=-5)
    assert chat(raw, owns=False).raw is raw


def test_a_body_without_priority_is_not_written_again() -> None:
    """The common case costs nothing more: the client's bytes themselves, or for a stream
    its bytes with ``stream_options`` appended, as before."""
    raw = body(max_tokens=5)
    assert chat(raw).raw is raw
    streamed = body(max_tokens=5, stream=True)
    assert chat(streamed).raw == streamed[:-1] + b',"stream_options":{"include_usage":true}}'


def test_a_stream_with_a_priority_is_written_once_with_its_usage_asked() -> None:
    sent = chat(body(stream=True, priority=-3, stream_options={"include_usage": False}))
    assert json.loads(sent.raw)["stream_options"] == {"include_usage": True}
    assert "priority" not in json.loads(sent.raw)
    assert sent.strip_usage


def test_an_extra_paths_body_loses_the_clients_priority_too() -> None:
    class Rule:
        fixed, input_fields = 0, ("query",)

    raw = json.dumps({"model": MODEL, "query": "q", "priority": -9}).encode()
    sent = parse_extra(raw, "/v1/rerank", lambda _m: Rule(), owned)
    assert json.loads(sent.raw) == {"model": MODEL, "query": "q"}
    assert parse_extra(raw, "/v1/rerank", lambda _m: Rule()).raw is raw


def test_the_classes_engine_priority_is_appended_once() -> None:
    request = chat(body(priority=-1_000_000, max_tokens=5))
    sent = with_priority(request, 10)
    assert members(sent.raw)[-1] == ("priority", 10)
    assert [name for name, _ in members(sent.raw)].count("priority") == 1
    assert with_priority(request, None) is request  # unset: nothing sent
    extra = InferenceRequest(Kind.EXTRA, MODEL, False, None, 0, None, b'{"model":"m"}')
    assert with_priority(extra, 10) is extra  # a route that may not take one


# -- the config -----------------------------------------------------------------------------------


def config(cls: dict[str, Any], family: str = "vllm") -> Any:
    data = {
        "keys": [{"key": "sk-a", "org": "a", "classes": ["batch"]}],
        "classes": {"batch": {"weight": 1, **cls}},
        "pools": {
            "p": {
                "models": [MODEL],
                "family": family,
                "backends": [{"url": "http://127.0.0.1:8001", "slots": 1}],
            }
        },
    }
    return parse_config(yaml.safe_dump(data), environ={})


def test_engine_priority_is_unset_by_default_and_sent_to_vllm_pools_only() -> None:
    assert config({}).engine_priority("batch", MODEL) is None
    assert config({"engine_priority": 10}).engine_priority("batch", MODEL) == 10
    assert config({"engine_priority": -3}).engine_priority("batch", MODEL) == -3
    assert config({"engine_priority": 10}, "openai").engine_priority("batch", MODEL) is None
    assert config({}).owns_priority(MODEL)
    assert not config({}, "tgi").owns_priority(MODEL)
    assert not config({}).owns_priority("another-model")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (2**63, "must be <= 9223372036854775807"),
        (-(2**63) - 1, "must be >= -9223372036854775808"),
        (1.5, "expected an integer"),
        ("high", "expected an integer"),
    ],
)
def test_an_engine_priority_out_of_vllms_range_is_refused(value: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        config({"engine_priority": value})
    assert str(info.value).splitlines() == [f"classes.batch.engine_priority: {expected}"]
