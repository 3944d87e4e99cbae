"""What a request costs (docs/design.md §4): ``input_weight·input + output_weight·expected_output``.

The estimate is made once, at admission, and travels with the request: SFQ charges it at
dispatch, so the order never depends on what happens later; at the request's end its flow's
charge is trued up to ``actual``, the same formula on the usage the backend reported
(docs/design.md §3 rule 3).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Protocol

from ..config import ConfigError, CostSpec
from .calibration import Calibration, InputModel
from .errors import ApiError
from .inference_request import InferenceRequest, Kind
from .upstream_body import RESPONSES_OUTPUT_FIELD, appended, output_fields, output_limited

MIN_TOKENS_PER_MESSAGE = 1
"""The fewest tokens a message (a prompt, an input) is priced at, its text and its template's
together: a template renders role markers around the emptiest message, and a tokenizer adds a
BOS token to each prompt. A floor on what is charged, not on what calibration fits (clamping
the fit would bend its chars/token): a pool configured or fitted at 0 tokens per message
still charges 800 empty messages 800 tokens."""


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
    # the messages it was derived from with them (0 likewise): calibration learns from both
    messages: int = 0
    # the output it was priced at: max_tokens × the org's output ratio then. What a client
    # that leaves before any usage came is billed at least (docs/usage-and-budgets.md)
    output_tokens: float = dataclasses.field(default=0.0, compare=False)


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
        self._prior = InputModel(spec.tokens_per_message, spec.chars_per_token)
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
        """Text tokens plus the chat template's per message, plus token ids as sent, plus
        the image, audio, file and video parts, plus an extra path's fixed tokens
        (docs/design.md §4).

        A tokenizer counts the text but not the template, hence the configured
        ``tokens_per_message`` on top. The template's tokens apply to every message, be its
        content empty (its role markers are still rendered), and the messages' tokens are
        at least one each (``MIN_TOKENS_PER_MESSAGE``), whatever was configured or learned:
        800 empty messages are not free. Token ids alone make no message: no template.
        """
        text = request.text or ""
        messages = request.messages
        if self._tokenizer is not None:
            counted = self._tokenizer.count(text) if text else 0
            counted += math.ceil(self.spec.tokens_per_message * messages)
        else:  # rounded up, less a millionth: a fit's last bits must not add a whole token
            counted = math.ceil(self.input_model().tokens(messages, len(text)) - 1e-6)
        counted = max(counted, MIN_TOKENS_PER_MESSAGE * messages)
        return counted + request.token_ids + self.media_tokens(request) + request.fixed_tokens

    def media_tokens(self, request: InferenceRequest) -> int:
        """What a request's non-text parts are priced at: an image whose size was read by
        its own rule, any other part at the pool's price for its kind."""
        prices = self.spec.media_tokens
        return sum(getattr(prices, m.kind) if m.tokens is None else m.tokens for m in request.media)

    def input_model(self) -> InputModel:
        """What calibration learned of the pool's text, else the configured values."""
        cal = self._calibration
        return self._prior if cal is None else cal.input_model(self._pool, self._prior)

    def output_ratio(self, org: str) -> float:
        default = self.spec.output_ratio
        cal = self._calibration
        return default if cal is None else cal.output_ratio(self._pool, org, default)

    def price(
        self, request: InferenceRequest, org: str, ceiling: int | None = None
    ) -> tuple[InferenceRequest, Estimate]:
        """The request to send upstream, and what it is charged.

        Its output is bounded so that input + output stays within the pool's (or the
        tighter ``ceiling`` of the class) ``max_request_tokens``: c_max is then bounded, and
        a typo cannot lock an org out. A client that asked for more is refused, or clamped
        when the pool says so; a client that asked for nothing gets the pool's default,
        written into the body (unless the pool says not to), so that what the backend may
        generate is what was charged: leaving ``max_tokens`` out buys nothing.
        """
        tokens = self.input_tokens(request)
        limit = min(self.spec.max_request_tokens, ceiling or self.spec.max_request_tokens)
        sent, per_choice = self._bounded(request, tokens, limit)
        return sent, self._estimate(sent, tokens, per_choice, org)

    def _bounded(
        self, request: InferenceRequest, tokens: int, limit: int
    ) -> tuple[InferenceRequest, int]:
        """``request`` with its output per choice bounded, and that bound (0: no output)."""
        if not request.kind.generates:  # embeddings, extra paths: their input only
            if tokens > limit:
                raise _over_limit(f"Its input of about {tokens} tokens is", limit)
            return request, 0
        # n (or best_of) sequences for each prompt, each this long
        room = (limit - tokens) // request.choices
        asked = request.max_tokens
        if asked is not None and asked <= room:
            return request, asked
        if room < 1:
            sequences = f" for its {request.choices} sequences" if request.choices > 1 else ""
            what = f"Its input of about {tokens} tokens leaves no output{sequences} within"
            raise _over_limit(what, limit)
        if asked is not None and self.spec.over_limit == "refuse":
            wanted = tokens + asked * request.choices
            raise _over_limit(f"It may use {wanted} tokens, input and output, over", limit)
        per_choice = min(asked or self.spec.default_max_tokens, room)
        inject = self.spec.inject_max_tokens
        if asked is None and inject is False:  # the operator's choice: the body goes unchanged
            return request, per_choice
        field: str = inject or "max_tokens"
        if request.kind is Kind.RESPONSES:
            field = RESPONSES_OUTPUT_FIELD  # the only field of /v1/responses
        elif request.kind is Kind.COMPLETION:
            field = "max_tokens"  # the only field of /v1/completions
        return with_output_limit(request, per_choice, field), per_choice

    def estimate(self, request: InferenceRequest, org: str = "") -> Estimate:
        """What ``request`` is charged as it is (the lab's requests are already bounded)."""
        per_choice = request.max_tokens or self.spec.default_max_tokens
        return self._estimate(request, self.input_tokens(request), per_choice, org)

    def _estimate(
        self, request: InferenceRequest, tokens: int, per_choice: int, org: str
    ) -> Estimate:
        max_tokens = per_choice * request.choices if request.kind.generates else 0
        expected_output = max_tokens * self.output_ratio(org)
        cost = self.spec.input_weight * tokens + self.spec.output_weight * expected_output
        # calibration learns the text's chars/token only from inputs that are all text, of
        # the routes whose prompt it knows (not an extra path's, nor its fixed tokens)
        counted_by_chars = (
            self._tokenizer is None
            and not request.token_ids
            and not request.media
            and request.kind is not Kind.EXTRA
        )
        chars = len(request.text or "") if counted_by_chars else 0
        messages = request.messages if counted_by_chars else 0
        # floor of one token's worth: an empty prompt still occupies a slot, and SFQ needs > 0
        return Estimate(tokens, max_tokens, max(cost, 1.0), chars, messages, expected_output)

    def actual(self, prompt_tokens: int | None, completion_tokens: int | None) -> float | None:
        """The same formula on the tokens the backend reported: what the request really cost,
        what its flow's charge is trued up to at its end (the gap is a mis-estimation, or a
        tenant gaming the estimate). None without a prompt count."""
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
            self._pool, org, chars=estimate.chars, messages=estimate.messages,
            prompt_tokens=prompt_tokens, max_tokens=estimate.max_tokens,
            completion_tokens=completion_tokens,
        )  # fmt: skip


def _over_limit(what: str, limit: int) -> ApiError:
    return ApiError(
        400, f"This request is too large for its pool. {what} the ceiling of {limit} "
        "tokens per request; lower max_tokens or the input.", code="tokens_exceed_limit",
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


def with_output_limit(request: InferenceRequest, per_choice: int, field: str) -> InferenceRequest:
    """``request`` as sent upstream with its output bounded to ``per_choice`` tokens.

    A body that names no token field gets ``field`` appended to its bytes (the common case,
    cheap, and the client's bytes stay as they were); one whose value was lowered gets every
    token field it set rewritten, since a backend may read either of them, and one that
    names them only as null gets ``field`` instead.
    """
    if request.names_output:  # never a second member of that name: parsers differ on which wins
        raw = output_limited(request.raw, per_choice, field, output_fields(request.kind))
    else:
        raw = appended(request.raw, field, per_choice)
    return dataclasses.replace(request, raw=raw, max_tokens=per_choice)
