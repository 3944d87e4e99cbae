"""Large request bodies parsed in a worker process, off the event loop (docs/design.md §6,
Parsing off the loop).

Reading a JSON body costs CPU in proportion to its structure: about 1 ms a MiB of prose,
up to 350 ms a MiB of arrays nested in arrays. msgspec's decoder holds the GIL while it
reads, and the checks after it are Python, so a thread would stall the loop just the same.
A body larger than ``limits.parse_in_loop_bytes`` is therefore parsed, by the same
``core.inference_request`` functions, in a process of its own, which answers with the
parsed request or with its refusal; the loop meanwhile serves everyone else.

- **One process** per serving process (this module's ``main``), started
  when the first such body comes, at a lower CPU priority than the loop (``nice`` +10): the
  loop serves every request, the worker only the large bodies. It ignores the signals that
  stop or reload the proxy and ends when the proxy does (its stdin closes). One that dies
  (out of memory, say) fails the body it held with a 500 and is started again for the next.
  It is spoken to over its stdin and stdout, a body at a time, by one thread of the proxy
  that only waits on the pipes: the body is written as it came, never copied into a pickle.
- **Its line is fair**: bodies wait for it in a line per org, the orgs taking turns, one
  body at a time in the worker. An org sending a stream of hostile bodies waits behind its
  own, and another org's body waits for at most one of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import traceback
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO
from weakref import WeakKeyDictionary

from ..config import AffinitySpec, Config, ExtraCostSpec
from ..core.errors import ApiError
from ..core.inference_request import CapValues, InferenceRequest, Kind, parse, parse_extra

NICE = 10  # the worker's CPU priority below the loop's
_ASK = struct.Struct("!QQ")  # the sizes of what follows: the job's pickle, then the body
_ANSWER = struct.Struct("!Q")  # the size of the outcome's pickle that follows


@dataclass(frozen=True, slots=True)
class Models:
    """What parsing needs of the config, by model, in a form a process can be sent: the
    models whose servers report no usage in a stream, those whose pool asks for it on every
    chunk (``cost.continuous_usage``), those whose engine's priority is the proxy's
    (``Config.owns_priority``), the affinity settings of those whose pool has them, and the
    cost rule of the extra path asked for (if one was)."""

    silent: frozenset[str]
    affinity: Mapping[str, AffinitySpec]
    extra: Mapping[str, ExtraCostSpec]
    continuous: frozenset[str] = frozenset()
    prioritised: frozenset[str] = frozenset()

    @staticmethod
    def of(config: Config, path: str | None = None) -> Models:
        silent: set[str] = set()
        continuous: set[str] = set()
        affinity: dict[str, AffinitySpec] = {}
        extra: dict[str, ExtraCostSpec] = {}
        prioritised: set[str] = set()
        for pool in config.pools.values():
            rule = pool.extra_path(path) if path is not None else None
            for model in pool.models:
                if not pool.stream_usage:
                    silent.add(model)
                if pool.cost.continuous_usage:
                    continuous.add(model)
                if config.owns_priority(model):
                    prioritised.add(model)
                if pool.affinity is not None:
                    affinity[model] = pool.affinity
                if rule is not None:
                    extra[model] = rule.cost
        return Models(
            frozenset(silent), affinity, extra, frozenset(continuous), frozenset(prioritised)
        )

    def reports_stream_usage(self, model: str) -> bool:
        return model not in self.silent

    def continuous_usage(self, model: str) -> bool:
        return model in self.continuous

    def owns_priority(self, model: str) -> bool:
        return model in self.prioritised

    def affinity_of(self, model: str) -> AffinitySpec | None:
        return self.affinity.get(model)

    def rule_of(self, model: str) -> ExtraCostSpec | None:
        return self.extra.get(model)


@dataclass(frozen=True, slots=True)
class Job:
    """What the worker is told besides the body."""

    kind: Kind
    path: str
    models: Models
    caps: CapValues


@dataclass(frozen=True, slots=True)
class Refusal:
    """A body's 400 (or 404) as the worker sends it: an ApiError cannot cross as itself
    (unpickled, it would be made again from its message alone)."""

    status: int
    message: str
    code: str


@dataclass(frozen=True, slots=True)
class Failure:
    """A bug of the parser, as the worker sends it: the proxy answers 500 and logs it."""

    traceback: str


# what the worker answers: the request (its ``raw`` left out when it is the body as sent,
# which the proxy holds) and whether it was; or its refusal, or a failure
Outcome = tuple[InferenceRequest, bool] | Refusal | Failure


def parse_here(job: Job, raw: bytes) -> Outcome:
    """What the worker does with a body: parse it as the loop would."""
    try:
        models = job.models
        if job.kind is Kind.EXTRA:
            request = parse_extra(raw, job.path, models.rule_of, models.owns_priority)
        else:
            request = parse(
                job.kind,
                raw,
                models.reports_stream_usage,
                models.affinity_of,
                job.caps,
                models.continuous_usage,
                models.owns_priority,
            )
    except ApiError as err:
        return Refusal(err.status, err.message, err.code)
    except Exception:  # a bug: the proxy says so, and the worker goes on
        return Failure(traceback.format_exc())
    same = request.raw is raw
    if same:
        request.raw = b""
    return request, same


class WorkerDied(Exception):
    """The worker process ended while it held a body (its stderr says why)."""


class _Process:
    """The worker process, spoken to from one thread at a time (``_EXCHANGE``'s)."""

    def __init__(self) -> None:
        self._popen: subprocess.Popen[bytes] | None = None

    def exchange(self, job: bytes, raw: bytes) -> Outcome:
        """Send ``job`` and ``raw``, wait for the outcome (in the exchange thread)."""
        popen = self._popen
        if popen is None or popen.poll() is not None:
            popen = self._popen = _start()
        assert popen.stdin is not None
        assert popen.stdout is not None
        try:
            popen.stdin.write(_ASK.pack(len(job), len(raw)))
            popen.stdin.write(job)
            popen.stdin.write(raw)
            popen.stdin.flush()
            head = popen.stdout.read(_ANSWER.size)
            size = _ANSWER.unpack(head)[0] if len(head) == _ANSWER.size else -1
            data = popen.stdout.read(size) if size >= 0 else b""
        except OSError as err:  # a broken pipe: it died
            self._stop()
            raise WorkerDied(f"the parse worker died: {err}") from None
        if size < 0 or len(data) < size:
            self._stop()
            raise WorkerDied("the parse worker died")
        outcome: Outcome = pickle.loads(data)
        return outcome

    def _stop(self) -> None:
        popen, self._popen = self._popen, None
        if popen is not None:
            popen.kill()
            popen.wait()


def _start() -> subprocess.Popen[bytes]:
    """The worker, on this interpreter and this copy of the package (first on its path,
    whatever the working directory and ``PYTHONPATH`` say)."""
    root = str(Path(__file__).resolve().parents[2])
    code = f"import sys; sys.path.insert(0, {root!r}); import {__name__} as w; w.main()"
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )


class _Line:
    """The bodies of one event loop waiting for the worker: one at a time in it, the orgs
    with bodies waiting taking turns (round robin, the org just served last), each org's
    in the order they came."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}  # in turn order
        self._busy = False
        self._serving: str | None = None  # whose body the worker has, while busy

    async def turn(self, org: str) -> None:
        """Wait for ``org``'s turn; the caller then holds the worker until ``done``."""
        if not self._busy and not self._waiting:
            self._busy, self._serving = True, org
            return
        waiter = self._loop.create_future()
        self._waiting.setdefault(org, deque()).append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # it had its turn: pass it on
                self.done()
            else:
                queue = self._waiting.get(org)
                if queue is not None and waiter in queue:
                    queue.remove(waiter)
                    if not queue:
                        del self._waiting[org]
            raise

    def done(self) -> None:
        """The worker is free: the next org in turn gets it, never the one it just served
        while another waits (it goes to the end of the round)."""
        waiting = self._waiting
        while waiting:
            org = next(iter(waiting))
            if org == self._serving and len(waiting) > 1:
                waiting[org] = waiting.pop(org)
                org = next(iter(waiting))
            queue = waiting.pop(org)
            waiter = queue.popleft()
            if queue:
                waiting[org] = queue
            if not waiter.done():  # else cancelled as its turn came
                waiter.set_result(None)
                self._serving = org
                return
        self._busy, self._serving = False, None

    def done_from(self, _future: Future[Outcome]) -> None:
        """``done``, from the exchange thread once the worker has answered."""
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits in it any more
            self._loop.call_soon_threadsafe(self.done)


class Worker:
    """The worker process, the thread that speaks to it, and the lines of bodies waiting."""

    def __init__(self) -> None:
        self._process = _Process()
        self._thread: ThreadPoolExecutor | None = None
        self._lines: WeakKeyDictionary[asyncio.AbstractEventLoop, _Line] = WeakKeyDictionary()
        self._models: tuple[Config, Models] | None = None  # of the config last seen
        self._lock = threading.Lock()

    async def parse(
        self, config: Config, org: str, kind: Kind, raw: bytes, path: str
    ) -> InferenceRequest:
        """``raw`` parsed in the worker once ``org``'s turn comes; its refusal raised here."""
        loop = asyncio.get_running_loop()
        line = self._lines.get(loop)
        if line is None:
            line = self._lines[loop] = _Line(loop)
        await line.turn(org)
        try:
            limits = config.limits
            caps = CapValues(limits.max_messages, limits.max_content_parts, limits.max_tools)
            models = Models.of(config, path) if kind is Kind.EXTRA else self._models_of(config)
            job = pickle.dumps(Job(kind, path, models, caps), pickle.HIGHEST_PROTOCOL)
            future = self._exchanges().submit(self._process.exchange, job, raw)
        except BaseException:
            line.done()
            raise
        future.add_done_callback(line.done_from)  # the turn passes once the worker answered
        outcome = await asyncio.wrap_future(future)
        if isinstance(outcome, Refusal):
            raise ApiError(outcome.status, outcome.message, code=outcome.code)
        if isinstance(outcome, Failure):
            raise RuntimeError(f"the parse worker failed:\n{outcome.traceback}")
        request, same = outcome
        if same:
            request.raw = raw
        return request

    def _models_of(self, config: Config) -> Models:
        if self._models is None or self._models[0] is not config:  # a reload's new config
            self._models = (config, Models.of(config))
        return self._models[1]

    def _exchanges(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="sfq-parse")
            return self._thread


WORKER = Worker()


def _serve(ask: IO[bytes], answer: IO[bytes]) -> None:
    """The worker's loop: a job and its body in, the outcome out, until the proxy is gone."""
    while True:
        head = ask.read(_ASK.size)
        if len(head) < _ASK.size:
            return
        job_size, raw_size = _ASK.unpack(head)
        job: Job = pickle.loads(ask.read(job_size))
        raw = ask.read(raw_size)
        if len(raw) < raw_size:
            return
        data = pickle.dumps(parse_here(job, raw), pickle.HIGHEST_PROTOCOL)
        del raw
        answer.write(_ANSWER.pack(len(data)))
        answer.write(data)
        answer.flush()


def main() -> None:
    """The worker process: below the proxy's priority, deaf to its signals (the drain's
    SIGTERM, a reload's SIGHUP, a terminal's SIGINT are the proxy's to act on), and its
    stdout kept for the answers (anything printed goes to stderr)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    os.nice(NICE)
    ask = os.fdopen(os.dup(0), "rb")
    answer = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _serve(ask, answer)
