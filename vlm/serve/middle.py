"""Chunk module, concept model and dechunk of a vLLM batch, on the per-request concept state.

Legend: B rows, T tokens, D width, J key/value heads, C KV cache entries, d head width.

The model's own middle does the work (`ConceptMoELM.middle` and `middle_step`), so that the numbers
are the ones `vlm chat` computes: a request's first prefill runs `middle` on the prompt into concept
caches of the slot's capacity, as `ConceptMoELM.prefill` does, then copies their concepts to the
slot's pages; decode tokens (and a prefill chunk that continues a prompt) run `middle_step` over the
rows' state gathered from their pages, as `ConceptMoELM.decode_step` does, and write back the one
entry each row added. Between steps the state lives in vLLM's slots (state.py, laid out by
layout.py's `ConceptStates`): this file only moves it between the slots and the model's state
objects.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from vlm.model.cache import ChunkState, InferenceCache, KVCache
from vlm.model.conceptmoe import ConceptMoELM
from vlm.serve.layout import CHUNK, KV

if TYPE_CHECKING:
    from vlm.serve.layout import ConceptStates

log = logging.getLogger(__name__)


class Middle:
    """What lies between the encoder and the decoder, for the tokens of one vLLM batch."""

    def __init__(self, lm: ConceptMoELM, state: ConceptStates):
        self.lm, self.state = lm, state
        self.passes = len(lm.cfg.concept_schedule)
        # the chunk state's optional fields this model leaves None
        self.absent = frozenset(() if lm.cfg.chunk.residual == "delta" else ("ema_in_BD",))
        self.overflows = 0  # concepts that found their request's slot full (counted, logged)

    def _overflow(self, n: int) -> None:
        if not n:
            return
        self.overflows += n
        log.warning(
            "concept capacity %d reached: %d concepts not kept so far; "
            "outputs now differ from `vlm chat` (raise --concept-capacity)",
            self.state.capacity,
            self.overflows,
        )

    # ------------------------------------------------------------ a request's first prefill
    def prefill(self, h_1TD: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(z, c) [T, D]: the decoder's input and the EMA concept each prompt token reads; fills the
        request's slot."""
        T, dev = h_1TD.shape[1], h_1TD.device
        zero_1 = torch.zeros(1, dtype=torch.long, device=dev)
        # caches of the slot's capacity (a prompt closes at most T concepts): the model keeps the
        # first concepts that fit, and they go to the slot's pages after
        cfg, dtype = self.lm.cfg, self.state.layers[0].kv_cache[0].dtype
        size = min(T, self.state.capacity)
        caches = [
            KVCache.allocate(1, cfg.c_kv_heads, size, cfg.head_dim, dtype, dev)
            for _ in range(self.passes)
        ]
        cache = InferenceCache([], caches, [], zero_1, capacity=T)
        doc_1T = torch.zeros(1, T, dtype=torch.long, device=dev)
        pos_1T = torch.arange(T, device=dev)[None]
        # the modality only splits the ratio loss and the statistics: no boundary depends on it
        mid = self.lm.middle(h_1TD, doc_1T, pos_1T, cache=cache)
        self._overflow(int(mid.chunks.overflow))
        for n, c in enumerate(caches):
            m = int(c.len_B[0])
            self.state.fill(n, slot, tuple(getattr(c, name)[0, :, :m] for name in KV))
        self._put(torch.tensor([slot], device=dev), cache.chunk)
        return mid.z_BTD[0], mid.c_BTD[0]

    # ------------------------------------------------------------ one token per row
    def step(self, h_BD: torch.Tensor, slots_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(z, c) [B, D] of one new token per row, each in its slot (`decode_step`'s middle)."""
        C = self.state.capacity
        st = self._get(slots_B, h_BD.dtype)
        n_B = st.n_concepts_B.clone()
        # the filled entries and the one this step may write: the gather costs what attention reads
        used = min(int(n_B.max()) + 1, C)
        caches, rows_kv = [], []  # the rows' keys and values, gathered; `KVCache` writes in place
        for n in range(self.passes):
            rows_kv.append(self.state.gather(n, slots_B, used))
            # a full slot writes past its last entry's place and keeps nothing (`middle_step`
            # drops its concept)
            caches.append(KVCache(**dict(zip(KV, rows_kv[-1])), len_B=n_B.clamp_max(C - 1)))
        # the gathered caches hold `used` entries; a row is full against them (n >= used) exactly
        # when it is against its slot (n >= C): n <= max(n) < used unless used = C
        cache = InferenceCache([], caches, [], n_B.clone(), st)
        mid = self.lm.middle_step(h_BD[:, None], cache)
        if mid.dropped_B is not None:
            self._overflow(int(mid.dropped_B.sum()))
        self._put(slots_B, st)
        pos_B = n_B.clamp_max(C - 1)
        rows = (st.n_concepts_B > n_B).nonzero().flatten()  # only their entry at pos_B changed
        for n, kv_BJCd in enumerate(rows_kv):
            at = pos_B[rows]
            self.state.put(n, slots_B[rows], at, tuple(t[rows, :, at] for t in kv_BJCd))
        return mid.z_B1D[:, 0], mid.c_B1D[:, 0]

    # ------------------------------------------------------------ the slots
    def _get(self, slots_B: torch.Tensor, dtype: torch.dtype) -> ChunkState:
        """The rows' chunk state from their slots (copies), laid out as layout.py's `CHUNK`."""
        return CHUNK.read(self.state.chunk[slots_B], dtype, self.absent)

    def _put(self, slots_B: torch.Tensor, st: ChunkState) -> None:
        s = torch.zeros(len(slots_B), *self.state.chunk.shape[1:], device=slots_B.device)
        CHUNK.write(st, s)
        self.state.chunk[slots_B] = s
