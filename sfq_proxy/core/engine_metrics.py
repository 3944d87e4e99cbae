"""What an inference engine says of its own load: its ``/metrics`` text in, a reading out.
No I/O, no clock (docs/design.md §5, "Engine-aware dispatch").

A backend's ``slots`` is a guess; the engine knows how many requests it runs and how many
wait in its own FCFS queue. The engine gate (``engine_gate``) dispatches on these readings,
so they must be right or say that they are not: a reading either holds numbers that every
sample of the metric agreed to, or a ``problem`` and no numbers, never a partial sum.

- **vLLM** (``vllm:``, v1 engines): ``num_requests_running`` and ``num_requests_waiting``
  summed over engines (a data-parallel server is one backend), ``num_requests_waiting_by_reason
  {reason="capacity"}`` (those waiting for room, not for a LoRA budget or a KV transfer)
  when the server has it, ``kv_cache_usage_perc`` (a fraction, 1.0 is full; before v0.10 it
  was ``gpu_cache_usage_perc``) averaged over engines, and from ``cache_config_info``'s
  labels the KV cache's size (``kv_cache_size_tokens``, else ``num_gpu_blocks × block_size``).
  vLLM has no metric for ``--max-num-seqs``: the gate learns the capacity instead.
- **llama.cpp** (family ``llama-server``, started with ``--metrics``):
  ``llamacpp:requests_processing`` (busy slots), ``llamacpp:requests_deferred`` (tasks
  waiting for a slot) and, on servers before mid-2025, ``llamacpp:kv_cache_usage_ratio``. Its
  slot count is ``total_slots`` of ``/props`` (``parse_discovery``), which the caller passes
  as ``capacity``. llama-cpp-python's own server (family ``llamacpp``, the project's test
  backend) has no ``/metrics`` at all (nor ``/slots``, ``/props`` or ``/health``: 404): no
  engine dispatch for it.
- **TGI**: ``tgi_batch_current_size`` (running), ``tgi_queue_size`` (waiting), and
  ``tgi_batch_current_max_tokens`` (the tokens the batch reserved) over ``/info``'s
  ``max_batch_total_tokens`` as the KV use, when the caller passes the latter; ``/info``'s
  ``max_batch_size``, when set, is the capacity.

Bounded: a body longer than ``max_bytes`` (1 MiB by default, 20 times a real vLLM's 48 KiB)
is not parsed at all (``too_large``), lines longer than ``MAX_LINE_CHARS`` are skipped,
only the lines of the few wanted metrics go through a regular expression (linear, no
backtracking), and every value is checked (a NaN, an infinity, a negative count or a
fraction above 1 makes its metric unknown), and more than ``MAX_SERIES`` samples of one
metric make it invalid. A real vLLM body (48 KiB) takes ~0.2 ms, against ~22 ms for
prometheus_client's parser (which the core may not import anyway); the worst 1 MiB body
found, 40,000 lines of a wanted name and no value, ~30 ms (tests/core/test_engine_metrics.py).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Family = Literal["vllm", "llama-server", "tgi"]
Problem = Literal["too_large", "no_metrics", "missing", "invalid", "unsupported"]
"""Why a reading holds no numbers: the body was over ``max_bytes``; the backend has no
metrics endpoint (404, 501) or the scrape failed; a needed metric is absent; one of its
samples is not a usable number; the family is not one of ``Family``."""

MAX_BYTES = 1 << 20  # a real vLLM /metrics is ~48 KiB, with histograms for one model
MAX_LINE_CHARS = 16384  # vLLM's cache_config_info, the longest line, is ~1.5 KiB
MAX_COUNT = 1_000_000  # requests: more than any engine runs or queues; beyond is clamped
MAX_SERIES = 1024  # label sets of one metric: a real vLLM has one per engine

# name, optional {labels} (a quoted value may hold '}', '"' escaped, spaces), value,
# optional timestamp. Possessive runs (Python 3.11): nothing is ever tried twice, so a
# hostile line costs its length, whatever it holds.
_SAMPLE = re.compile(
    r'([a-zA-Z_:][a-zA-Z0-9_:]*+)(?:\{((?:[^"}]++|"(?:[^"\\\n]++|\\.)*+")*+)\})?'
    r"[ \t]++(\S++)(?:[ \t]++\S++)?+[ \t]*+\r?"
)
_LABEL = re.compile(
    r'[ \t]*+([a-zA-Z_][a-zA-Z0-9_]*+)[ \t]*+=[ \t]*+"((?:[^"\\\n]++|\\.)*+)"[ \t]*+,?'
)
_ESCAPED = re.compile(r'\\[\\"n]')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True, slots=True)
class EngineReading:
    """One scrape of one backend, as the engine reported it (not yet corrected for what the
    proxy sent since: that is the gate's in-flight credit).

    ``running`` and ``waiting`` are whole requests; ``waiting_for_capacity`` is the part of
    ``waiting`` held back for want of room (None when the engine does not tell the reasons
    apart: then all of ``waiting`` counts); ``kv_usage`` is the KV cache's used fraction;
    ``kv_tokens`` the KV cache's size in tokens and ``capacity`` the requests the engine
    runs at once, when it says (discovery; None otherwise)."""

    running: int | None = None
    waiting: int | None = None
    waiting_for_capacity: int | None = None
    kv_usage: float | None = None
    kv_tokens: int | None = None
    capacity: int | None = None
    problem: Problem | None = None

    @property
    def usable(self) -> bool:
        """Whether the gate may dispatch on it: no problem, and both counts known."""
        return self.problem is None and self.running is not None and self.waiting is not None

    @property
    def saturated(self) -> bool:
        """The engine keeps requests waiting for room: what it runs is all it can now."""
        held = self.waiting if self.waiting_for_capacity is None else self.waiting_for_capacity
        return self.usable and bool(held)


def unavailable(problem: Problem = "no_metrics") -> EngineReading:
    """The reading of a backend that has no metrics to read (llama-cpp-python's server, a
    llama-server started without ``--metrics``, a scrape that failed or timed out)."""
    return EngineReading(problem=problem)


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: str  # the raw text between the braces; see ``labels``
    value: float


def samples(body: str, name: str) -> list[Sample]:
    """The samples of metric ``name`` in Prometheus text ``body``, in order; malformed and
    over-long lines skipped. The body is searched for the name at a line's start at C
    speed and only those lines are cut out: the other metrics' lines (histograms, most of
    a body) cost nothing, and a hostile body no list of its lines. More than
    ``MAX_SERIES`` samples raise ``TooManySeries``."""
    found: list[Sample] = []
    at = 0 if body.startswith(name) else _next_line(body, name, 0)
    while at >= 0:
        end = body.find("\n", at)
        end = len(body) if end < 0 else end
        if end - at <= MAX_LINE_CHARS:
            match = _SAMPLE.fullmatch(body, at, end)
            if match is not None and match[1] == name:  # not a longer name that starts so
                if len(found) == MAX_SERIES:
                    raise TooManySeries(name)
                found.append(Sample(name, match[2] or "", _float(match[3])))
        at = _next_line(body, name, end)
    return found


def _next_line(body: str, name: str, start: int) -> int:
    """Where the next line that starts with ``name`` starts, from ``start`` on; -1: none."""
    at = body.find("\n" + name, start)
    return at + 1 if at >= 0 else -1


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan  # present but not a number: its metric is invalid


def labels(text: str) -> dict[str, str]:
    """A sample's labels (``a="1",b="x \\"y\\""``) as a dict, escapes undone."""
    found = {}
    for m in _LABEL.finditer(text):
        value = m[2]
        found[m[1]] = _ESCAPED.sub(lambda e: _ESCAPES[e[0]], value) if "\\" in value else value
    return found


class TooManySeries(ValueError):
    """A metric with more than ``MAX_SERIES`` samples: read as invalid."""


class _Invalid(Exception):
    """A wanted metric with a sample that is not a usable number."""


def _text(body: bytes | str, max_bytes: int) -> str | None:
    if len(body) > max_bytes:  # characters for a str: at most 4 bytes each, still bounded
        return None
    return body.decode("utf-8", "replace") if isinstance(body, bytes) else body


def _values(body: str, name: str) -> list[float]:
    try:
        return [s.value for s in samples(body, name)]
    except TooManySeries:
        raise _Invalid from None


def _count(values: list[float]) -> int | None:
    """A count summed over label sets (engines); None when absent; _Invalid when any
    sample is NaN, infinite or negative (a partial sum would under-count the load)."""
    if not values:
        return None
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise _Invalid
    total = sum(values)  # finite values may still add up to inf
    return MAX_COUNT if total >= MAX_COUNT else math.ceil(total - 1e-9)


def _fraction(values: list[float]) -> float | None:
    """A used fraction averaged over engines (a data-parallel server's engines have equal
    caches, and its front end sends a request to the least loaded); None when absent;
    _Invalid outside [0, 1]."""
    if not values:
        return None
    if any(not (0.0 <= v <= 1.0) for v in values):  # NaN fails too
        raise _Invalid
    return sum(values) / len(values)


def _int_label(value: str | None) -> int | None:
    if value is None or not (value.isascii() and value.isdigit()) or len(value) > 15:
        return None
    return int(value)


def _positive(value: int | None) -> int | None:
    return value if value is not None and 0 < value <= MAX_COUNT else None


def _reading(
    body: bytes | str, max_bytes: int, read: Callable[[str], EngineReading]
) -> EngineReading:
    """What every family's parser shares: the size cap, and a problem rather than numbers
    when ``read`` met an invalid sample or left a count unknown."""
    text = _text(body, max_bytes)
    if text is None:
        return unavailable("too_large")
    try:
        reading = read(text)
    except (_Invalid, TooManySeries):
        return unavailable("invalid")
    return reading if reading.usable else unavailable("missing")


def parse_vllm(body: bytes | str, *, max_bytes: int = MAX_BYTES) -> EngineReading:
    """A vLLM server's ``/metrics``."""

    def read(text: str) -> EngineReading:
        waiting = _count(_values(text, "vllm:num_requests_waiting"))
        by_reason = samples(text, "vllm:num_requests_waiting_by_reason")
        for_capacity = _count(
            [s.value for s in by_reason if labels(s.labels).get("reason") == "capacity"]
        )
        usage = _values(text, "vllm:kv_cache_usage_perc")
        return EngineReading(
            running=_count(_values(text, "vllm:num_requests_running")),
            waiting=waiting,
            waiting_for_capacity=(
                None if for_capacity is None or waiting is None else min(for_capacity, waiting)
            ),
            kv_usage=_fraction(usage or _values(text, "vllm:gpu_cache_usage_perc")),
            kv_tokens=_kv_tokens(samples(text, "vllm:cache_config_info")),
        )

    return _reading(body, max_bytes, read)


def _kv_tokens(infos: list[Sample]) -> int | None:
    """The KV cache's size in tokens over all engines, from ``cache_config_info``'s labels:
    ``kv_cache_size_tokens``, else ``num_gpu_blocks × block_size``; None if any engine's is
    unknown."""
    total = 0
    for info in infos:
        got = labels(info.labels)
        tokens = _int_label(got.get("kv_cache_size_tokens"))
        if tokens is None:
            blocks, size = _int_label(got.get("num_gpu_blocks")), _int_label(got.get("block_size"))
            if blocks is None or size is None:
                return None
            tokens = blocks * size
        total += tokens
    return total or None


def parse_llamacpp(
    body: bytes | str, *, capacity: int | None = None, max_bytes: int = MAX_BYTES
) -> EngineReading:
    """A llama.cpp ``llama-server``'s ``/metrics`` (started with ``--metrics``);
    ``capacity`` is ``total_slots`` from its ``/props``, when the caller read it."""

    def read(text: str) -> EngineReading:
        return EngineReading(
            running=_count(_values(text, "llamacpp:requests_processing")),
            waiting=_count(_values(text, "llamacpp:requests_deferred")),
            kv_usage=_fraction(_values(text, "llamacpp:kv_cache_usage_ratio")),
            capacity=_positive(capacity),
        )

    return _reading(body, max_bytes, read)


def parse_tgi(
    body: bytes | str,
    *,
    max_batch_total_tokens: int | None = None,
    max_batch_size: int | None = None,
    max_bytes: int = MAX_BYTES,
) -> EngineReading:
    """A TGI server's ``/metrics``; ``max_batch_total_tokens`` and ``max_batch_size`` are
    from its ``/info``, when the caller read them (the KV use and the capacity need them)."""
    total = _positive(max_batch_total_tokens)

    def read(text: str) -> EngineReading:
        reserved = _count(_values(text, "tgi_batch_current_max_tokens"))
        return EngineReading(
            running=_count(_values(text, "tgi_batch_current_size")),
            waiting=_count(_values(text, "tgi_queue_size")),
            kv_usage=None if reserved is None or total is None else min(1.0, reserved / total),
            kv_tokens=total,
            capacity=_positive(max_batch_size),
        )

    return _reading(body, max_bytes, read)


@dataclass(frozen=True, slots=True)
class Discovery:
    """What an engine says of itself beside its metrics, at ``DISCOVERY_PATHS``: llama-server's
    slots (``/props``' ``total_slots``), TGI's batch size and KV budget (``/info``'s
    ``max_batch_size`` and ``max_batch_total_tokens``, which TGI 3 no longer has)."""

    capacity: int | None = None
    kv_tokens: int | None = None


NOTHING_DISCOVERED = Discovery()
# where a family's engine describes itself (vLLM does in its metrics: cache_config_info)
DISCOVERY_PATHS = {"llama-server": "/props", "tgi": "/info"}


def parse_discovery(family: str, body: bytes | str, *, max_bytes: int = MAX_BYTES) -> Discovery:
    """A ``family`` engine's self-description (JSON), what the gate can use of it; nothing
    from a body over ``max_bytes``, not a JSON object, or whose values are not counts."""
    if len(body) > max_bytes:
        return NOTHING_DISCOVERED
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested beyond the parser's depth
        return NOTHING_DISCOVERED
    if not isinstance(doc, dict):
        return NOTHING_DISCOVERED
    if family == "llama-server":
        return Discovery(capacity=_json_count(doc.get("total_slots")))
    if family == "tgi":
        return Discovery(
            capacity=_json_count(doc.get("max_batch_size")),
            kv_tokens=_json_count(doc.get("max_batch_total_tokens")),
        )
    return NOTHING_DISCOVERED


def _json_count(value: object) -> int | None:
    return _positive(value) if isinstance(value, int) and not isinstance(value, bool) else None


def parse(
    family: str,
    body: bytes | str,
    *,
    max_bytes: int = MAX_BYTES,
    discovery: Discovery = NOTHING_DISCOVERED,
) -> EngineReading:
    """The reading of a ``family`` backend's ``/metrics``, with what its ``discovery`` said."""
    if family == "vllm":
        return parse_vllm(body, max_bytes=max_bytes)
    if family == "llama-server":
        return parse_llamacpp(body, capacity=discovery.capacity, max_bytes=max_bytes)
    if family == "tgi":
        return parse_tgi(
            body,
            max_batch_total_tokens=discovery.kv_tokens,
            max_batch_size=discovery.capacity,
            max_bytes=max_bytes,
        )
    return unavailable("unsupported")
