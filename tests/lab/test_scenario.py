"""Scenarios of the scenario lab (sfq_proxy/scenario.py): loading, generation, traces, errors."""

from __future__ import annotations

import copy
import math
import statistics
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from sfq_proxy.config import ConfigError
from sfq_proxy.lab.scenario import (
    EngineModel,
    PoolModel,
    Request,
    Scenario,
    Team,
    load_scenario,
    parse_scenario,
)

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "config" / "scenarios"
AZURE_CONV = SCENARIOS / "data" / "azure-llm-2023-conv.csv"

POOL = {
    "backends": 2,
    "slots": 4,
    "engine": {"prefill_tokens_per_s": 8000, "decode_tokens_per_s": 40, "batch_slowdown": 0.05},
}
FIXED_10 = {"kind": "fixed", "value": 10}


def team(arrivals: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"arrivals": arrivals, "input_tokens": FIXED_10, "output_tokens": FIXED_10, **extra}


def base(**teams: dict[str, Any]) -> dict[str, Any]:
    return {"name": "t", "seed": 1, "duration_s": 100, "pool": copy.deepcopy(POOL), "teams": teams}


def build(data: dict[str, Any], base_dir: Path = ROOT, **kwargs: Any) -> Scenario:
    return parse_scenario(yaml.safe_dump(data, sort_keys=False), base_dir, **kwargs)


def times(scenario: Scenario, name: str) -> list[float]:
    return [r.time_s for r in scenario.requests_of(name)]


def errors_of(data: dict[str, Any], base_dir: Path = ROOT) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        build(data, base_dir)
    return info.value.errors


def without_ids(requests: tuple[Request, ...]) -> list[tuple[Any, ...]]:
    return [(r.time_s, r.team, r.org, r.cls, r.input_tokens, r.output_tokens) for r in requests]


# --------------------------------------------------------------------------- abc.yaml


def slot_seconds(request: Request, engine: EngineModel, slots: int) -> float:
    """How long a request holds its slot when every slot of its backend is busy."""
    slowdown = 1 + engine.batch_slowdown * (slots - 1)
    return (
        request.input_tokens / engine.prefill_tokens_per_s
        + request.output_tokens * slowdown / engine.decode_tokens_per_s
    )


def test_abc_loads_full_size_quickly_and_as_documented() -> None:
    started = time.perf_counter()
    s = load_scenario(SCENARIOS / "abc.yaml")
    assert time.perf_counter() - started < 1.0
    assert (s.name, s.seed, s.duration_s) == ("abc", 7, 600.0)
    engine = EngineModel(prefill_tokens_per_s=8000, decode_tokens_per_s=40, batch_slowdown=0.05)
    assert s.pool == PoolModel(2, 4, engine, input_weight=1.0, output_weight=4.0)
    assert s.teams == (
        Team("A", "team-a", "batch", 1.0),
        Team("B", "team-b", "interactive", 1.0),
        Team("C", "team-c", "batch", 1.0),
    )
    assert times(s, "A") == [0.0] * 400
    assert times(s, "B") == [2.0 * i for i in range(300)]
    assert times(s, "C") == [t for t in (30, 120, 210, 300, 390, 480, 570) for _ in range(24)]
    assert all(200 <= r.output_tokens <= 500 for r in s.requests_of("A"))
    assert {(r.input_tokens, r.output_tokens) for r in s.requests_of("B")} == {(150, 30)}
    assert {(r.input_tokens, r.output_tokens) for r in s.requests_of("C")} == {(500, 150)}
    # The real-proxy run needs the server to generate exactly what the scenario says.
    assert all(r.max_tokens == r.output_tokens for r in s.requests)


def test_abc_is_an_honest_overload() -> None:
    """Offered slot time exceeds what 8 slots give in 600 s; B and C stay under a third."""
    s = load_scenario(SCENARIOS / "abc.yaml")
    pool = s.pool
    capacity = pool.backends * pool.slots * s.duration_s
    demand = {t.name: 0.0 for t in s.teams}
    for r in s.requests:
        demand[r.team] += slot_seconds(r, pool.engine, pool.slots)
    assert sum(demand.values()) > 1.03 * capacity
    assert demand["A"] > 0.8 * capacity  # A alone keeps the pool busy nearly all run
    assert demand["B"] < capacity / 3
    assert demand["C"] < capacity / 3


def test_full_scenarios_are_valid_files() -> None:
    for path in SCENARIOS.glob("*.yaml"):
        assert load_scenario(path).requests, path


# --------------------------------------------------------------------------- determinism


def abc_like(seed: int) -> dict[str, Any]:
    data = base(
        A=team(
            {"kind": "poisson", "per_s": 2},
            input_tokens={"kind": "lognormal", "median": 1000, "p99": 4000},
            output_tokens={"kind": "uniform", "low": 1, "high": 500},
        ),
        B=team({"kind": "rate", "per_s": 0.5}),
    )
    data["seed"] = seed
    return data


def test_same_seed_gives_identical_requests_and_another_seed_different_ones() -> None:
    first, again, other = build(abc_like(3)), build(abc_like(3)), build(abc_like(4))
    assert first == again
    assert first.requests != other.requests
    assert times(first, "A") != times(other, "A")
    assert times(first, "B") == times(other, "B")  # a rate has no randomness


def test_adding_a_team_leaves_the_other_teams_requests_unchanged() -> None:
    data = abc_like(3)
    before = build(data)
    data["teams"] = {
        "Z": team(
            {"kind": "poisson", "per_s": 3}, output_tokens={"kind": "uniform", "low": 1, "high": 9}
        ),
        **data["teams"],
    }
    after = build(data)
    assert [t.name for t in after.teams] == ["Z", "A", "B"]
    for name in ("A", "B"):
        assert without_ids(after.requests_of(name)) == without_ids(before.requests_of(name))


def test_a_shorter_duration_keeps_a_prefix_of_each_team() -> None:
    full = build(abc_like(3))
    short = build(abc_like(3), duration_s=30)
    assert short.duration_s == 30
    assert all(r.time_s < 30 for r in short.requests)
    for name in ("A", "B"):
        mine = without_ids(short.requests_of(name))
        assert mine
        assert mine == without_ids(full.requests_of(name))[: len(mine)]


# --------------------------------------------------------------------------- arrivals


def test_at_start_puts_every_request_at_start_s_or_spreads_them() -> None:
    s = build(
        base(
            A=team({"kind": "at_start", "count": 5}),
            B=team({"kind": "at_start", "count": 4, "start_s": 10, "spread_s": 2}),
        )
    )
    assert times(s, "A") == [0.0] * 5
    assert times(s, "B") == [10.0, 10.5, 11.0, 11.5]


def test_rate_has_exact_spacing_within_its_window() -> None:
    s = build(
        base(
            A=team({"kind": "rate", "per_s": 4}),
            B=team({"kind": "rate", "per_s": 0.3, "start_s": 5, "end_s": 20}),
        )
    )
    assert times(s, "A") == [i / 4 for i in range(400)]  # [0, 100): 0 .. 99.75
    assert times(s, "B") == [5 + i / 0.3 for i in range(5)]  # 5, 8.33, .., 18.33


def test_bursts_have_their_size_at_their_times() -> None:
    s = build(base(C=team({"kind": "bursts", "every_s": 30, "size": 3, "start_s": 10})))
    assert times(s, "C") == [10.0] * 3 + [40.0] * 3 + [70.0] * 3


def test_poisson_is_exact_for_a_fixed_seed_and_statistically_right() -> None:
    data = base(D=team({"kind": "poisson", "per_s": 1.0}))
    data["duration_s"] = 20_000
    s = build(data)
    got = times(s, "D")
    # Exact values for seed 1: a change of the generator would show here first.
    assert len(got) == 19_985
    assert got[:3] == pytest.approx([0.153234, 0.385661, 0.955775], abs=1e-6)
    # Mean 20 000, sd ~141: 5 sd either way.
    assert abs(len(got) - 20_000) < 5 * math.sqrt(20_000)
    gaps = [b - a for a, b in zip([0.0, *got], got, strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1.0, rel=0.03)  # 1.00075 exactly
    assert all(0 < t < 20_000 for t in got)


def test_end_s_past_the_duration_is_cut_at_the_duration() -> None:
    s = build(base(A=team({"kind": "rate", "per_s": 1, "start_s": 90, "end_s": 500})))
    assert times(s, "A") == [float(t) for t in range(90, 100)]


# --------------------------------------------------------------------------- token sizes


def sizes(tokens: dict[str, Any], count: int = 5000) -> list[int]:
    s = build(base(A=team({"kind": "at_start", "count": count}, input_tokens=tokens)))
    return [r.input_tokens for r in s.requests]


def test_fixed_is_exact() -> None:
    assert set(sizes({"kind": "fixed", "value": 77}, 50)) == {77}


def test_uniform_is_within_bounds_and_reaches_both() -> None:
    got = sizes({"kind": "uniform", "low": 3, "high": 7}, 2000)
    assert set(got) == {3, 4, 5, 6, 7}


def test_lognormal_has_its_median_and_p99_and_is_capped() -> None:
    got = sorted(sizes({"kind": "lognormal", "median": 1000, "p99": 4000}))
    assert statistics.median(got) == pytest.approx(1000, rel=0.10)
    assert got[int(0.99 * len(got))] == pytest.approx(4000, rel=0.2)
    assert min(got) >= 1
    wild = sizes({"kind": "lognormal", "median": 2, "p99": 1000}, 2000)
    assert min(wild) >= 1
    assert max(wild) == 20 * 1000


def test_max_tokens_is_the_ceiling_of_output_times_the_multiplier() -> None:
    s = build(
        base(
            A=team({"kind": "at_start", "count": 1}, output_tokens={"kind": "fixed", "value": 100}),
            B=team({"kind": "at_start", "count": 1}, max_tokens_multiplier=1.1),
            C=team(
                {"kind": "at_start", "count": 1},
                output_tokens={"kind": "fixed", "value": 100},
                max_tokens_multiplier=1.1,
            ),
            D=team({"kind": "at_start", "count": 1}, max_tokens_multiplier=2.55),
        )
    )
    assert [r.max_tokens for r in s.requests] == [100, 11, 110, 26]


# --------------------------------------------------------------------------- teams and order


def test_weights_are_class_weight_times_org_weight_with_defaults() -> None:
    data = base(
        A=team({"kind": "at_start", "count": 1}, org="shared", **{"class": "interactive"}),
        B=team({"kind": "at_start", "count": 1}, org="shared"),
        C=team({"kind": "at_start", "count": 1}, org="solo", **{"class": "interactive"}),
        D=team({"kind": "at_start", "count": 1}),
    )
    data["classes"] = {"interactive": {"weight": 6}, "batch": {"weight": 1.5}}
    data["orgs"] = {"shared": {"weight": 2}}
    assert build(data).teams == (
        Team("A", "shared", "interactive", 12.0),
        Team("B", "shared", "batch", 3.0),
        Team("C", "solo", "interactive", 6.0),
        Team("D", "D", "batch", 1.5),  # org defaults to the team's name, class to batch
    )


def test_requests_are_sorted_by_time_then_team_order_and_numbered() -> None:
    s = build(
        base(
            Z=team({"kind": "bursts", "every_s": 10, "size": 2, "end_s": 25}),
            A=team({"kind": "rate", "per_s": 0.2}),
        )
    )
    assert [r.id for r in s.requests] == list(range(len(s.requests)))
    keys = [(r.time_s, r.team) for r in s.requests]
    assert keys[:7] == [(0, "Z"), (0, "Z"), (0, "A"), (5, "A"), (10, "Z"), (10, "Z"), (10, "A")]
    assert keys == sorted(keys, key=lambda k: (k[0], ["Z", "A"].index(k[1])))


# --------------------------------------------------------------------------- traces


def azure_trace(path: Path, rows: list[tuple[str, int, int]]) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens", *(f"{t},{i},{o}" for t, i, o in rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def trace_scenario(trace: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"name": "trace", "seed": 5, "pool": copy.deepcopy(POOL), "trace": trace, **top}


def test_azure_conv_replays_with_zipf_orgs_compressed_times_and_max_tokens() -> None:
    started = time.perf_counter()
    s = load_scenario(SCENARIOS / "azure-conv.yaml")
    assert time.perf_counter() - started < 1.0
    raw = AZURE_CONV.read_text().splitlines()[1:]
    assert len(s.requests) == len(raw) == 19_366
    assert [t.name for t in s.teams] == ["org-1", "org-2", "org-3", "org-4", "org-5"]
    assert all(t == Team(t.name, t.name, "batch", 1.0) for t in s.teams)
    counts = [len(s.requests_of(t.name)) for t in s.teams]
    assert counts == sorted(counts, reverse=True)
    assert counts[0] > 0.4 * len(raw)
    # Zipf(1.1) over 5: org-1 gets 1/H = 46.5% of the requests, org-5 7.9%.
    assert counts[0] / len(raw) == pytest.approx(0.465, abs=0.02)
    assert counts[4] / len(raw) == pytest.approx(0.079, abs=0.01)

    def stamp(line: str) -> datetime:
        return datetime.fromisoformat(line.split(",")[0][:26])

    span = (stamp(raw[-1]) - stamp(raw[0])).total_seconds()
    assert s.requests[0].time_s == 0.0
    assert s.requests[-1].time_s == pytest.approx(span / 0.35, abs=1e-3)
    assert s.duration_s > s.requests[-1].time_s
    by_time = sorted(raw, key=lambda line: stamp(line))
    assert [(r.input_tokens, r.output_tokens) for r in s.requests[:3]] == [
        tuple(max(1, int(x)) for x in line.split(",")[1:]) for line in by_time[:3]
    ]
    assert all(r.output_tokens >= 1 and r.input_tokens >= 1 for r in s.requests)
    assert all(r.max_tokens == 4 * r.output_tokens for r in s.requests)


def test_azure_limit_and_duration_cut_the_trace() -> None:
    trace = {"path": str(AZURE_CONV), "format": "azure", "orgs": 3, "compress": 20, "limit": 500}
    s = build(trace_scenario(trace))
    assert len(s.requests) == 500
    shorter = build(trace_scenario(trace), duration_s=1.0)
    assert 0 < len(shorter.requests) < 500
    assert all(r.time_s < 1.0 for r in shorter.requests)
    assert without_ids(shorter.requests) == without_ids(s.requests)[: len(shorter.requests)]


def test_azure_timestamps_clamps_and_compression(tmp_path: Path) -> None:
    azure_trace(
        tmp_path / "t.csv",
        [
            ("2023-11-16 23:59:59.9000000", 0, 0),
            ("2023-11-17 00:00:00.0000001", 10, 3),
            ("2023-11-17 00:00:02.1500000", 20, 7),
        ],
    )
    trace = {"path": "t.csv", "format": "azure", "compress": 2, "max_tokens_multiplier": 1.5}
    s = build(trace_scenario(trace), tmp_path)
    assert [r.time_s for r in s.requests] == pytest.approx([0.0, 0.05, 1.125])
    assert [(r.input_tokens, r.output_tokens, r.max_tokens) for r in s.requests] == [
        (1, 1, 2),
        (10, 3, 5),
        (20, 7, 11),
    ]
    assert s.teams == (Team("org-1", "org-1", "batch", 1.0),)


def test_simple_trace_format_with_teams_per_org_and_weights(tmp_path: Path) -> None:
    (tmp_path / "trace.csv").write_text(
        "timestamp_s,org,class,input_tokens,output_tokens,max_tokens\n"
        "0,beta,interactive,100,10,20\n"
        "4,alpha,batch,200,0,\n"
        "2,beta,interactive,300,30,30\n"
        "2,gamma,batch,5,5,5\n"
        "6,gamma,interactive,5,5,5\n"
    )
    data = trace_scenario({"path": "trace.csv", "format": "simple", "compress": 2})
    data["classes"] = {"interactive": {"weight": 6}}
    data["orgs"] = {"alpha": {"weight": 3}}
    data["teams"] = {"own": team({"kind": "at_start", "count": 1, "start_s": 1})}
    s = build(data, tmp_path)
    assert s.teams == (
        Team("own", "own", "batch", 1.0),
        Team("beta", "beta", "interactive", 6.0),
        Team("alpha", "alpha", "batch", 3.0),
        Team("gamma/batch", "gamma", "batch", 1.0),
        Team("gamma/interactive", "gamma", "interactive", 6.0),
    )
    assert [
        (r.time_s, r.team, r.input_tokens, r.output_tokens, r.max_tokens) for r in s.requests
    ] == [
        (0.0, "beta", 100, 10, 20),
        (1.0, "own", 10, 10, 10),
        (1.0, "beta", 300, 30, 30),
        (1.0, "gamma/batch", 5, 5, 5),
        (2.0, "alpha", 200, 1, 1),  # output clamped to 1; no max_tokens: ceil(1 × 1)
        (3.0, "gamma/interactive", 5, 5, 5),
    ]
    assert s.duration_s == pytest.approx(3.0)  # just past the last request


def test_simple_trace_without_max_tokens_column_uses_the_multiplier(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text(
        "timestamp_s,org,class,input_tokens,output_tokens\n1.5,a,batch,10,7\n"
    )
    trace = {"path": str(tmp_path / "t.csv"), "format": "simple", "max_tokens_multiplier": 3}
    s = build(trace_scenario(trace, duration_s=10))
    assert s.requests == (Request(0, 1.5, "a", "a", "batch", 10, 7, 21),)


# --------------------------------------------------------------------------- errors


def test_unknown_keys_are_errors_with_their_path() -> None:
    data = base(A=team({"kind": "rate", "per_s": 1, "per_sec": 2}, colour="red"))
    data["pool"]["engine"]["turbo"] = True
    data["extra"] = 1
    assert sorted(errors_of(data)) == [
        ("extra", "unknown field"),
        ("pool.engine.turbo", "unknown field"),
        ("teams.A.arrivals.per_sec", "unknown field"),
        ("teams.A.colour", "unknown field"),
    ]


def test_bad_numbers_are_errors_with_their_path() -> None:
    data = base(
        A=team({"kind": "rate", "per_s": -1}),
        B=team({"kind": "poisson", "per_s": 0}),
        C=team({"kind": "bursts", "every_s": 10, "size": 0, "start_s": -5}),
        D=team({"kind": "rate", "per_s": 1}, max_tokens_multiplier=0.5),
    )
    assert sorted(errors_of(data)) == [
        ("teams.A.arrivals.per_s", "must be > 0"),
        ("teams.B.arrivals.per_s", "must be > 0"),
        ("teams.C.arrivals.size", "must be > 0"),
        ("teams.C.arrivals.start_s", "must be >= 0"),
        ("teams.D.max_tokens_multiplier", "must be >= 1"),
    ]
    assert str(ConfigError([("teams.A.arrivals.per_s", "must be > 0")])) == (
        "teams.A.arrivals.per_s: must be > 0"
    )


def test_a_scenarios_cost_weights_are_bounded_and_checked_as_the_proxys_are() -> None:
    """The same section type as a pool's cost: a weight the proxy would refuse used to pass
    here and fail later, inside the simulator, without a path."""
    data = base(A=team({"kind": "rate", "per_s": 1}))
    data["pool"]["cost"] = {"input_weight": 1e6, "output_ratio": 2}
    assert sorted(errors_of(data)) == [
        ("pool.cost.input_weight", "must be <= 1000"),
        ("pool.cost.output_ratio", "must be <= 1"),
    ]
    data["pool"]["cost"] = {"input_weight": 0, "output_weight": 0}
    assert errors_of(data) == [("pool.cost", "input_weight and output_weight cannot both be 0")]


def test_bad_distribution_parameters_are_errors() -> None:
    data = base(
        A=team(
            {"kind": "rate", "per_s": 1},
            input_tokens={"kind": "uniform", "low": 9, "high": 3},
            output_tokens={"kind": "lognormal", "median": 100, "p99": 50},
        ),
        B=team({"kind": "rate", "per_s": 1}, input_tokens={"kind": "gaussian", "mean": 3}),
        C=team({"kind": "rate", "per_s": 1, "start_s": 50, "end_s": 40}),
    )
    assert sorted(errors_of(data)) == [
        ("teams.A.input_tokens", "low must be <= high"),
        ("teams.A.output_tokens", "p99 must be >= median"),
        ("teams.B.input_tokens", "kind must be one of: fixed, uniform, lognormal"),
        ("teams.C.arrivals", "end_s must be > start_s"),
    ]


def test_scenario_level_errors() -> None:
    data = base()
    del data["duration_s"]
    assert sorted(errors_of(data)) == [
        ("", "needs teams, a trace or both"),
        ("duration_s", "required"),
    ]
    data = base(**{"Team A": team({"kind": "rate", "per_s": 1})})
    assert errors_of(data) == [("teams.Team A.org", "required: the team name is not an org name")]
    data = base(A=team({"kind": "rate", "per_s": 1e9}))
    assert errors_of(data) == [("teams.A.arrivals", "more than 1000000 requests")]
    with pytest.raises(ConfigError, match="the configuration is empty"):
        parse_scenario("", ROOT)


def test_trace_errors_name_the_trace(tmp_path: Path) -> None:
    missing = trace_scenario({"path": "nope.csv", "format": "azure"})
    [(path, message)] = errors_of(missing, tmp_path)
    assert path == "trace.path"
    assert "cannot read" in message
    assert "nope.csv" in message

    (tmp_path / "s.csv").write_text("timestamp_s,org,class,input_tokens,output_tokens\n")
    simple = trace_scenario({"path": "s.csv", "format": "simple", "orgs": 3, "class": "batch"})
    assert sorted(errors_of(simple, tmp_path)) == [
        ("trace.class", "only for format azure"),
        ("trace.orgs", "only for format azure"),
    ]

    for body, problem in [
        ("TIMESTAMP,ContextTokens\n", "line 1: the header must be"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n", "line 2: TIMESTAMP"),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.1,-1,2\n",
            "line 2: Context",
        ),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no rows"),
    ]:
        (tmp_path / "a.csv").write_text(body)
        [(path, message)] = errors_of(
            trace_scenario({"path": "a.csv", "format": "azure"}), tmp_path
        )
        assert path == "trace.path"
        assert problem in message, (body, message)

    (tmp_path / "t.csv").write_text("timestamp_s,org,class,input_tokens,output_tokens\n0,x,b,1,1\n")
    clash = trace_scenario({"path": "t.csv", "format": "simple"})
    clash["teams"] = {"x": team({"kind": "rate", "per_s": 1})}
    assert errors_of(clash, tmp_path) == [("trace", "org 'x' is also the name of a team")]


def test_load_scenario_names_the_file_in_errors(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(base(A=team({"kind": "rate", "per_s": -1}))))
    with pytest.raises(ConfigError) as info:
        load_scenario(path)
    assert info.value.source == str(path)
    assert str(info.value) == "teams.A.arrivals.per_s: must be > 0"
    with pytest.raises(ConfigError, match="cannot read"):
        load_scenario(tmp_path / "absent.yaml")


def test_a_class_may_have_size_buckets_as_in_the_proxys_config() -> None:
    data = base(A=team({"kind": "at_start", "count": 1}, **{"class": "interactive"}), B=team(
        {"kind": "at_start", "count": 1}))  # fmt: skip
    data["classes"] = {"interactive": {"weight": 2, "size_buckets": [500], "max_overtaken": 4}}
    a, b = build(data).teams
    assert (a.size_buckets, a.max_overtaken, a.weight) == ((500.0,), 4, 2.0)
    assert b.size_buckets is None  # batch: a FIFO in each flow
    data["classes"]["interactive"]["size_buckets"] = [500, 100]
    assert errors_of(data) == [("classes.interactive.size_buckets", "must be strictly increasing")]
    data["classes"]["interactive"] = {"max_overtaken": -1}
    assert errors_of(data) == [("classes.interactive.max_overtaken", "must be >= 0")]
    data["classes"]["interactive"] = {"max_overtaken": 4}
    assert errors_of(data) == [("classes.interactive.max_overtaken", "only with size_buckets")]


# --------------------------------------------------------------------------- hidden tokens


def test_hidden_input_tokens_have_draws_of_their_own_and_none_by_default() -> None:
    """Prompt tokens the estimate does not see: from a stream of their own, so the team's
    other draws are the ones it has without them."""
    plain = build(abc_like(3))
    data = abc_like(3)
    data["teams"]["A"]["hidden_input_tokens"] = {"kind": "uniform", "low": 100, "high": 900}
    hidden = build(data)
    assert without_ids(hidden.requests) == without_ids(plain.requests)
    assert {r.hidden_input_tokens for r in plain.requests} == {0}
    a = hidden.requests_of("A")
    assert all(100 <= r.hidden_input_tokens <= 900 for r in a)
    assert len({r.hidden_input_tokens for r in a}) > 10
    assert all(r.prompt_tokens == r.input_tokens + r.hidden_input_tokens for r in a)
    assert {r.hidden_input_tokens for r in hidden.requests_of("B")} == {0}
    assert build(data).requests == hidden.requests  # seeded


def test_hidden_input_tokens_are_checked_as_token_counts() -> None:
    def errors(hidden: Any) -> list[tuple[str, str]]:
        return errors_of(base(A=team({"kind": "rate", "per_s": 1}, hidden_input_tokens=hidden)))

    path = "teams.A.hidden_input_tokens"
    assert errors({"kind": "fixed", "value": 0}) == [(f"{path}.value", "must be > 0")]
    assert errors({"kind": "uniform", "low": 9, "high": 3}) == [(path, "low must be <= high")]
    kinds = "kind must be one of: fixed, uniform, lognormal"
    assert errors(4000) == [(path, kinds)]
    assert errors({"kind": "fixed", "value": 1, "extra": 2}) == [(f"{path}.extra", "unknown field")]


def test_gaming_hides_most_of_the_cheaters_cost_from_the_estimate() -> None:
    """config/scenarios/gaming.yaml as its comment says: two orgs of equal weight backlogged
    on 4 slots from t=0 with the same chats; the honest org's estimate is its actual cost,
    the cheater's requests really cost about 5 times theirs."""
    s = load_scenario(SCENARIOS / "gaming.yaml")
    pool = s.pool
    assert (pool.backends, pool.slots) == (1, 4)
    assert [(t.name, t.org, t.weight) for t in s.teams] == [
        ("honest", "honest", 1.0),
        ("cheater", "cheater", 1.0),
    ]
    assert {r.time_s for r in s.requests} == {0.0}

    def actual_over_estimate(name: str) -> float:
        mine = s.requests_of(name)
        actual = sum(pool.input_weight * r.prompt_tokens + pool.output_weight * r.output_tokens
                     for r in mine)  # fmt: skip
        estimate = sum(pool.input_weight * r.input_tokens + pool.output_weight * r.max_tokens
                       for r in mine)  # fmt: skip
        return actual / estimate

    assert actual_over_estimate("honest") == 1
    assert 4 < actual_over_estimate("cheater") < 7


# --------------------------------------------------------------------------- the engine


def test_an_engine_may_declare_its_batch_cache_and_policy_and_defaults_to_none() -> None:
    """Each backend's engine as ``sim/engine.py`` models it: max_num_seqs (default: the
    proxy's slots), kv_cache_tokens (default: unlimited), scheduling_policy (fcfs)."""
    plain = build(base(A=team({"kind": "rate", "per_s": 1}))).pool.engine
    assert (plain.max_num_seqs, plain.kv_cache_tokens, plain.scheduling_policy) == (
        None, None, "fcfs",
    )  # fmt: skip
    data = base(A=team({"kind": "rate", "per_s": 1}))
    data["pool"]["engine"] |= {
        "max_num_seqs": 2, "kv_cache_tokens": 4096, "scheduling_policy": "priority",
    }  # fmt: skip
    engine = build(data).pool.engine
    assert engine == EngineModel(8000, 40, 0.05, 2, 4096, "priority")
    scheduler = engine.scheduler(default_max_num_seqs=4)
    assert (scheduler.max_num_seqs, scheduler.kv_cache_tokens, scheduler.policy) == (
        2, 4096, "priority",
    )  # fmt: skip


def test_bad_engine_limits_are_errors_with_their_path() -> None:
    data = base(A=team({"kind": "rate", "per_s": 1}))
    data["pool"]["engine"] |= {
        "max_num_seqs": 0, "kv_cache_tokens": -1, "scheduling_policy": "sjf",
    }  # fmt: skip
    errors = dict(errors_of(data))
    assert errors["pool.engine.max_num_seqs"] == "must be > 0"
    assert errors["pool.engine.kv_cache_tokens"] == "must be > 0"
    assert errors["pool.engine.scheduling_policy"] == "Input should be 'fcfs' or 'priority'"


def test_every_request_must_fit_in_the_kv_cache_alone() -> None:
    """Its prompt and max_tokens: the engine could never finish a larger one, and a real run
    serves the scenario with a context window of the cache, as vLLM would."""
    data = base(A=team({"kind": "rate", "per_s": 1}, max_tokens_multiplier=2))  # 10 + 20
    data["pool"]["engine"]["kv_cache_tokens"] = 30
    assert build(data).pool.engine.kv_cache_tokens == 30
    data["pool"]["engine"]["kv_cache_tokens"] = 29
    assert errors_of(data) == [(
        "pool.engine.kv_cache_tokens",
        "request 0 of team A needs 30 tokens of KV cache (prompt and max_tokens) alone: more "
        "than the cache",
    )]  # fmt: skip
