"""What `make llamacpp` prints while llama.cpp compiles (tests/support/llamacpp_backend.py): the
build's steps and its progress once per percent, bounded and readable in a CI log, and
everything's last lines when the build fails. No build here: its output is made up as pip
-v and scikit-build-core's verbose ninja write it (commands, flags and all)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from llamacpp_backend import FAILED_TAIL, LINE_CHARS, _build, build_lines

FLAGS = " ".join(f"-DGGML_FLAG_{i}" for i in range(40))  # a compiler's line: ~900 chars


def ninja_build(steps: int) -> list[str]:
    """A verbose pip build's output, as ninja (-v) writes it under scikit-build-core."""
    lines = [
        "Using pip 25.3 from /tmp/venv/lib/python3.11/site-packages/pip (python 3.11)\n",
        "Collecting numpy>=1.20.0 (from llama-cpp-python==0.3.36)\n",
        "  *** scikit-build-core 0.11.6 using CMake 3.25.1 (wheel)\n",
        "  *** Configuring CMake...\n",
        "  -- The C compiler identification is GNU 12.2.0\n",
        "  -- Configuring done\n",
        "  -- Generating done\n",
        "  -- Build files have been written to: /tmp/tmpkmrax_of/build\n",
        "  *** Building project with Ninja...\n",
    ]
    for n in range(1, steps + 1):
        made = f"vendor/llama.cpp/src/CMakeFiles/llama.dir/part-{n}.cpp.o"
        lines.append(
            f"  [{n}/{steps}] /usr/bin/g++ {FLAGS} -MF {made}.d -o {made} -c /tmp/p{n}.cpp\n"
        )
        if n % 10 == 0:
            lines.append("  /tmp/p.cpp:12:5: warning: unused variable 'x' [-Wunused-variable]\n")
    return [
        *lines,
        "  *** Installing project into wheel...\n",
        "  *** Making wheel...\n",
        "Successfully installed llama-cpp-python-0.3.36 numpy-2.3.5 uvicorn-0.38.0\n",
    ]


def test_a_ninja_build_shows_its_steps_and_a_line_per_percent_with_the_file_it_made() -> None:
    shown = list(build_lines(ninja_build(139)))
    progress = [line for line in shown if line.startswith("  [")]
    assert [line for line in shown if line not in progress] == [
        "  *** scikit-build-core 0.11.6 using CMake 3.25.1 (wheel)",
        "  *** Configuring CMake...",
        "  -- Configuring done",
        "  -- Generating done",
        "  -- Build files have been written to: /tmp/tmpkmrax_of/build",
        "  *** Building project with Ninja...",
        "  *** Installing project into wheel...",
        "  *** Making wheel...",
        "  Successfully installed llama-cpp-python-0.3.36 numpy-2.3.5 uvicorn-0.38.0",
    ]
    assert progress[0] == "  [1/139] part-1.cpp.o"
    assert progress[-1] == "  [139/139] part-139.cpp.o"
    percents = [100 * int(n) // 139 for n in re.findall(r"\[(\d+)/139\]", "".join(progress))]
    assert percents == sorted(set(percents))  # once per percent, in order
    assert len(progress) == 101  # 0 % to 100 %: 101 lines of the 139 steps


def test_a_make_build_shows_a_line_per_percent_and_a_long_line_is_cut() -> None:
    made = "vendor/llama.cpp/ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o"
    lines = [f"[{p:3d}%] Building C object {made}\n" for p in (0, 0, 1, 1, 1, 2, 50, 50, 100)]
    lines.append(f"-- Build files have been written to: /tmp/{'x' * 500}\n")
    shown = list(build_lines(lines))
    assert shown[:-1] == [f"  [{p:3d}%] Building C object {made}" for p in (0, 1, 2, 50, 100)]
    assert len(shown[-1]) == 2 + LINE_CHARS


def test_a_failed_build_prints_the_last_lines_of_all_it_said_and_raises(
    capsys: pytest.CaptureFixture[str],
) -> None:
    failing = "for i in range(200): print(f'line {i}')\nraise SystemExit(3)"
    with pytest.raises(subprocess.CalledProcessError) as failed:
        _build([sys.executable, "-c", failing], {})
    assert failed.value.returncode == 3
    assert capsys.readouterr().out.splitlines() == [
        f"line {i}" for i in range(200 - FAILED_TAIL, 200)
    ]
