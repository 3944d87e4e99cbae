"""``sfq-proxy serve --workers N``: N processes on one port, one fairness domain through the
shared state (each process its own event loop, so every core is used).

The parent reserves the port (a socket bound with SO_REUSEPORT, never listening, so port 0
works too), forks the workers, which each listen on it with SO_REUSEPORT (the kernel
spreads new connections among them), passes SIGTERM, SIGINT and SIGHUP on, and starts a
worker again when one dies unexpectedly. Forked before any event loop or Redis connection
exists, so nothing is shared by accident. A worker whose parent dies, by SIGKILL too, is
sent SIGTERM (``PR_SET_PDEATHSIG``): it drains and ends, rather than serve the port beside
the next group. Each worker is named after its index
(``sfq-proxy w0``…), which labels its ``process_*`` metrics (``process_metrics.py``); its
``sfq_*`` counts go through the group's directory to every worker's scrapes
(``worker_metrics.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path

from ..config import Config
from ..observability import process_metrics, worker_metrics
from .server import announce, run, serve

log = logging.getLogger(__name__)
RESTART_DELAY_S = 1.0  # between a worker's unexpected death and its replacement
CANNOT_START = 2  # a worker's exit code when its start failed (Redis unreachable, say)
_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None  # memory, when there is one
METRICS_PREFIX = "sfq-proxy-metrics-"  # then the parent's pid, "-", and mkdtemp's letters
PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies


def serve_workers(config: Config, config_path: Path, workers: int) -> int:
    """Run ``workers`` serving processes until a signal stops them; returns the exit code."""
    reserved = _reserve(config.listen.host, config.listen.port)
    port = reserved.getsockname()[1]
    config = config.model_copy(update={"listen": config.listen.model_copy(update={"port": port})})
    url = f"http://{config.listen.host}:{port}"
    announce(f"sfq-proxy: {workers} workers on {url}", url=url)
    # each worker's sfq_* counts, which every worker serves (worker_metrics.py)
    base = Path(_SHM or tempfile.gettempdir())
    remove_stale(base)
    prefix = f"{METRICS_PREFIX}{os.getpid()}-"
    worker_metrics.directory = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    owner = os.open(worker_metrics.directory, os.O_RDONLY)  # inherited by the workers
    fcntl.flock(owner, fcntl.LOCK_EX)  # held while any process of the group lives
    try:
        return _supervise(config, config_path, workers, reserved)
    finally:
        shutil.rmtree(worker_metrics.directory, ignore_errors=True)
        os.close(owner)


def remove_stale(base: Path) -> None:
    """Remove the metrics directories that parents killed with SIGKILL (or crashed) left in
    ``base``: on a host that starts the proxy again after each, they would fill its memory.
    Stale is a directory whose parent is no longer running (or was this process's pid)
    and whose lock no process holds: the kernel lets go of a group's when its last
    process ends, however it ends, and a group in another pid namespace sharing
    ``/dev/shm``, whose parent's pid means nothing here, still holds its own. Anything but
    a directory is not ours and is left alone, links not followed: any local user may
    put a FIFO there, whose opening would wait for a writer (and the start with it)."""
    for path in base.glob(f"{METRICS_PREFIX}*-*"):
        pid = path.name[len(METRICS_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or (int(pid) != os.getpid() and _running(int(pid))):
            continue
        try:
            if stat.S_ISDIR(path.lstat().st_mode) and not _locked(path):
                shutil.rmtree(path)
        except FileNotFoundError:  # removed meanwhile
            continue
        except OSError as err:  # another user's, say
            log.warning("could not remove a stale metrics directory %s: %s", path, err)


def _locked(directory: Path) -> bool:
    """Whether a process holds ``directory``'s lock (a live group's). Opened so that nothing
    can make it wait, should it have been swapped for a link or a FIFO since its ``lstat``."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _supervise(config: Config, config_path: Path, workers: int, reserved: socket.socket) -> int:
    """Fork the workers, pass the signals on, start a worker again when one dies."""
    stopping: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if signum != signal.SIGHUP:
            stopping.append(signum)
        for pid in children:
            os.kill(pid, signum)

    children = {_fork(config, config_path, i): i for i in range(workers)}
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    code = 0
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        index = children.pop(pid, None)
        if index is None:
            continue
        ended = os.waitstatus_to_exitcode(status)
        if stopping:
            code = code or ended  # a worker that did not end cleanly
        elif ended == CANNOT_START:  # nor would the next one
            log.error("worker %d could not start: stopping", index)
            code = ended
            forward(signal.SIGTERM, None)
        else:
            log.error("worker %d (pid %d) ended (exit %d): starting it again", index, pid, ended)
            time.sleep(RESTART_DELAY_S)
            children[_fork(config, config_path, index)] = index
    reserved.close()
    return code


def _reserve(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _fork(config: Config, config_path: Path, index: int) -> int:
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the loop installs its own
        signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):  # not Linux: orphans live on
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # it died before that: nobody will ever stop this one
        os._exit(0)
    process_metrics.become_worker(index)  # its process_* labelled worker="<index>"
    try:
        run(lambda: serve(config, config_path, worker=True))
        code = 0
    except BaseException:
        log.exception("worker failed")
        code = 1
    sys.stdout.flush()
    os._exit(code)
