"""Dechunk (ConceptMoE section 3.3): EMA over concepts (eq. 8), plug-back (eq. 9) and the decoder
input z (eq. 10) with STE, over a whole sequence (`forward`) and for one new token per row (`step`,
with the state `prefill_state` builds after a prompt).

Legend: B rows, T tokens, D width, M concept slots, K concept slots of a rank (sequence
parallelism).

Convention (docs/design.md, "Dechunk"): token n reads the EMA at concept psi(n), the last one
closed at or before n.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from vlm.model.cache import DechunkState
from vlm.model.config import ChunkConfig
from vlm.model.ema_scan import ema_scan
from vlm.model.layers import doc_starts
from vlm.model.sequence_parallel import SequenceShard, all_gather, sharded_ema_scan
from vlm.model.share_init import assign_

if TYPE_CHECKING:  # chunking.py re-exports this module's names: no import back at run time
    from vlm.model.chunking import Chunks, ChunkStep


# ---------------------------------------------------------------- equations
class _STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.ones_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def ste(x: torch.Tensor) -> torch.Tensor:
    """Straight-through: forward 1, backward identity (eq. 10's multiplier on the selected probability)."""
    return _STE.apply(x)


def plug_back(concepts_BMD: torch.Tensor, cidx_BT: torch.Tensor) -> torch.Tensor:
    """Eq. 9: token n reads concept psi(n), the last one closed at or before n; 0 where psi(n) = -1
    (padding, and tokens whose concept lies past the static capacity: they read none)."""
    D = concepts_BMD.shape[-1]
    read_BTD = concepts_BMD.gather(1, cidx_BT.clamp_min(0)[..., None].expand(-1, -1, D))
    return torch.where(cidx_BT[..., None] >= 0, read_BTD, 0)


# ---------------------------------------------------------------- module
class DechunkStep(NamedTuple):
    """One decode step's dechunk output."""

    z_B1D: torch.Tensor  # the decoder's input (eq. 10)
    # the EMA concept each row's token reads (joint decoding's c, eq. 11); for the rows
    c_B1D: torch.Tensor
    # whose boundary fired, the smoothed concept that just closed (the
    # cross-attention decoder's new cache entry)


class Dechunk(nn.Module):
    """EMA over concepts (eq. 8), plug-back (eq. 9) and the decoder input z (eq. 10) with STE."""

    def __init__(self, cfg: ChunkConfig, dim: int):
        super().__init__()
        self.cfg = cfg
        # H-Net's residual projection; identity at init reproduces eq. 10, conversion starts it
        # at zero.
        self.residual = nn.Linear(dim, dim, bias=False) if cfg.residual == "linear" else None
        if self.residual is not None:  # at this rank's share (a ZeRO-3 partition, share_init)
            assign_(self.residual.weight, torch.eye(dim))

    @staticmethod
    def ema_step(concept_BD: torch.Tensor, p_B: torch.Tensor, ema_BD: torch.Tensor) -> torch.Tensor:
        """Eq. 8 for one new concept per row (fp32, as `ema_scan`): c_m = p_m x_m + (1 - p_m) c_{m-1}."""
        p = p_B.float()[:, None]
        return p * concept_BD.float() + (1 - p) * ema_BD

    @staticmethod
    def gated(concepts_BMD: torch.Tensor, ch: Chunks) -> torch.Tensor:
        """Synergy eq. 4's m_i sigma_i Middle(x_i): each concept times its gate (eq. 3), when the chunking has one."""
        return (
            concepts_BMD
            if ch.cgate_BM is None
            else concepts_BMD * ch.cgate_BM[..., None].to(concepts_BMD.dtype)
        )

    @staticmethod
    def smooth(
        concepts_BMD: torch.Tensor, ch: Chunks, shard: SequenceShard | None = None
    ) -> torch.Tensor:
        """Eq. 8 at concept level, [B, M, D], restarted at each document (DLCM's concept smoothing
        S, eq. 11 there: what the cross-attention decoder attends over), over the gated concepts.
        `shard`: this rank's concept slots, carried on from the earlier shards'."""
        return Dechunk._ema(Dechunk.gated(concepts_BMD, ch), ch, shard)

    @staticmethod
    def _ema(x_BMD: torch.Tensor, ch: Chunks, shard: SequenceShard | None) -> torch.Tensor:
        if shard is None:
            return ema_scan(x_BMD, ch.cp_BM, doc_starts(ch.cdoc_BM))
        reset_BK = shard.local(doc_starts(ch.row_cdoc_BM))
        return sharded_ema_scan(x_BMD, ch.cp_BM, reset_BK, shard)

    @staticmethod
    def read(smoothed_BMD: torch.Tensor, ch: Chunks, shard: SequenceShard | None) -> torch.Tensor:
        """Eq. 9's plug-back; under sequence parallelism from the row's slots gathered from their
        ranks."""
        row_BMD = smoothed_BMD if shard is None else all_gather(smoothed_BMD, shard)
        return plug_back(row_BMD, ch.cidx_BT)

    def forward(
        self,
        h_BTD: torch.Tensor,
        concepts_BMD: torch.Tensor,
        ch: Chunks,
        inputs_BMD: torch.Tensor | None = None,
        smoothed_BMD: torch.Tensor | None = None,
        shard: SequenceShard | None = None,
    ):
        """(z, c, c_in): the decoder input (eq. 10), the EMA concept each token reads and, for
        residual "delta" (which needs `inputs_BMD`, the concept model's inputs), the same EMA
        over those inputs (else None). `smoothed_BMD`: `smooth(concepts_BMD, ch)` when the caller
        has it already."""
        if smoothed_BMD is None:
            smoothed_BMD = self.smooth(concepts_BMD, ch, shard)
        c_BTD = self.read(smoothed_BMD, ch, shard)
        if ch.cgate_BM is None:
            gate = ste(ch.sel_BT)[..., None].to(c_BTD.dtype)
        else:
            # Synergy eq. 4: the router's gradient comes through the gate in the concepts, not an STE
            gate = torch.ones_like(ch.sel_BT)[..., None].to(c_BTD.dtype)
        if self.cfg.residual == "delta":
            # the STE multiplies the whole update c - c_in: on c alone the forward is the same but
            # p's gradient would miss -c_in
            c_in_BTD = self.read(self._ema(self.gated(inputs_BMD, ch), ch, shard), ch, shard)
            return h_BTD + (c_BTD - c_in_BTD) * gate, c_BTD, c_in_BTD
        res = self.residual(h_BTD) if self.residual is not None else h_BTD
        return res + c_BTD * gate, c_BTD, None

    # ---------------------------------------------------------------- inference
    @staticmethod
    def prefill_state(
        doc_BT: torch.Tensor, ch: Chunks, c_BTD: torch.Tensor, c_in_BTD: torch.Tensor | None = None
    ) -> DechunkState:
        """The state after a prompt (one document per row), from `forward`'s c and c_in: the EMA the
        last token read (and, for "delta", the same over the inputs) and the concept count."""
        rows = torch.arange(doc_BT.shape[0], device=doc_BT.device)
        last = (doc_BT >= 0).sum(1) - 1
        # the ones computed (within capacity)
        n_concepts_B = ch.b_BT.sum(1).clamp_max(ch.cdoc_BM.shape[1])
        return DechunkState(
            c_BTD[rows, last].float(),
            n_concepts_B,
            None if c_in_BTD is None else c_in_BTD[rows, last].float(),
        )

    def step(
        self, h_B1D: torch.Tensor, c_B1D: torch.Tensor, ck: ChunkStep, state: DechunkState
    ) -> DechunkStep:
        """`forward` for one new token per row (eval mode): the rows whose boundary fired (`ck.b_B`)
        take in their new concept, `c_B1D` (the concept model's output; its input is `ck.c_BD`),
        gated as `gated` does, into eq. 8's EMA (and the concept count); every row's token then
        reads its EMA (eq. 9) into z (eq. 10; the STE multiplier is 1 in the forward). Fixed shapes:
        every row computes, the others keep their state. Updates `state` in place."""
        fired_B1 = ck.b_B[:, None]
        c_BD, c_in_BD = c_B1D[:, 0], ck.c_BD
        if ck.gate_B is not None:  # Synergy eq. 3-4: the concept (and its input) times its gate
            c_BD = c_BD * ck.gate_B[:, None].to(c_BD.dtype)
            c_in_BD = c_in_BD * ck.gate_B[:, None].to(c_in_BD.dtype)
        state.ema_BD.copy_(
            torch.where(fired_B1, self.ema_step(c_BD, ck.p_B, state.ema_BD), state.ema_BD)
        )
        state.n_concepts_B.add_(ck.b_B.long())
        read_B1D = state.ema_BD[:, None].to(h_B1D.dtype)
        if self.cfg.residual == "delta":  # own state + the concept model's (EMA) update
            ema_in = self.ema_step(c_in_BD, ck.p_B, state.ema_in_BD)
            state.ema_in_BD.copy_(torch.where(fired_B1, ema_in, state.ema_in_BD))
            z_B1D = h_B1D + read_B1D - state.ema_in_BD[:, None].to(h_B1D.dtype)
        else:
            res = self.residual(h_B1D) if self.residual is not None else h_B1D
            z_B1D = res + read_B1D
        return DechunkStep(z_B1D, read_B1D)
