"""A pool's ``cost:`` section (docs/design.md §4): the weights of the cost formula, how its
tokens are counted, and the bounds on what one request may ask for.

Apart from the pools because the lab's scenarios use the formula's weights
(:class:`WeightedCost`) without any pool.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from .fields import CostWeight, NonEmptyStr, PartTokens, RequestTokens, StrictModel
from .limits import MAX_OUTPUT_TOKENS


class WeightedCost(StrictModel):
    """The cost formula's weights (docs/design.md §4): ``input_weight·input +
    output_weight·max_tokens·output_ratio``. A pool's ``cost`` section extends it; the lab's
    scenarios use it as it is, so both are bounded and checked alike."""

    input_weight: CostWeight = 1.0
    output_weight: CostWeight = 1.0
    output_ratio: float = Field(1.0, gt=0, le=1)

    @model_validator(mode="after")
    def _some_weight(self) -> Self:
        """With both weights zero every request would be free and SFQ would order nothing."""
        if self.input_weight == 0 and self.output_weight == 0:
            raise ValueError("input_weight and output_weight cannot both be 0")
        return self


class MediaTokens(StrictModel):
    """Input tokens a non-text content part is priced at, by kind. An image whose size the
    proxy can read (a ``data:`` URL) is priced by OpenAI's tile rule instead; a part of a
    kind not listed here is priced as a file."""

    image: PartTokens = 765  # OpenAI's rule for a 1024×1024 image at high detail
    audio: PartTokens = 1500
    file: PartTokens = 3000
    video: PartTokens = 10000


class CostSpec(WeightedCost):
    """Cost model of a pool: the weights, how its tokens are counted, and the bounds on
    what one request may ask for (docs/design.md §4)."""

    default_max_tokens: int = Field(512, gt=0, le=MAX_OUTPUT_TOKENS)
    tokenizer: NonEmptyStr | None = None
    chars_per_token: float = Field(4.0, ge=0.1, le=100, allow_inf_nan=False)
    tokens_per_message: float = Field(0.0, ge=0, le=1000, allow_inf_nan=False)
    media_tokens: MediaTokens = MediaTokens()
    max_request_tokens: RequestTokens = 131_072
    over_limit: Literal["refuse", "clamp"] = "refuse"
    inject_max_tokens: Literal["max_tokens", "max_completion_tokens", False] = "max_tokens"
    # a stream asks vLLM for its usage on every chunk (``stream_options.
    # continuous_usage_stats``): a client that leaves is billed the engine's counts so far.
    # Off by default: other servers may refuse the option, and the client sees those usages
    continuous_usage: bool = False
