"""Every random generator a run draws from, as a checkpoint keeps it (tensors and plain containers:
loadable with torch.load(weights_only=True))."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def _numpy_rng_state() -> dict[str, Any]:
    """numpy's global RNG state with its key array as a tensor."""
    st = np.random.get_state(legacy=False)
    return {
        **st,
        "state": {
            "key": torch.from_numpy(st["state"]["key"].astype(np.int64)),
            "pos": st["state"]["pos"],
        },
    }


def _set_numpy_rng_state(st: dict[str, Any]) -> None:
    key = st["state"]["key"].numpy().astype(np.uint32)
    np.random.set_state({**st, "state": {"key": key, "pos": st["state"]["pos"]}})


def rng_state() -> dict[str, Any]:
    """Every generator a run draws from. CUDA's only where this process has initialised CUDA (a run
    on the GPU has, before its first step): a CPU run on a machine with a GPU drew nothing from
    them, and `is_available()` says that a GPU exists, not that the run uses it."""
    state = {
        "python": random.getstate(),
        "numpy": _numpy_rng_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    _set_numpy_rng_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    # a GPU run (its model is on the GPU by now), as above
    if "cuda" in state and torch.cuda.is_initialized():
        torch.cuda.set_rng_state_all(state["cuda"])
