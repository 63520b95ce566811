"""Sequence parallelism, the model's side: a row split over S ranks, and the pieces that cross the
shards so that the split computes what one rank holding the whole row computes.

Legend: B rows, T tokens of the row, L tokens of a shard (T / S), D width, H query heads, G heads
of a rank (H / S), d head width, K concept slots of a shard (the row's M / S), S ranks.

Rank s of a sequence group holds tokens [s L, (s + 1) L) of every row, and concept slots
[s K, (s + 1) K) of the row's static concept capacity (M padded to a multiple of S), whichever token
shard closed them. Every rank reads the whole batch (the same micro-batch as its group); what is
index arithmetic (documents, positions, the row's boundary mask once drawn) is computed for the
whole row on every rank, O(T) integers; what carries a gradient is exchanged:

- token attention (Ulysses): an all-to-all from sequence to heads before attention and back after
  (`ulysses_to_heads` / `ulysses_to_sequence`), so each rank attends over the whole row for H / S
  heads with the document masks of the whole row;
- the router's previous-token key across a shard boundary: a one-token halo (`previous_token`);
- the concepts: each token shard pools its tokens into the row's concept slots and a reduce-scatter
  gives each rank its concept slots (`reduce_scatter`); the concept model's attention is Ulysses over
  the concept slots (the whole row's concepts, every document mask intact);
- the EMA dechunk (eq. 8): a scan over each shard's concept slots, then a scan over the group of the
  shards' end states (`ema_carry`);
- each token reads its EMA concept from the gathered slots (`all_gather`);
- sums over the row (per-document ratio statistics, MoE balance): `row_sum`, whose value is the row's
  and whose gradient reaches this shard's terms only, so the ranks' gradients add up to the row's.

Every collective here with a gradient has its backward a collective too: each rank's output must
reach its loss (a rank that ignores one, e.g. the first shard's halo, multiplies it by 0), and
every rank runs the same collectives in the same order.

The group and its collectives are the trainer's (vlm.train.sequence_shard makes them,
vlm.train.collectives.SequenceGroup runs them); the model only calls these functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class SequenceComm(Protocol):
    """The collectives of a sequence-parallel group, as the trainer gives them to the model
    (vlm.train.collectives.SequenceGroup): the model calls no torch.distributed itself."""

    def gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x`, in rank order (no gradient)."""

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the group, in place (no gradient)."""

    def swap(self, x: torch.Tensor) -> torch.Tensor:
        """[S, ...] -> [S, ...]: row j goes to rank j, row s of the result came from rank s
        (differentiable: the backward is the reverse swap)."""


@dataclass(frozen=True)
class SequenceShard:
    """This rank's place in its sequence-parallel group."""

    comm: SequenceComm | None  # the group's collectives (None: a shard no forward runs on)
    rank: int  # s: this rank's shard, 0 .. S - 1 (0: the row's first tokens)
    size: int  # S

    def span(self, T: int) -> tuple[int, int]:
        """[lo, hi): this rank's tokens (or concept slots) of a length-T sequence (S divides T)."""
        if T % self.size:
            raise ValueError(f"a sequence of {T} is not split evenly over {self.size} ranks")
        n = T // self.size
        return self.rank * n, (self.rank + 1) * n

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of `x` along `dim` (a view)."""
        lo, hi = self.span(x.shape[dim])
        return x.narrow(dim, lo, hi - lo)


def padded_slots(M: int, S: int) -> int:
    """The row's concept slots rounded up to a multiple of S (each rank holds M / S)."""
    return -(-M // S) * S


# ---------------------------------------------------------------- collectives with gradients
def _gather_list(x: torch.Tensor, shard: SequenceShard) -> list[torch.Tensor]:
    return shard.comm.gather(x)


class _AllGather(torch.autograd.Function):
    """Concatenate every rank's x along `dim`; the backward sums the gradients over the group and
    keeps this rank's part (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, dim, shard):
        ctx.dim, ctx.shard = dim, shard
        return torch.cat(_gather_list(x, shard), dim)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.dim, ctx.shard), None, None


def _reduce_scatter(x: torch.Tensor, dim: int, shard: SequenceShard) -> torch.Tensor:
    """Sum over the group, this rank's part along `dim` (all-reduce then a copy of the part: gloo has
    no reduce-scatter)."""
    x = shard.comm.sum_(x.contiguous().clone())
    return shard.local(x, dim).clone()


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, shard):
        ctx.dim, ctx.shard = dim, shard
        return _reduce_scatter(x, dim, shard)

    @staticmethod
    def backward(ctx, g):
        return torch.cat(_gather_list(g, ctx.shard), ctx.dim), None, None


def all_gather(x: torch.Tensor, shard: SequenceShard, dim: int = 1) -> torch.Tensor:
    """The whole row from each rank's part along `dim` (differentiable)."""
    return _AllGather.apply(x, dim, shard)


def reduce_scatter(x: torch.Tensor, shard: SequenceShard, dim: int = 1) -> torch.Tensor:
    """This rank's part along `dim` of the sum over the group of `x` (differentiable)."""
    return _ReduceScatter.apply(x, dim, shard)


def gather_detached(x: torch.Tensor, shard: SequenceShard, dim: int = 1) -> torch.Tensor:
    """The whole row of a tensor without gradient (boundaries, counts)."""
    return torch.cat(_gather_list(x.detach(), shard), dim)


def row_sum(x: torch.Tensor, shard: SequenceShard | None) -> torch.Tensor:
    """Sum over the group of this rank's sums `x`: the row's value, with the gradient of this rank's
    own term only (x + (sum - x).detach()), so each rank's gradient is its tokens' share of the
    row's and the group's gradients add up to the row's. None: x."""
    if shard is None:
        return x
    total = shard.comm.sum_(x.detach().clone())
    return x + (total - x.detach())


# ---------------------------------------------------------------- the router's halo
def previous_token(x_BLD: torch.Tensor, shard: SequenceShard | None) -> torch.Tensor:
    """[B, L, D]: x at the previous position of the row (x_{n-1}) for each local position; the
    first one reads the previous shard's last token (the halo; zeros on the first shard, where
    position 0 is a document start and reads nothing). Differentiable into the previous shard."""
    prev = x_BLD[:, :-1]
    if shard is None or shard.size == 1:
        halo = torch.zeros_like(x_BLD[:, :1])
    else:
        last_BSD = all_gather(x_BLD[:, -1:], shard, dim=1)
        # the first shard takes zeros that stay in the graph: every rank's backward must run the
        # gather's (a collective)
        halo = last_BSD[:, max(shard.rank - 1, 0) : max(shard.rank, 1)] * (shard.rank > 0)
    return torch.cat([halo, prev], 1)


# ---------------------------------------------------------------- Ulysses attention
def _all_to_all(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """[S, ...] -> [S, ...]: row j goes to rank j, row s of the result came from rank s."""
    return shard.comm.swap(x)


def ulysses_to_heads(x_BHLd: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """[B, H, L, d] (all heads, this shard's tokens) -> [B, H / S, T, d] (this rank's heads, the
    whole row): rank s keeps heads [s H / S, (s + 1) H / S)."""
    B, H, L, d = x_BHLd.shape
    S = shard.size
    x_SBGLd = x_BHLd.view(B, S, H // S, L, d).transpose(0, 1)
    y_SBGLd = _all_to_all(x_SBGLd, shard)  # row s: rank s's tokens of my heads
    return y_SBGLd.permute(1, 2, 0, 3, 4).reshape(B, H // S, S * L, d)


def ulysses_to_sequence(y_BGTd: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """The inverse of `ulysses_to_heads`: [B, H / S, T, d] -> [B, H, L, d]."""
    B, G, T, d = y_BGTd.shape
    S = shard.size
    x_SBGLd = y_BGTd.view(B, G, S, T // S, d).permute(2, 0, 1, 3, 4)
    y_SBGLd = _all_to_all(x_SBGLd, shard)  # row s: my tokens of rank s's heads
    return y_SBGLd.transpose(0, 1).reshape(B, S * G, T // S, d)


def ulysses_attention(q, k, v, shard: SequenceShard, attend_row):
    """Attention of this shard's queries over the whole row: q [B, H, L, d], k and v [B, J, L, d]
    -> [B, H, L, d], by `attend_row(q, k, v)` on [B, H / S, T, d] (the row's document masks apply
    unchanged). Key/value heads are split as the query heads are where S divides them; else each is
    repeated for its query heads first (GQA's grouping keeps query head i on key head i // (H/J))."""
    H, J, S = q.shape[1], k.shape[1], shard.size
    if J % S:
        k, v = k.repeat_interleave(H // J, 1), v.repeat_interleave(H // J, 1)
    out = attend_row(
        ulysses_to_heads(q, shard), ulysses_to_heads(k, shard), ulysses_to_heads(v, shard)
    )
    return ulysses_to_sequence(out, shard)


# ---------------------------------------------------------------- the EMA across shards
def ema_carry(
    y_BKD: torch.Tensor,
    decay_BK: torch.Tensor,
    shard: SequenceShard,
) -> torch.Tensor:
    """Eq. 8's EMA over the row's concepts from each shard's own scan: `y_BKD` is the scan of this
    rank's slots started from zero, `decay_BK` the product of (1 - p) since the shard's first slot
    (0 past a document start). The state entering shard s is the scan over the group of the
    earlier shards' end states, c_s = y_end_{s-1} + A_{s-1} c_{s-1} (a loop over ranks, not
    concepts); each slot adds decay x c_s. Differentiable through every shard's terms."""
    ends_BSD = all_gather(y_BKD[:, -1:].float(), shard, dim=1)
    decays_BS = all_gather(decay_BK[:, -1:].float(), shard, dim=1)
    # zeros for the first shard, in the graph: every rank's backward runs the gathers' (collectives)
    carry_BD = ends_BSD[:, 0] * 0 + decays_BS[:, :1] * 0
    for s in range(shard.rank):
        carry_BD = ends_BSD[:, s] + decays_BS[:, s, None] * carry_BD
    return (y_BKD.float() + decay_BK[..., None].float() * carry_BD[:, None]).to(y_BKD.dtype)


def sharded_ema_scan(
    x_BKD: torch.Tensor, p_BK: torch.Tensor, reset_BK: torch.Tensor, shard: SequenceShard
) -> torch.Tensor:
    """`ema_scan` over the row's concept slots when this rank holds slots [s K, (s + 1) K): its own
    scan from zero, then the carry from the earlier shards (`ema_carry`). `reset_BK`: the document
    starts among this rank's slots, as the whole row's give them (a document that continues from
    the previous shard does not restart)."""
    from vlm.model.ema_scan import ema_scan

    y_BKD = ema_scan(x_BKD, p_BK, reset_BK)
    # the product of (1 - p) since the shard's first slot, 0 from a document start on: what the
    # entering state is still worth at each slot
    a_BK = torch.where(reset_BK, torch.zeros_like(p_BK, dtype=torch.float32), 1 - p_BK.float())
    return ema_carry(y_BKD, torch.cumprod(a_BK, 1), shard)
