"""A wall clock the tests set: key expiry, usage periods and budgets read Unix time."""

from __future__ import annotations

DEC_1 = 1_764_547_200  # 2025-12-01T00:00:00Z
LATE = DEC_1 + 23 * 3600 + 30  # 2025-12-01T23:00:30Z: 3570 s before midnight


class Wall:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
