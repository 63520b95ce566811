PY ?= python3
PIP ?= $(PY) -m pip
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/torch_extensions

.PHONY: install install-eval train test flops bench

# torch first and pinned: the CPU build; anything else would pull CUDA wheels.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"

# lmms-eval pins torchvision (CUDA-only on PyPI): install it without dependencies, plus what it imports.
install-eval: install
	$(PIP) install -q --no-deps "lmms-eval==0.7.3"
	$(PIP) install -q -e ".[dev,eval,demo,track]"

train: install
	vlm train --out runs/default

flops: install
	vlm flops --config configs/paper_moe_90b.yaml --ratio 1.5

bench: install
	$(PY) -m eval.bench all --quick --out runs/bench

test: install-eval
	$(PY) -m pytest -n 2 tests
