"""How far the charged cost estimate is from the real cost, on the Azure conversation trace.

Drives the proxy's real ``CostModel`` (with ``Calibration`` at the proxy's default settings,
as ``sfq_proxy/lab/simulator.py`` builds it) request by request in arrival order: each
request is priced by ``CostModel.estimate``, then its true token counts from the trace are
fed to ``CostModel.observe``, so calibration only ever uses requests before the one priced
(learning is causal; the completion delay of a real run is not modelled). The error is the
MAPE (mean absolute percentage error) of the charge against ``CostModel.actual`` of the
trace's true counts, beside the same figure with the configured defaults only (no
calibration), and the MAPE of the estimated input tokens alone.

Two cases:

1. no ``max_tokens``: charged at the pool's ``default_max_tokens``, which the proxy injects
   upstream, so the real generation is capped by it: completion = min(GeneratedTokens, it);
2. ``max_tokens`` sent: the lab's convention (``max_tokens_multiplier`` of
   ``config/scenarios/azure-conv.yaml``, 4): max_tokens = ceil(GeneratedTokens × 4), the
   completion = GeneratedTokens.

The trace has token counts, not texts, so prompt texts are synthetic, either way:

- ``chat``: a chat request of 2 × turns messages (system, past turns, the new user
  message; turns uniform in 1..5, at most ContextTokens ÷ 8 messages) whose template costs
  4 tokens per message (the simulated server's ``MESSAGE_OVERHEAD_TOKENS``), and whose text
  holds the rest of ContextTokens at a chars/token drawn per request from a lognormal law
  (median 4.0, sigma 0.2: prose, code and other languages tokenize differently);
- ``lab``: what the lab's load generator sends, one completion prompt of exactly 4 chars
  per token (``sfq_proxy/lab/loadgen.py``): its input estimate is exact, so its rows show
  the output side's error alone.

    .venv/bin/python bench/calibration_error.py [--limit N]
"""

from __future__ import annotations

import argparse
import math
import random
import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from sfq_proxy.config import CalibrationSpec, CostSpec
from sfq_proxy.core.cost import CostModel
from sfq_proxy.core.inference_request import InferenceRequest, Kind
from sfq_proxy.lab.loadgen import CHARS_PER_TOKEN as LAB_CHARS_PER_TOKEN
from sfq_proxy.lab.scenario import Request, Scenario, parse_scenario
from sfq_proxy.lab.simulator import cost_model, cost_spec, inference_request
from sfq_proxy.sim.api import MESSAGE_OVERHEAD_TOKENS

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "config" / "scenarios" / "azure-conv.yaml"

MAX_TURNS = 5  # a chat request's turns: uniform in 1..MAX_TURNS
CPT_MEDIAN = 4.0  # the text's chars/token: lognormal around the proxy's configured default
CPT_SIGMA = 0.2


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's synthetic prompt: its text length and how many texts it is made of."""

    kind: Kind
    chars: int
    messages: int


@dataclass(slots=True)
class Errors:
    """Sums of absolute relative errors, charged and actual cost, over one run."""

    n: int = 0
    cost: float = 0.0
    tokens: float = 0.0
    charged: float = 0.0
    actual: float = 0.0

    def add(self, charged: float, actual: float, tokens: int, true_tokens: int) -> None:
        self.n += 1
        self.cost += abs(charged - actual) / actual
        self.tokens += abs(tokens - true_tokens) / true_tokens
        self.charged += charged
        self.actual += actual

    def mape(self) -> float:
        return 100 * self.cost / self.n if self.n else math.nan

    def input_mape(self) -> float:
        return 100 * self.tokens / self.n if self.n else math.nan

    def bias(self) -> float:
        return self.charged / self.actual if self.actual else math.nan


def load_trace(limit: int | None, multiplier: float | None) -> tuple[Scenario, float]:
    """The azure-conv scenario's requests (its Zipf orgs, its max_tokens convention), the
    first ``limit`` rows of the trace; with the ``max_tokens_multiplier`` applied."""
    data = yaml.safe_load(SCENARIO.read_text(encoding="utf-8"))
    trace = data["trace"]
    if multiplier is not None:
        trace["max_tokens_multiplier"] = multiplier
    trace["limit"] = limit if limit is not None else trace.get("limit")
    text = yaml.safe_dump(data, sort_keys=False)
    scenario = parse_scenario(text, SCENARIO.parent, source=str(SCENARIO))
    return scenario, float(trace.get("max_tokens_multiplier", 1.0))


def chat_prompts(requests: list[Request], seed: int) -> list[Prompt]:
    """Synthetic chat prompts whose true token count is each request's ContextTokens."""
    rng = random.Random(f"{seed}:calibration-error:prompts")
    prompts = []
    mu = math.log(CPT_MEDIAN)
    for request in requests:
        turns = rng.randint(1, MAX_TURNS)
        cpt = rng.lognormvariate(mu, CPT_SIGMA)
        context = request.input_tokens
        messages = max(1, min(2 * turns, context // (2 * MESSAGE_OVERHEAD_TOKENS)))
        text_tokens = max(0, context - MESSAGE_OVERHEAD_TOKENS * messages)
        prompts.append(Prompt(Kind.CHAT, round(text_tokens * cpt), messages))
    return prompts


def lab_prompts(requests: list[Request]) -> list[Prompt]:
    """The load generator's prompts: one string of exactly 4 characters per token."""
    return [Prompt(Kind.COMPLETION, r.input_tokens * LAB_CHARS_PER_TOKEN, 1) for r in requests]


def priced(request: Request, prompt: Prompt, *, send_max_tokens: bool) -> InferenceRequest:
    """The simulator's request, with the synthetic prompt text in place of its token ids."""
    return replace(
        inference_request(request),
        kind=prompt.kind,
        text="x" * prompt.chars,
        token_ids=0,
        max_tokens=request.max_tokens if send_max_tokens else None,
        messages=prompt.messages,
    )


def run(
    requests: list[Request], prompts: list[Prompt], spec: CostSpec, *, send_max_tokens: bool
) -> tuple[Errors, Errors, CostModel]:
    """Price every request with and without calibration; (calibrated, uncalibrated, model)."""
    calibrated, fixed = cost_model(spec, calibrate=True), cost_model(spec, calibrate=False)
    with_cal, without = Errors(), Errors()
    for request, prompt in zip(requests, prompts, strict=True):
        asked = priced(request, prompt, send_max_tokens=send_max_tokens)
        prompt_tokens = request.input_tokens
        completion = request.output_tokens
        if not send_max_tokens:  # the proxy sent default_max_tokens: generation stops there
            completion = min(completion, spec.default_max_tokens)
        for model, errors in ((calibrated, with_cal), (fixed, without)):
            estimate = model.estimate(asked, request.org)
            actual = model.actual(prompt_tokens, completion)
            assert actual is not None
            errors.add(estimate.cost, actual, estimate.input_tokens, prompt_tokens)
            model.observe(estimate, request.org, prompt_tokens, completion)
    return with_cal, without, calibrated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None, help="first N trace rows (all)")
    parser.add_argument(
        "--default-max-tokens", type=int, default=512, help="the pool's default_max_tokens"
    )
    parser.add_argument(
        "--multiplier", type=float, default=None,
        help="case 2's max_tokens = ceil(output × this) (default: azure-conv.yaml's)",
    )  # fmt: skip
    parser.add_argument(
        "--tokens-per-message", type=float, default=None,
        help="the pool's cost.tokens_per_message (default: the configured default)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be >= 1")

    scenario, multiplier = load_trace(args.limit, args.multiplier)
    requests = list(scenario.arrival_order())
    overrides: dict[str, float] = {"default_max_tokens": args.default_max_tokens}
    if args.tokens_per_message is not None:
        overrides["tokens_per_message"] = args.tokens_per_message
    base = cost_spec(scenario.pool).model_dump(exclude_unset=True)
    spec = CostSpec.model_validate({**base, **overrides})
    cal = CalibrationSpec()

    print("$ " + shlex.join(getattr(sys, "orig_argv", sys.argv)))
    print(
        f"trace: Azure LLM inference 2023, conversation ({SCENARIO.relative_to(ROOT)}: "
        f"{len(requests)} requests in arrival order, {len(scenario.teams)} orgs by its "
        f"seeded Zipf draw)"
    )
    print(
        f"cost: input_weight {spec.input_weight:g}, output_weight {spec.output_weight:g}, "
        f"output_ratio {spec.output_ratio:g}, chars_per_token {spec.chars_per_token:g}, "
        f"tokens_per_message {spec.tokens_per_message:g}, "
        f"default_max_tokens {spec.default_max_tokens}"
    )
    print(
        f"calibration: half-life {cal.half_life_requests} requests, an org's own output "
        f"ratio after {cal.min_org_samples} (no calibration: the cost line's values only)"
    )
    print("real (trace): prompt tokens (ContextTokens), completion tokens (GeneratedTokens)")
    print(
        f"synthetic: the orgs; case 2's max_tokens = ceil(GeneratedTokens × {multiplier:g}); "
        "the prompt texts:"
    )
    print(
        f"  chat = 2-{2 * MAX_TURNS} messages, {MESSAGE_OVERHEAD_TOKENS} template tokens "
        f"each, text at a lognormal chars/token (median {CPT_MEDIAN:g}, sigma {CPT_SIGMA:g}) "
        "per request"
    )
    print(
        f"  lab  = one prompt of exactly {LAB_CHARS_PER_TOKEN} chars/token, as the lab's "
        "loadgen sends (input estimate exact: output error alone)"
    )
    print()

    cases = (
        (f"1 no max_tokens (default {spec.default_max_tokens})", False),
        (f"2 max_tokens = {multiplier:g}x output", True),
    )
    synth = (("chat", chat_prompts(requests, scenario.seed)), ("lab", lab_prompts(requests)))
    header = (
        f"{'case':<31} {'prompts':<7} {'MAPE cal':>9} {'MAPE none':>10} "
        f"{'input cal':>10} {'input none':>11} {'chg/act cal':>12} {'chg/act none':>13} "
        f"{'n':>6}  learned"
    )
    print(header)
    print("-" * len(header))
    for name, prompts in synth:
        for label, send in cases:
            with_cal, without, model = run(requests, prompts, spec, send_max_tokens=send)
            learned = (
                f"tokens/message {model.input_model().tokens_per_message:.2f}, "
                f"chars/token {model.input_model().chars_per_token:.2f}, "
                f"output_ratio {model.output_ratio(''):.3f}"
            )
            print(
                f"{label:<31} {name:<7} {with_cal.mape():>8.1f}% {without.mape():>9.1f}% "
                f"{with_cal.input_mape():>9.1f}% {without.input_mape():>10.1f}% "
                f"{with_cal.bias():>12.2f} {without.bias():>13.2f} {with_cal.n:>6}  {learned}"
            )
    print()
    print(
        "MAPE = mean |charged - actual| / actual over the requests; 'input' = the same on the "
        "estimated prompt tokens; chg/act = total charged / total actual cost; 'learned' = "
        "the calibrated pool values after the last request."
    )
    print(
        "Case 2 is the best case for calibration: a max_tokens proportional to the output "
        "lets one learned ratio predict each output exactly; case 1's budget says nothing "
        "of the output."
    )


if __name__ == "__main__":
    main()
