"""The Debian tools some tests run, which ``make tools`` installs (with apt, as root).

Without one, its tests skip, saying so and naming ``make tools`` (pytest's summary lists
them); under CI (``CI=true``), where ``make test`` runs as root and installs them, a missing
tool fails its tests instead: nothing may be skipped there.
"""

from __future__ import annotations

import os
import shutil

import pytest

# command → the Debian package that has it
PACKAGES = {
    "docker-compose": "docker-compose",
    "promtool": "prometheus",
    "redis-server": "redis-server",
    "chromium": "chromium",
    "chromedriver": "chromium-driver",
}


def need_tool(command: str) -> str:
    """The path of ``command``; else skip the test (under CI, fail it)."""
    found = shutil.which(command)
    if found is not None:
        return found
    message = (
        f"{command} is not on PATH: `make tools` installs it as root "
        f"(apt-get install {PACKAGES[command]})"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)
