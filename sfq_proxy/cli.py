"""The ``sfq-proxy`` command: serve, check-config, demo, sim-backend."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from .config import Config, ConfigError, default_config, load_config
from .http.server import run, serve
from .lab import commands as lab
from .lab.demo import demo
from .sim import server as simbackend


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sfq-proxy", description="Fair-share reverse proxy for OpenAI-compatible LLM servers."
    )
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run the proxy")
    p.add_argument("--config", required=True, help="YAML configuration file")
    p.set_defaults(func=_serve)

    p = sub.add_parser("check-config", help="validate a configuration and summarise it")
    p.add_argument("config", help="YAML configuration file")
    p.set_defaults(func=_check_config)

    p = sub.add_parser("demo", help="the proxy on its built-in config and simulated backends")
    p.add_argument(
        "--traffic", action="store_true", help="also play three teams' traffic and print shares"
    )
    p.add_argument("--host", help="address the proxy listens on (default: the config's)")
    p.add_argument("--scenario", help="run a scenario through the proxy instead (see simulate)")
    p.add_argument("--time-scale", type=float, default=20.0, help="with --scenario: speed-up")
    p.add_argument("--duration", type=float, help="with --scenario: its first N seconds")
    p.set_defaults(func=_demo)

    simbackend.add_parser(sub)
    lab.add_parsers(sub)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


def _load(path: str) -> Config:
    """The config at ``path``, or exit with every error and its path."""
    try:
        return load_config(path)
    except ConfigError as err:
        sys.exit(f"{path}: invalid configuration:\n{err}")
    except OSError as err:
        sys.exit(f"{path}: {err.strerror}")


def _serve(args: argparse.Namespace) -> int:
    config = _load(args.config)
    try:
        run(lambda: serve(config, Path(args.config)))
    except ConfigError as err:  # found when building the app: a tokenizer that won't load
        sys.exit(f"{args.config}: invalid configuration:\n{err}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.scenario:
        run(lambda: lab.demo_scenario(
            args.scenario, time_scale=args.time_scale, duration_s=args.duration))  # fmt: skip
        return 0
    config = default_config()
    if args.host:  # e.g. 0.0.0.0 in a container, so Prometheus can scrape it
        listen = config.listen.model_copy(update={"host": args.host})
        config = config.model_copy(update={"listen": listen})
    run(lambda: demo(config, traffic=args.traffic))
    return 0


def _check_config(args: argparse.Namespace) -> int:
    print(_load(args.config).summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
