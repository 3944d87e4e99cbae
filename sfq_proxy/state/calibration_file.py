"""Calibration kept across restarts: an atomically replaced JSON file.

The learning itself is sans-I/O (``sfq_proxy.core.calibration``); this is its file, and the
decoding of its JSON, which the copy shared in Redis uses too (``shared_calibration``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, TypedDict

from ..config import CalibrationSpec
from ..core.calibration import Calibration
from .atomic_file import write_atomically

__all__ = ["Settings", "decode", "load", "loaded", "save", "settings"]

log = logging.getLogger(__name__)


class Settings(TypedDict):
    half_life_requests: int
    min_org_samples: int
    min_pool_samples: int


def settings(spec: CalibrationSpec) -> Settings:
    """Of every calibration the proxy makes: the one it loads, and with Redis the shared one,
    its base and its deltas (whose merges need one decay)."""
    return {
        "half_life_requests": spec.half_life_requests,
        "min_org_samples": spec.min_org_samples,
        "min_pool_samples": spec.min_org_samples,
    }


def loaded(spec: CalibrationSpec) -> Calibration:
    """What was learned before, if a state file holds it; else start from the defaults."""
    if spec.state_file:
        return load(Path(spec.state_file), **settings(spec))
    return Calibration(**settings(spec))


def save(calibration: Calibration, path: Path) -> None:
    """Replace ``path`` atomically: a crash leaves either the old state or the new one."""
    path = Path(path)
    text = json.dumps(calibration.to_json(), allow_nan=False, indent=1, sort_keys=True)
    write_atomically(path, text)


def load(path: Path, **settings: Any) -> Calibration:
    """The saved state, or a fresh one when there is none worth having.

    Losing what was learned only makes estimates fall back to the configured defaults for
    a while, so a missing or damaged file must not stop the proxy from starting: it is
    logged and ignored. Invalid ``settings`` do raise, since they are a config error.
    """
    path = Path(path)
    fresh = Calibration(**settings)  # validates the settings before any file error is excused
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        log.warning("calibration state %s not found; starting from the configured defaults", path)
        return fresh
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("cannot read calibration state %s (%s); starting afresh", path, exc)
        return fresh
    try:
        return decode(text, **settings)
    except ValueError as exc:
        log.warning("corrupt calibration state %s (%s); starting afresh", path, exc)
        return fresh


def decode(text: str | bytes, **settings: Any) -> Calibration:
    """The calibration a JSON text holds; a ValueError says what is wrong with it (as JSON,
    JSONDecodeError is one; nested too deep for the parser, it is made one)."""
    try:
        return Calibration.from_json(json.loads(text), **settings)
    except RecursionError as exc:
        raise ValueError(f"nested too deeply ({exc})") from exc
