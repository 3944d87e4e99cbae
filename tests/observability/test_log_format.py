"""The shape of both logs' lines (docs/operations.md, Logs): timestamps, levels, logger names,
JSON or text, and the redaction of the operational log in either format."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import sys

import pytest

from sfq_proxy.core.errors import CUT_CHARS
from sfq_proxy.observability import access_log, logs

TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
SECRET = "sk-live-0123456789"


def record(message: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise RuntimeError(f"upstream said Authorization: Bearer {SECRET}")
        except RuntimeError:
            exc_info = sys.exc_info()
    made = logging.LogRecord(
        "sfq_proxy.http.relay", logging.WARNING, __file__, 1, message, args, exc_info
    )
    made.created = 1_700_000_000.0425  # 2023-11-14T22:13:20.042Z
    return made


def test_timestamp_is_rfc3339_utc_with_milliseconds() -> None:
    assert logs.timestamp(0) == "1970-01-01T00:00:00.000Z"
    assert logs.timestamp(1_700_000_000.0425) == "2023-11-14T22:13:20.042Z"
    assert logs.timestamp(1_700_000_000.9999) == "2023-11-14T22:13:20.999Z"  # never .1000


def test_a_json_line_has_ts_level_logger_msg() -> None:
    line = logs.RedactingFormatter("json").format(record("pool %s: %d down", "p", 2))
    assert json.loads(line) == {
        "ts": "2023-11-14T22:13:20.042Z",
        "level": "warning",
        "logger": "sfq_proxy.http.relay",
        "msg": "pool p: 2 down",
    }


def test_a_json_line_carries_its_traceback_in_exc_redacted() -> None:
    line = logs.RedactingFormatter("json").format(record("failed with %s", SECRET, exc=True))
    assert "\n" not in line
    fields = json.loads(line)
    assert fields["msg"] == "failed with sk-[redacted]"
    assert fields["exc"].startswith("Traceback (most recent call last):")
    assert "RuntimeError: upstream said Authorization: [redacted]" in fields["exc"]
    assert SECRET not in line


def test_a_text_line_is_ts_level_logger_then_the_message_and_traceback() -> None:
    text = logs.RedactingFormatter("text").format(record("failed with %s", SECRET, exc=True))
    first, *trace = text.splitlines()
    head = "2023-11-14T22:13:20.042Z WARNING sfq_proxy.http.relay:"
    assert first == f"{head} failed with sk-[redacted]"
    assert trace[0] == "Traceback (most recent call last):"
    assert SECRET not in text


@pytest.mark.parametrize("fmt", logs.FORMATS)
def test_configured_upstream_keys_are_redacted_even_with_json_escapes(
    fmt: logs.LogFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key that JSON would escape (a quote, a backslash) is redacted before encoding, and
    the line stays valid JSON."""
    monkeypatch.setattr(logs, "_secrets", set())
    upstream = 'up"stream\\key'
    logs.hide(upstream)
    line = logs.RedactingFormatter(fmt).format(record("sent %s to the backend", upstream))
    assert upstream not in line
    assert json.dumps(upstream)[1:-1] not in line
    if fmt == "json":
        assert json.loads(line)["msg"] == "sent [redacted] to the backend"
    else:
        assert line.endswith("sent [redacted] to the backend")


def test_configure_uses_the_format_and_level_chosen_for_the_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(logs, "_format", None)
    monkeypatch.setattr(logs, "_level", logs.DEFAULT_LEVEL)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        assert logs.choose(logging.INFO, "text") == "text"
        stream = io.StringIO()
        logs.configure(stream)
        assert root.level == logging.INFO
        logging.getLogger("sfq_proxy.test").info("hello")
        logging.getLogger("sfq_proxy.test").debug("not shown")
        [line] = stream.getvalue().splitlines()
        assert re.fullmatch(f"{TS.pattern} INFO sfq_proxy.test: hello", line), line
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def test_unchosen_the_format_is_text_only_when_both_streams_are_terminals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(logs, "_format", None)
    monkeypatch.setattr(sys, "stdout", Tty())
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert logs.log_format() == "json"  # stderr is a file: someone collects it
    monkeypatch.setattr(sys, "stderr", Tty())
    assert logs.log_format() == "text"
    assert logs.choose(fmt="json") == "json"  # chosen: kept, terminals or not
    assert logs.log_format() == "json"


# --- the access log --------------------------------------------------------------------------


def access_lines(fmt: logs.LogFormat, records: list[access_log.AccessRecord]) -> list[str]:
    stream = io.StringIO()

    async def emit() -> None:
        access_log.configure(stream, fmt=fmt)
        for made in records:
            made.emit()
        await asyncio.sleep(0)  # lines leave when the loop turns

    try:
        asyncio.run(emit())
    finally:
        access_log.configure(None)
    return stream.getvalue().splitlines()


def test_an_access_json_line_starts_with_ts_level_logger() -> None:
    made = access_log.AccessRecord("req-1", org="A", key="A#0", cls="batch", status=200)
    [line] = access_lines("json", [made])
    fields = json.loads(line)
    assert list(fields)[:7] == ["ts", "level", "logger", "request_id", "trace_id", "org", "key"]
    assert TS.fullmatch(fields["ts"])
    assert (fields["level"], fields["logger"]) == ("info", "sfq_proxy.access")
    assert (fields["key"], fields["class"], fields["status"]) == ("A#0", "batch", 200)


@pytest.mark.parametrize("model", ["modèle-7b", "模型", "\ud800 half a pair", "ok"])
def test_an_access_json_line_is_ascii_whatever_a_name_holds(model: str) -> None:
    """A client names its model, an operator its keys: any text. The line is written
    as ASCII JSON all the same (stdout need not take UTF-8), with the name escaped."""
    made = access_log.AccessRecord("req-1", org="A", model=model, cost=0.1 + 0.2, status=200)
    [line] = access_lines("json", [made])
    assert line.isascii()
    fields = json.loads(line)
    assert (fields["model"], fields["cost"], fields["status"]) == (model, 0.1 + 0.2, 200)


def test_an_access_text_line_starts_with_ts_level_logger() -> None:
    made = access_log.AccessRecord("req-1", org="A", key="ci-bot", status=404)
    [line] = access_lines("text", [made])
    ts, rest = line.split(" ", 1)
    assert TS.fullmatch(ts)
    assert rest == (
        "INFO sfq_proxy.access: request_id=req-1 org=A key=ci-bot status=404 "
        "queue_wait_s=0.0 retries=0"
    )


def test_access_timestamps_follow_the_clock_per_millisecond(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Formatted once per millisecond, but never stale: each line gets its own time."""
    clock = iter([1_700_000_000.0001, 1_700_000_000.0009, 1_700_000_000.0012, 1_700_000_001.5])
    monkeypatch.setattr(access_log, "_clock", lambda: next(clock))
    lines = access_lines("json", [access_log.AccessRecord(f"r{i}") for i in range(4)])
    assert [json.loads(line)["ts"] for line in lines] == [
        "2023-11-14T22:13:20.000Z",
        "2023-11-14T22:13:20.000Z",
        "2023-11-14T22:13:20.001Z",
        "2023-11-14T22:13:21.500Z",
    ]


# --- nothing a client sends is logged unbounded ----------------------------------------------


def test_each_line_of_a_message_and_of_its_traceback_is_cut() -> None:
    """What aiohttp could not parse, quoted in its message and its traceback: each line
    keeps LINE_CHARS characters and says how long it was; short lines are as they were."""
    quoted = "x" * 20_000
    made = record("bad request:\n%s\nfrom %s", quoted, "127.0.0.1", exc=True)
    made.exc_text = f"Traceback (most recent call last):\nValueError: {quoted}"
    for fmt in logs.FORMATS:
        line = logs.RedactingFormatter(fmt).format(made)
        texts = [json.loads(line)[name] for name in ("msg", "exc")] if fmt == "json" else [line]
        for text in texts:
            assert len(text) < 4 * logs.LINE_CHARS
            for part in text.splitlines():
                assert len(part) <= logs.LINE_CHARS + len("…(cut, 20100 chars)")
        assert "x" * logs.LINE_CHARS + "…(cut, 20000 chars)" in texts[0]
        assert "from 127.0.0.1" in texts[0]


def test_a_secret_is_redacted_before_its_line_is_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut first, an upstream key astride the cut would leave its first half, which
    redaction no longer knows."""
    monkeypatch.setattr(logs, "_secrets", set())
    upstream = "upstream-key-0123456789"
    logs.hide(upstream)
    head = "2023-11-14T22:13:20.042Z WARNING sfq_proxy.http.relay: "
    made = record("%s%s and more", "y" * (logs.LINE_CHARS - len(head) - 8), upstream)
    line = logs.RedactingFormatter("text").format(made)
    kept, _, rest = line.partition("…(cut, ")
    assert (kept[: len(head)], kept[-9:], len(kept)) == (head, "y[redacte", logs.LINE_CHARS)
    assert rest == f"{len(head) + len(made.getMessage()) - len(upstream) + 10} chars)"
    assert "upstream" not in line


@pytest.mark.parametrize("fmt", logs.FORMATS)
@pytest.mark.parametrize("length", [255, 256, 257, 5 * 1024 * 1024])
def test_an_access_line_cuts_the_model_a_client_named(fmt: logs.LogFormat, length: int) -> None:
    """Cut past CUT_CHARS exactly: the line is checked by its length alone, and a model one
    character too long always makes a line long enough to be looked at."""
    made = access_log.AccessRecord("r", model="m" * length, status=404)
    [line] = access_lines(fmt, [made])
    assert _field(fmt, line, "model") == (
        "m" * length if length <= CUT_CHARS else f"{'m' * CUT_CHARS}…(cut, {length} chars)"
    )
    assert len(line) < 700


@pytest.mark.parametrize("fmt", logs.FORMATS)
def test_an_access_line_too_long_all_the_same_has_every_text_cut(fmt: logs.LogFormat) -> None:
    made = access_log.AccessRecord("r", org="o" * 5000, key="k" * 5000, model="ok")
    [line] = access_lines(fmt, [made])
    assert len(line) < 1000
    assert _field(fmt, line, "org") == f"{'o' * CUT_CHARS}…(cut, 5000 chars)"
    assert _field(fmt, line, "key") == f"{'k' * CUT_CHARS}…(cut, 5000 chars)"
    assert _field(fmt, line, "model") == "ok"


def _field(fmt: logs.LogFormat, line: str, name: str) -> object:
    if fmt == "json":
        return json.loads(line)[name]
    found = re.search(rf" {name}=(.*?) \w+=", line)
    assert found, line
    return found[1]
