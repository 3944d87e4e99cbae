"""Slow learning of the cost estimate's parameters from observed usage (docs/design.md §4).

SFQ charges a request once, at dispatch, and never corrects it (article §5.1). A systematic
gap between the estimate and reality is closed here instead, outside the algorithm, by
recalibrating the estimate itself from the ``usage`` of completed requests (article §7.4):

- per pool, the input model ``prompt_tokens ≈ a·messages + b·chars``, a least-squares fit
  on text prompts only. ``a`` is what the chat template adds per message (role markers,
  and a preamble folded into it), ``b`` is 1 / chars-per-token. A pure ratio
  Σchars ÷ Σtokens cannot tell the two apart: on short chats the template's tokens weigh
  as much as the text's and the ratio sinks to its floor, pricing a long prompt at several
  times its tokens (issue 16);
- per pool and per (pool, org), ``output_ratio``, the share of ``max_tokens`` requests
  use, because clients ask for far more ``max_tokens`` than they use, and some much more
  than others. It is the mean of completion ÷ max_tokens, each request weighing the output
  it generated (issue 38): weighed by its ``max_tokens`` instead (Σ completion ÷
  Σ max_tokens), 300 idle-time requests that asked for 120,000 tokens and stopped at once
  made it ~0, and real work was then charged a thirtieth of its cost. An org's own ratio is
  trusted once it has ``min_org_samples`` observations, and never below ``MIN_ORG_SHARE``
  of its pool's, which the org's own junk does not move.

Both rest on exponentially decayed sums, so that old behaviour fades with a half-life
counted in observations (not in seconds: a quiet pool keeps what it learned).
A learned value only changes future estimates; nothing already charged moves.

Sans-I/O: no clock, no event loop, no files (``sfq_proxy.state.calibration_file`` keeps it).

Memory is bounded: a pool keeps at most ``max_orgs`` org ratios. When a new org arrives at
a full pool, the org with the fewest samples is dropped (the least recently observed among
equals): the well-established ratios are the ones worth keeping, and a dropped org simply
falls back to its pool's ratio, as a new one would.

What several processes learned is combined exactly by :meth:`Calibration.merge`: a sum
updated as S ← S·d + x, after n more observations counted from zero into B, is S·dⁿ + B
(``sfq_proxy.state.redis_calibration`` shares calibration through Redis that way).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

__all__ = ["MAX_TOKENS_PER_MESSAGE", "Calibration", "InputFit", "InputModel", "Ratio"]


# 1 had a chars_per_token ratio where 2 has the input fit's sums; 2's output ratios weighed
# each request by its max_tokens where 3's weigh it by its output
FORMAT_VERSION = 3
_RATIO_KEYS = frozenset({"num", "den", "samples"})
_POOL_KEYS = frozenset({"input", "output_ratio", "orgs"})
_V1_POOL_KEYS = frozenset({"chars_per_token", "output_ratio", "orgs"})

# The fitted template tokens per message are clamped to [0, MAX_TOKENS_PER_MESSAGE]. A
# template never removes tokens, so a negative value is noise. Templates add 3 to 8 per
# message (ChatML, Llama 3), and with one regressor for both, a fixed preamble (Llama 3.1's
# dated system header: about 25 tokens) lands on single-message prompts' per-message
# share: 64 leaves room for both. Beyond it, the fit is explaining tokens that the chars
# do not show (media parts, tool schemas) or noise; b is then refit under the clamped a.
MAX_TOKENS_PER_MESSAGE = 64.0

# The least-squares fit is used when 1 − ρ² ≥ this, ρ the cosine between the (decayed,
# weighted) vectors of messages and of chars: 1 − ρ² is 0 when chars ∝ messages (every
# request alike, or one sample) and about CV² for single-message traffic whose chars vary
# by a coefficient of variation CV. Below 1% of variation the slope is mostly noise (and
# rounding), and the priors are a better guess than an extrapolation from it.
_MIN_SPREAD = 1e-4

# Ill-conditioned data still fix one thing: the tokens of a message of their own length
# (t ≈ a·m + b·c along c = r·m). The configured (a0, b0) is moved onto that line by the
# least change, a trusted to about _A_SPREAD tokens a message, b to about _B_SPREAD of b0
# (chars/token is 3 to 5 for most text). So the gap goes to the template while messages
# hold few text tokens (below 4 × 8 = 32 or so), to chars/token when they hold many: many
# identical tiny chats are not read as 1 token a character, nor one long prompt repeated
# as a 300-token template.
_A_SPREAD = 8.0
_B_SPREAD = 0.25

# An org's learned output ratio is at least this share of its pool's. What the org alone
# learned can be steered by the org: asking for huge budgets it never uses, when the pool is
# idle and that costs it nothing, then sending full-length work. The pool's ratio weighs
# every org's output, so such requests (which generate next to nothing) barely move it,
# and an org's full-length request is charged at least about half its output. The price: an
# honest org that uses under half the pool's share of its budgets is charged for half the
# pool's until the fair queue trues charges up to the usage reported.
MIN_ORG_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class InputModel:
    """Input tokens ≈ ``tokens_per_message``·messages + chars / ``chars_per_token``."""

    tokens_per_message: float
    chars_per_token: float

    def tokens(self, messages: int, chars: int) -> float:
        """Unrounded: the caller rounds once, after adding what it counts otherwise."""
        return self.tokens_per_message * messages + chars / self.chars_per_token


_DEFAULT_PRIOR = InputModel(tokens_per_message=0.0, chars_per_token=4.0)  # CostSpec's


@dataclass
class InputFit:
    """Exponentially decayed sums for the least-squares fit of ``t ≈ a·m + b·c``.

    ``m`` messages, ``c`` characters and ``t`` prompt tokens of each observation: their
    sums (for the fallback ratio) and the sums of the products the normal equations need.
    Every sum is of counts ≥ 0, so every sum is ≥ 0 too.
    """

    m: float = 0.0
    c: float = 0.0
    t: float = 0.0
    mm: float = 0.0
    mc: float = 0.0
    cc: float = 0.0
    mt: float = 0.0
    ct: float = 0.0
    samples: int = 0  # raw count, undecayed: how much evidence there is, not how recent

    def add(self, m: float, c: float, t: float, decay: float) -> None:
        """Age what was seen before by one step of ``decay``, then count this observation."""
        self.m = self.m * decay + m
        self.c = self.c * decay + c
        self.t = self.t * decay + t
        self.mm = self.mm * decay + m * m
        self.mc = self.mc * decay + m * c
        self.cc = self.cc * decay + c * c
        self.mt = self.mt * decay + m * t
        self.ct = self.ct * decay + c * t
        self.samples += 1

    def solve(self, prior: InputModel, cpt_bounds: tuple[float, float]) -> InputModel | None:
        """The fitted model, clamped; None until something has been observed.

        ``prior`` is the configured model, the starting point when the data cannot tell
        ``a`` from ``b`` (see ``_MIN_SPREAD``): ``a`` is then the prior's moved by its share
        of the gap (``_A_SPREAD``), and b = (Σt − a·Σm) ÷ Σc, decayed; with a0 = 0 and
        messages of long text, that is the old ratio Σchars ÷ Σtokens. ``a`` is clamped to
        [0, MAX_TOKENS_PER_MESSAGE], and ``b`` refit under it when that moved it (by least
        squares, or on the ratio's line). chars/token = 1/b is clamped to ``cpt_bounds``
        last (b ≤ 0 gives the upper bound: tokens do not shrink as text grows). Sums that
        no float arithmetic makes sense of (only a hand-edited file has them) give None.
        """
        if not (self.c > 0 and self.cc > 0):
            return None
        fitted = self._least_squares()
        if fitted is None:
            a = _clamp(self._prior_on_the_data(prior), (0.0, MAX_TOKENS_PER_MESSAGE))
            b = self.t / self.c - a * (self.m / self.c)
        else:
            a, b = fitted
            if not 0.0 <= a <= MAX_TOKENS_PER_MESSAGE:
                a = _clamp(a, (0.0, MAX_TOKENS_PER_MESSAGE))
                b = self.ct / self.cc - a * (self.mc / self.cc)
        if math.isnan(a) or math.isnan(b):
            return None
        chars_per_token = 1.0 / b if b > 0 else math.inf
        return InputModel(a, _clamp(chars_per_token, cpt_bounds))

    def _prior_on_the_data(self, prior: InputModel) -> float:
        """``a`` where the least change to the prior meets Σt = a·Σm + b·Σc (decayed).

        Minimising ((a − a0)/σa)² + ((b − b0)/σb)² on that line gives
        a = a0 + gap·σa²·Σm / (σa²·Σm² + σb²·Σc²), gap = Σt − a0·Σm − b0·Σc; computed per
        character (every sum over Σc > 0), so that no square of a sum can overflow.
        """
        q = self.m / self.c  # messages per character
        b0 = 1.0 / prior.chars_per_token
        gap = self.t / self.c - prior.tokens_per_message * q - b0
        var_a, var_b = _A_SPREAD**2, (_B_SPREAD * b0) ** 2
        return prior.tokens_per_message + gap * var_a * q / (var_a * q * q + var_b)

    def _least_squares(self) -> tuple[float, float] | None:
        """Solve [[mm, mc], [mc, cc]]·(a, b) = (mt, ct), or None if ill-conditioned.

        Solved scaled to a unit diagonal, (a·√mm, b·√cc): the matrix becomes [[1, ρ], [ρ, 1]],
        so no product of two sums is ever formed (none can overflow, whatever the counts
        and the half-life), and its determinant 1 − ρ² is the conditioning itself.
        """
        sm, sc = math.sqrt(self.mm), math.sqrt(self.cc)
        if not (sm > 0 and sc > 0):
            return None
        rho = min(self.mc / sm / sc, 1.0)  # ≥ 0: every sum is; ≤ 1 but for rounding
        spread = (1.0 - rho) * (1.0 + rho)
        if not spread >= _MIN_SPREAD:
            return None
        u, v = self.mt / sm, self.ct / sc
        a = (u - rho * v) / spread / sm
        b = (v - rho * u) / spread / sc
        return (a, b) if math.isfinite(a) and math.isfinite(b) else None


@dataclass
class Ratio:
    """A ratio of exponentially decayed sums, so recent observations weigh most."""

    num: float = 0.0
    den: float = 0.0
    samples: int = 0  # raw count, undecayed: how much evidence there is, not how recent

    def add(self, num: float, den: float, decay: float) -> None:
        """Age what was seen before by one step of ``decay``, then count this observation."""
        self.num = self.num * decay + num
        self.den = self.den * decay + den
        self.samples += 1

    def value(self) -> float | None:
        """None until something has been observed: the caller then falls back to its default."""
        return self.num / self.den if self.den > 0 else None


@dataclass
class _Pool:
    input: InputFit = field(default_factory=InputFit)
    output_ratio: Ratio = field(default_factory=Ratio)
    orgs: dict[str, Ratio] = field(default_factory=dict)  # insertion order = least recent first


class Calibration:
    """What the proxy has learned about its pools and orgs."""

    def __init__(
        self,
        *,
        half_life_requests: int,
        min_org_samples: int = 50,
        min_pool_samples: int = 1,
        chars_per_token_bounds: tuple[float, float] = (1.0, 12.0),
        output_ratio_bounds: tuple[float, float] = (0.01, 1.0),
        max_orgs: int = 10_000,
    ) -> None:
        """Bounds keep a few odd responses (or a buggy upstream) from wrecking the estimates."""
        if not isinstance(half_life_requests, int) or half_life_requests < 1:
            raise ValueError(f"half_life_requests must be an int >= 1, not {half_life_requests!r}")
        if not isinstance(min_org_samples, int) or min_org_samples < 0:
            raise ValueError(f"min_org_samples must be an int >= 0, not {min_org_samples!r}")
        if not isinstance(min_pool_samples, int) or min_pool_samples < 1:
            raise ValueError(f"min_pool_samples must be an int >= 1, not {min_pool_samples!r}")
        if not isinstance(max_orgs, int) or max_orgs < 1:
            raise ValueError(f"max_orgs must be an int >= 1, not {max_orgs!r}")
        self.half_life_requests = half_life_requests
        self.min_pool_samples = min_pool_samples
        self.min_org_samples = min_org_samples
        self.chars_per_token_bounds = _checked_bounds(
            "chars_per_token_bounds", chars_per_token_bounds
        )
        self.output_ratio_bounds = _checked_bounds("output_ratio_bounds", output_ratio_bounds)
        self.max_orgs = max_orgs
        self.decay = 0.5 ** (1 / half_life_requests)
        self._pools: dict[str, _Pool] = {}
        # per pool, the last fit and what it was solved from: every request is priced on
        # it, and requests priced between two observations find it solved already
        self._fits: dict[str, tuple[tuple[object, ...], InputModel]] = {}

    # -- learning --------------------------------------------------------------------------

    def observe(
        self,
        pool: str,
        org: str,
        *,
        chars: int,
        messages: int,
        prompt_tokens: int | None,
        max_tokens: int,
        completion_tokens: int | None,
    ) -> None:
        """Learn from one completed request; whatever its ``usage`` lacks is not learned from.

        ``chars`` is 0 unless the whole input was text counted by characters: a prompt with
        token ids or media parts says nothing about chars per token, as its tokens are not
        all in its chars. A response without a completion count (or a request with no
        output budget, such as an embedding) says nothing about the output ratio.
        """
        state = self._pools.get(pool)
        if state is None:
            state = self._pools[pool] = _Pool()
        if chars > 0 and messages >= 0 and prompt_tokens is not None and prompt_tokens > 0:
            state.input.add(messages, chars, prompt_tokens, self.decay)
        if completion_tokens is not None and completion_tokens >= 0 and max_tokens > 0:
            # weighed by its output (a token at least): a thousand answers of 1 token weigh
            # one answer of 1,000, however much they asked for
            weight = max(completion_tokens, 1)
            used = weight * (completion_tokens / max_tokens)
            state.output_ratio.add(used, weight, self.decay)
            self._org_ratio(state, org).add(used, weight, self.decay)

    def _org_ratio(self, state: _Pool, org: str) -> Ratio:
        """The org's ratio, moved to the most recent end; a newcomer may evict the weakest."""
        ratio = state.orgs.pop(org, None)
        if ratio is None:
            ratio = Ratio()
            if len(state.orgs) >= self.max_orgs:
                _evict_weakest(state.orgs, len(state.orgs) - self.max_orgs + 1)
        state.orgs[org] = ratio
        return ratio

    def merge(self, later: Calibration) -> None:
        """Learn what ``later`` learned, as if its observations came here after all of ours.

        ``later`` must have started from nothing, with our decay: each of its sums is then
        B = Σ xᵢ·d^(n−i) over its n observations, and learning them here one by one would
        have made ours S·dⁿ + B, which is what this computes. A group of sums decays only
        when it learns, so n is each group's own count: the pool's input fit, its output
        ratio, each org's ratio. The orgs ``later`` saw become the most recent, and a pool
        over ``max_orgs`` drops its weakest, as ``observe`` would. ``later`` is not changed.

        Exact but for rounding, unless orgs were dropped: an org that one-by-one learning
        would have dropped and seen again from zero keeps its history here.
        """
        if later.decay != self.decay:
            raise ValueError(f"cannot merge a decay of {later.decay} into one of {self.decay}")
        for name, theirs in later._pools.items():
            ours = self._pools.setdefault(name, _Pool())
            _fold(ours.input, theirs.input, self.decay)
            _fold(ours.output_ratio, theirs.output_ratio, self.decay)
            for org, ratio in theirs.orgs.items():
                mine = ours.orgs.pop(org, None) or Ratio()
                _fold(mine, ratio, self.decay)
                ours.orgs[org] = mine
            _evict_weakest(ours.orgs, len(ours.orgs) - self.max_orgs)

    # -- estimates -------------------------------------------------------------------------

    def input_model(self, pool: str, default: InputModel) -> InputModel:
        """The pool's fitted input model, or the configured ``default`` until it rests on
        ``min_pool_samples`` text prompts. ``default`` is also the prior the fit starts
        from when its data cannot separate the two parameters."""
        state = self._pools.get(pool)
        if state is None or state.input.samples < self.min_pool_samples:
            return default
        sums, bounds = state.input, self.chars_per_token_bounds
        key = (default, bounds, sums.m, sums.c, sums.t, sums.mm, sums.mc, sums.cc, sums.mt, sums.ct)
        cached = self._fits.get(pool)
        if cached is not None and cached[0] == key:
            return cached[1]
        fitted = sums.solve(default, bounds)
        model = default if fitted is None else fitted
        self._fits[pool] = (key, model)
        return model

    def _trusted(self, ratio: Ratio) -> float | None:
        """A pool's learned value once it rests on ``min_pool_samples`` requests: one odd
        first answer must not swing every estimate of the pool."""
        return ratio.value() if ratio.samples >= self.min_pool_samples else None

    def output_ratio(self, pool: str, org: str, default: float) -> float:
        """The org's ratio once it has enough samples, but not below ``MIN_ORG_SHARE`` of the
        pool's; else the pool's; else ``default``.

        ``default`` is the configured value and is returned as is: only learned values are
        clamped, since they are the ones that may be skewed by a few odd observations.
        """
        state = self._pools.get(pool)
        if state is None:
            return default
        learned = self._trusted(state.output_ratio)
        pools = default if learned is None else _clamp(learned, self.output_ratio_bounds)
        own = state.orgs.get(org)
        if own is not None and own.samples >= self.min_org_samples:
            value = own.value()
            if value is not None:
                return _org_value(value, pools, self.output_ratio_bounds)
        return pools

    # -- reporting and persistence ---------------------------------------------------------

    def snapshot(self, priors: Mapping[str, InputModel] | None = None) -> dict[str, Any]:
        """Per pool, the values the estimates would use (clamped; None until learned).

        ``priors`` maps a pool to its configured input model (``_DEFAULT_PRIOR`` if absent):
        what the input fit starts from while its data cannot separate the two parameters.
        A value is reported even before it rests on ``min_pool_samples`` (or an org's on
        ``min_org_samples``), when the configured (or the pool's) value is used in its
        place: ``samples`` tells which applies.
        """
        priors = priors or {}
        return {
            name: self._report_pool(state, priors.get(name, _DEFAULT_PRIOR))
            for name, state in self._pools.items()
        }

    def _report_pool(self, state: _Pool, prior: InputModel) -> dict[str, Any]:
        pools = _report(state.output_ratio, None, self.output_ratio_bounds)
        return {
            "input": self._report_input(state.input, prior),
            "output_ratio": pools,
            "orgs": {
                org: _report(ratio, pools["value"], self.output_ratio_bounds)
                for org, ratio in state.orgs.items()
            },
        }

    def _report_input(self, fit: InputFit, prior: InputModel) -> dict[str, Any]:
        model = fit.solve(prior, self.chars_per_token_bounds)
        return {
            "tokens_per_message": None if model is None else model.tokens_per_message,
            "chars_per_token": None if model is None else model.chars_per_token,
            "samples": fit.samples,
        }

    def to_json(self) -> dict[str, Any]:
        """The raw decayed sums, so that a restart resumes learning exactly where it was."""
        return {
            "version": FORMAT_VERSION,
            "pools": {
                name: {
                    "input": _input_to_json(state.input),
                    "output_ratio": _ratio_to_json(state.output_ratio),
                    "orgs": {org: _ratio_to_json(r) for org, r in state.orgs.items()},
                }
                for name, state in self._pools.items()
            },
        }

    @classmethod
    def from_json(cls, data: Any, **settings: Any) -> Calibration:
        """Rebuild from :meth:`to_json`; a ValueError says what is wrong with ``data``.

        Settings are not stored in the document: they come from the current config, and if
        ``max_orgs`` shrank, the best-sampled orgs are the ones kept.

        A version 1 document (before the input fit) is still read, as strictly: its output
        ratios are kept, its ``chars_per_token`` ratio is dropped, since a ratio of sums
        cannot be split into the fit's two parameters. The input model is then learned
        afresh, from the configured values until ``min_pool_samples`` text prompts. The
        output ratios of versions 1 and 2 are kept as values, reweighed (``_reweighed``).
        """
        calibration = cls(**settings)
        document = _mapping(data, "document")
        version = document.get("version")
        if type(version) is not int or version not in (1, 2, FORMAT_VERSION):
            raise ValueError(f"unsupported version {version!r}")
        if set(document) != {"version", "pools"}:
            raise ValueError(f"unexpected keys {sorted(set(document) - {'version', 'pools'})}")
        for name, raw in _mapping(document["pools"], "pools").items():
            calibration._pools[name] = _pool_from_json(raw, f"pools.{name}", version)
            excess = len(calibration._pools[name].orgs) - calibration.max_orgs
            if excess > 0:
                _evict_weakest(calibration._pools[name].orgs, excess)
        return calibration


# -- helpers -------------------------------------------------------------------------------


def _checked_bounds(name: str, bounds: tuple[float, float]) -> tuple[float, float]:
    try:
        low, high = (float(b) for b in bounds)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a pair of numbers, not {bounds!r}") from exc
    if not (math.isfinite(low) and math.isfinite(high) and 0 < low <= high):
        raise ValueError(f"{name} must satisfy 0 < low <= high, finite; got {bounds!r}")
    return low, high


def _clamp(value: float, bounds: tuple[float, float]) -> float:
    return min(max(value, bounds[0]), bounds[1])


_Sums = TypeVar("_Sums", InputFit, Ratio)


def _fold(ours: _Sums, later: _Sums, decay: float) -> None:
    """S ← S·dⁿ + B for every decayed sum, n being ``later``'s samples (see ``merge``)."""
    aged = decay**later.samples
    for f in fields(ours):
        if f.name != "samples":
            setattr(ours, f.name, getattr(ours, f.name) * aged + getattr(later, f.name))
    ours.samples += later.samples


def _evict_weakest(orgs: dict[str, Ratio], count: int) -> None:
    """Drop the ``count`` orgs with the fewest samples (none if ``count`` ≤ 0); ties go to
    the least recent."""
    ranked = heapq.nsmallest(count, enumerate(orgs.items()), key=lambda i: (i[1][1].samples, i[0]))
    for _, (org, _ratio) in ranked:
        del orgs[org]


def _org_value(value: float, pools: float | None, bounds: tuple[float, float]) -> float:
    """A learned ratio, clamped: an org's (``pools`` its pool's) at least ``MIN_ORG_SHARE``
    of its pool's."""
    floor = 0.0 if pools is None else MIN_ORG_SHARE * pools
    return _clamp(max(value, floor), bounds)


def _report(ratio: Ratio, pools: float | None, bounds: tuple[float, float]) -> dict[str, Any]:
    """A ratio's value as estimates use it (None until learned), and its samples."""
    value = ratio.value()
    shown = None if value is None else _org_value(value, pools, bounds)
    return {"value": shown, "samples": ratio.samples}


def _input_to_json(fit: InputFit) -> dict[str, Any]:
    return {f.name: getattr(fit, f.name) for f in fields(fit)}


def _ratio_to_json(ratio: Ratio) -> dict[str, Any]:
    return {"num": ratio.num, "den": ratio.den, "samples": ratio.samples}


def _mapping(data: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected an object, not {type(data).__name__}")
    return data


def _pool_from_json(data: Any, where: str, version: int) -> _Pool:
    """A version 1 pool is checked as strictly as ever, then its chars/token ratio dropped;
    the output ratios of a version 1 or 2 pool are reweighed."""
    raw = _mapping(data, where)
    keys = _V1_POOL_KEYS if version == 1 else _POOL_KEYS
    if set(raw) != keys:
        raise ValueError(f"{where}: expected keys {sorted(keys)}, got {sorted(raw)}")
    if version == 1:
        _ratio_from_json(raw["chars_per_token"], f"{where}.chars_per_token")
        fit = InputFit()
    else:
        fit = _input_from_json(raw["input"], f"{where}.input")
    raw_orgs = _mapping(raw["orgs"], f"{where}.orgs")
    output = _ratio_from_json(raw["output_ratio"], f"{where}.output_ratio")
    orgs = {org: _ratio_from_json(r, f"{where}.orgs.{org}") for org, r in raw_orgs.items()}
    if version < FORMAT_VERSION:
        output, orgs = _reweighed(output), {org: _reweighed(r) for org, r in orgs.items()}
    return _Pool(input=fit, output_ratio=output, orgs=orgs)


def _reweighed(ratio: Ratio) -> Ratio:
    """A ratio of version 1 or 2 (Σ completion ÷ Σ max_tokens) as version 3 sums it: the same
    value, weighing the output it was learned from (Σ completion), as each request now
    weighs its own. Sums with no value (or none a float can hold) keep only their count."""
    value = ratio.value()
    used = math.nan if value is None else ratio.num * value
    if not math.isfinite(used):
        return Ratio(samples=ratio.samples)
    return Ratio(num=used, den=ratio.num, samples=ratio.samples)


def _input_from_json(data: Any, where: str) -> InputFit:
    """Its sums are of counts ≥ 0 (products included), so each must be finite and ≥ 0."""
    raw = _mapping(data, where)
    keys = {f.name for f in fields(InputFit)}
    if set(raw) != keys:
        raise ValueError(f"{where}: expected keys {sorted(keys)}, got {sorted(raw)}")
    sums = {k: _sum_from_json(raw[k], f"{where}.{k}") for k in sorted(keys - {"samples"})}
    return InputFit(**sums, samples=_samples_from_json(raw["samples"], f"{where}.samples"))


def _ratio_from_json(data: Any, where: str) -> Ratio:
    raw = _mapping(data, where)
    if set(raw) != _RATIO_KEYS:
        raise ValueError(f"{where}: expected keys {sorted(_RATIO_KEYS)}, got {sorted(raw)}")
    return Ratio(
        num=_sum_from_json(raw["num"], f"{where}.num"),
        den=_sum_from_json(raw["den"], f"{where}.den"),
        samples=_samples_from_json(raw["samples"], f"{where}.samples"),
    )


def _samples_from_json(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where}: expected an int >= 0, not {value!r}")
    return value


def _sum_from_json(value: Any, where: str) -> float:
    """A decayed sum of counts: a finite number >= 0 (NaN or inf would poison every estimate)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{where}: expected a number, not {value!r}")
    try:
        number = float(value)
    except OverflowError as exc:  # an int too large for a float
        raise ValueError(f"{where}: {value!r} is out of range") from exc
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{where}: expected a finite number >= 0, not {value!r}")
    return number
