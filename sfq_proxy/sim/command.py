"""``sfq-proxy sim-backend``: a simulated vLLM server from the command line, until SIGINT or
SIGTERM."""

from __future__ import annotations

import argparse

from ..runner.server import run, wait_for_signal
from .engine import (
    SCHEDULING_POLICIES,
)
from .server import SimBackend
from .settings import DEFAULT_MODEL, MEDIA_FIELDS, SimConfig


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``sim-backend``: run a simulated vLLM server until SIGINT/SIGTERM."""
    d = SimConfig()
    p = subparsers.add_parser(
        "sim-backend",
        help="run a simulated vLLM (OpenAI-compatible) server",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--model",
        dest="models",
        action="append",
        help=f"served model name, repeatable (default: {DEFAULT_MODEL})",
    )
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=d.kv_cache_tokens,
        help="tokens of KV cache (prompts and outputs of the batch); unset: unlimited",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=d.scheduling_policy,
        help="the engine's queue: arrival order, or by the request's priority (lower first)",
    )
    p.add_argument(
        "--metrics-format",
        choices=("vllm", "llama-server"),
        default=d.metrics_format,
        help="whose metrics /metrics serves: vLLM's, or llama-server's (with its /props)",
    )
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--prefill-tokens-per-s", type=float, default=d.prefill_tokens_per_s)
    p.add_argument("--decode-tokens-per-s", type=float, default=d.decode_tokens_per_s)
    p.add_argument("--batch-slowdown", type=float, default=d.batch_slowdown)
    p.add_argument("--time-scale", type=float, default=d.time_scale)
    p.add_argument("--output-mode", choices=("max", "random", "min_tokens"), default=d.output_mode)
    p.add_argument(
        "--default-max-tokens",
        type=_max_tokens_arg,
        default=d.default_max_tokens,
        help="output of a request that sets no max_tokens: a number, or 'context' for the rest "
        "of the context window, as vLLM does",
    )
    p.add_argument(
        "--tokens-per-message",
        type=int,
        default=d.tokens_per_message,
        help="prompt tokens the chat template adds per message",
    )
    for kind, name in MEDIA_FIELDS.items():
        p.add_argument(
            f"--{kind}-tokens",
            dest=name,
            type=int,
            default=getattr(d, name),
            help=f"prompt tokens of a {kind} part whose size cannot be read",
        )
    p.add_argument("--seed", type=int, default=d.seed)
    p.set_defaults(func=run_from_args)


def _max_tokens_arg(value: str) -> int | None:
    """``--default-max-tokens``: a positive number, or ``context`` (None)."""
    if value == "context":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a number or 'context'") from None


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of ``sim-backend``; blocks until SIGINT/SIGTERM, returns the exit code."""
    config = SimConfig(
        models=args.models or (DEFAULT_MODEL,),
        max_num_seqs=args.max_num_seqs,
        kv_cache_tokens=args.kv_cache_tokens,
        scheduling_policy=args.scheduling_policy,
        metrics_format=args.metrics_format,
        max_model_len=args.max_model_len,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_tokens_per_s=args.decode_tokens_per_s,
        batch_slowdown=args.batch_slowdown,
        time_scale=args.time_scale,
        output_mode=args.output_mode,
        seed=args.seed,
        default_max_tokens=args.default_max_tokens,
        tokens_per_message=args.tokens_per_message,
        **{name: getattr(args, name) for name in MEDIA_FIELDS.values()},
    )
    run(lambda: _serve_until_signal(config, args.host, args.port))
    return 0


async def _serve_until_signal(config: SimConfig, host: str, port: int) -> None:
    sim = SimBackend(config)
    url = await sim.start(host, port)
    print(f"sim-backend serving {', '.join(config.models)} at {url}", flush=True)
    try:
        await wait_for_signal()
    finally:
        await sim.stop()
