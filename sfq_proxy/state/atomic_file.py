"""Files the proxy owns, replaced whole: a crash leaves the old file or the new one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomically(
    path: Path, text: str, mode: int | None = None, *, durable: bool = True
) -> None:
    """Replace ``path`` with ``text``: a temp file beside it (``mode``, e.g. 0o600 for one
    that holds key digests), synced, renamed over it, and the rename made durable where the
    platform can open a directory (not when ``durable`` is False: a file that a restart
    makes again, where only readers must never see half of it). A failure leaves no temp
    file behind."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if not durable:
        return
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
