# One command each, on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-benchmarks test-tp test-backend test-slow test-determinism lint gpu-check test-flex test-fleet test-install

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch (a local wheel on the reference machine); an unpinned torch is a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q torch
	$(BIN)/pip install -q -e '.[dev]'
	# pie-ctx's CPU kernels, compiled for this CPU (a failed build leaves the PyTorch ops).
	$(BIN)/python -m runtime.model.kernels
	# The live-view test drives Debian's chromium; it skips where none can be installed.
	-command -v chromium >/dev/null || ! command -v apt-get >/dev/null || \
		apt-get install -y -q chromium >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1)
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/pie-ctx run examples/hello.py

# The benchmark scripts' smoke runs (~4 min) are their own target, in CI after this one.
test: $(STAMP)
	$(BIN)/python -m pytest -q --ignore=tests/benchmarks

test-benchmarks: $(STAMP)
	$(BIN)/python -m pytest -q tests/benchmarks

# The SDK suite against a tensor-parallel engine of 2 ranks (gloo; docs/scale-out.md).
test-tp: $(STAMP)
	PIE_CTX_TEST_TP=2 $(BIN)/python -m pytest -q tests/sdk

# The SDK suite over the transformers backend (transformers' own Llama; docs/models.md).
test-backend: $(STAMP)
	PIE_CTX_TEST_BACKEND=transformers $(BIN)/python -m pytest -q tests/sdk tests/decoding

# Same seed, same tokens over the whole matrix of weights and KV formats (the default
# suite runs fp32 only): 5 formats of the default model, an engine and a restart each
# (256 tokens each; the int8 configurations and gguf took 12 min beside another busy run).
test-determinism: $(STAMP)
	PIE_CTX_TEST_DETERMINISM=full $(BIN)/python -m pytest -q tests/precision/test_deterministic.py

test-slow: $(STAMP)
	PIE_CTX_SLOW=1 $(BIN)/python -m pytest -q

# A plain install: a fresh venv with pie-ctx and its declared dependencies only (no
# extras), the demo and one served chat completion (scripts/install_check.py), then the venv
# removed. Reuses pip's cache and the model and kernel cache (PIE_CTX_CACHE, else
# ~/.cache/pie-ctx) of the other targets.
INSTALL_VENV ?= $(or $(TMPDIR),/tmp)/pie-ctx-install-check
test-install:
	rm -rf $(INSTALL_VENV)
	$(PY) -m venv $(INSTALL_VENV)
	$(INSTALL_VENV)/bin/pip install -q torch==2.13.0 || $(INSTALL_VENV)/bin/pip install -q torch
	mkdir $(INSTALL_VENV)/src  # a copy: building in place would leave build/ here
	cp -r pyproject.toml README.md pie_ctx runtime $(INSTALL_VENV)/src/
	$(INSTALL_VENV)/bin/pip install -q $(INSTALL_VENV)/src
	$(INSTALL_VENV)/bin/python scripts/install_check.py; rc=$$?; rm -rf $(INSTALL_VENV); exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check pie_ctx runtime tests benchmarks examples scripts

# On a GPU machine, offline: the machine's python3 and CUDA torch, no venv. WHEELS=DIR (from
# `python scripts/gpu_wheels.py --python-version 3.12 --out DIR`) installs the other
# dependencies with --no-index into a target folder on PYTHONPATH. Runs the CUDA tests, the
# kernel report per backend, best_of_n and model benchmarks in bf16; exits 2 without a CUDA
# device, 1 when a step fails or an asked-for backend did not run. Log: gpu-check.log, ending
# with one JSON line. GPU_CHECK_ARGS=--allow-no-flash runs without flash-attn. docs/forward.md.
GPU_CHECK_ARGS ?=
gpu-check:
	$(PY) scripts/gpu_check.py $(if $(WHEELS),--wheels $(WHEELS)) $(GPU_CHECK_ARGS)

# The SDK suite with the FlexAttention backend forced (docs/forward.md).
test-flex: $(STAMP)
	PIE_CTX_ATTENTION=flex $(BIN)/python -m pytest -q tests/sdk

# The fleet (docs/scale-out.md): Ray Serve and pyzmq (the extra `ray`), then a local Ray
# instance with 2 replicas of the tiny model, the KV events' wire test, and the fleet
# benchmark's smoke (~3 min).
test-fleet: $(STAMP)
	$(BIN)/pip install -q -e '.[ray]'
	PIE_CTX_TEST_FLEET=1 $(BIN)/python -m pytest -q tests/fleet tests/kv/test_kv_events.py
	PIE_CTX_TEST_FLEET=1 $(BIN)/python -m pytest -q tests/benchmarks/test_smoke.py -k fleet
