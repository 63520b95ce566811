"""Expert parallelism, the model's side: a MoE layer that holds E/P of the routed experts and
exchanges tokens with the P - 1 ranks that hold the others.

Legend: D width, F expert hidden width, G Grove groups, A (token, choice) slots sorted by expert, N
flat tokens or patches, P expert ranks, C capacity rows per rank, L this rank's experts, R received
rows (P x C).

The router stays replicated: every rank scores all E experts for its own tokens, so the loads, the
loss-free balancing bias and the balance / z losses are computed as without expert parallelism.
What moves is the expert computation. The (token, choice) slots, sorted by expert, are cut into P
blocks, one per expert rank (the experts of rank j are j*E/P ... (j+1)*E/P - 1, so each block is one
contiguous run of the sorted slots); each block travels in a static buffer of C rows, C the
capacity per (rank, expert rank) pair. One all-to-all carries the rows, one the number of rows per
local expert; the receiver sorts what it got by local expert, runs its experts (grouped_mm or the
loop, as without expert parallelism) and a third all-to-all brings the results back to the rows
they came from. Every size is a shape: no host synchronisation on the path.

C = the rank's slots (N x K) is dropless and exact; a smaller capacity (a capacity factor) drops
the slots of a block past C, the last ones of its sort (the highest experts, later tokens): those
choices contribute nothing for that token, and they are counted (`MoEStats.overflow`, logged as
moe/overflow), never dropped silently.

The exchange itself (which ranks, which process group, the collective) is the trainer's: an object
with the `ExpertExchange` interface, attached to each layer once when the run is built
(`MoE.shard_experts`), like a parallelize plan. The model imports nothing from the trainer.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from vlm.model.moe_dispatch import Slots, expert_swiglu, sort_by_group


class ExpertExchange(Protocol):
    """The expert-parallel group as a MoE layer sees it."""

    size: int  # P: the ranks the experts are split over
    rank: int  # this rank's place among them: it holds experts rank*E/P ... (rank+1)*E/P - 1
    # capacity per (rank, expert rank) pair as a multiple of the rank's slots / P; None: all of the
    # rank's slots (dropless)
    capacity_factor: float | None

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """[P, ...] -> [P, ...]: row j goes to rank j; row s of the result came from rank s.
        Differentiable (the backward is the reverse exchange); the same shape on every rank."""
        ...

    def common_slots(self, slots: int, device: torch.device) -> int:
        """The slots the capacity is computed from, the same on every rank of the group: `slots`
        where every rank's forward has the same shapes (a GPU's static shapes, a compiled graph),
        the largest over the group on an eager CPU, where the chunk module sizes the concept
        sequence by the batch's boundaries (vlm.model.chunking: the host is the device there)."""
        ...


class LoopbackExchange:
    """An exchange with no other process: every row comes back to where it was (row j of the
    result is row j of the input). With `size` 1 it is exact expert parallelism on one rank; with
    more it computes nothing meaningful and exists to trace the exchanged path's shapes (the
    static-shape test compiles it with fullgraph=True)."""

    def __init__(self, size: int = 1, rank: int = 0, capacity_factor: float | None = None):
        self.size, self.rank, self.capacity_factor = size, rank, capacity_factor

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def common_slots(self, slots: int, device: torch.device) -> int:
        return slots


def capacity(slots: int, ranks: int, factor: float | None) -> int:
    """Rows per (rank, expert rank) block: all of a rank's `slots` (factor None: nothing can be
    dropped), else ceil(factor x slots / ranks), at most `slots`."""
    if factor is None:
        return slots
    return min(slots, math.ceil(factor * slots / ranks))


def local_slice(num_experts: int, size: int, rank: int) -> slice:
    """The routed experts that rank `rank` of `size` holds."""
    if num_experts % size:
        raise ValueError(f"{num_experts} experts cannot be split over {size} ranks")
    n = num_experts // size
    return slice(rank * n, (rank + 1) * n)


def pack(x_ND: torch.Tensor, slots: Slots, ranks: int, C: int):
    """The sender's side: [P, C, D] rows (block j for expert rank j, its slots in expert order, zero
    past them), [P, E/P] rows per local expert of the receiver in each block (after the capacity),
    each sorted slot's place in the buffer (its row, or -1 where it was not sent: padding or past
    the capacity), and the slots past the capacity (0-d)."""
    A = slots.tok_A.shape[0]
    E_local = slots.counts_G.shape[0] // ranks
    cnt_PL = slots.counts_G.view(ranks, E_local)
    cnt_P = cnt_PL.sum(1)
    start_P = cnt_P.cumsum(0) - cnt_P
    p_C = torch.arange(C, device=x_ND.device)
    live_PC = p_C < cnt_P[:, None]
    src_PC = (start_P[:, None] + p_C).clamp(0, max(A - 1, 0))
    x_PCD = x_ND[slots.tok_A[src_PC]].masked_fill(~live_PC[..., None], 0)
    # the first C slots of each block survive: per local expert, what of its run lies below C
    end_PL = cnt_PL.cumsum(1)
    sent_PL = end_PL.clamp_max(C) - (end_PL - cnt_PL).clamp_max(C)
    # where each sorted slot went (padding's sentinel group is E: rank P, not sent)
    dst_A = torch.div(slots.group_A, E_local, rounding_mode="floor")
    pos_A = torch.arange(A, device=x_ND.device) - start_P[dst_A.clamp_max(ranks - 1)]
    row_A = torch.where((dst_A < ranks) & (pos_A < C), dst_A * C + pos_A, -1)
    overflow = (cnt_P - C).clamp_min(0).sum()
    return x_PCD, sent_PL, row_A, overflow


def receive(x_PCD: torch.Tensor, got_PL: torch.Tensor) -> Slots:
    """The receiver's side: the received rows sorted by local expert (rows of block s are sorted by
    expert already and `got_PL[s]` says how many each has; the rest of a block is empty and goes
    last)."""
    P, C = x_PCD.shape[:2]
    E_local = got_PL.shape[1]
    end_PL = got_PL.cumsum(1)
    p_PC = torch.arange(C, device=x_PCD.device).expand(P, C).contiguous()
    expert_PC = torch.searchsorted(end_PL.contiguous(), p_PC, right=True)  # E_local: empty
    return sort_by_group(expert_PC.reshape(-1, 1), E_local)


def exchanged_swiglu(
    x_ND: torch.Tensor,
    slots: Slots,
    w_gate_LDF: torch.Tensor,
    w_up_LDF: torch.Tensor,
    w_down_LFD: torch.Tensor,
    exchange: ExpertExchange,
    use_grouped: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`expert_swiglu` with the experts spread over the exchange's ranks: [A, D], the result of each
    sorted slot's expert (0 for padding and for slots past the capacity), and the number of slots
    past the capacity (0-d). `slots` are sorted by global expert; the weights are this rank's
    E/P experts."""
    P, A, D = exchange.size, slots.tok_A.shape[0], x_ND.shape[-1]
    C = capacity(exchange.common_slots(A, x_ND.device), P, exchange.capacity_factor)
    x_PCD, sent_PL, row_A, overflow = pack(x_ND, slots, P, C)
    got_PCD = exchange.all_to_all(x_PCD)
    got_PL = exchange.all_to_all(sent_PL)
    local = receive(got_PCD, got_PL)
    y_RD = expert_swiglu(
        got_PCD.reshape(P * C, D), local, w_gate_LDF, w_up_LDF, w_down_LFD, use_grouped
    )
    # back into the order the rows arrived in, and home
    y_PCD = y_RD[torch.argsort(local.order_A)].view(P, C, D)
    back_PCD = exchange.all_to_all(y_PCD)
    y_AD = back_PCD.reshape(P * C, D)[row_A.clamp_min(0)].masked_fill((row_A < 0)[:, None], 0)
    return y_AD, overflow
