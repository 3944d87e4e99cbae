"""Per-event cost of the usage stripper (sfq_proxy/http/sse.py), before and after it parsed
server-sent events per the WHATWG rules, side by side.

    python bench/sse_events.py [--streams 200] [--rounds 5]

Each stream is what vLLM sends when the proxy asks for usage: a role event, 200 one-token
events, a finishing event, the usage event, [DONE]; one event per chunk, as servers write
them, except in "lf, cut" (chunks of 1000 bytes, cut anywhere). Line endings: LF, CRLF
(sse-starlette's), or mixed (LF, CRLF and CR in turn). ns/event is the best of --rounds,
over whole streams and over their token events alone (the end of a stream, parsed, costs
some microseconds per stream); "at once" is the share of the chunks whose events the
stripper let out as soon as they were complete (the baseline held every CRLF event to the
end of its stream).
The baseline is the class as it was, copied below.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable
from typing import Protocol

from sfq_proxy.http.sse import UsageStripper

# -- baseline: sfq_proxy/http/relay.py's _UsageStripper before SSE was parsed per the spec --
_NO_CHOICES = re.compile(rb'"choices": ?\[\]')
_FINISHING = re.compile(rb'"finish_reason": ?"')
_MARKS = re.compile(rb'"finish_reason": ?"|"choices": ?\[\]')
_USAGE = b'"usage"'
_FINGERPRINT = re.compile(rb'("system_fingerprint":\s*(?:"[^"]*"|null))')


class BaselineStripper:
    def __init__(self) -> None:
        self._partial = b""
        self._held = b""
        self._finished = False

    def feed(self, chunk: bytes) -> bytes:
        data = self._partial + chunk
        cut = data.rfind(b"\n\n") + 2
        if cut < 2:
            self._partial = data
            return b""
        if cut == len(data):
            complete, self._partial = data, b""
        else:
            complete, self._partial = data[:cut], data[cut:]
        found = (_MARKS if self._finished else _FINISHING).search(complete)
        if found is None and not self._held:
            return complete
        self._finished = True
        boundary = -1 if self._held or found is None else complete.rfind(b"\n\n", 0, found.start())
        start = boundary + 2 if boundary >= 0 else 0
        out = [complete[:start]]
        for event in complete[start:].split(b"\n\n")[:-1]:
            if _USAGE in event and _NO_CHOICES.search(event):
                self._held = _with_fingerprint_of(self._held, event)
                continue
            if self._held:
                out.append(self._held + b"\n\n")
                self._held = b""
            if _FINISHING.search(event):
                self._held = event
            else:
                out.append(event + b"\n\n")
        return b"".join(out)

    def close(self) -> bytes:
        held = self._held + b"\n\n" if self._held else b""
        return held + self._partial


def _with_fingerprint_of(finishing: bytes, usage_event: bytes) -> bytes:
    found = _FINGERPRINT.search(usage_event)
    if not finishing or found is None or b'"system_fingerprint"' in finishing:
        return finishing
    return finishing[:-1] + b"," + found.group(1) + b"}"


# -- the streams ------------------------------------------------------------------------------
TOKENS = 200


class Stripper(Protocol):
    def feed(self, chunk: bytes) -> bytes: ...
    def close(self) -> bytes: ...


def events() -> list[bytes]:
    def chunk(choices: list[dict[str, object]], **extra: object) -> bytes:
        body = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
                "model": "bench", "choices": choices, **extra}  # fmt: skip
        return b"data: " + json.dumps(body, separators=(",", ":")).encode()

    def choice(delta: dict[str, str], finish: str | None = None) -> list[dict[str, object]]:
        return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]

    usage = {"prompt_tokens": 42, "completion_tokens": TOKENS, "total_tokens": 42 + TOKENS}
    return [
        chunk(choice({"role": "assistant", "content": ""})),
        *(chunk(choice({"content": f" tok{i}"})) for i in range(TOKENS)),
        chunk(choice({}, "stop")),
        chunk([], usage=usage, system_fingerprint="fp-bench"),
        b"data: [DONE]",
    ]


def streams(evs: list[bytes]) -> dict[str, list[bytes]]:
    mixed = [e + nl + nl for e, nl in zip(evs, [b"\n", b"\r\n", b"\r"] * len(evs), strict=False)]
    lf = b"".join(e + b"\n\n" for e in evs)
    return {
        "lf": [e + b"\n\n" for e in evs],
        "crlf": [e + b"\r\n\r\n" for e in evs],
        "mixed": mixed,
        "lf, cut": [lf[i : i + 1000] for i in range(0, len(lf), 1000)],
    }


def measure(
    make: Callable[[], Stripper], chunks: list[bytes], n: int, rounds: int, events: int
) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(n):
            stripper = make()
            for chunk in chunks:
                stripper.feed(chunk)
            stripper.close()
        best = min(best, (time.perf_counter_ns() - start) / n)
    return best / events


def at_once(make: Callable[[], Stripper], chunks: list[bytes]) -> float:
    stripper = make()
    return sum(bool(stripper.feed(chunk)) for chunk in chunks) / len(chunks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=200, help="streams per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    evs = events()
    whole, tokens = streams(evs), streams(evs[: TOKENS + 1])  # tokens: no end, nothing held
    print(f"{'ns/event':<9} {'whole streams':^26} {'token events only':^26} {'at once':^16}")
    print(f"{'stream':<9}" + f" {'baseline':>9} {'now':>8} {'ratio':>7}" * 2
          + f" {'baseline':>8} {'now':>7}")  # fmt: skip
    for name, chunks in whole.items():
        row = f"{name:<9}"
        for part, n in ((chunks, len(evs)), (tokens[name], TOKENS + 1)):
            before = measure(BaselineStripper, part, args.streams, args.rounds, n)
            after = measure(UsageStripper, part, args.streams, args.rounds, n)
            row += f" {before:>9.0f} {after:>8.0f} {after / before:>7.2f}"
        row += f" {at_once(BaselineStripper, chunks):>8.0%} {at_once(UsageStripper, chunks):>7.0%}"
        print(row)


if __name__ == "__main__":
    main()
