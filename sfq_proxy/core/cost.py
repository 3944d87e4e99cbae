"""What a request costs (docs/design.md §4): ``input_weight·input + output_weight·expected_output``.

The estimate is made once, at admission, and travels with the request: SFQ charges it at
dispatch and it is never corrected, so the order never depends on what happened later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from ..config import ConfigError, CostSpec
from .calibration import Calibration
from .inference_request import InferenceRequest, Kind


class Tokenizer(Protocol):
    def count(self, text: str) -> int: ...


@dataclass(frozen=True, slots=True)
class Estimate:
    input_tokens: int
    max_tokens: int  # output it may generate, every choice (n, best_of); 0 for embeddings
    cost: float
    # the characters input_tokens was derived from by chars/token (0 when a tokenizer counted
    # them, or token ids were sent): what calibration learns chars/token from
    chars: int = 0


class CostModel:
    """One pool's pricing: its token counter, its weights, and what calibration learned."""

    def __init__(
        self,
        spec: CostSpec,
        path: str = "cost",
        *,
        pool: str = "",
        calibration: Calibration | None = None,
    ) -> None:
        """``path`` names ``spec`` in the config, for the error if its tokenizer won't load."""
        self.spec = spec
        self._pool = pool
        self._calibration = calibration
        self._tokenizer = None
        if spec.tokenizer:
            try:
                self._tokenizer = load_tokenizer(spec.tokenizer)
            except Exception as exc:  # the tokenizers package raises bare Exceptions
                message = f"cannot load {spec.tokenizer!r}: {exc}"
                raise ConfigError([(f"{path}.tokenizer", message)]) from exc

    def input_tokens(self, request: InferenceRequest) -> int:
        text = request.text or ""
        if self._tokenizer is not None:
            counted = self._tokenizer.count(text) if text else 0
        else:
            counted = math.ceil(len(text) / self.chars_per_token())
        return counted + request.token_ids

    def chars_per_token(self) -> float:
        default = self.spec.chars_per_token
        cal = self._calibration
        return default if cal is None else cal.chars_per_token(self._pool, default)

    def output_ratio(self, org: str) -> float:
        default = self.spec.output_ratio
        cal = self._calibration
        return default if cal is None else cal.output_ratio(self._pool, org, default)

    def estimate(self, request: InferenceRequest, org: str = "") -> Estimate:
        tokens = self.input_tokens(request)
        if request.kind is Kind.EMBEDDING:
            max_tokens = 0
        else:
            # n (or best_of) sequences, each up to max_tokens: what the backend may generate
            max_tokens = (request.max_tokens or self.spec.default_max_tokens) * request.choices
        expected_output = max_tokens * self.output_ratio(org)
        cost = self.spec.input_weight * tokens + self.spec.output_weight * expected_output
        counted_by_chars = self._tokenizer is None and not request.token_ids
        chars = len(request.text or "") if counted_by_chars else 0
        # floor of one token's worth: an empty prompt still occupies a slot, and SFQ needs > 0
        return Estimate(tokens, max_tokens, max(cost, 1.0), chars)

    def actual(self, prompt_tokens: int | None, completion_tokens: int | None) -> float | None:
        """The same formula on the tokens the backend reported: what the request really cost,
        to be shown beside what it was charged (a charge is never corrected; the gap is a
        mis-estimation, or a tenant gaming the estimate). None without a prompt count."""
        if prompt_tokens is None:
            return None
        spec = self.spec
        cost = spec.input_weight * prompt_tokens + spec.output_weight * (completion_tokens or 0)
        return max(cost, 1.0)  # the floor a charge has too, so the two compare

    def observe(
        self,
        estimate: Estimate,
        org: str,
        prompt_tokens: int | None,
        completion_tokens: int | None,
    ) -> None:
        """Feed a completed request's usage to calibration, for *future* estimates only."""
        if self._calibration is None:
            return
        self._calibration.observe(
            self._pool, org, chars=estimate.chars, prompt_tokens=prompt_tokens,
            max_tokens=estimate.max_tokens, completion_tokens=completion_tokens,
        )  # fmt: skip


class _HfTokenizer:
    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer as HfTokenizer
        except ImportError as exc:  # an optional extra: say how to get it
            raise RuntimeError(
                "the 'tokenizers' package is not installed; install sfq-proxy[tokenizers]"
            ) from exc
        self._tokenizer = HfTokenizer.from_file(path)

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


def load_tokenizer(path: str) -> Tokenizer:
    """A local ``tokenizer.json`` (Hugging Face format); nothing is ever downloaded."""
    return _HfTokenizer(path)
