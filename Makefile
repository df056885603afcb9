# One command each, on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-tp test-backend test-slow lint gpu-check

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

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The SDK suite against a tensor-parallel engine of 2 ranks (gloo; docs/scale-out.md).
test-tp: $(STAMP)
	PIE_CTX_TEST_TP=2 $(BIN)/python -m pytest -q tests/sdk

# The SDK suite over the transformers backend (transformers' own Llama; docs/models.md).
test-backend: $(STAMP)
	PIE_CTX_TEST_BACKEND=transformers $(BIN)/python -m pytest -q tests/sdk tests/decoding

test-slow: $(STAMP)
	PIE_CTX_SLOW=1 $(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check pie_ctx runtime tests benchmarks examples scripts

# On a machine with an NVIDIA GPU (sm80+ for flash-attn): build the `cuda` extra against the
# installed torch, run every CUDA-marked test, print which attention kernel each path uses,
# then the model and best-of-n benchmarks on the GPU. See docs/forward.md.
gpu-check: $(STAMP)
	@$(BIN)/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
		'gpu-check: torch sees no CUDA device (a CPU build of torch? pip install torch==2.13.0 from PyPI is a CUDA build)')"
	$(BIN)/pip install -q packaging ninja
	$(BIN)/pip install -e '.[cuda]' --no-build-isolation
	$(BIN)/python -m pytest -q -rs -m cuda tests
	$(BIN)/python scripts/attention_kernels.py --device cuda --dtype bfloat16 --page-size 16
	$(BIN)/python scripts/attention_kernels.py --device cuda --dtype bfloat16 --page-size 256
	$(BIN)/python benchmarks/model.py --device cuda --dtype bfloat16
	$(BIN)/python benchmarks/best_of_n.py --device cuda --dtype bfloat16 --page-size 16
	$(BIN)/python benchmarks/best_of_n.py --device cuda --dtype bfloat16 --page-size 256
