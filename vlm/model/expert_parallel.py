"""Expert parallelism, the model's side: a MoE layer that holds E/P of the routed experts and
exchanges tokens with the P - 1 ranks that hold the others.

Legend: D width, F expert hidden width, G Grove groups, A (token, choice) slots sorted by expert, N
flat tokens or patches, P expert ranks, C capacity rows per rank, L this rank's experts, R received
rows, S sent rows.

The router stays replicated: every rank scores all E experts for its own tokens, so the loads, the
loss-free balancing bias and the balance / z losses are computed as without expert parallelism.
What moves is the expert computation. The (token, choice) slots, sorted by expert, are cut into P
blocks, one per expert rank (the experts of rank j are j*E/P ... (j+1)*E/P - 1, so each block is one
contiguous run of the sorted slots). The receiver sorts what it got by local expert, runs its
experts (grouped_mm or the loop, as without expert parallelism) and the reverse exchange brings
the results back to the slots they came from; the backward of each exchange is the reverse one.
A block travels in one of two ways (`ExpertExchange.variable`, the run's `parallel.exchange`):

- variable (the default): its real rows. One all-to-all of the [P, L] rows per (expert rank,
  local expert) goes first; the host reads the sizes once per layer (the one sanctioned host read
  on the model path, as torchtitan and Megatron-Core do), and an all-to-all with those split sizes
  sends each block's rows, S in all (the rank's routed slots), R received. A rank sends and
  computes what was routed, whatever P: nothing grows with the number of ranks. The sizes depend
  on the data, so this part runs eagerly (`torch.compiler.disable`): a compiled block breaks its
  graph around it.
- static: a buffer of C rows per block, C the capacity per (rank, expert rank) pair, zero past the
  block's rows, and a second small all-to-all of the [P, L] counts. Every size is a shape: no host
  synchronisation, fullgraph compilation and CUDA-graph capture; but dropless (C = all N x K of a
  rank's slots) sends and computes P times the routed rows.

A capacity factor sets C = ceil(factor x slots / P) in both ways (the variable exchange then sends
min(block, C) rows): the slots of a block past C, the last ones of its sort (the highest experts,
later tokens), contribute nothing for that token, and they are counted (`MoEStats.overflow`,
logged as moe/overflow), never dropped silently. Without a factor nothing is dropped and the layer
computes exactly what one rank holding every expert computes.

The exchange itself (which ranks, which process group, the collectives) is the trainer's: an
object with the `ExpertExchange` interface, attached to each layer once when the run is built
(`MoE.shard_experts`), like a parallelize plan. The model imports nothing from the trainer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from vlm.model.moe_dispatch import Slots, expert_swiglu, sort_by_group


class ExpertExchange(Protocol):
    """The expert-parallel group as a MoE layer sees it."""

    size: int  # P: the ranks the experts are split over
    rank: int  # this rank's place among them: it holds experts rank*E/P ... (rank+1)*E/P - 1
    # capacity per (rank, expert rank) pair as a multiple of the rank's slots / P; None: all of the
    # rank's slots (dropless)
    capacity_factor: float | None
    # True: each block travels at its real size (`all_to_all_v`, the sizes read on the host once per
    # layer); False: in a static [P, C] buffer (`all_to_all`, no host read)
    variable: bool
    traffic: ExchangeTraffic  # the bytes its all-to-alls sent (and their backwards will)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """[P, ...] -> [P, ...]: row j goes to rank j; row s of the result came from rank s.
        Differentiable (the backward is the reverse exchange); the same shape on every rank."""
        ...

    def all_to_all_v(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """[sum(send), ...] -> [sum(recv), ...]: the next send[j] rows go to rank j; the next
        recv[s] rows of the result came from rank s (what rank s's `send[rank]` said).
        Differentiable (the backward is the exchange with `send` and `recv` swapped)."""
        ...

    def common_slots(self, slots: int, device: torch.device) -> int:
        """The slots the capacity is computed from, the same on every rank of the group: `slots`
        where every rank's forward has the same shapes (a GPU's static shapes, a compiled graph),
        the largest over the group on an eager CPU, where the chunk module sizes the concept
        sequence by the batch's boundaries (vlm.model.chunking: the host is the device there)."""
        ...


class ExchangeTraffic:
    """Bytes an exchange sent, counted on the host from the shapes and split sizes (no read of a
    device value): `forward` through the forwards' all-to-alls (the block a rank keeps included:
    it is part of the collective), `backward` what their reverse exchanges will send (autograd
    runs them: the differentiable ones, the rows), `to_peers` the forwards' bytes to the other
    ranks, and `calls`. Eager calls only: a compiled graph's static exchange is not counted.
    `clear()` starts again."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.forward = self.backward = self.to_peers = self.calls = 0

    def add(self, x: torch.Tensor, send: list[int], rank: int) -> None:
        row = math.prod(x.shape[1:]) * x.element_size()
        self.forward += sum(send) * row
        self.backward += sum(send) * row if x.requires_grad else 0
        self.to_peers += (sum(send) - send[rank]) * row
        self.calls += 1


class LoopbackExchange:
    """An exchange with no other process: every row comes back to where it was (row j of the
    result is row j of the input). With `size` 1 it is exact expert parallelism on one rank; with
    more it computes nothing meaningful and exists to trace the exchanged path's shapes (the
    static-shape test compiles it with fullgraph=True) and to time what surrounds the exchange;
    its `traffic` is what rank `rank` of `size` would send."""

    def __init__(
        self,
        size: int = 1,
        rank: int = 0,
        capacity_factor: float | None = None,
        variable: bool = True,
    ):
        self.size, self.rank, self.capacity_factor = size, rank, capacity_factor
        self.variable = variable
        self.traffic = ExchangeTraffic()

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            self.traffic.add(x, [x.shape[0] // self.size] * self.size, self.rank)
        return x.clone()

    def all_to_all_v(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        if list(send) != list(recv):  # what came back is what was sent: the sizes must agree
            raise ValueError(f"a loopback exchange receives what it sends: {send} != {recv}")
        self.traffic.add(x, send, self.rank)
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


def sent_per_local_expert(cnt_PL: torch.Tensor, C: int) -> torch.Tensor:
    """[P, L]: the rows of each block that fit its capacity C, per local expert of the receiver
    (the first C of the block, in expert order)."""
    end_PL = cnt_PL.cumsum(1)
    return end_PL.clamp_max(C) - (end_PL - cnt_PL).clamp_max(C)


def received_slots(got_PL: torch.Tensor, rows: int) -> Slots:
    """The receiver's view of the `rows` rows a variable exchange brought, block s of which holds
    got_PL[s, l] rows of local expert l, in expert order: sorted by local expert."""
    P, L = got_PL.shape
    expert_PL = torch.arange(L, device=got_PL.device).expand(P, L)
    expert_R = expert_PL.reshape(-1).repeat_interleave(got_PL.reshape(-1), output_size=rows)
    return sort_by_group(expert_R.reshape(-1, 1), L)


def pack(x_ND: torch.Tensor, slots: Slots, ranks: int, C: int):
    """The static sender's side: [P, C, D] rows (block j for expert rank j, its slots in expert
    order, zero past them), [P, E/P] rows per local expert of the receiver in each block (after
    the capacity), each sorted slot's place in the buffer (its row, or -1 where it was not sent:
    padding or past the capacity), and the slots past the capacity (0-d)."""
    A = slots.tok_A.shape[0]
    E_local = slots.counts_G.shape[0] // ranks
    cnt_PL = slots.counts_G.view(ranks, E_local)
    cnt_P = cnt_PL.sum(1)
    start_P = cnt_P.cumsum(0) - cnt_P
    p_C = torch.arange(C, device=x_ND.device)
    live_PC = p_C < cnt_P[:, None]
    src_PC = (start_P[:, None] + p_C).clamp(0, max(A - 1, 0))
    x_PCD = x_ND[slots.tok_A[src_PC]].masked_fill(~live_PC[..., None], 0)
    sent_PL = sent_per_local_expert(cnt_PL, C)
    # where each sorted slot went (padding's sentinel group is E: rank P, not sent)
    dst_A = torch.div(slots.group_A, E_local, rounding_mode="floor")
    pos_A = torch.arange(A, device=x_ND.device) - start_P[dst_A.clamp_max(ranks - 1)]
    row_A = torch.where((dst_A < ranks) & (pos_A < C), dst_A * C + pos_A, -1)
    overflow = (cnt_P - C).clamp_min(0).sum()
    return x_PCD, sent_PL, row_A, overflow


def receive(x_PCD: torch.Tensor, got_PL: torch.Tensor) -> Slots:
    """The static receiver's side: the received rows sorted by local expert (rows of block s are
    sorted by expert already and `got_PL[s]` says how many each has; the rest of a block is empty
    and goes last)."""
    P, C = x_PCD.shape[:2]
    E_local = got_PL.shape[1]
    end_PL = got_PL.cumsum(1)
    p_PC = torch.arange(C, device=x_PCD.device).expand(P, C).contiguous()
    expert_PC = torch.searchsorted(end_PL.contiguous(), p_PC, right=True)  # E_local: empty
    return sort_by_group(expert_PC.reshape(-1, 1), E_local)


# what the receiver computes on its rows: [R, D] rows and their sort by local expert -> [R, D],
# row by row (the experts' SwiGLU; the identity where only the exchange is timed)
Compute = Callable[[torch.Tensor, Slots], torch.Tensor]


def _in_arrival_order(y_RD: torch.Tensor, local: Slots) -> torch.Tensor:
    """The receiver's results, computed in local-expert order, back in the order the rows came."""
    return y_RD[torch.argsort(local.order_A)]


def static_round_trip(
    x_ND: torch.Tensor, slots: Slots, exchange: ExpertExchange, compute: Compute
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sorted slot's result [A, D] (0 for padding and past the capacity) and the slots past
    the capacity (0-d), through static [P, C] buffers: every size a shape."""
    P, A, D = exchange.size, slots.tok_A.shape[0], x_ND.shape[-1]
    C = capacity(exchange.common_slots(A, x_ND.device), P, exchange.capacity_factor)
    x_PCD, sent_PL, row_A, overflow = pack(x_ND, slots, P, C)
    got_PCD = exchange.all_to_all(x_PCD)
    got_PL = exchange.all_to_all(sent_PL)
    local = receive(got_PCD, got_PL)
    y_PCD = _in_arrival_order(compute(got_PCD.reshape(P * C, D), local), local).view(P, C, D)
    back_PCD = exchange.all_to_all(y_PCD)
    y_AD = back_PCD.reshape(P * C, D)[row_A.clamp_min(0)].masked_fill((row_A < 0)[:, None], 0)
    return y_AD, overflow


@dataclass
class VariablePlan:
    """What the sizes of one layer's variable exchange are (read on the host once)."""

    send: list[int]  # rows this rank sends to each expert rank
    recv: list[int]  # rows it receives from each
    src_S: torch.Tensor  # the sorted slot each sent row is
    got_PL: torch.Tensor  # rows received per (sending rank, local expert)
    overflow: torch.Tensor  # 0-d: the slots past the capacity


def plan_variable(slots: Slots, exchange: ExpertExchange, device: torch.device) -> VariablePlan:
    """The counts first: one all-to-all of the [P, L] rows per (expert rank, local expert), then
    the one host read of this layer (what is sent and received per rank)."""
    P, A = exchange.size, slots.tok_A.shape[0]
    L = slots.counts_G.shape[0] // P
    cnt_PL = slots.counts_G.view(P, L)
    if exchange.capacity_factor is None:
        sent_PL = cnt_PL
    else:
        C = capacity(exchange.common_slots(A, device), P, exchange.capacity_factor)
        sent_PL = sent_per_local_expert(cnt_PL, C)
    got_PL = exchange.all_to_all(sent_PL)
    cnt_P, sent_P = cnt_PL.sum(1), sent_PL.sum(1)
    sizes = torch.cat([sent_P, got_PL.sum(1)]).tolist()  # the host read
    send, recv = sizes[:P], sizes[P:]
    S = sum(send)
    # block j's first sent_P[j] sorted slots, block after block: a shift per block
    shift_P = (cnt_P.cumsum(0) - cnt_P) - (sent_P.cumsum(0) - sent_P)
    src_S = torch.arange(S, device=device) + shift_P.repeat_interleave(sent_P, output_size=S)
    return VariablePlan(send, recv, src_S, got_PL, (cnt_P - sent_P).sum())


@torch.compiler.disable  # the sizes are data: a compiled block breaks its graph here
def variable_round_trip(
    x_ND: torch.Tensor, slots: Slots, exchange: ExpertExchange, compute: Compute
) -> tuple[torch.Tensor, torch.Tensor]:
    """`static_round_trip` with every block at its real size: a rank sends its routed slots
    (within the capacity), S rows, and computes the R rows the others routed to its experts."""
    A, D = slots.tok_A.shape[0], x_ND.shape[-1]
    plan = plan_variable(slots, exchange, x_ND.device)
    x_SD = x_ND[slots.tok_A[plan.src_S]]
    got_RD = exchange.all_to_all_v(x_SD, plan.send, plan.recv)
    local = received_slots(plan.got_PL, got_RD.shape[0])
    y_RD = _in_arrival_order(compute(got_RD, local), local)
    back_SD = exchange.all_to_all_v(y_RD, plan.recv, plan.send)
    y_AD = back_SD.new_zeros(A, D).index_copy(0, plan.src_S, back_SD)
    return y_AD, plan.overflow


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

    def compute(got_RD: torch.Tensor, local: Slots) -> torch.Tensor:
        return expert_swiglu(got_RD, local, w_gate_LDF, w_up_LDF, w_down_LFD, use_grouped)

    trip = variable_round_trip if exchange.variable else static_round_trip
    return trip(x_ND, slots, exchange, compute)
