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

What a state layer holds is computed from the model's own state classes (vlm/model/cache.py): the
concept cache's keys and values (`KVCache`'s `_BJCd` fields: `KV`) and the chunk state
(`ChunkState`'s fields: `CHUNK`), so a field added to either is carried in the slots, or refused
by name when this module is imported, and never silently misaligned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from vlm.model.cache import ChunkState, KVCache
from vlm.model.chunking import concept_capacity as model_capacity
from vlm.model.config import ModelConfig


class ChunkRows:
    """Where each field of a chunk state (vlm/model/cache.py's `ChunkState`: the router's and the
    dechunk's) lies in a slot's fp32 [rows, D] tensor, computed from the class's fields: a vector
    (`_BD`) one row each, in field order, then the numbers (`_B`) side by side in one row (exact in
    fp32 up to 2^24). A field added to the state is carried, or refused here (by name) when the
    slots cannot hold it, never left out."""

    def __init__(self, state: type):
        vectors, numbers = [], []
        for f in fields(state):
            width = f.name.rpartition("_")[2]
            if "dtype" not in f.metadata or width not in ("BD", "B"):
                raise TypeError(
                    f"{state.__name__}.{f.name}: a serving slot holds state fields declared "
                    "with `kept(dtype)` (vlm/model/cache.py) and named _BD or _B"
                )
            (vectors if width == "BD" else numbers).append(f.name)
        self.state, self.rows = state, len(vectors) + bool(numbers)
        # field -> (row, column; None: the whole row)
        self.at = {name: (r, None) for r, name in enumerate(vectors)}
        self.at |= {name: (len(vectors), c) for c, name in enumerate(numbers)}
        self.dtypes = {f.name: f.metadata["dtype"] for f in fields(state)}
        # the fields a model may leave None (one it does not use)
        self.optional = {f.name for f in fields(state) if f.default is None}
        self.numbers = len(numbers)

    def shape(self, width: int) -> tuple[int, int]:
        if width < self.numbers:
            raise ValueError(
                f"a chunk state row of width {width} cannot hold {self.numbers} counters"
            )
        return self.rows, width

    def of(self, held: torch.Tensor, name: str) -> torch.Tensor:
        """Field `name` of every slot in `held` ([B, CHUNK.rows, D]): [B, D] or [B], a view."""
        row, col = self.at[name]
        return held[:, row] if col is None else held[:, row, col]

    def write(self, st, held: torch.Tensor) -> None:
        """Every field of state `st` (each row's) into held, in fp32 (a None field stays as is)."""
        for name in self.at:
            if (t := getattr(st, name)) is not None:
                self.of(held, name)[:] = t.float()

    def read(self, held: torch.Tensor, hidden: torch.dtype, absent=frozenset()):
        """The state held in held (copies), each field in its declared dtype (`hidden`: the hidden
        states'); the optional fields named in `absent` (a model that does not use them) None."""
        if unknown := set(absent) - self.optional:
            raise ValueError(f"{self.state.__name__} has no optional field {sorted(unknown)}")
        dtypes = {"hidden": hidden, "float32": torch.float32, "long": torch.long}
        return self.state(
            **{
                name: None
                if name in absent
                else self.of(held, name).to(dtypes[self.dtypes[name]], copy=True)
                for name in self.at
            }
        )


CHUNK = ChunkRows(ChunkState)
# a state layer's tensors: the concept cache's per-entry ones (KVCache's `_BJCd` fields: its keys
# and values), each [slots, J, entries, d] in the model's dtype, then the chunk state; the cache's
# other fields are not stored, each is known in a slot:
NOT_STORED = {
    "len_B": "the chunk state's n_concepts_B (one entry per concept)",
    "window": "0 (a concept cache reads every entry)",
}
KV = tuple(f.name for f in fields(KVCache) if f.name.endswith("_BJCd"))
if unplaced := {f.name for f in fields(KVCache)} - set(KV) - set(NOT_STORED):
    raise TypeError(f"KVCache fields {sorted(unplaced)}: the serving state layers do not hold them")
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
    entry = len(KV) * mc.c_kv_heads * mc.head_dim * _size(dtype)
    chunk = CHUNK.rows * mc.hidden_size * 4
    page = page_bytes * math.ceil((chunk + MIN_ENTRIES * entry) / page_bytes)
    entries = (page - chunk) // entry
    per_pass = math.ceil(capacity / entries)
    for k in range(per_pass, per_pass + max(1, token_layers) + 1):
        if _groups_unpadded(token_layers, passes * k):
            per_pass = k
            break
    return StatePlan(passes, per_pass, entries)


def state_shapes(mc: ModelConfig, plan: StatePlan) -> tuple[tuple[int, ...], ...]:
    """One state layer's: its keys and values (`KV`), then the chunk state (`CHUNK`)."""
    kv = (mc.c_kv_heads, plan.entries, mc.head_dim)
    return (kv,) * len(KV) + (CHUNK.shape(mc.hidden_size),)


def state_dtypes(mc: ModelConfig, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    return (dtype,) * len(KV) + (torch.float32,)


def state_bytes(mc: ModelConfig, plan: StatePlan, dtype: torch.dtype) -> int:
    """A request's state, all layers (before any padding to vLLM's page)."""
    one = sum(
        math.prod(s) * _size(d) for s, d in zip(state_shapes(mc, plan), state_dtypes(mc, dtype))
    )
    return plan.layers * one


class ConceptStates:
    """A model's concept state in vLLM's state layers (`layers`: objects whose `kv_cache` holds
    the tensors `state_shapes` declares: [slots, kv_heads, entries, head_dim] for each of `KV`, then
    the [slots, CHUNK.rows, D] fp32 chunk state, as vLLM hands them to `ConceptState`), laid out by
    `plan`: a pass's concepts over its layers, gathered and scattered here. Keys and values go in
    and out as tuples in `KV`'s order."""

    def __init__(self, layers: list, plan: StatePlan):
        self.layers, self.plan, self.capacity = layers, plan, plan.capacity

    def _kv(self, n: int, j: int) -> tuple[torch.Tensor, ...]:
        return self.layers[n * self.plan.per_pass + j].kv_cache[: len(KV)]

    @property
    def chunk(self) -> torch.Tensor:
        """[slots, CHUNK.rows, D] fp32: the first layer's."""
        return self.layers[0].kv_cache[len(KV)]

    def gather(self, n: int, slots_B: torch.Tensor, used: int) -> tuple[torch.Tensor, ...]:
        """Pass n's first `used` entries of each slot, [B, kv_heads, used, head_dim] keys and values
        (copies)."""
        E = self.plan.entries
        parts = [
            tuple(t[slots_B, :, : min(E, used - j * E)] for t in self._kv(n, j))
            for j in range(math.ceil(used / E))
        ]
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat(ts, 2) for ts in zip(*parts))

    def put(self, n: int, slots_B, pos_B, kv_BJd: tuple[torch.Tensor, ...]) -> None:
        """Pass n's entry at position pos_B[i] of slot slots_B[i] (one per row)."""
        E = self.plan.entries
        layer_B, at_B = pos_B // E, pos_B % E
        for j in layer_B.unique().tolist():
            rows = (layer_B == j).nonzero().flatten()
            for t, new_BJd in zip(self._kv(n, j), kv_BJd, strict=True):
                t[slots_B[rows], :, at_B[rows]] = new_BJd[rows]

    def fill(self, n: int, slot: int, kv_JMd: tuple[torch.Tensor, ...]) -> None:
        """Pass n's first M entries of one slot."""
        E, M = self.plan.entries, kv_JMd[0].shape[1]
        for j in range(math.ceil(M / E)):
            for t, new_JMd in zip(self._kv(n, j), kv_JMd, strict=True):
                t[slot, :, : min(E, M - j * E)] = new_JMd[:, j * E : (j + 1) * E]
