"""Smoke test of ``bench/calibration_error.py``: a short run prints both cases, with finite
figures, through the real cost model and calibration."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "calibration_error.py"
ROW = re.compile(r"^([12]) .*? (chat|lab)\s+(.*)$")


def test_a_short_run_prints_both_cases_with_finite_figures() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--limit", "300"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    assert lines[0].startswith("$ ")  # the command line on top
    assert "--limit 300" in lines[0]
    rows = {}
    for line in lines:
        match = ROW.match(line)
        if match:
            rows[match[1], match[2]] = match[3].split()
    assert set(rows) == {("1", "chat"), ("2", "chat"), ("1", "lab"), ("2", "lab")}
    for cells in rows.values():
        mape_cal, mape_none, input_cal, input_none = (float(c.rstrip("%")) for c in cells[:4])
        assert all(math.isfinite(x) and x >= 0 for x in (mape_cal, mape_none, input_cal))
        assert math.isfinite(input_none)
        assert int(cells[6]) == 300  # n requests
    # the lab's prompts are exactly 4 chars/token: their input estimate is exact
    assert float(rows["1", "lab"][2].rstrip("%")) == 0.0
    # the uncalibrated charge (output_ratio 1) overcharges; calibration must do better
    for cells in rows.values():
        assert float(cells[0].rstrip("%")) < float(cells[1].rstrip("%"))
