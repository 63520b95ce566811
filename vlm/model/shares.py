"""What one rank keeps of each parameter: the one place that says it (the build, the loaders, the
size check and `vlm plan` all ask here).

A rank's share of a parameter is a run of its rows (dim 0) and, within those rows, a run of flat
(row-major) elements:
- a MoE layer's routed experts with expert parallelism (`parallel.expert` P > 1): rank r of its
  expert group keeps experts r*E/P ... (r+1)*E/P - 1, the rows of its slice (the same rule as
  vlm.model.expert_parallel.local_slice);
- ZeRO-3: each tensor (after the expert slice) is cut into `world` equal flat partitions, the last
  padded (DeepSpeed's layout: partition p = ceil(numel / world) elements, rank r keeps
  r*p ... (r+1)*p - 1 of the flat tensor); expert shards are partitioned over their replicas;
- everything else is whole on every rank (ZeRO 1/2 partition the optimizer's flat groups, not the
  weights).
The dtype a rank holds its weights in is the engine's training dtype: bf16 with deepspeed.bf16,
else fp32 (the optimizer's fp32 master copies are the optimizer's, not the weights').

`building(sharding)` states the sharding of the model being constructed; the modules that build
their tensors at their share from construction on (vlm.model.moe.MoE's experts) read it with
`current()`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from dataclasses import dataclass
from typing import Iterable

import torch

# the routed experts' weights of a MoE layer: [E, ...], one row per expert
ROUTED_EXPERT = re.compile(r"(^|\.)moe\.(w_gate_EDF|w_up_EDF|w_down_EFD)$")


def is_routed_expert(name: str) -> bool:
    """`name` (a parameter's, as named_parameters gives it) is a MoE layer's routed-expert weight."""
    return ROUTED_EXPERT.search(name) is not None


@dataclass(frozen=True)
class Sharding:
    """How the ranks share the weights, seen from one rank."""

    world: int = 1  # ranks in the job (ZeRO-3 partitions over all of them)
    rank: int = 0
    zero_stage: int = 0
    expert: int = 1  # P: ranks a MoE layer's routed experts are split over (consecutive ranks)
    bf16: bool = False  # weights held in bf16 (deepspeed.bf16), else fp32

    @classmethod
    def of(cls, layout, zero_stage: int, bf16: bool) -> Sharding:
        """The sharding of `layout` (vlm.train.layout.ParallelLayout, or anything with world,
        rank and expert) under ZeRO `zero_stage`."""
        return cls(layout.world, layout.rank, int(zero_stage), layout.expert, bool(bf16))

    @property
    def expert_rank(self) -> int:
        return self.rank % self.expert

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def bytes_per_param(self) -> int:
        return 2 if self.bf16 else 4

    @property
    def whole(self) -> bool:
        """Every rank holds every weight whole, in fp32: the build of a single process."""
        return self.zero_stage < 3 and self.expert == 1 and not self.bf16


WHOLE = Sharding()


@dataclass(frozen=True)
class Share:
    """What a rank keeps of one parameter of shape `shape`: rows `rows` of dim 0 (its local
    tensor), and elements `flat` of that local tensor, flattened."""

    shape: tuple[int, ...]
    rows: tuple[int, int]
    flat: tuple[int, int]

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the tensor the rank builds (its rows), before any ZeRO-3 partition."""
        return (self.rows[1] - self.rows[0], *self.shape[1:]) if self.shape else ()

    @property
    def numel(self) -> int:
        """Elements the rank keeps."""
        return self.flat[1] - self.flat[0]

    @property
    def whole_range(self) -> tuple[int, int]:
        """The kept elements as a range of the whole tensor, flattened."""
        base = self.rows[0] * self.row_numel
        return base + self.flat[0], base + self.flat[1]

    @property
    def is_whole(self) -> bool:
        return self.numel == math.prod(self.shape)


def expert_rows(num_experts: int, expert: int, expert_rank: int) -> tuple[int, int]:
    """The routed experts rank `expert_rank` of `expert` holds (ValueError where they do not divide)."""
    if num_experts % expert:
        raise ValueError(f"{num_experts} experts cannot be split over {expert} ranks")
    n = num_experts // expert
    return expert_rank * n, (expert_rank + 1) * n


def zero3_partition(numel: int, ranks: int, rank: int) -> tuple[int, int, int]:
    """DeepSpeed ZeRO-3's partition of a tensor of `numel` elements over `ranks`: (start, stop,
    partition size) of rank `rank` (stop - start < size on the last ranks: padding)."""
    size = -(-numel // ranks) if numel else 0
    start = min(rank * size, numel)
    return start, min(start + size, numel), size


def share_of(sharding: Sharding, name: str, shape: Iterable[int]) -> Share:
    """What this rank of `sharding` keeps of parameter `name` whose whole shape is `shape`."""
    shape = tuple(int(s) for s in shape)
    expert = sharding.expert > 1 and is_routed_expert(name) and len(shape) >= 1
    rows = (
        expert_rows(shape[0], sharding.expert, sharding.expert_rank)
        if expert
        else (0, shape[0] if shape else 1)
    )
    local = (rows[1] - rows[0]) * math.prod(shape[1:])
    if sharding.zero_stage == 3:
        # expert shards are partitioned over their replicas, everything else over the world
        ranks, rank = (
            (sharding.world // sharding.expert, sharding.rank // sharding.expert)
            if expert
            else (sharding.world, sharding.rank)
        )
        start, stop, _ = zero3_partition(local, ranks, rank)
        return Share(shape, rows, (start, stop))
    return Share(shape, rows, (0, local))


def rank_bytes(named_shapes: Iterable[tuple[str, Iterable[int]]], sharding: Sharding) -> int:
    """Bytes of weights this rank of `sharding` keeps of the parameters (name, whole shape)."""
    return sum(share_of(sharding, n, s).numel for n, s in named_shapes) * sharding.bytes_per_param


_CURRENT: contextvars.ContextVar[Sharding] = contextvars.ContextVar("sharding", default=WHOLE)


def current() -> Sharding:
    """The sharding of the model being built (WHOLE outside `building`)."""
    return _CURRENT.get()


@contextlib.contextmanager
def building(sharding: Sharding):
    """Inside: the modules constructed build their tensors at `sharding`'s share."""
    token = _CURRENT.set(sharding)
    try:
        yield sharding
    finally:
        _CURRENT.reset(token)
