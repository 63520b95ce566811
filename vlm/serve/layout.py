"""The concept state's layout per request (state.py declares it to vLLM): shapes, dtypes and bytes,
without vLLM, so that the benchmark and the tests can size it anywhere.

Legend: B rows, M concept slots, J key/value heads, d head width.

vLLM's hybrid KV cache manager gives every layer's page one size, the token cache's block page (a
block of tokens' keys and values in one token layer), and a state layer takes one page per request
whatever it holds: a state larger than a page makes vLLM raise the token block size until one page
holds it, and pads it to that page (the padding, and the coarser token blocks, cost what the concept
cache saves). So the state is cut to the page (`plan_state`): each concept pass's keys and values
are split along the concept axis over as many state layers as it takes, each one page, its entries
as many as fit beside the chunk state; the capacity is rounded up to those whole pages (the padding
would have been paid anyway), and the layer count chosen so that vLLM's grouping of layers adds no
padding layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vlm.model.chunking import concept_capacity as model_capacity
from vlm.model.config import ModelConfig

# rows of the fp32 chunk-state tensor: router key, pending merge, EMA, EMA over the concept model's
# inputs (residual "delta"), counters (pending tokens, concepts)
KEY, PENDING, EMA, EMA_IN, COUNTS = range(5)
CHUNK_ROWS = 5
# vLLM's CPU attention backend (cpu_attn.py): the head sizes its kernels are built for
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# the fewest concept entries worth a state layer: a page that holds fewer is widened (see plan_state)
MIN_ENTRIES = 16


def padded_head_size(head_dim: int) -> int:
    """The head size the paged token layers use: the smallest the CPU kernels take that holds it
    (a smaller head is zero-padded: token_attention.py)."""
    return next(s for s in CPU_HEAD_SIZES if s >= head_dim)


def concept_capacity(mc: ModelConfig, max_model_len: int, override: int | None) -> int:
    """Concept entries per pass and request asked for: `override`, else the capacity the model's
    config gives evaluation (`chunk.eval_capacity_slack`: ceil(T x slack / R); unset, as by default,
    one per token: the exact bound, which no request can overflow). `plan_state` rounds it up to
    whole pages."""
    if override:
        return int(override)
    return model_capacity(max_model_len, mc.chunk.eval_capacity_slack, mc.chunk.smallest_target)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def token_page_bytes(mc: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """One token block's keys and values in one token layer of vLLM's paged cache: its page."""
    return 2 * block_size * mc.num_kv_heads * padded_head_size(mc.head_dim) * _size(dtype)


@dataclass(frozen=True)
class StatePlan:
    """How a request's concept state lies in vLLM's state layers: layer i holds entries
    [j x entries, (j + 1) x entries) of concept pass n = i // per_pass (j = i % per_pass), and every
    layer a chunk state (the first layer's is the one used)."""

    passes: int  # concept passes (the concept schedule's length), at least 1
    per_pass: int  # state layers per pass
    entries: int  # concept entries per state layer

    @property
    def layers(self) -> int:
        return self.passes * self.per_pass

    @property
    def capacity(self) -> int:
        """Concept entries per pass and request."""
        return self.per_pass * self.entries


def _groups_unpadded(token_layers: int, state_layers: int) -> bool:
    """Whether vLLM's grouping of layers (`_get_kv_cache_groups_uniform_page_size`: groups of the
    smaller kind's count, or the larger's when within 1.5x) divides both kinds evenly, adding no
    padding layers."""
    if not token_layers:
        return True
    g = min(token_layers, state_layers)
    if max(token_layers, state_layers) < 1.5 * g:
        g = max(token_layers, state_layers)
    return token_layers % g == 0 and state_layers % g == 0


def plan_state(
    mc: ModelConfig,
    capacity: int,
    dtype: torch.dtype,
    page_bytes: int | None = None,
    token_layers: int = 0,
) -> StatePlan:
    """The state of `capacity` concepts per pass cut to pages of `page_bytes` (None: one layer per
    pass holding them all, the size vLLM then aligns its pages to). A page too small for the chunk
    state and MIN_ENTRIES entries is widened to the smallest multiple that holds them (vLLM raises
    its block size to that multiple; at the raised size the same plan results). `token_layers`: the
    paged token layers beside the state layers, for vLLM's grouping."""
    passes = max(1, len(mc.concept_schedule))
    if page_bytes is None:
        return StatePlan(passes, 1, capacity)
    entry = 2 * mc.c_kv_heads * mc.head_dim * _size(dtype)
    chunk = CHUNK_ROWS * mc.hidden_size * 4
    page = page_bytes * math.ceil((chunk + MIN_ENTRIES * entry) / page_bytes)
    entries = (page - chunk) // entry
    per_pass = math.ceil(capacity / entries)
    for k in range(per_pass, per_pass + max(1, token_layers) + 1):
        if _groups_unpadded(token_layers, passes * k):
            per_pass = k
            break
    return StatePlan(passes, per_pass, entries)


def state_shapes(mc: ModelConfig, plan: StatePlan) -> tuple[tuple[int, ...], ...]:
    """One state layer's: its keys and values, then the chunk state."""
    kv = (mc.c_kv_heads, plan.entries, mc.head_dim)
    return kv, kv, (CHUNK_ROWS, mc.hidden_size)


def state_dtypes(mc: ModelConfig, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    # the counters live in the fp32 tensor: exact up to 2^24 concepts
    return dtype, dtype, torch.float32


def state_bytes(mc: ModelConfig, plan: StatePlan, dtype: torch.dtype) -> int:
    """A request's state, all layers (before any padding to vLLM's page)."""
    one = sum(
        math.prod(s) * _size(d) for s, d in zip(state_shapes(mc, plan), state_dtypes(mc, dtype))
    )
    return plan.layers * one


class ConceptStates:
    """A model's concept state in vLLM's state layers (`layers`: objects whose `kv_cache` holds
    [slots, kv_heads, entries, head_dim] keys and values and the [slots, CHUNK_ROWS, D] fp32 chunk
    state, as vLLM hands them to `ConceptState`), laid out by `plan`: a pass's concepts over its
    layers, gathered and scattered here."""

    def __init__(self, layers: list, plan: StatePlan):
        self.layers, self.plan, self.capacity = layers, plan, plan.capacity

    def _kv(self, n: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.layers[n * self.plan.per_pass + j].kv_cache
        return cache[0], cache[1]

    @property
    def chunk(self) -> torch.Tensor:
        """[slots, CHUNK_ROWS, D] fp32: the first layer's."""
        return self.layers[0].kv_cache[2]

    def gather(self, n: int, slots_B: torch.Tensor, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pass n's first `used` entries of each slot, [B, kv_heads, used, head_dim] keys and values
        (copies)."""
        E = self.plan.entries
        parts = [
            tuple(t[slots_B, :, : min(E, used - j * E)] for t in self._kv(n, j))
            for j in range(math.ceil(used / E))
        ]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts], 2), torch.cat([p[1] for p in parts], 2)

    def put(self, n: int, slots_B, pos_B, k_BJd: torch.Tensor, v_BJd: torch.Tensor) -> None:
        """Pass n's entry at position pos_B[i] of slot slots_B[i] (one per row)."""
        E = self.plan.entries
        layer_B, at_B = pos_B // E, pos_B % E
        for j in layer_B.unique().tolist():
            rows = (layer_B == j).nonzero().flatten()
            k, v = self._kv(n, j)
            k[slots_B[rows], :, at_B[rows]] = k_BJd[rows]
            v[slots_B[rows], :, at_B[rows]] = v_BJd[rows]

    def fill(self, n: int, slot: int, k_JMd: torch.Tensor, v_JMd: torch.Tensor) -> None:
        """Pass n's first M entries of one slot."""
        E, M = self.plan.entries, k_JMd.shape[1]
        for j in range(math.ceil(M / E)):
            k, v = self._kv(n, j)
            k[slot, :, : min(E, M - j * E)] = k_JMd[:, j * E : (j + 1) * E]
            v[slot, :, : min(E, M - j * E)] = v_JMd[:, j * E : (j + 1) * E]
