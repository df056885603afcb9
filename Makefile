# One command each, on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-slow lint bench

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch (a local wheel on the reference machine); an unpinned torch is a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q torch
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/pie-ctx run examples/hello.py

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	PIE_CTX_SLOW=1 $(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check pie_ctx runtime tests benchmarks examples
