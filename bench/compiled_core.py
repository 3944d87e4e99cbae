"""A copy of this checkout's package with its hot modules compiled by mypyc, to measure.

    python bench/compiled_core.py DIR [--with-http]
    python bench/instructions.py --baseline DIR     # then: sfq (base) is the compiled copy
    python bench/overhead.py --baseline DIR

The profile of a request is flat: most of what the proxy adds to a bare pass-through is
Python bytecode spread over many small functions, which no single trim removes. The
sans-I/O core is fully typed (``mypy --strict``), the code mypyc turns into C extension
modules; this builds such a copy in DIR (``sfq_proxy/`` copied, the ``CORE`` modules
compiled in place, and with ``--with-http`` the shell's ``HTTP`` ones too) for the benches'
``--baseline``, so that what compiling would save is measured beside the code as it is, in
the same rounds.

It measures; it does not ship. A compiled module differs where the tests look: mypyc checks
each argument's declared type at a call, so a bad value sent to the core is a TypeError
where the core's own check would say which value is bad (a ValueError); an interpreted
class may not subclass a compiled one (``SharedCalibration``); a compiled class cannot be
patched (``servers.py serve``: the benches' ``--without``). Left out: ``keys.py``
(pydantic models), ``queues.py`` (the lab's other disciplines), and of the shell ``sse.py``
and ``answer.py`` (a class attribute read through ``cls``; an async generator) and
``upstream.py`` (compiled, it refuses aiohttp's parsed response, a C object its types call a
NamedTuple).
Requires: a C compiler, and the dev extra (mypy, which brings mypyc).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = [
    "admission", "affinity", "calibration", "cost", "errors", "fair_queue", "flows",
    "inference_request", "limits", "media", "placement", "queue_memory", "scheduler",
    "throttle", "usage",
]  # fmt: skip
HTTP = [
    "observability/access_log", "http/handler", "observability/metrics", "state/pool", "http/relay",
]  # fmt: skip
# mypy's settings for the build: the package's own plugin, without `make lint`'s strictness
MYPY_INI = "[mypy]\npython_version = 3.11\nplugins = pydantic.mypy\n"
BUILD = """
import sys
from mypyc.build import mypycify
from setuptools import setup

setup(name="sfq-proxy-compiled", ext_modules=mypycify(sys.argv[1:], opt_level="3"),
      script_args=["build_ext", "--inplace"])
"""
CHECK = """
import importlib, sys

sys.exit(any(not importlib.import_module(m).__file__.endswith(".so") for m in sys.argv[1:]))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="where the compiled copy goes (replaced)")
    parser.add_argument("--with-http", action="store_true", help="the shell's hot modules too")
    args = parser.parse_args()
    if shutil.which("cc") is None:
        sys.exit("a C compiler is missing: apt-get install gcc")
    out = args.dir.resolve()
    if out.exists() and any(out.iterdir()) and not (out / "mypy.ini").exists():
        sys.exit(f"{out} holds something else: give a new directory, or one this made")
    shutil.rmtree(out, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(ROOT / "sfq_proxy", out / "sfq_proxy", ignore=ignore)
    (out / "mypy.ini").write_text(MYPY_INI)
    modules = [f"sfq_proxy/core/{name}.py" for name in CORE]
    if args.with_http:
        modules += [f"sfq_proxy/{name}.py" for name in HTTP]
    build = subprocess.run(
        [sys.executable, "-c", BUILD, *modules], cwd=out, capture_output=True, text=True
    )
    if build.returncode:
        sys.exit(f"{build.stdout}{build.stderr}mypyc failed to build {out}")
    names = [path[:-3].replace("/", ".") for path in modules]
    if subprocess.run([sys.executable, "-c", CHECK, *names], cwd=out).returncode:
        sys.exit(f"{out}: a module imports as Python, not compiled")
    print(f"{out}: {len(modules)} modules compiled; measure with --baseline {out}")


if __name__ == "__main__":
    main()
