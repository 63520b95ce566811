"""Chunk module, concept model and dechunk of a vLLM batch, on the per-request concept state.

The project's own modules do the work (`ChunkModule`, `Dechunk`, the concept blocks with
`KVCache`), so that the numbers are the ones `vlm chat` computes: a request's first prefill runs
their parallel `forward` and fills its slot, as `ConceptMoELM.prefill` does; decode tokens (and a
prefill chunk that continues a prompt) run their one-token `step`, as `ConceptMoELM.decode_step`
does. Between steps the state lives in vLLM's slots (state.py); a step gathers its rows and writes
back what changed.
"""

from __future__ import annotations

import logging

import torch

from vlm.model.block import StackContext, run_stack
from vlm.model.cache import ChunkState, InferenceCache, KVCache
from vlm.model.chunking import Chunks
from vlm.model.conceptmoe import ConceptMoELM
from vlm.serve.layout import COUNTS, EMA, EMA_IN, KEY, PENDING
from vlm.serve.state import ConceptStates

log = logging.getLogger(__name__)


def capped(ch: Chunks, capacity: int) -> Chunks:
    """The chunking with at most `capacity` concepts: the model's own rule for a static capacity
    (concepts past it are not computed, the tokens that would read them read none)."""
    if ch.cdoc_BM.shape[1] <= capacity:
        return ch
    cut = lambda t: None if t is None else t[:, :capacity]  # noqa: E731
    cidx_BT = torch.where(ch.cidx_BT < capacity, ch.cidx_BT, torch.full_like(ch.cidx_BT, -1))
    return ch._replace(
        cidx_BT=cidx_BT,
        cdoc_BM=cut(ch.cdoc_BM),
        cpos_BM=cut(ch.cpos_BM),
        cp_BM=cut(ch.cp_BM),
        cgate_BM=cut(ch.cgate_BM),
    )


class Middle:
    """What lies between the encoder and the decoder, for the tokens of one vLLM batch."""

    def __init__(self, lm: ConceptMoELM, state: ConceptStates):
        self.lm, self.state = lm, state
        self.passes = len(lm.cfg.concept_schedule)
        self.overflows = 0  # concepts that found their request's slot full (counted, logged)

    def _overflow(self, n: int) -> None:
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
        lm, cfg, C = self.lm, self.lm.cfg, self.state.capacity
        T = h_1TD.shape[1]
        doc_1T = torch.zeros(1, T, dtype=torch.long, device=h_1TD.device)
        # the modality only splits the ratio loss and the statistics: no boundary depends on it
        ch = lm.chunker(h_1TD, doc_1T)
        if ch.cdoc_BM.shape[1] > C:
            self._overflow(ch.cdoc_BM.shape[1] - C)
            ch = capped(ch, C)
        c_1MD = lm.chunker.merge(h_1TD, doc_1T, ch)
        concept_in_1MD = c_1MD
        caches = []
        for n in range(self.passes):
            k, v = self.state.concept_kv(n)
            zero_1 = torch.zeros(1, dtype=torch.long, device=h_1TD.device)
            # views of the slot: `fill` writes the prompt's concepts straight into vLLM's state
            caches.append(KVCache(k[slot][None], v[slot][None], zero_1))
        if lm.concept_up is not None:
            c_1MD = lm.concept_up(c_1MD)
        cctx = StackContext.build(
            ch.cdoc_BM,
            ch.cpos_BM,
            cfg.head_dim,
            cfg.rope_theta,
            c_1MD.dtype,
            cfg.attn_backend,
            use_rope=cfg.concept_pos == "rope",
        )
        c_1MD, _ = run_stack(lm.concept, c_1MD, cctx, cfg.concept_schedule, caches=caches)
        if lm.concept_down is not None:
            c_1MD = lm.concept_down(c_1MD)
        smoothed_1MD = lm.dechunk.smooth(c_1MD, ch)
        z_1TD, cread_1TD, cread_in_1TD = lm.dechunk(h_1TD, c_1MD, ch, concept_in_1MD, smoothed_1MD)
        st = ChunkState.join(
            lm.chunker.prefill_state(h_1TD, doc_1T, ch),
            lm.dechunk.prefill_state(doc_1T, ch, cread_1TD, cread_in_1TD),
        )
        self._put(torch.tensor([slot], device=h_1TD.device), st)
        return z_1TD[0], cread_1TD[0]

    # ------------------------------------------------------------ one token per row
    def step(self, h_BD: torch.Tensor, slots_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(z, c) [B, D] of one new token per row, each in its slot (`decode_step`'s middle)."""
        lm, C = self.lm, self.state.capacity
        st = self._get(slots_B, h_BD.dtype)
        n_B = st.n_concepts_B.clone()
        full_B = n_B >= C
        # the filled entries and the one this step may write: the gather costs what attention reads
        used = min(int(n_B.max()) + 1, C)
        caches, rows_kv = [], []  # the rows' keys and values, gathered; `KVCache` writes in place
        for n in range(self.passes):
            k, v = self.state.concept_kv(n)
            rows_kv.append((k[slots_B, :, :used], v[slots_B, :, :used]))
            # a full slot writes past its last entry's place and keeps nothing (see fired_B)
            caches.append(KVCache(*rows_kv[-1], n_B.clamp_max(C - 1)))
        cache = InferenceCache([], caches, [], n_B.clone(), st)
        ck = lm.chunker.step(h_BD, st)
        fired_B = ck.b_B & ~full_B
        if bool((ck.b_B & full_B).any()):
            self._overflow(int((ck.b_B & full_B).sum()))
        pos_B = n_B.clamp_max(C - 1)
        # when no row closed a concept the concept model's results would all be dropped
        if bool(ck.b_B.any()):
            c_B1D = lm.concept_step(ck.c_BD[:, None], pos_B, fired_B, cache)
        else:
            c_B1D = torch.zeros_like(h_BD[:, None])
        d = lm.dechunk.step(h_BD[:, None], c_B1D, ck, st)
        st.n_concepts_B.copy_(n_B + fired_B.long())
        self._put(slots_B, st)
        rows = fired_B.nonzero().flatten()  # only their entry at pos_B changed
        for n, (k_BJCd, v_BJCd) in enumerate(rows_kv):
            k, v = self.state.concept_kv(n)
            k[slots_B[rows], :, pos_B[rows]] = k_BJCd[rows, :, pos_B[rows]]
            v[slots_B[rows], :, pos_B[rows]] = v_BJCd[rows, :, pos_B[rows]]
        return d.z_B1D[:, 0], d.c_B1D[:, 0]

    # ------------------------------------------------------------ the slots
    def _get(self, slots_B: torch.Tensor, dtype: torch.dtype) -> ChunkState:
        s = self.state.chunk[slots_B]
        ema_in = s[:, EMA_IN].clone() if self.lm.cfg.chunk.residual == "delta" else None
        return ChunkState(
            s[:, KEY].to(dtype),
            s[:, PENDING].to(dtype),
            s[:, COUNTS, 0].long(),
            s[:, EMA].clone(),
            s[:, COUNTS, 1].long(),
            ema_in,
        )

    def _put(self, slots_B: torch.Tensor, st: ChunkState) -> None:
        s = torch.zeros(len(slots_B), *self.state.chunk.shape[1:], device=slots_B.device)
        s[:, KEY], s[:, PENDING] = st.last_key_BD.float(), st.pending_BD.float()
        s[:, EMA] = st.ema_BD.float()
        if st.ema_in_BD is not None:
            s[:, EMA_IN] = st.ema_in_BD.float()
        s[:, COUNTS, 0], s[:, COUNTS, 1] = st.pending_n_B.float(), st.n_concepts_B.float()
        self.state.chunk[slots_B] = s
