"""Slow learning of the cost estimate's parameters from observed usage (docs/design.md §4).

SFQ charges a request once, at dispatch, and never corrects it (article §5.1). A systematic
gap between the estimate and reality is closed here instead, outside the algorithm, by
recalibrating the estimate itself from the ``usage`` of completed requests (article §7.4):

- per pool, ``chars_per_token`` = Σ prompt chars ÷ Σ prompt tokens, from text prompts only;
- per pool and per (pool, org), ``output_ratio`` = Σ completion tokens ÷ Σ max_tokens,
  because clients ask for far more ``max_tokens`` than they use, and some much more than
  others. An org's own ratio is trusted once it has ``min_org_samples`` observations.

Both are ratios of exponentially decayed sums, so that old behaviour fades with a half-life
counted in observations of that ratio (not in seconds: a quiet pool keeps what it learned).
A learned value only changes future estimates; nothing already charged moves.

Sans-I/O: no clock, no event loop, no files (``sfq_proxy.http.calibration_store`` keeps it).

Memory is bounded: a pool keeps at most ``max_orgs`` org ratios. When a new org arrives at
a full pool, the org with the fewest samples is dropped (the least recently observed among
equals): the well-established ratios are the ones worth keeping, and a dropped org simply
falls back to its pool's ratio, as a new one would.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Calibration", "Ratio"]


FORMAT_VERSION = 1
_RATIO_KEYS = frozenset({"num", "den", "samples"})
_POOL_KEYS = frozenset({"chars_per_token", "output_ratio", "orgs"})


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
    chars_per_token: Ratio = field(default_factory=Ratio)
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

    # -- learning --------------------------------------------------------------------------

    def observe(
        self,
        pool: str,
        org: str,
        *,
        chars: int,
        prompt_tokens: int | None,
        max_tokens: int,
        completion_tokens: int | None,
    ) -> None:
        """Learn from one completed request; whatever its ``usage`` lacks is not learned from.

        A prompt without text (token ids only) says nothing about chars per token, and a
        response without a completion count (or a request with no output budget, such as an
        embedding) says nothing about the output ratio.
        """
        state = self._pools.get(pool)
        if state is None:
            state = self._pools[pool] = _Pool()
        if chars > 0 and prompt_tokens is not None and prompt_tokens > 0:
            state.chars_per_token.add(chars, prompt_tokens, self.decay)
        if completion_tokens is not None and completion_tokens >= 0 and max_tokens > 0:
            state.output_ratio.add(completion_tokens, max_tokens, self.decay)
            self._org_ratio(state, org).add(completion_tokens, max_tokens, self.decay)

    def _org_ratio(self, state: _Pool, org: str) -> Ratio:
        """The org's ratio, moved to the most recent end; a newcomer may evict the weakest."""
        ratio = state.orgs.pop(org, None)
        if ratio is None:
            ratio = Ratio()
            if len(state.orgs) >= self.max_orgs:
                _evict_weakest(state.orgs, len(state.orgs) - self.max_orgs + 1)
        state.orgs[org] = ratio
        return ratio

    # -- estimates -------------------------------------------------------------------------

    def chars_per_token(self, pool: str, default: float) -> float:
        """The pool's learned ratio, or the configured ``default`` until it is trusted."""
        state = self._pools.get(pool)
        learned = self._trusted(state.chars_per_token) if state else None
        return default if learned is None else _clamp(learned, self.chars_per_token_bounds)

    def _trusted(self, ratio: Ratio) -> float | None:
        """A pool's learned value once it rests on ``min_pool_samples`` requests: one odd
        first answer must not swing every estimate of the pool."""
        return ratio.value() if ratio.samples >= self.min_pool_samples else None

    def output_ratio(self, pool: str, org: str, default: float) -> float:
        """The org's ratio once it has enough samples, else the pool's, else ``default``.

        ``default`` is the configured value and is returned as is: only learned values are
        clamped, since they are the ones that may be skewed by a few odd observations.
        """
        state = self._pools.get(pool)
        if state is None:
            return default
        own = state.orgs.get(org)
        if own is not None and own.samples >= self.min_org_samples:
            learned = own.value()
            if learned is not None:
                return _clamp(learned, self.output_ratio_bounds)
        learned = self._trusted(state.output_ratio)
        return default if learned is None else _clamp(learned, self.output_ratio_bounds)

    # -- reporting and persistence ---------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Per pool, the values the estimates would use (clamped; None until learned).

        An org's value is reported even before it has ``min_org_samples``, when its pool's
        value is used in its place: ``samples`` tells which applies.
        """
        cpt, out = self.chars_per_token_bounds, self.output_ratio_bounds
        return {
            name: {
                "chars_per_token": _report(state.chars_per_token, cpt),
                "output_ratio": _report(state.output_ratio, out),
                "orgs": {org: _report(ratio, out) for org, ratio in state.orgs.items()},
            }
            for name, state in self._pools.items()
        }

    def to_json(self) -> dict[str, Any]:
        """The raw decayed sums, so that a restart resumes learning exactly where it was."""
        return {
            "version": FORMAT_VERSION,
            "pools": {
                name: {
                    "chars_per_token": _ratio_to_json(state.chars_per_token),
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
        """
        calibration = cls(**settings)
        document = _mapping(data, "document")
        if document.get("version") != FORMAT_VERSION:
            raise ValueError(f"unsupported version {document.get('version')!r}")
        if set(document) != {"version", "pools"}:
            raise ValueError(f"unexpected keys {sorted(set(document) - {'version', 'pools'})}")
        for name, raw in _mapping(document["pools"], "pools").items():
            calibration._pools[name] = _pool_from_json(raw, f"pools.{name}")
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


def _evict_weakest(orgs: dict[str, Ratio], count: int) -> None:
    """Drop the ``count`` orgs with the fewest samples; ties go to the least recent."""
    ranked = heapq.nsmallest(count, enumerate(orgs.items()), key=lambda i: (i[1][1].samples, i[0]))
    for _, (org, _ratio) in ranked:
        del orgs[org]


def _report(ratio: Ratio, bounds: tuple[float, float]) -> dict[str, Any]:
    value = ratio.value()
    return {"value": None if value is None else _clamp(value, bounds), "samples": ratio.samples}


def _ratio_to_json(ratio: Ratio) -> dict[str, Any]:
    return {"num": ratio.num, "den": ratio.den, "samples": ratio.samples}


def _mapping(data: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected an object, not {type(data).__name__}")
    return data


def _pool_from_json(data: Any, where: str) -> _Pool:
    raw = _mapping(data, where)
    if set(raw) != _POOL_KEYS:
        raise ValueError(f"{where}: expected keys {sorted(_POOL_KEYS)}, got {sorted(raw)}")
    orgs = _mapping(raw["orgs"], f"{where}.orgs")
    return _Pool(
        chars_per_token=_ratio_from_json(raw["chars_per_token"], f"{where}.chars_per_token"),
        output_ratio=_ratio_from_json(raw["output_ratio"], f"{where}.output_ratio"),
        orgs={org: _ratio_from_json(r, f"{where}.orgs.{org}") for org, r in orgs.items()},
    )


def _ratio_from_json(data: Any, where: str) -> Ratio:
    raw = _mapping(data, where)
    if set(raw) != _RATIO_KEYS:
        raise ValueError(f"{where}: expected keys {sorted(_RATIO_KEYS)}, got {sorted(raw)}")
    samples = raw["samples"]
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 0:
        raise ValueError(f"{where}.samples: expected an int >= 0, not {samples!r}")
    return Ratio(
        num=_sum_from_json(raw["num"], f"{where}.num"),
        den=_sum_from_json(raw["den"], f"{where}.den"),
        samples=samples,
    )


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
