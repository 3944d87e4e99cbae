"""Scenarios for the scenario lab: a YAML file → a deterministic list of requests.

A scenario names a pool (``pool.py``: backends × the proxy's slots, static or gated by the
engine's readings, and a toy engine model: its speeds, and optionally its scheduler's
``max_num_seqs``, ``kv_cache_tokens`` and ``scheduling_policy``, the same on every
backend), the teams that load it
and how each team's requests arrive and how large they are; or it replays a trace file
(the Azure LLM inference traces, or a simple CSV). :func:`load_scenario` validates the file
and generates every request up front, so the simulator, the report and the load generator
all see the same plain data.

The module is pure: it reads the YAML and the trace file and nothing else, keeps no state
and uses no clock. Randomness is one ``random.Random(f"{seed}:{team}:{purpose}")`` per team
and purpose (``arrivals``, ``input``, ``output``, ``hidden``), so a run is reproducible and
adding a team never changes another team's requests. Bad scenarios raise
:class:`~sfq_proxy.config.ConfigError` with paths like ``teams.A.arrivals.per_s``.
"""

from __future__ import annotations

import math
import operator
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import reduce
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self

from pydantic import Discriminator, Field, Tag, ValidationError, model_validator

from ..config import (
    DEFAULT_MAX_OVERTAKEN,
    ConfigError,
    MaxOvertaken,
    Name,
    NonEmptyStr,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    SizeBounds,
    StrictModel,
    config_error,
    read_yaml,
)
from ..sim.engine import INT64_MAX, INT64_MIN, EngineModel  # the one engine model, the sim's
from .pool import PoolModel, PoolSection, check_pool
from .traces import NAME_RE, Multiplier, TraceRow, TraceSpec, max_tokens_for, read_trace

__all__ = [
    "EngineModel",
    "PoolModel",
    "Request",
    "Scenario",
    "Served",
    "Team",
    "load_scenario",
    "parse_scenario",
]

# --------------------------------------------------------------------------- data types


@dataclass(frozen=True, slots=True)
class Team:
    """A source of requests, all of one flow: ``weight`` = class weight × org weight. Several
    teams of one org and class are one flow (a team mixing short and long requests is two
    teams, so the report shows each kind). ``size_buckets`` and ``max_overtaken`` are its
    class's (docs/design.md §3, Size buckets inside a flow); None: the flow is a FIFO.
    ``engine_ceiling`` (engine dispatch: the share of an engine it may fill) and
    ``engine_priority`` (the engine's ``priority`` of its requests) are its class's too."""

    name: str
    org: str
    cls: str
    weight: float
    size_buckets: tuple[float, ...] | None = None
    max_overtaken: int = DEFAULT_MAX_OVERTAKEN
    engine_ceiling: float = 1.0
    engine_priority: int = 0


@dataclass(frozen=True, slots=True)
class Request:
    """One request: sent at ``time_s``, it reads ``input_tokens`` and generates
    ``output_tokens`` (≤ ``max_tokens``, the limit the client asks for).

    ``hidden_input_tokens`` more prompt tokens are read by the backend but not seen by the
    proxy's estimate (a tenant gaming it, say with text that tokenizes far denser than the
    pool's chars per token): the backend reads and reports ``prompt_tokens``, the sum."""

    id: int
    time_s: float
    team: str
    org: str
    cls: str
    input_tokens: int
    output_tokens: int
    max_tokens: int
    hidden_input_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        """What the backend reads and reports: the prompt the estimate saw and the rest."""
        return self.input_tokens + self.hidden_input_tokens


@dataclass(frozen=True, slots=True)
class Scenario:
    """A loaded scenario. ``requests`` are sorted by time (ties: team order, then each
    team's own order) and ``requests[i].id == i``; they all arrive in ``[0, duration_s)``."""

    name: str
    seed: int
    duration_s: float
    pool: PoolModel
    teams: tuple[Team, ...]
    requests: tuple[Request, ...]

    def requests_of(self, team: str) -> tuple[Request, ...]:
        """The requests of ``team``, in time order."""
        return tuple(r for r in self.requests if r.team == team)

    def arrival_order(self) -> list[Request]:
        """The requests in the order they reach the proxy, in the simulator and in a real
        run alike: by time, and requests of the same instant interleaved round-robin across
        teams (in team order, each team's own in order): A1 B1 C1 A2 B2 …, never all of
        the first-listed team's before the others'."""
        rank = {team.name: i for i, team in enumerate(self.teams)}
        out: list[Request] = []
        requests = self.requests
        i = 0
        while i < len(requests):
            j = i
            while j < len(requests) and requests[j].time_s == requests[i].time_s:
                j += 1
            turn: dict[str, int] = {}
            keyed = []
            for r in requests[i:j]:  # already in team order, then each team's order
                turn[r.team] = turn.get(r.team, -1) + 1
                keyed.append((turn[r.team], rank.get(r.team, len(rank)), r.id, r))
            out += [k[3] for k in sorted(keyed, key=lambda k: k[:3])]
            i = j
        return out


@dataclass(frozen=True, slots=True)
class Served:
    """What became of a request in a run (simulated or real): dispatched to a slot (sent to
    its backend) at ``start_s``, completed at ``end_s`` (scenario seconds), charged ``cost``
    (the estimate, at dispatch). ``actual`` is what it really cost, the pool's formula on
    the tokens the backend reported (``CostModel.actual``); None when unknown. ``trued_up``:
    the scheduler was told ``actual`` at the request's end, so its flow's charge was trued
    up to it (the proxy's behaviour, docs/design.md §3); False when the estimate stood."""

    request: Request
    start_s: float
    end_s: float
    cost: float
    actual: float | None = None
    trued_up: bool = False
    # when the engine first took it into its batch (scenario seconds; after ``start_s`` when
    # it waited in the engine's queue), and how often it was preempted; None, 0: unknown
    # (a real run)
    admitted_s: float | None = None
    preemptions: int = 0
    # when its first output token was generated (scenario seconds; None: unknown, a real
    # run's answers are not streamed)
    first_token_s: float | None = None

    @property
    def served_cost(self) -> float:
        """The cost of what was served: the actual cost where known, else the charge."""
        return self.cost if self.actual is None else self.actual


# --------------------------------------------------------------------------- the YAML


# Largest number of requests a scenario may generate: a typo such as ``per_s: 10000``
# should be an error, not a process that fills the memory.
MAX_REQUESTS = 1_000_000
# z such that P(N(0,1) < z) = 0.99: p99 of a lognormal is exp(mu + Z99 × sigma).
_Z99 = 2.3263478740408408
# A lognormal draw is capped at this multiple of the p99 so one freak draw cannot
# dominate a run.
_LOGNORMAL_CAP = 20


def _tagged(*models: type[StrictModel]) -> Any:
    """A union of ``models`` chosen by their ``kind`` field.

    Tags look like ``kind[rate]`` so that ``config.errors._error_path`` drops them from error
    paths: ``teams.A.arrivals.per_s`` rather than ``teams.A.arrivals.rate.per_s``.
    """
    kinds = [m.model_fields["kind"].annotation.__args__[0] for m in models]  # type: ignore[union-attr]

    def kind_of(value: Any) -> str | None:
        kind = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
        return f"kind[{kind}]" if isinstance(kind, str) else None

    members = [Annotated[m, Tag(f"kind[{k}]")] for m, k in zip(models, kinds, strict=True)]
    discriminator = Discriminator(
        kind_of,
        custom_error_type="invalid_kind",
        custom_error_message=f"kind must be one of: {', '.join(kinds)}",
    )
    return Annotated[reduce(operator.or_, members), discriminator]


class _Window(StrictModel):
    """Arrivals happen in ``[start_s, end_s)``, ``end_s`` defaulting to the duration."""

    start_s: NonNegativeFloat = 0.0
    end_s: PositiveFloat | None = None

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.end_s is not None and self.end_s <= self.start_s:
            raise ValueError("end_s must be > start_s")
        return self


class AtStartArrivals(_Window):
    """``count`` requests at ``start_s``, or evenly spread over ``spread_s`` seconds."""

    kind: Literal["at_start"]
    count: PositiveInt
    spread_s: NonNegativeFloat = 0.0

    def times(self, end: float, rng: random.Random) -> Iterator[float]:
        for i in range(self.count):
            t = self.start_s + self.spread_s * i / self.count
            if t < end:
                yield t

    def bound(self, end: float) -> float:
        return self.count


class RateArrivals(_Window):
    """One request every ``1 / per_s`` seconds, the first at ``start_s``."""

    kind: Literal["rate"]
    per_s: PositiveFloat

    def times(self, end: float, rng: random.Random) -> Iterator[float]:
        i = 0
        while (t := self.start_s + i / self.per_s) < end:  # no drift from summing gaps
            yield t
            i += 1

    def bound(self, end: float) -> float:
        return (end - self.start_s) * self.per_s + 1


class BurstArrivals(_Window):
    """``size`` requests at once every ``every_s`` seconds, the first burst at ``start_s``."""

    kind: Literal["bursts"]
    every_s: PositiveFloat
    size: PositiveInt

    def times(self, end: float, rng: random.Random) -> Iterator[float]:
        k = 0
        while (t := self.start_s + k * self.every_s) < end:
            yield from [t] * self.size
            k += 1

    def bound(self, end: float) -> float:
        return ((end - self.start_s) / self.every_s + 1) * self.size


class PoissonArrivals(_Window):
    """A Poisson process of rate ``per_s``: exponential gaps, starting at ``start_s``."""

    kind: Literal["poisson"]
    per_s: PositiveFloat

    def times(self, end: float, rng: random.Random) -> Iterator[float]:
        t = self.start_s
        while (t := t + rng.expovariate(self.per_s)) < end:
            yield t

    def bound(self, end: float) -> float:
        return (end - self.start_s) * self.per_s  # the mean; the check has slack for more


if TYPE_CHECKING:  # what the tagged union validates to
    Arrivals = AtStartArrivals | RateArrivals | BurstArrivals | PoissonArrivals
else:
    Arrivals = _tagged(AtStartArrivals, RateArrivals, BurstArrivals, PoissonArrivals)


class FixedTokens(StrictModel):
    """Always ``value`` tokens."""

    kind: Literal["fixed"]
    value: PositiveInt

    def sampler(self, rng: random.Random) -> Callable[[], int]:
        return lambda: self.value


class UniformTokens(StrictModel):
    """An integer uniformly drawn from ``[low, high]`` (both included)."""

    kind: Literal["uniform"]
    low: PositiveInt
    high: PositiveInt

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.low > self.high:
            raise ValueError("low must be <= high")
        return self

    def sampler(self, rng: random.Random) -> Callable[[], int]:
        return lambda: rng.randint(self.low, self.high)


class LognormalTokens(StrictModel):
    """Lognormal with the given median and 99th percentile, rounded, ≥ 1, ≤ 20 × p99."""

    kind: Literal["lognormal"]
    median: PositiveFloat
    p99: PositiveFloat

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.p99 < self.median:
            raise ValueError("p99 must be >= median")
        return self

    def sampler(self, rng: random.Random) -> Callable[[], int]:
        mu = math.log(self.median)
        sigma = (math.log(self.p99) - mu) / _Z99
        cap = max(1, math.floor(_LOGNORMAL_CAP * self.p99))
        return lambda: min(cap, max(1, round(rng.lognormvariate(mu, sigma))))


if TYPE_CHECKING:
    Tokens = FixedTokens | UniformTokens | LognormalTokens
else:
    Tokens = _tagged(FixedTokens, UniformTokens, LognormalTokens)


class TeamSpec(StrictModel):
    """A synthetic team. ``org`` defaults to the team's name, ``class`` to batch."""

    org: Name | None = None
    cls: Name = Field("batch", alias="class")
    arrivals: Arrivals
    input_tokens: Tokens
    output_tokens: Tokens
    max_tokens_multiplier: Multiplier = 1.0
    # prompt tokens the proxy's estimate does not see (Request.hidden_input_tokens); none
    # unless given
    hidden_input_tokens: Tokens | None = None


class WeightSpec(StrictModel):
    weight: PositiveFloat = 1.0


class ClassSection(WeightSpec):
    """A class: its weight, its size buckets and its ``engine_ceiling`` as in the proxy's
    config (``classes``), and the ``engine_priority`` its requests get in an engine with the
    priority policy (vLLM's request field: lower first)."""

    size_buckets: SizeBounds | None = None
    max_overtaken: MaxOvertaken = DEFAULT_MAX_OVERTAKEN
    engine_ceiling: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    engine_priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)


class ScenarioSpec(StrictModel):
    """The whole file. ``duration_s`` may be omitted only with a trace (it then ends just
    after the trace's last request)."""

    name: NonEmptyStr
    seed: int
    duration_s: PositiveFloat | None = None
    pool: PoolSection
    classes: dict[Name, ClassSection] = Field(default_factory=dict)
    orgs: dict[Name, WeightSpec] = Field(default_factory=dict)
    teams: dict[NonEmptyStr, TeamSpec] = Field(default_factory=dict)
    trace: TraceSpec | None = None


# --------------------------------------------------------------------------- generation


def load_scenario(path: str | Path, *, duration_s: float | None = None) -> Scenario:
    """Read, validate and generate the scenario at ``path``.

    ``duration_s`` overrides the file's duration (to shorten a run, e.g. in tests): only
    requests with ``time_s < duration_s`` are generated or replayed.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([("", f"cannot read {path}: {exc}")], str(path)) from None
    return parse_scenario(text, path.parent, duration_s=duration_s, source=str(path))


def parse_scenario(
    text: str,
    base_dir: Path,
    *,
    duration_s: float | None = None,
    source: str = "<string>",
) -> Scenario:
    """Validate YAML ``text`` and generate its requests; a relative trace path is relative
    to ``base_dir``."""
    if duration_s is not None and not (duration_s > 0 and math.isfinite(duration_s)):
        raise ValueError("duration_s must be a positive finite number")
    data = read_yaml(text, source)
    try:
        spec = ScenarioSpec.model_validate(data)
    except ValidationError as exc:
        raise config_error(exc, source) from None
    try:
        return _build(spec, Path(base_dir), duration_s)
    except ConfigError as exc:
        exc.source = source
        raise


# (time_s, team order, index in the team, team, org, class, input, output, max_tokens,
# hidden input)
_Row = tuple[float, int, int, str, str, str, int, int, int, int]
# (time_s, org, class, input, output, max_tokens) of a trace, in file order


def _build(spec: ScenarioSpec, base_dir: Path, override: float | None) -> Scenario:
    errors = _cross_check(spec)
    if errors:
        raise ConfigError(errors)
    duration = override if override is not None else spec.duration_s
    trace_rows: list[TraceRow] = []
    if spec.trace is not None:
        trace_rows = read_trace(spec.trace, spec.seed, base_dir)
        if duration is None:  # end just after the last request, so all are in [0, duration)
            last = max((r[0] for r in trace_rows), default=0.0)
            duration = math.nextafter(last, math.inf)
        trace_rows = [r for r in trace_rows if r[0] < duration]
    assert duration is not None  # _cross_check requires duration_s without a trace

    def weight(org: str, cls: str) -> float:
        return _weight(spec.classes, cls) * _weight(spec.orgs, org)

    teams: list[Team] = []
    rows: list[_Row] = []
    for order, (name, team) in enumerate(spec.teams.items()):
        org = team.org or name
        teams.append(Team(name, org, team.cls, weight(org, team.cls)))
        rows += _generate(spec.seed, name, order, team, duration)
    rows += _trace_team_rows(trace_rows, spec, teams, weight)
    teams = [_classed(team, spec) for team in teams]  # synthetic and trace teams alike
    if len(rows) > MAX_REQUESTS:
        raise ConfigError([("", f"generates more than {MAX_REQUESTS} requests")])
    rows.sort(key=lambda r: r[:3])
    requests = tuple(Request(i, r[0], *r[3:]) for i, r in enumerate(rows))
    _check_fits(requests, spec.pool.engine.kv_cache_tokens)
    return Scenario(spec.name, spec.seed, duration, spec.pool.model(), tuple(teams), requests)


def _check_fits(requests: Sequence[Request], kv_cache_tokens: int | None) -> None:
    """Every request must fit in the KV cache alone, its prompt and ``max_tokens`` (a real run
    serves the scenario with a context window of the cache: vLLM will not start with one
    larger). Otherwise the engine could never finish it."""
    if kv_cache_tokens is None:
        return
    largest = max(requests, key=lambda r: r.prompt_tokens + r.max_tokens, default=None)
    if largest is not None and largest.prompt_tokens + largest.max_tokens > kv_cache_tokens:
        need = largest.prompt_tokens + largest.max_tokens
        raise ConfigError([(
            "pool.engine.kv_cache_tokens",
            f"request {largest.id} of team {largest.team} needs {need} tokens of KV cache "
            "(prompt and max_tokens) alone: more than the cache",
        )])  # fmt: skip


def _weight(section: Mapping[str, WeightSpec], name: str) -> float:
    entry = section.get(name)
    return 1.0 if entry is None else entry.weight


def _classed(team: Team, spec: ScenarioSpec) -> Team:
    """``team`` with its class's size buckets (if the class has some) and engine settings."""
    cls = spec.classes.get(team.cls)
    if cls is None:
        return team
    team = replace(team, engine_ceiling=cls.engine_ceiling, engine_priority=cls.engine_priority)
    if cls.size_buckets is None:
        return team
    return replace(team, size_buckets=tuple(cls.size_buckets), max_overtaken=cls.max_overtaken)


def _cross_check(spec: ScenarioSpec) -> list[tuple[str, str]]:
    errors: list[tuple[str, str]] = []
    if not spec.teams and spec.trace is None:
        errors.append(("", "needs teams, a trace or both"))
    if spec.duration_s is None and spec.trace is None:
        errors.append(("duration_s", "required"))
    for name, team in spec.teams.items():
        if team.org is None and not NAME_RE.fullmatch(name):
            errors.append((f"teams.{name}.org", "required: the team name is not an org name"))
    errors += [  # as the proxy's config says it
        (f"classes.{name}.max_overtaken", "only with size_buckets")
        for name, cls in spec.classes.items()
        if cls.size_buckets is None and "max_overtaken" in cls.model_fields_set
    ]
    errors += check_pool(spec.pool)
    errors += [  # the engine's FCFS queue has no use for it: a real vLLM ignores it too
        (f"classes.{name}.engine_priority", "only with pool.engine.scheduling_policy: priority")
        for name, cls in spec.classes.items()
        if cls.engine_priority and spec.pool.engine.scheduling_policy != "priority"
    ]
    trace = spec.trace
    if trace is not None and trace.format != "azure":
        azure_only = {"orgs": "orgs", "zipf_s": "zipf_s", "cls": "class"}
        errors += [
            (f"trace.{key}", "only for format azure")
            for field, key in azure_only.items()
            if field in trace.model_fields_set
        ]
    return errors


def _generate(seed: int, name: str, order: int, team: TeamSpec, duration: float) -> list[_Row]:
    """The requests of one synthetic team."""

    def rng(purpose: str) -> random.Random:
        return random.Random(f"{seed}:{name}:{purpose}")

    arrivals = team.arrivals
    end = min(duration, arrivals.end_s if arrivals.end_s is not None else duration)
    if arrivals.bound(end) > MAX_REQUESTS:
        raise ConfigError([(f"teams.{name}.arrivals", f"more than {MAX_REQUESTS} requests")])
    times = list(arrivals.times(end, rng("arrivals")))
    input_tokens = team.input_tokens.sampler(rng("input"))
    output_tokens = team.output_tokens.sampler(rng("output"))
    hidden = team.hidden_input_tokens
    # a stream of its own: the other draws are the same with or without hidden tokens
    hidden_tokens = (lambda: 0) if hidden is None else hidden.sampler(rng("hidden"))
    org = team.org or name
    rows: list[_Row] = []
    for i, t in enumerate(times):
        out = output_tokens()
        max_tokens = max_tokens_for(out, team.max_tokens_multiplier)
        row = (t, order, i, name, org, team.cls, input_tokens(), out, max_tokens, hidden_tokens())
        rows.append(row)
    return rows


def _trace_team_rows(
    trace_rows: Sequence[TraceRow],
    spec: ScenarioSpec,
    teams: list[Team],
    weight: Callable[[str, str], float],
) -> list[_Row]:
    """Trace requests grouped into teams (appended to ``teams``): one team per org, named
    after it, or ``org/class`` when an org of a simple trace uses several classes."""
    if not trace_rows:
        return []
    classes_of: dict[str, dict[str, None]] = {}
    for _, org, cls, *_ in trace_rows:
        classes_of.setdefault(org, {})[cls] = None
    if spec.trace is not None and spec.trace.format == "azure":  # org-1, org-2, …, not org-10
        classes_of = dict(sorted(classes_of.items(), key=lambda kv: int(kv[0][4:])))
    taken = {t.name for t in teams}
    order: dict[tuple[str, str], tuple[int, str]] = {}
    for org, classes in classes_of.items():
        for cls in classes:
            name = org if len(classes) == 1 else f"{org}/{cls}"
            if name in taken:
                raise ConfigError([("trace", f"org {name!r} is also the name of a team")])
            order[org, cls] = (len(teams), name)
            teams.append(Team(name, org, cls, weight(org, cls)))
    counts = dict.fromkeys(order, 0)
    rows: list[_Row] = []
    for t, org, cls, inp, out, max_tokens in trace_rows:
        team_order, name = order[org, cls]
        rows.append((t, team_order, counts[org, cls], name, org, cls, inp, out, max_tokens, 0))
        counts[org, cls] += 1
    return rows
