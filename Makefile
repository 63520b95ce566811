PY ?= python3
PIP ?= $(PY) -m pip
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/torch_extensions

.PHONY: install train test flops

# torch first and pinned: the CPU build; anything else would pull CUDA wheels.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"

train: install
	vlm train --out runs/default

flops: install
	vlm flops --config configs/default.yaml

test: install
	$(PY) -m pytest -n 2 tests
