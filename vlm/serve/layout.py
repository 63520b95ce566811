"""The concept state's layout per request (state.py declares it to vLLM): shapes, dtypes and bytes,
without vLLM, so that the benchmark can size it anywhere."""

from __future__ import annotations

import math

import torch

from vlm.model.chunking import concept_capacity as model_capacity
from vlm.model.config import ModelConfig

# rows of the fp32 chunk-state tensor: router key, pending merge, EMA, EMA over the concept model's
# inputs (residual "delta"), counters (pending tokens, concepts)
KEY, PENDING, EMA, EMA_IN, COUNTS = range(5)
CHUNK_ROWS = 5


def concept_capacity(mc: ModelConfig, max_model_len: int, override: int | None) -> int:
    """Concept entries per pass and request: `override`, else the capacity the model's config gives
    evaluation (`chunk.eval_capacity_slack`: ceil(T x slack / R); unset, as by default, one per
    token: the exact bound, which no request can overflow)."""
    if override:
        return int(override)
    return model_capacity(max_model_len, mc.chunk.eval_capacity_slack, mc.chunk.smallest_target)


def state_layers(mc: ModelConfig) -> int:
    """vLLM state layers: one per pass of the concept schedule (at least one, for the chunk state).
    Per pass rather than one for all: vLLM gives every layer's page one size and groups layers of
    one kind, so pages the size of one pass's concepts keep the token cache's blocks small and the
    state layers grouped like the token layers."""
    return max(1, len(mc.concept_schedule))


def state_shapes(mc: ModelConfig, capacity: int) -> tuple[tuple[int, ...], ...]:
    """One state layer's: a pass's keys and values, then the chunk state (read from the first
    layer's; the others' keep the layers alike)."""
    kv = (mc.c_kv_heads, capacity, mc.head_dim)
    return kv, kv, (CHUNK_ROWS, mc.hidden_size)


def state_dtypes(mc: ModelConfig, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    # the counters live in the fp32 tensor: exact up to 2^24 concepts
    return dtype, dtype, torch.float32


def state_bytes(mc: ModelConfig, capacity: int, dtype: torch.dtype) -> int:
    """A request's state, all layers."""
    one = sum(
        math.prod(s) * torch.empty((), dtype=d).element_size()
        for s, d in zip(state_shapes(mc, capacity), state_dtypes(mc, dtype))
    )
    return state_layers(mc) * one
