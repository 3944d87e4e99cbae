"""The ``sfq-proxy`` command: serve, check-config, keys, demo, sim-backend, simulate, loadgen.

Serving needs only the proxy (``sfq_proxy.core``, ``sfq_proxy.http``). The demo, the
simulated server and the scenario lab live in ``sfq_proxy.lab`` and ``sfq_proxy.sim``,
which an installation may leave out (the container image does): their commands then say
what to install instead of failing on an import.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from . import keys_cli
from .config import Config, ConfigError, load_config
from .config.summary import summary, warnings
from .observability import logs
from .observability.process_metrics import version
from .runner.server import run, serve
from .runner.workers import serve_workers

LAB_COMMANDS = ("simulate", "loadgen", "sim-backend")
MISSING_LAB = (
    "sfq-proxy {command}: this installation has no lab or simulated server (the container "
    "image carries the proxy alone); install the whole package: pip install 'sfq-proxy[lab]'"
)


LOG_LEVEL_ENV = "SFQ_LOG_LEVEL"
LOG_FORMAT_ENV = "SFQ_LOG_FORMAT"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sfq-proxy", description="Fair-share reverse proxy for OpenAI-compatible LLM servers."
    )
    parser.add_argument("--version", action="version", version=f"sfq-proxy {version()}")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run the proxy")
    p.add_argument("--config", required=True, help="YAML configuration file")
    p.add_argument(
        "--workers", type=int, default=1, metavar="N",
        help="processes sharing the port (needs state: redis, one fairness domain for all)",
    )  # fmt: skip
    _add_log_options(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("check-config", help="validate a configuration and summarise it")
    p.add_argument("config", help="YAML configuration file")
    p.set_defaults(func=_check_config)

    p = sub.add_parser("demo", help="the proxy on its built-in config and simulated backends")
    p.add_argument(
        "--traffic", action="store_true", help="also play three teams' traffic and print shares"
    )
    p.add_argument("--host", help="address the proxy listens on (default: 127.0.0.1)")
    p.add_argument(
        "--port", type=int, help="port the proxy listens on (default: 8080; 0 picks a free one)"
    )
    p.add_argument("--scenario", help="run a scenario through the proxy instead (see simulate)")
    p.add_argument("--time-scale", type=float, default=20.0, help="with --scenario: speed-up")
    p.add_argument("--duration", type=float, help="with --scenario: its first N seconds")
    _add_log_options(p)
    p.set_defaults(func=_demo)

    keys_cli.add_parser(sub)
    _add_lab_parsers(sub)
    args = parser.parse_args(argv)
    if "log_level" in args:
        _choose_logs(args)
    code: int = args.func(args)
    return code


def _add_log_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level", type=str.lower, choices=list(logs.LEVELS), metavar="LEVEL",
        help=f"the proxy's own log lines (stderr) at LEVEL and above: {', '.join(logs.LEVELS)} "
        f"(default: ${LOG_LEVEL_ENV}, else warning; the access log is always on)",
    )  # fmt: skip
    p.add_argument(
        "--log-format", type=str.lower, choices=logs.FORMATS, metavar="FORMAT",
        help=f"both logs (stderr, and stdout's access log): json or text (default: "
        f"${LOG_FORMAT_ENV}, else text when stdout and stderr are terminals, json otherwise)",
    )  # fmt: skip
    p.set_defaults(parser=p)


def _choose_logs(args: argparse.Namespace) -> None:
    """Both logs' level and format: the flag, else the environment, else the default; a bad
    value in the environment is a usage error, as a bad flag is."""
    parser: argparse.ArgumentParser = args.parser
    chosen: dict[str, str | None] = {}
    for option, env, allowed in (
        ("log_level", LOG_LEVEL_ENV, list(logs.LEVELS)),
        ("log_format", LOG_FORMAT_ENV, list(logs.FORMATS)),
    ):
        value = getattr(args, option)
        if value is None and os.environ.get(env, "").strip():
            value = os.environ[env].strip().lower()
            if value not in allowed:
                parser.error(
                    f"environment variable {env}: invalid choice: {os.environ[env]!r} "
                    f"(choose from {', '.join(allowed)})"
                )
        chosen[option] = value
    level = logs.LEVELS[chosen["log_level"] or "warning"]
    logs.choose(level, next((f for f in logs.FORMATS if f == chosen["log_format"]), None))
    logs.configure()


def _add_lab_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The lab's and the simulated server's commands, or stand-ins that say what is missing."""
    try:
        from .lab import commands as lab
        from .sim import command as simbackend
    except ImportError:
        for command in LAB_COMMANDS:
            p = sub.add_parser(command, help="(needs the lab: pip install 'sfq-proxy[lab]')")
            p.add_argument("args", nargs=argparse.REMAINDER)
            p.set_defaults(func=_missing_lab, command=command)
        return
    simbackend.add_parser(sub)
    lab.add_parsers(sub)


def _missing_lab(args: argparse.Namespace) -> int:
    sys.exit(MISSING_LAB.format(command=args.command))


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
    if args.workers < 1:
        sys.exit("--workers must be at least 1")
    where = f"{config.listen.host}:{config.listen.port}"
    if args.workers > 1:
        if config.state is None:
            sys.exit(
                f"{args.config}: --workers {args.workers} needs state: redis: in memory each "
                "process would be a fairness domain of its own, with every slot of every pool"
            )
        with _listen_errors(f"sfq-proxy: cannot listen on {where}", "change listen.port"):
            return serve_workers(config, Path(args.config), args.workers)
    try:
        with _listen_errors(f"sfq-proxy: cannot listen on {where}", "change listen.port"):
            run(lambda: serve(config, Path(args.config)))
    except ConfigError as err:  # found when building the app: a tokenizer that won't load
        sys.exit(f"{args.config}: invalid configuration:\n{err}")
    return 0


# what binding a listening socket can fail with, and what it means to the operator
_LISTEN_ERRORS = {
    errno.EADDRINUSE: "the address is in use (another process listens on it)",
    errno.EACCES: "permission denied (ports below 1024 need privileges)",
    errno.EADDRNOTAVAIL: "no such address on this machine",
}


@contextlib.contextmanager
def _listen_errors(what: str, advice: str) -> Iterator[None]:
    """Exit with one line, no traceback, when the listening socket cannot be bound."""
    try:
        yield
    except OSError as err:
        # permission denied may come from a file too: only the listening socket's counts
        binding = err.errno != errno.EACCES or "bind" in str(err)
        if err.errno not in _LISTEN_ERRORS or not binding:
            raise
        sys.exit(f"{what}: {_LISTEN_ERRORS[err.errno]}; {advice}")


def _demo(args: argparse.Namespace) -> int:
    try:
        from .lab import commands as lab
        from .lab.demo import admin_key as demo_admin_key
        from .lab.demo import demo, demo_config
    except ImportError:
        sys.exit(MISSING_LAB.format(command="demo"))
    if args.scenario:
        run(lambda: lab.demo_scenario(
            args.scenario, time_scale=args.time_scale, duration_s=args.duration))  # fmt: skip
        return 0
    if args.port is not None and not 0 <= args.port <= 65535:
        args.parser.error(f"argument --port: {args.port} is not a port (0 to 65535)")
    admin = demo_admin_key()
    listen = demo_config(admin, args.host, args.port).listen  # --host 0.0.0.0 in a container
    with _listen_errors(
        f"sfq-proxy demo: cannot listen on {listen.host}:{listen.port}",
        "choose another port with --port (make run PORT=...)",
    ):
        run(lambda: demo(host=args.host, port=args.port, admin=admin, traffic=args.traffic))
    return 0


def _check_config(args: argparse.Namespace) -> int:
    config = _load(args.config)
    with _reader_may_leave():
        print("\n".join([summary(config), *warnings(config)]))
    return 0


@contextlib.contextmanager
def _reader_may_leave() -> Iterator[None]:
    """Output read by a command that may stop early (``check-config sfq.yaml | head``): its
    leaving ends the output, not a traceback. stdout then goes to /dev/null, so that the
    interpreter's last flush at exit has nowhere to fail either."""
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
