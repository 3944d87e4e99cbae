"""Real llama.cpp servers (llama-cpp-python's OpenAI server) for the tests, from PyPI alone.

    python tests/support/llamacpp_backend.py install  # build llama-cpp-python into its venv
    python tests/support/llamacpp_backend.py model    # the tiny Llama of vllm_backend as GGUF
    python tests/support/llamacpp_backend.py serve 8011 8012  # servers until Ctrl-C

llama-cpp-python comes as an sdist only: ``install`` compiles llama.cpp with cmake (CPU only,
no tests, tools or multimodal library) into its own venv (``SFQ_LLAMACPP_VENV``, default
/tmp/sfq-llamacpp-venv), and keeps the sdist there: ``model`` converts the tiny seeded Llama
that vllm_backend builds (it needs the vLLM venv's torch and transformers) to
``SFQ_LLAMACPP_MODEL`` (default /tmp/sfq-tiny-llama.gguf) with the ``convert_hf_to_gguf.py``
the sdist vendors. Both steps are skipped when their result is there.

What the proxy has to know about this server family:

- one request at a time per server: a lock serialises them (there is no parallel-slots
  option), so a backend is worth ``slots: 1``;
- by default (``--interrupt_requests True``) a request that arrives while a stream runs ends
  that stream early, ``data: [DONE]`` without a finishing event; every route that takes the
  lock counts, ``GET /v1/models`` included;
- no ``/health``: probe a route that takes no lock (``HEALTH_PATH``);
- ``stream_options`` is ignored: streams carry no usage chunk.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import vllm_backend
from server_process import ServerProcess, serve_until_signal, step

PIN = "llama-cpp-python==0.3.36"
VENV = Path(os.environ.get("SFQ_LLAMACPP_VENV", "/tmp/sfq-llamacpp-venv"))
MODEL = Path(os.environ.get("SFQ_LLAMACPP_MODEL", "/tmp/sfq-tiny-llama.gguf"))
SERVED_NAME = "tiny"
N_CTX = 1024
HEALTH_PATH = "/openapi.json"  # FastAPI's own route: answered without the model's lock
STAMP = VENV / f".installed-{PIN}"
SDIST_DIR = VENV / "sdist"
CONVERTER = VENV / "convert"  # the sdist's vendor/llama.cpp: the converter and its gguf-py
# A small, quick CPU build (7 min on 2 cores, against 16 with llama.cpp's defaults; the tiny
# model still runs at ~750 tokens/s): no -march=native (the venv may outlive the CPU it was
# built on), -O1, no llamafile sgemm, OpenMP or AVX-512 kernels, none of llama.cpp's common
# library, tests, tools, examples or server, no multimodal (mtmd) library, no HTTPS or curl.
CMAKE_ARGS = " ".join(
    [
        "-DGGML_NATIVE=OFF",
        "-DGGML_AVX512=OFF",
        "-DGGML_LLAMAFILE=OFF",
        "-DGGML_OPENMP=OFF",
        "-DLLAVA_BUILD=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_BUILD_COMMON=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_TOOLS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=OFF",
        "-DCMAKE_C_FLAGS=-O1",
        "-DCMAKE_CXX_FLAGS=-O1",
    ]
)
SERVER_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
INSTALL_STEPS = 5
_PROGRESS = re.compile(r"\[\s*(?:(\d+)%|(\d+)/(\d+))\]")  # make's, or ninja's
_STEP = re.compile(
    r"\*\*\* |-- (?:Configuring done|Generating done|Build files have been)|Successfully installed"
)
_MAKES = re.compile(r" -o (\S+)")  # what a compiler's or linker's command makes
LINE_CHARS = 160
FAILED_TAIL = 60  # lines of a failed build's output shown: its error is among the last
# convert_hf_to_gguf.py names the BPE pre-tokenizer by hashing what the tokenizer makes of a
# test text, which only known models match; the tiny model's tokenizer is byte-level BPE
# with GPT-2's split, so say so instead.
_CONVERT = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/gguf-py"]
import convert_hf_to_gguf
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def ensure_installed() -> Path:
    """The venv's python, building llama-cpp-python first when the venv is not complete: a
    line per step, and the build's own steps and progress (``build_lines``)."""
    python = VENV / "bin" / "python"
    if STAMP.exists():
        return python
    _step(1, f"creating the virtual environment {VENV}")
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(python), "-m", "pip"]
    _step(2, "pip install --upgrade pip")
    subprocess.run([*pip, "install", "--quiet", "--upgrade", "pip"], check=True)
    _step(3, f"pip download {PIN} (its sdist: the source of llama.cpp too)")
    subprocess.run(
        [*pip, "download", "--quiet", "--no-deps", "--no-binary", ":all:", "-d", str(SDIST_DIR),
         PIN],
        check=True,
    )  # fmt: skip
    (sdist,) = SDIST_DIR.glob("*.tar.gz")
    env = {
        **os.environ,
        "CMAKE_ARGS": CMAKE_ARGS,
        "CMAKE_BUILD_PARALLEL_LEVEL": os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2"),
    }
    _step(4, "pip install it, compiling llama.cpp with cmake (~7 min on 2 cores)")
    # --no-cache-dir: pip's wheel cache would not know that CMAKE_ARGS changed
    requirement = f"llama-cpp-python[server] @ {sdist.as_uri()}"
    _build([*pip, "install", "-v", "--no-cache-dir", requirement], env)
    _step(5, f"extracting its model converter into {CONVERTER}")
    _extract_converter(sdist)
    STAMP.touch()
    print(f"[llama.cpp install] done: {python}", flush=True)
    return python


def _step(n: int, what: str) -> None:
    step("llama.cpp install", n, INSTALL_STEPS, what)


def _build(command: list[str], env: dict[str, str]) -> None:
    """Run pip's verbose build, printing what ``build_lines`` keeps of it; if it fails, the
    last ``FAILED_TAIL`` lines of everything it said, then raise."""
    tail: deque[str] = deque(maxlen=FAILED_TAIL)
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in build_lines(_kept(proc.stdout, tail)):
            print(line, flush=True)
    if proc.returncode:
        print("".join(tail), end="", flush=True)
        raise subprocess.CalledProcessError(proc.returncode, command)


def _kept(lines: Iterable[str], tail: deque[str]) -> Iterator[str]:
    for line in lines:
        tail.append(line)
        yield line


def build_lines(lines: Iterable[str]) -> Iterator[str]:
    """What of a verbose pip build of a cmake project is worth a line in a log: the build
    backend's steps (scikit-build-core's ``*** `` lines), cmake's ``-- … done`` ones, pip's
    last word, and the build's progress once per percent it moves, make's ``[ 42%]
    Building C object …`` or ninja's ``[58/139]`` with the file its command makes (the
    command itself, compiler flags and all, is noise): ~110 lines for the whole build,
    each cut to ``LINE_CHARS``."""
    shown = -1
    for line in lines:
        line = line.strip()
        if found := _PROGRESS.match(line):
            done = int(found[1]) if found[1] else 100 * int(found[2]) // int(found[3])
            if done <= shown:
                continue
            shown = done
            if made := _MAKES.search(line):
                line = f"{found[0]} {Path(made[1]).name}"
        elif not _STEP.match(line):
            continue
        yield f"  {line[:LINE_CHARS]}"


def _extract_converter(sdist: Path) -> None:
    with tarfile.open(sdist) as tar:
        root = tar.getnames()[0].split("/")[0]
        prefix = f"{root}/vendor/llama.cpp/"
        wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
        members = []
        for member in tar.getmembers():
            rest = member.name.removeprefix(prefix)
            if rest != member.name and rest.startswith(wanted) and member.isfile():
                member.name = rest
                members.append(member)
        tar.extractall(CONVERTER, members=members, filter="data")


def ensure_model() -> Path:
    """The tiny GGUF, converted from vllm_backend's tiny Llama (built first when missing)."""
    if not MODEL.exists():
        ensure_installed()
        hf_model = vllm_backend.ensure_model()
        print(f"[llama.cpp model] converting {hf_model} to {MODEL}", flush=True)
        partial = MODEL.with_suffix(".partial")
        subprocess.run(
            [str(vllm_backend.ensure_installed()), "-c", _CONVERT, str(CONVERTER), str(hf_model),
             "--outfile", str(partial), "--outtype", "f32"],
            check=True,
            env={**os.environ, **vllm_backend.SERVER_ENV},
        )  # fmt: skip
        partial.rename(MODEL)
    return MODEL


def is_ready() -> bool:
    """Installed and the model made: what the tests need to run without building."""
    return STAMP.exists() and MODEL.exists()


@dataclass
class LlamaCppServer(ServerProcess):
    """One llama-cpp-python server, one thread, the model's context of ``N_CTX``."""

    interrupt_requests: bool = True  # the server's default
    family = "llamacpp"
    health_path = HEALTH_PATH
    env: dict[str, str] = field(default_factory=lambda: dict(SERVER_ENV))

    def command(self) -> list[str]:
        return [
            str(ensure_installed()), "-m", "llama_cpp.server",
            "--model", str(ensure_model()), "--model_alias", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--n_ctx", str(N_CTX), "--n_threads", "1", "--n_threads_batch", "1",
            "--interrupt_requests", str(self.interrupt_requests),
        ]  # fmt: skip


def main(argv: list[str]) -> None:
    command, *ports = argv or ["help"]
    if command == "install":
        print(ensure_installed())
    elif command == "model":
        print(ensure_model())
    elif command == "serve":
        ports_ = [int(p) for p in ports or [8011, 8012]]
        serve_until_signal(lambda port: LlamaCppServer(port=port), ports_)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
