# Every target builds its own virtual environment from pyproject.toml when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/sfq-proxy demo --traffic

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) bench/sfq_core.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
