"""Every collective a training run makes, named here: all ranks call each one, in the same order, so
each is a function called from one place in the step, the trainer or a save (a call that only rank 0
makes would hang the others: keeping them here makes that visible). `tests/test_collectives.py`
fails when any module of vlm/ other than this one calls torch.distributed's collectives.

Without a process group (one process) every collective is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vlm.model.expert_parallel import ExchangeTraffic


# ---------------------------------------------------------------- primitives
def _several() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_reduce(x: torch.Tensor, op) -> torch.Tensor:
    """Reduced over the ranks (a copy; the input is left alone)."""
    if not _several():
        return x.clone()
    y = x.detach().clone()
    dist.all_reduce(y, op=op)
    return y


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    return _all_reduce(x, dist.ReduceOp.SUM)


def all_reduce_min(x: torch.Tensor) -> torch.Tensor:
    return _all_reduce(x, dist.ReduceOp.MIN)


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    return _all_reduce(x, dist.ReduceOp.MAX)


def barrier() -> None:
    """Every rank waits for the others (rank 0 built the default data, wrote the export, ...)."""
    if _several():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s `obj` (picklable: paths, decisions) on every rank."""
    if not _several():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_object(obj) -> list:
    """Every rank's `obj` (picklable), by rank; also a barrier. [obj] without a process group."""
    if not _several():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def side_group():
    """A second group of every rank (gloo: host memory) for the collectives of a background thread
    (a checkpoint's writer), which may run while the main thread's collectives do: two threads
    must not share one group. None without a process group. Collective: every rank creates it,
    in the same order."""
    if not _several():
        return None
    return dist.new_group(backend="gloo")


def side_gather(obj, group) -> list:
    """Every rank's `obj`, by rank, through `side_group`'s group; [obj] without one."""
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(out, obj, group=group)
    return out


def side_broadcast(obj, group, src: int = 0):
    """Rank `src`'s `obj` on every rank, through `side_group`'s group."""
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def broadcast_module(module: torch.nn.Module, src: int = 0) -> None:
    """Every rank's parameters and buffers become rank `src`'s (in place)."""
    if not _several():
        return
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=src)


# ---------------------------------------------------------------- a step's
def loss_statistics(
    sums: dict[str, torch.Tensor], labelled: float, device: torch.device
) -> tuple[dict[str, torch.Tensor], float]:
    """The loss terms' statistics over the global batch (vlm.train.losses.Totals: by term, each in
    its own dtype and shape) and its labelled tokens, in one all-reduce."""
    keys = sorted(sums)
    head = torch.tensor([labelled], dtype=torch.float64, device=device)
    flat = all_reduce_sum(torch.cat([head] + [sums[k].double().flatten() for k in keys]))
    out, i = {}, 1
    for k in keys:
        n = sums[k].numel()
        out[k] = flat[i : i + n].view(sums[k].shape).to(sums[k].dtype)
        i += n
    return out, float(flat[0])


def all_finite(finite: torch.Tensor, device: torch.device) -> bool:
    """Whether a micro-batch's loss (or a step's gradients) is finite on every rank."""
    return float(all_reduce_min(finite.to(torch.float64).reshape(1).to(device))[0]) >= 1.0


def step_metrics(vec: torch.Tensor) -> torch.Tensor:
    """A step's logged sums, histograms and expert loads (vlm.train.metrics.StepAccumulator.reduce),
    and the held-out evaluation's."""
    return all_reduce_sum(vec)


def model_statistics(flat: torch.Tensor) -> torch.Tensor:
    """The statistics the model's forwards accumulated for the updates after an applied step (expert
    loads, top-k quantiles: vlm.model.training_controls.TrainingControls.apply_statistics)."""
    return all_reduce_sum(flat)


def data_counters(vec: torch.Tensor) -> torch.Tensor:
    """The loader's samples read and skipped by reason, overall and per source."""
    return all_reduce_sum(vec)


def per_rank(values: list[float], device: torch.device) -> torch.Tensor:
    """[ranks, len(values)] float64: every rank's `values` (a logged step's wall-clock figures), by
    rank, in one all-reduce of a one-hot block (a few KB at a thousand ranks)."""
    if not _several():
        return torch.tensor([values], dtype=torch.float64)
    block = torch.zeros(dist.get_world_size(), len(values), dtype=torch.float64, device=device)
    block[dist.get_rank()] = torch.tensor(values, dtype=torch.float64, device=device)
    return all_reduce_sum(block).cpu()


def stop_requested(requested: bool, device: torch.device, world_size: int) -> bool:
    """A SIGTERM / SIGINT seen on any rank stops every rank after the same step."""
    if world_size == 1:
        return requested
    return bool(all_reduce_sum(torch.tensor([float(requested)], device=device)).item() > 0)


# ---------------------------------------------------------------- a run's set-up and saves
def decision_of_rank0(choice):
    """Rank 0 decides (the checkpoint to resume from, whether a run folder may be used): every
    rank gets its answer."""
    return broadcast_object(choice, src=0)


def every_rank(obj) -> list:
    """Each rank's part of a decision (its save's error, its refusal of a checkpoint), by rank."""
    return gather_object(obj)


def weights_of_rank0(module: torch.nn.Module) -> None:
    """Every rank's module becomes rank 0's (the vision warm-up trained it on rank 0)."""
    broadcast_module(module, src=0)


# ---------------------------------------------------------------- sequence parallelism
class SequenceGroup:
    """The sequence-parallel group of this rank as the model's row split sees it
    (vlm.model.sequence_parallel.SequenceComm)."""

    def __init__(self, group):
        self.group = group

    def gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def swap(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        out = all_to_all_single_autograd(x.contiguous(), None, None, self.group)
        # the functional collective returns an async tensor: wait before it is reshaped
        return out.wait() if hasattr(out, "wait") else out

    def __deepcopy__(self, memo):
        return self  # a process group is not copied with a module


# ---------------------------------------------------------------- expert parallelism
class GroupExchange:
    """The expert-parallel group of this rank as its MoE layers see it
    (vlm.model.expert_parallel.ExpertExchange): `size` ranks holding E/size experts each, this one
    the `rank`-th; `variable` says how a layer sends its blocks (parallel.exchange). Both
    all-to-alls are torch's functional collective with its autograd (the backward is the reverse
    all-to-all): equal splits, whose sizes are shapes (torch.compile traces it into a graph), or
    the split sizes a layer read on the host."""

    def __init__(
        self, group, size: int, rank: int, capacity_factor: float | None, variable: bool = True
    ):
        self.group, self.size, self.rank = group, size, rank
        self.capacity_factor, self.variable = capacity_factor, variable
        self.traffic = ExchangeTraffic()  # what the forwards sent

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        if not torch.compiler.is_compiling():
            self.traffic.add(x, [x.shape[0] // self.size] * self.size, self.rank)
        return all_to_all_single_autograd(x.contiguous(), None, None, self.group)

    def all_to_all_v(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        self.traffic.add(x, send, self.rank)
        return all_to_all_single_autograd(x.contiguous(), list(recv), list(send), self.group)

    def common_slots(self, slots: int, device: torch.device) -> int:
        if device.type != "cpu" or torch.compiler.is_compiling():
            return slots
        return int(expert_group_max(torch.tensor([slots]), self.group)[0])

    def __deepcopy__(self, memo):
        return self  # a process group is not copied with a module


def expert_group_max(x: torch.Tensor, group) -> torch.Tensor:
    """The largest value over an expert-parallel group (a copy)."""
    y = x.detach().clone()
    dist.all_reduce(y, op=dist.ReduceOp.MAX, group=group)
    return y


def all_gather_experts(x: torch.Tensor, exchange: GroupExchange) -> torch.Tensor:
    """[n, ...] on each rank of the expert-parallel group -> [size * n, ...], by rank (a layer's
    whole set of routed experts from its shards: an export)."""
    parts = [torch.empty_like(x) for _ in range(exchange.size)]
    dist.all_gather(parts, x.detach().contiguous(), group=exchange.group)
    return torch.cat(parts)


def expert_gradient_square(local: torch.Tensor) -> torch.Tensor:
    """The squared gradient norm of the expert parameters summed over every rank (each rank holds
    other experts, or the same ones in another expert-data-parallel replica)."""
    return all_reduce_sum(local)


def place_in(group) -> tuple[int, int]:
    """(this rank's place in process group `group`, the group's size); None: the world."""
    return dist.get_rank(group), dist.get_world_size(group)
