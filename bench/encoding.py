"""What a compressed upstream answer costs, against asking for ``identity``.

    python bench/encoding.py [--rounds 7] [--level 6]

The proxy asks its backends for ``Accept-Encoding: identity``: it reads usage from the
answer's bytes, and on a LAN compression saves no time worth having. This measures the
alternative per response, on the answers of ``overhead.py`` (harness.py's chat completion and
200-event SSE stream) and on a long chat completion: the backend's gzip (one call for a
body; for a stream, one sync-flushed block per event, as a gzip middleware sends them), the
proxy's decoding of it (``answer.Inflater``, fed as the answer arrives) and the
bytes on the wire, with the time they take on a 1 Gbit/s link. Asking for identity costs
none of the CPU. CPU µs per response, median of ``--rounds`` runs of about 0.2 s each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import completion, stream

from sfq_proxy.http.answer import Inflater


def long_completion(words: int = 2000) -> str:
    text = " ".join(f"word{i % 97}" for i in range(words))
    answer = json.loads(completion())
    answer["choices"][0]["message"]["content"] = text
    answer["usage"] = {"prompt_tokens": 42, "completion_tokens": words, "total_tokens": words + 42}
    return json.dumps(answer)


def events_of(body: bytes) -> list[bytes]:
    """A stream as it arrives: one chunk per event."""
    return [event + b"\n\n" for event in body.split(b"\n\n") if event]


def gzip_chunks(chunks: list[bytes], level: int) -> list[bytes]:
    """A backend's gzip: each chunk compressed and flushed at once (one for a body)."""
    compressor = zlib.compressobj(level, wbits=16 + zlib.MAX_WBITS)
    out = [compressor.compress(c) + compressor.flush(zlib.Z_SYNC_FLUSH) for c in chunks]
    out[-1] += compressor.flush()
    return out


def inflate(chunks: list[bytes]) -> bytes:
    inflater = Inflater("gzip")
    return b"".join([inflater.feed(c) for c in chunks]) + inflater.close()


def gbit_us(size: int) -> float:
    """The time ``size`` bytes take on a 1 Gbit/s link, in µs (framing aside)."""
    return size * 8 / 1e3


def per_call_us(work: Callable[[], object], rounds: int) -> float:
    """Median over ``rounds`` of the CPU time of one call, in µs."""
    calls = 1
    while True:  # calibrate: about 0.2 s a round
        start = time.process_time()
        for _ in range(calls):
            work()
        spent = time.process_time() - start
        if spent > 0.05:
            break
        calls *= 4
    calls = max(1, int(calls * 0.2 / spent))
    results = []
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(calls):
            work()
        results.append((time.process_time() - start) / calls * 1e6)
    return statistics.median(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--level", type=int, default=6, help="the backend's gzip level")
    args = parser.parse_args()
    answers = {
        "json": [completion().encode()],
        "json-long": [long_completion().encode()],
        "stream": events_of(stream().encode()),
    }
    print(
        f"{'answer':<10} {'chunks':>6} | {'identity: bytes':>15} {'1G µs':>6} {'cpu µs':>7} |"
        f" {'gzip: bytes':>11} {'1G µs':>6} {'backend µs':>10} {'proxy µs':>9} {'cpu µs':>7}"
    )
    for name, chunks in answers.items():
        plain = b"".join(chunks)
        packed = gzip_chunks(chunks, args.level)
        assert inflate(packed) == plain
        encode = per_call_us(lambda c=chunks: gzip_chunks(c, args.level), args.rounds)
        decode = per_call_us(lambda p=packed: inflate(p), args.rounds)
        wire = sum(map(len, packed))
        print(
            f"{name:<10} {len(chunks):>6} | {len(plain):>15,} {gbit_us(len(plain)):>6.0f} {0:>7} |"
            f" {wire:>11,} {gbit_us(wire):>6.0f} {encode:>10.1f} {decode:>9.1f}"
            f" {encode + decode:>7.1f}"
        )


if __name__ == "__main__":
    main()
