"""``sfq-proxy keys create|list|update|revoke``: the admin API's keys from a shell, against a
running proxy (docs/keys.md). The admin key is read from an environment variable, never
from the command line, where ``ps`` and the shell's history would show it. A server's
refusal is printed as its message, with exit code 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote

DEFAULT_ADMIN_KEY_ENV = "SFQ_ADMIN_KEY"
TIMEOUT_S = 10.0
ANY = "*"  # --pools '*' / --models '*': no restriction (on update, lifts one)
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86_400}
_COLUMNS = ("id", "alias", "org", "status", "classes", "pools", "models", "budgets",
            "created", "expires", "last_used", "source")  # fmt: skip
_NUMBER = r"(\d+(?:\.\d+)?)"
_BUDGET = re.compile(rf"(day|month):(?:tokens=(\d+)|money={_NUMBER})(?::warn={_NUMBER})?")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``keys`` command and its actions, under the CLI's subcommands ``sub``."""
    p = sub.add_parser("keys", help="create, list, update or revoke keys of a running proxy")
    actions = p.add_subparsers(required=True, metavar="ACTION")
    create = _action(actions, "create", "make a key (its secret is printed once)")
    create.add_argument("--alias", required=True, help="a unique name for the key")
    create.add_argument("--org", required=True, help="the org its requests are charged to")
    _fields(create)
    _action(actions, "list", "list every key (never a secret)")
    update = _action(actions, "update", "change a key made through the API")
    update.add_argument("id", help="the key's id (k_...)")
    update.add_argument("--alias", help="a new alias")
    update.add_argument("--org", help="a new org")
    _fields(update)
    update.add_argument("--no-expiry", action="store_true", help="the key never expires")
    update.add_argument("--no-budgets", action="store_true", help="remove the key's budgets")
    revoke = _action(actions, "revoke", "revoke a key made through the API, at once")
    revoke.add_argument("id", help="the key's id (k_...)")


def _action(
    actions: argparse._SubParsersAction[argparse.ArgumentParser], name: str, text: str
) -> argparse.ArgumentParser:
    p = actions.add_parser(name, help=text)
    p.add_argument("--url", required=True, help="the proxy, e.g. http://127.0.0.1:8080")
    p.add_argument(
        "--admin-key-env", default=DEFAULT_ADMIN_KEY_ENV, metavar="VAR",
        help=f"environment variable holding the admin key (default: {DEFAULT_ADMIN_KEY_ENV})",
    )  # fmt: skip
    p.set_defaults(func=run, action=name, parser=p)
    return p


def _fields(p: argparse.ArgumentParser) -> None:
    p.add_argument("--classes", help="comma-separated workload classes, the default first")
    p.add_argument("--pools", help=f"comma-separated pools it may use ('{ANY}': any)")
    p.add_argument("--models", help=f"comma-separated models it may use ('{ANY}': any)")
    p.add_argument("--expires-in", help="lifetime from now: 3600, 90m, 12h, 30d")
    p.add_argument(
        "--budget", action="append", metavar="PERIOD:UNIT=N[:warn=F]",
        help="a budget, repeatable: day:tokens=100000[:warn=0.8], month:money=50 (on update, "
        "the --budget options given replace every budget of the key)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Do ``args.action``; print what the proxy answered (or its refusal, returning 1)."""
    key = os.environ.get(args.admin_key_env, "").strip()
    if not key:
        print(f"sfq-proxy keys: environment variable {args.admin_key_env} is not set",
              file=sys.stderr)  # fmt: skip
        return 1
    try:
        if args.action == "list":
            print(table(_call(args, key, "GET", "/admin/keys")["keys"]))
        elif args.action == "revoke":
            answer = _call(args, key, "DELETE", f"/admin/keys/{quote(args.id, safe='')}")
            print(f"Revoked {answer['revoked']}")
        elif args.action == "create":
            answer = _call(args, key, "POST", "/admin/keys", body(args))
            print(f"Created {_describe(answer['key'])}")
            print(f"Secret (shown once, keep it now): {answer['secret']}")
        else:
            path = f"/admin/keys/{quote(args.id, safe='')}"
            print(f"Updated {_describe(_call(args, key, 'PATCH', path, body(args))['key'])}")
    except _Refused as err:
        print(f"sfq-proxy keys: {err}", file=sys.stderr)
        return 1
    return 0


def body(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON fields the options set; an option left out is not sent."""
    fields: dict[str, Any] = {n: getattr(args, n) for n in ("alias", "org") if getattr(args, n)}
    for name in ("classes", "pools", "models"):
        value = getattr(args, name)
        if value is not None:
            fields[name] = None if value == ANY else [v.strip() for v in value.split(",")]
    if args.expires_in is not None:
        fields["expires_in_s"] = _seconds(args)
    if getattr(args, "no_expiry", False):
        fields["expires_at"] = None
    if args.budget is not None:
        fields["budgets"] = [_budget(args, text) for text in args.budget]
    if getattr(args, "no_budgets", False):
        if args.budget is not None:
            args.parser.error("--budget and --no-budgets: give one or the other")
        fields["budgets"] = None
    return fields


def _budget(args: argparse.Namespace, text: str) -> dict[str, Any]:
    """One ``--budget``, as the API's JSON (the proxy checks its bounds)."""
    match = _BUDGET.fullmatch(text.strip())
    if match is None:
        parser: argparse.ArgumentParser = args.parser
        parser.error(f"--budget {text!r}: write day:tokens=100000, month:money=50, "
                     "or either with :warn=0.9")  # fmt: skip
    period, tokens, money, warn = match.groups()
    budget: dict[str, Any] = {"period": period}
    if tokens is not None:
        budget["tokens"] = int(tokens)
    else:
        budget["money"] = float(money)
    if warn is not None:
        budget["warn_at"] = float(warn)
    return budget


def _seconds(args: argparse.Namespace) -> float:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", args.expires_in)
    if match is None:
        parser: argparse.ArgumentParser = args.parser
        parser.error("--expires-in: write a number of seconds, or 90m, 12h, 30d")
    return float(match[1]) * _UNITS[match[2]]


class _Refused(Exception):
    """The proxy refused, or could not be reached: the message says why."""


def _call(
    args: argparse.Namespace, key: str, method: str, path: str, data: Any = None
) -> dict[str, Any]:
    request = urllib.request.Request(
        args.url.rstrip("/") + path,
        data=None if data is None else json.dumps(data).encode(),
        method=method,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            answer: dict[str, Any] = json.load(response)
            return answer
    except urllib.error.HTTPError as err:
        raise _Refused(f"{err.code}: {_message(err.read())}") from None
    except (urllib.error.URLError, OSError) as err:
        raise _Refused(f"cannot reach {args.url}: {err}") from None


def _message(raw: bytes) -> str:
    """The error's message in an OpenAI-style body, else the body as it came."""
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace").strip()


def _describe(key: dict[str, Any]) -> str:
    classes = ",".join(key["classes"])
    expires = key["expires"] or "never"
    return (
        f"{key['id']} (alias {key['alias']}, org {key['org']}, classes {classes}, "
        f"budgets {_cell('budgets', key['budgets'])}, expires {expires})"
    )


def table(keys: list[dict[str, Any]]) -> str:
    """The keys as aligned columns, one line each under a header."""
    rows = [[c.upper().replace("_", " ") for c in _COLUMNS]]
    rows += [[_cell(c, key[c]) for c in _COLUMNS] for key in keys]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _cell(column: str, value: Any) -> str:
    if column == "budgets":
        return ",".join(map(_budget_text, value)) or "-"
    if value is None:
        return "-"
    return ",".join(value) if isinstance(value, list) else str(value)


def _budget_text(budget: dict[str, Any]) -> str:
    """A budget as ``--budget`` writes it: day:tokens=100000:warn=0.8."""
    amount = f"tokens={budget['tokens']}" if "tokens" in budget else f"money={budget['money']:g}"
    return f"{budget['period']}:{amount}:warn={budget['warn_at']:g}"
