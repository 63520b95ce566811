"""Expert parallelism, the trainer's side (the model's: vlm.model.expert_parallel).

`parallel.expert: P` splits every MoE layer's routed experts over P ranks; the world's W ranks form
W/P expert-parallel groups of P consecutive ranks (DeepSpeed's layout), and the W/P ranks holding
the same shard (r, r + P, r + 2P, ...) are its expert-data-parallel group. Everything else (the
router, shared and Grove adjugate experts, attention, embeddings, the vision tower) is replicated on
every rank as before.

Built once with the run (`set_up`, between the model and the engine): DeepSpeed's process groups;
each MoE layer holds its slice of the experts from construction on (vlm.train.build_share: a rank
allocates its E/P experts only and keeps its rows of the whole build's draws, so the shards are
exactly what one rank holding every expert would train; a layer built whole keeps its slice here)
and gets the exchange of its group; the expert parameters carry DeepSpeed's marks
(`allreduce = False`, `group_name`), so that the engine reduces their gradients within their
expert-data-parallel group only (divided by W, the world, as for every other gradient: a shard's
gradient sums every rank's tokens already, which the exchange's backward brought home), ZeRO 1/2
partitions them over that group, and the optimizer's groups put them apart (`split_groups`). ZeRO-3
partitions expert weights only for DeepSpeed's own AutoEP layers: the engine is shown an AutoEP
marker and the expert parameters carry AutoEP's placement (`deepspeed_view`), so that it partitions
each shard over its expert-data-parallel group and everything else over the world. How each MoE
layer's tokens travel (parallel.exchange: variable or static) is its exchange's
(collectives.GroupExchange).

The gradient norm for `optim.clip` is exact on every path: ZeRO 1/2 and the bf16 optimizer sum each
rank's partitions over the world; on the plain fp32 path DeepSpeed would average each rank's own
norm, so the optimizer clips there itself (`ExpertAwareClip`).

Checkpoints: DeepSpeed's files as its MoE support writes them (the module from rank 0, the optimizer
per expert rank or ZeRO partition) and, from every rank, `experts_rank_NNNNN.pt`, its shard of the
routed experts (under ZeRO-3 gathered from its partitions), restored after DeepSpeed's load
(`restore_shard`; under ZeRO-3 into its partitions). Under every optimizer form but fp16 (ZeRO 0,
ZeRO 1-2 and ZeRO 3, fp32 or bf16) a checkpoint resumes on any expert degree and number of ranks
under the same form (its shards regrouped on load: vlm.train.expert_regroup,
vlm.train.expert_regroup_zero3), under fp16 or another form on the degree and the number of ranks
that wrote it (`check_resume`: one line otherwise);
its weights start a run of any degree through `train.init_from` (vlm.train.checkpoint_tensors reads each
rank's rows from the shards that hold them). The export gathers the shards (`gathered_experts`):
final/ holds every expert.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from configs.config import ConfigError
from vlm.model.moe import MoE
from vlm.model.share_init import whole_shape
from vlm.train import collectives
from vlm.train.engine import load_mapped, optimizer_form

SHARD_FILE = "experts_rank_{:05d}.pt"


@dataclass(frozen=True)
class ExpertParallel:
    size: int  # P: ranks the experts of a layer are split over
    rank: int  # this rank's place in its expert-parallel group
    replicas: int  # ranks holding the same shard (its expert-data-parallel group)
    group_name: str  # DeepSpeed's name of the groups
    exchange: collectives.GroupExchange
    local_params: int  # routed-expert parameters this rank holds
    total_params: int  # ... in the whole model

    def banner(self) -> str:
        cap = self.exchange.capacity_factor
        how = (
            "variable (each block's real rows; counts read on the host per layer)"
            if self.exchange.variable
            else "static (every block padded to the capacity)"
        )
        return (
            f"experts: 1/{self.size} per rank ({self.local_params:,} of {self.total_params:,} "
            f"expert parameters); {self.replicas} rank(s) per shard; all-to-all {how}, capacity "
            + ("dropless (every slot)" if cap is None else f"{cap:g} x slots / {self.size}")
        )


def moe_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def sharded_layers(module: nn.Module) -> list[MoE]:
    return [m for m in moe_layers(module) if m.exchange is not None]


def experts_train(module: nn.Module) -> bool:
    """Some sharded routed expert is trained (not frozen)."""
    return any(p.requires_grad for m in sharded_layers(module) for p in m.routed_expert_weights())


def is_expert(p: torch.Tensor) -> bool:
    """DeepSpeed's mark of an expert parameter (deepspeed.moe.utils.is_moe_param)."""
    return getattr(p, "allreduce", True) is False


def mark_expert(p: torch.Tensor, group_name: str) -> None:
    """Mark `p` as DeepSpeed marks an expert parameter of its own MoE layers: `allreduce` False
    (deepspeed.moe.utils.is_moe_param: its gradient is reduced within the expert-data-parallel
    group only) and `group_name`, the expert groups' name (its engine and ZeRO find that group by
    it). Attributes its MoE layer sets, not an API (tests/test_deepspeed_internals.py pins the
    DeepSpeed version this was written for)."""
    p.allreduce, p.group_name = False, group_name


def set_up(model: nn.Module, parallel, layout, groups) -> ExpertParallel | None:
    """Split the model's routed experts over `layout.expert` ranks (None, nothing done, for 1), in
    the expert groups `groups` (vlm.train.distributed.make_groups) holds. ConfigError (one line)
    where a layer's experts do not divide."""
    P = layout.expert
    if P == 1:
        return None
    layers = moe_layers(model)
    if not layers:
        raise ConfigError(f"parallel.expert={P}: the model has no MoE layer to split")
    for E in sorted({m.num_experts for m in layers}):
        if E % P:
            raise ConfigError(
                f"parallel.expert={P} does not divide a MoE layer's {E} experts "
                "(model.moe.num_experts / model.concept_moe.num_experts): use a divisor of it"
            )
    # layers built at their shard (vlm.train.build_share) hold E/P experts from construction on;
    # a whole one keeps its slice here
    name = groups.expert_name
    exchange = collectives.GroupExchange(
        groups.expert, P, layout.expert_rank, parallel.capacity_factor, parallel.variable_exchange
    )
    total = sum(math.prod(whole_shape(p)) for m in layers for p in m.routed_expert_weights())
    for m in layers:
        m.shard_experts(exchange)
        for p in m.routed_expert_weights():
            mark_expert(p, name)
    local = sum(p.numel() for m in layers for p in m.routed_expert_weights())
    return ExpertParallel(
        P, layout.expert_rank, layout.expert_replicas, name, exchange, local, total
    )


def even_eval_batches(batches: list, ep: ExpertParallel | None, device: torch.device) -> list:
    """The held-out batches cut to the fewest any rank has: with experts split every forward is a
    collective, so the ranks must run as many (a rank left with none uses its step's batch, as
    all do then)."""
    if ep is None:
        return batches
    n = collectives.all_reduce_min(torch.tensor([len(batches)], device=device))
    return batches[: int(n[0])]


def split_groups(groups: list[dict], ep: ExpertParallel | None) -> list[dict]:
    """The optimizer's groups with the expert parameters apart, as DeepSpeed's MoE support needs
    them (deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer): each in a group
    of its own, named by its expert-parallel groups and marked `moe`, with the settings of the group
    it came from (`label` keeps that group's name for the banner)."""
    if ep is None:
        return groups
    out = []
    for g in groups:
        dense = [p for p in g["params"] if not is_expert(p)]
        experts = [p for p in g["params"] if is_expert(p)]
        if dense:
            out.append({**g, "params": dense})
        if experts:
            label = f"{g['name']} (experts, 1/{ep.size})"
            out.append({**g, "params": experts, "name": ep.group_name, "moe": True, "label": label})
    return out


@contextlib.contextmanager
def deepspeed_view(model: nn.Module, ep: ExpertParallel | None, zero_stage: int = 0):
    """While DeepSpeed's engine is built around `model`: a parameterless marker of DeepSpeed's own
    MoE layer class inside it. The engine decides that a model has expert parameters
    (`has_moe_layers`: expert gradients reduced within their replicas, ZeRO groups split, MoE
    checkpoint files) only by finding an instance of that class while it is built; our layers
    are not DeepSpeed's (their router, Grove adjugates, balancing and exchange are ours). Under
    ZeRO-3 the marker is of its AutoEP layer class (the one its ZeRO-3 accepts) and the expert
    parameters carry AutoEP's placement (`ds_zero_placement_family`: partitioned over their
    expert-data-parallel group, not the world), frozen ones too: ZeRO-3 partitions every
    parameter. The marker is gone when the engine exists: the model keeps only its own modules.
    All of it is DeepSpeed's inside, not an API (tests/test_deepspeed_internals.py pins the
    DeepSpeed version this was written for)."""
    zero3 = ep is not None and zero_stage == 3
    # frozen experts under ZeRO 0-2: nothing to reduce, no optimizer state
    if ep is None or not (experts_train(model) or zero3):
        yield
        return
    if zero3:
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer as DeepSpeedMoE

        for m in sharded_layers(model):
            for p in m.routed_expert_weights():
                p.ds_zero_placement_family = "autoep_expert"
                p.ds_zero_partition_group_name = ep.group_name
    else:
        from deepspeed.moe.layer import MoE as DeepSpeedMoE

    class ExpertMarker(DeepSpeedMoE):
        def __init__(self):
            nn.Module.__init__(self)
            self.num_experts = max(m.num_experts for m in sharded_layers(model))
            self.ep_size, self.expert_group_name = ep.size, ep.group_name
            self.num_local_experts = 0  # the shards are saved by save_shard

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_=False, **_):
            pass  # the groups exist: set_up made them

        def forward(self, *args, **kwargs):
            raise RuntimeError("the expert-parallel marker computes nothing")

    name = "_deepspeed_expert_marker"
    model.add_module(name, ExpertMarker())
    try:
        yield
    finally:
        del model._modules[name]


def plain_fp32_clip(ep: ExpertParallel | None, ds_json: dict, plain: bool):
    """On the plain fp32 path with expert parallelism: (the DeepSpeed JSON without its own gradient
    clipping, the optimizer's exact clipping); else (ds_json, None)."""
    clip = float(ds_json.get("gradient_clipping") or 0.0)
    if ep is None or not plain or clip <= 0:
        return ds_json, None
    return {**ds_json, "gradient_clipping": 0.0}, ExpertAwareClip(clip, ep.replicas)


class ExpertAwareClip:
    """`optim.clip` by the global gradient norm where some parameters are expert shards: the
    replicated parameters' squared norm (the same on every rank) plus the expert shards' summed over
    every rank once (each shard's replicas hold the same gradient, hence / replicas); then
    DeepSpeed's rule, g * min(1, clip / (norm + 1e-6)). Returns the norm."""

    def __init__(self, max_norm: float, replicas: int):
        self.max_norm, self.replicas = max_norm, replicas

    @torch.no_grad()
    def __call__(self, params: list[torch.Tensor]) -> torch.Tensor:
        grads = [(p.grad, is_expert(p)) for p in params if p.grad is not None]
        if not grads:
            return torch.zeros(())
        dev = grads[0][0].device
        sq = torch.zeros(2, dtype=torch.float32, device=dev)
        for g, expert in grads:
            sq[int(expert)] += g.detach().float().norm().square()
        experts = collectives.expert_gradient_square(sq[1:]) / self.replicas
        norm = (sq[0] + experts[0]).sqrt()
        coef = (self.max_norm / (norm + 1e-6)).clamp_max(1.0)
        for g, _ in grads:
            g.mul_(coef.to(g.dtype))
        return norm


# ---------------------------------------------------------------- checkpoints
def _named_shard(module: nn.Module) -> dict[str, torch.Tensor]:
    ids = {id(p) for m in sharded_layers(module) for p in m.routed_expert_weights()}
    return {n: p for n, p in module.named_parameters() if id(p) in ids}


@contextlib.contextmanager
def _whole_shard(params: list[torch.Tensor], written: bool):
    """Collective under ZeRO-3: inside, each expert parameter holds this rank's whole shard
    (ZeRO-3 partitions it over its expert-data-parallel group: gathered there); `written`: what
    the group's first rank holds on leaving is partitioned again. Nothing to do otherwise."""
    if not any(hasattr(p, "ds_id") for p in params):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=0 if written else None):
        yield


def save_shard(module: nn.Module, folder: Path, rank: int, world_size: int, save) -> None:
    """This rank's routed experts into `folder`/experts_rank_NNNNN.pt with the expert degree and
    the ranks that wrote it (nothing without expert parallelism); `save(obj, path)`: the
    checkpoint's writer. Collective under ZeRO-3."""
    layers = sharded_layers(module)
    if not layers:
        return
    ex = layers[0].exchange
    named = _named_shard(module)
    with _whole_shard(list(named.values()), written=False):
        tensors = {n: p.detach().cpu().clone() for n, p in named.items()}
    state = {
        "expert_parallel": ex.size,
        "expert_rank": ex.rank,
        "world_size": world_size,
        "tensors": tensors,
    }
    save(state, Path(folder) / SHARD_FILE.format(rank))


def written_degree(ckpt: Path) -> tuple[int, int | None]:
    """(parallel.expert, ranks) of the run that wrote `ckpt`: (1, None) for a checkpoint without
    expert shards."""
    first = Path(ckpt) / SHARD_FILE.format(0)
    if not first.is_file():
        return 1, None
    state = load_mapped(first)
    return int(state["expert_parallel"]), int(state["world_size"])


# the optimizer forms whose expert shards and moments regroup onto another degree or number of
# ranks (vlm.train.expert_regroup), as vlm.train.engine.optimizer_form names them
REGROUPS = {
    "zero0": "ZeRO 0 fp32",
    "zero0-bf16": "ZeRO 0 bf16",
    "zero12": "ZeRO 1-2 (fp32 or bf16)",
    "zero3": "ZeRO 3 (fp32 or bf16)",
}
FORMS = {**REGROUPS, "fp16": "fp16"}


def check_resume(ckpt: Path, expert: int, world_size: int, form: str) -> None:
    """A checkpoint resumes on any expert degree and number of ranks (its expert shards and their
    Adam moments regrouped on load: vlm.train.expert_regroup) where it and this run keep the
    optimizer state in the same form (`form`: vlm.train.engine.optimizer_form) and that form
    regroups (REGROUPS); otherwise on the degree and, with experts split, the ranks that wrote it
    only: ConfigError (one line) otherwise."""
    P, W = written_degree(ckpt)
    if P == expert and (P == 1 or W == world_size):
        return
    written = written_form(ckpt)
    if written == form and form in REGROUPS:
        return
    was = f"parallel.expert={P}" + (f" on {W} ranks" if W else "")
    now = f"parallel.expert={expert} on {world_size} rank(s)"
    raise ConfigError(
        f"cannot resume from {ckpt}: written with {was}, this run has {now}; expert shards and "
        "their Adam moments move to another degree or number of ranks only between runs that "
        f"keep the optimizer the same way, under {' or '.join(REGROUPS.values())} (this run: "
        f"{FORMS[form]}; the checkpoint: {FORMS[written]}): resume with {was}, or start a new "
        f"run from its weights with train.init_from={ckpt}"
    )


def written_form(ckpt: Path) -> str:
    """How `ckpt` keeps its optimizer state, named as vlm.train.engine.optimizer_form names a
    run's: from the DeepSpeed config its ZeRO files record, else (stage 0) from its optimizer
    state (DeepSpeed's fp16 optimizers, which run bf16 at stage 0, keep fp32 copies beside it)."""
    ds = Path(ckpt) / "ds"
    zero = sorted(ds.glob("*zero_pp_rank_*_optim_states.pt")) if ds.is_dir() else []
    if zero:
        return optimizer_form(load_mapped(zero[0]).get("ds_config") or {})
    files = sorted(ds.glob("expp_rank_*_optim_states.pt")) if ds.is_dir() else []
    files = files or ([ds / "mp_rank_00_model_states.pt"] if ds.is_dir() else [])
    for path in files[:1]:
        held = load_mapped(path).get("optimizer") or {}
        if "fp32_groups" in held or "fp32_groups_flat" in held:
            return "zero0-bf16"
    return "zero0"


def restore_shard(module: nn.Module, ckpt: Path, rank: int) -> str | None:
    """This rank's routed experts from `ckpt` (DeepSpeed's module file holds rank 0's); None when
    done (or nothing to do), else why not (one line, for the caller's refusal). Collective under
    ZeRO-3 (every rank gathers, whatever its file says)."""
    mine = _named_shard(module)
    if not mine:
        return None
    with _whole_shard(list(mine.values()), written=True):
        return _copy_shard(mine, module, ckpt, rank)


def _copy_shard(mine: dict, module: nn.Module, ckpt: Path, rank: int) -> str | None:
    path = Path(ckpt) / SHARD_FILE.format(rank)
    if not path.is_file():
        return f"checkpoint {ckpt} has no expert shard for rank {rank} ({path.name})"
    state = load_mapped(path)
    ex = sharded_layers(module)[0].exchange
    if (state["expert_parallel"], state["expert_rank"]) != (ex.size, ex.rank):
        return (
            f"{path}: written as expert rank {state['expert_rank']} of {state['expert_parallel']}"
        )
    with torch.no_grad():
        for n, p in mine.items():
            t = state["tensors"].get(n)
            if t is None or t.shape != p.shape:
                return f"{path}: no tensor {n} of shape {tuple(p.shape)}"
            p.data.copy_(t)
    return None


@contextlib.contextmanager
def gathered_experts(module: nn.Module):
    """Collective: inside, every MoE layer holds all its routed experts (gathered from its
    expert-parallel group; an export); after, its shard again."""
    swapped = []
    try:
        for m in sharded_layers(module):
            for p in m.routed_expert_weights():
                whole = collectives.all_gather_experts(p.data, m.exchange)
                swapped.append((p, p.data))
                p.data = whole
        yield
    finally:
        for p, shard in swapped:
            p.data = shard
