"""An expert-parallel checkpoint resumed at another expert degree or on another number of ranks:
its expert shards regrouped on load, with their Adam moments (issue 50 item 2).

A checkpoint written at degree P on N ranks holds every expert once: expert rank j's E/P experts of
each MoE layer in `experts_rank_NNNNN.pt` (vlm.train.expert_parallel), its optimizer state in
DeepSpeed's `expp_rank_j` file (ZeRO 0: the torch optimizer's state dict of a rank holding shard j,
its parameters numbered group by group), the dense weights and the engine's counters in the
module file. The rank file of each writer names its optimizer's parameters in that order
(vlm.train.ckpt_save.optimizer_names), so every state maps back to a parameter by name. Resumed at
degree P' on N' ranks, each rank takes the rows of its own E/P' experts of every expert tensor and
of its two Adam moments from the shards that hold them (the whole run's expert k is row k of the
shards put end to end) and the dense weights and moments as they were; the schedule, the data
position and the RNG streams come with the trainer state as for any resume. A checkpoint without
expert shards (P = 1) resumes at P' > 1 the same way, its module holding every expert.

Under ZeRO 0 the optimizer state is one torch state dict per expert rank: in fp32 (the engine's
plain path) of the weights themselves, in bf16 of the fp32 copies DeepSpeed's unfused fp16 optimizer
keeps of them (in the file beside it: each copy regroups with its moments). Under ZeRO 1-2 (fp32 or
bf16: the same optimizer, bf16 weights beside its fp32 masters) it is in flat partitions: per
parameter group one flat fp32 tensor of its parameters in order, padded, split in equal partitions
over the group's ranks (the dense group over every rank, an expert group over its shard's
replicas), every rank's file (`zero_pp_rank_R`) naming each parameter's fragment in its partition;
each rank reads the elements of its new partitions from the writers' fragments that hold them
(`Fragments`) and writes them after the module loads (vlm.train.ds_internals.zero_fragments /
zero_write). Under ZeRO 3 every parameter exists only as its partitions: vlm.train.expert_regroup_zero3.
Every file is memory-mapped: a rank reads its share, not the world's state. fp16 and a change of
form are refused in one line (vlm.train.expert_parallel.check_resume).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from vlm.model.shares import is_routed_expert
from vlm.train import ds_internals, expert_regroup_zero3
from vlm.train.checkpoint_tensors import checkpoint_tensors, shard_rows
from vlm.train.ckpt_layout import read_meta
from vlm.train.engine import CheckpointRefused, safe_load
from vlm.train.engine import load_mapped as _mapped
from vlm.train.expert_parallel import SHARD_FILE, sharded_layers, written_degree, written_form


def needed(ckpt: Path, expert: int, world: int) -> bool:
    """A resume from `ckpt` at degree `expert` on `world` ranks regroups the expert shards (the
    degree or, with experts split, the ranks differ from the writer's)."""
    P, W = written_degree(ckpt)
    if P == 1 and expert == 1:
        return False
    return (P, W) != (expert, world)


def _named_states(ckpt: Path, optim_file: Path, writer: int) -> dict[str, dict]:
    """The optimizer state of writer `writer`'s file by parameter name; under bf16 at stage 0 with
    the parameter's fp32 copy (the master) under "fp32"."""
    rank_file = Path(ckpt) / f"rank_{writer:05d}.pt"
    names = safe_load(rank_file).get("optimizer_names")
    if names is None:
        raise CheckpointRefused(
            f"checkpoint {ckpt}: {rank_file.name} does not name its optimizer's parameters "
            "(written before expert shards could be regrouped): resume with the expert degree "
            "and ranks that wrote it"
        )
    sd = _mapped(optim_file)["optimizer"]
    torch_sd = sd.get("optimizer_state_dict", sd)  # under DeepSpeed's fp16 optimizer: inside it
    masters = ds_internals.fp32_masters(sd) or [[None] * len(g) for g in names]
    out = {}
    for group, group_names, copies in zip(torch_sd["param_groups"], names, masters, strict=True):
        for idx, name, master in zip(group["params"], group_names, copies, strict=True):
            if idx in torch_sd["state"]:
                out[name] = dict(torch_sd["state"][idx])
                if master is not None:
                    out[name]["fp32"] = master
    return out


def _old_states(ckpt: Path, P: int) -> tuple[dict[str, dict], list[dict[str, dict]]]:
    """(every parameter's state as the first writer kept it, each expert rank's states)."""
    ds = Path(ckpt) / "ds"
    if P == 1:
        states = _named_states(ckpt, ds_internals.module_file(ds), 0)
        return states, [states]
    # expert rank j's file is written by the first rank holding shard j: rank j
    shards = [_named_states(ckpt, ds_internals.moe_optimizer_file(ds, j), j) for j in range(P)]
    return shards[0], shards


def load(engine, ckpt: Path, optimizer: torch.optim.Optimizer) -> None:
    """Every rank: the engine's module and optimizer from `ckpt`, the routed experts regrouped for
    this rank's expert shard. CheckpointRefused (one line) where the checkpoint lacks a part."""
    if engine.zero_optimization_stage() == 3:  # every parameter partitioned: its own regroup
        return expert_regroup_zero3.load(engine, ckpt)
    ckpt = Path(ckpt)
    module = engine.module
    P, _ = written_degree(ckpt)
    stored = checkpoint_tensors(ckpt)
    layers = sharded_layers(module)
    ex = layers[0].exchange if layers else None
    have = stored.shapes()
    sd = {}
    for name, t in module.state_dict().items():
        if name not in have:
            raise CheckpointRefused(f"checkpoint {ckpt}: no tensor {name} in its module")
        if ex is not None and is_routed_expert(name):
            n = t.shape[0]
            sd[name] = stored.rows(name, ex.rank * n, (ex.rank + 1) * n)
        else:
            sd[name] = stored.rows(name, 0, have[name][0] if have[name] else 1)
    module.load_state_dict(sd, strict=True)
    if written_form(ckpt) == "zero12":
        _load_zero(engine, ckpt, P, ex)
    else:
        _load_plain(engine, ckpt, P, ex, optimizer)
    ds_internals.restore_engine_counters(engine, _mapped(ds_internals.module_file(ckpt / "ds")))


def _load_plain(engine, ckpt: Path, P: int, ex, optimizer) -> None:
    """ZeRO 0: each parameter's torch optimizer state, expert rows regrouped; under bf16 (the fp16
    optimizer's fp32 copies stepped by the torch optimizer) each copy and its state likewise."""
    dense, shards = _old_states(ckpt, P)
    copies = ds_internals.fp32_copies(getattr(engine, "optimizer", None))
    stepped = {id(w): c for group in copies or [] for w, c in group}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        if is_routed_expert(name):
            per = [s.get(name) for s in shards]
            if any(s is None for s in per):
                continue  # not trained yet (no state): as the engine's own load leaves it
            n = p.shape[0]
            a = ex.rank * n if ex is not None else 0
            state = {}
            for key, v in per[0].items():
                if torch.is_tensor(v) and v.dim() >= 1 and v.shape[1:] == p.shape[1:]:
                    state[key] = shard_rows([s[key] for s in per], a, a + n).clone()
                else:
                    state[key] = v.clone() if torch.is_tensor(v) else v
        else:
            old = dense.get(name)
            if old is None:
                continue
            state = {k: v.clone() if torch.is_tensor(v) else v for k, v in old.items()}
        target = stepped.get(id(p), p)
        master = state.pop("fp32", None)
        if copies is not None:
            if master is None:
                raise CheckpointRefused(
                    f"checkpoint {ckpt}: no fp32 copy of {name} in its optimizer files "
                    "(not written under bf16)"
                )
            target.data.copy_(master)
        optimizer.state[target] = {
            k: v.to(p.device) if torch.is_tensor(v) and v.dim() >= 1 else v
            for k, v in state.items()
        }


KEYS = ("fp32", "exp_avg", "exp_avg_sq")


class Fragments:
    """One parameter of the whole run, flattened, as the writers' fragments of it: a dense one's
    fragments in the order of its group's ranks (all ranks), a routed expert's shards end to end
    (expert k is row k), each shard's fragments in the order of its replicas' ranks. A read takes
    its elements from the fragments that hold them only."""

    def __init__(self):
        self.pieces: list[tuple[tuple, dict]] = []  # ((shard, rank), {key: flat fragment})
        self.step = None

    def add(self, order: tuple, parts: dict, step) -> None:
        self.pieces.append((order, parts))
        self.step = step if self.step is None else self.step

    def read(self, start: int, numel: int) -> dict | None:
        """Elements [start, start + numel) of the fp32 master and both moments, with Adam's step;
        None where the writers hold fewer (a parameter not trained yet)."""
        self.pieces.sort(key=lambda t: t[0])
        out: dict = {k: [] for k in KEYS}
        at, end = 0, start + numel
        for _, parts in self.pieces:
            n = parts["fp32"].numel()
            lo, hi = max(start, at), min(end, at + n)
            if lo < hi:
                for k in KEYS:
                    out[k].append(parts[k][lo - at : hi - at])
            at += n
        if sum(t.numel() for t in out["fp32"]) != numel:
            return None
        return {**{k: torch.cat(v) for k, v in out.items()}, "step": self.step}


def zero_params(ckpt: Path, P: int) -> dict[str, Fragments]:
    """ZeRO 1-2: each parameter of the run as the writers' fragments of its fp32 master and Adam
    moments (their files memory-mapped). A parameter's fragments lie in its group's partitions in
    the order of the group's ranks: the dense group's are all ranks, an expert group's the ranks
    holding that shard, each in global rank order."""
    ds = ckpt / "ds"
    W = read_meta(ckpt, ("world_size",))["world_size"]
    params: dict[str, Fragments] = {}
    for r in range(W):
        path = ds_internals.zero_optimizer_file(ds, r)
        if path is None:
            raise CheckpointRefused(f"checkpoint {ckpt}: no ZeRO optimizer file of rank {r} in ds/")
        j = int(_mapped(ckpt / SHARD_FILE.format(r))["expert_rank"]) if P > 1 else 0
        for name, parts, step in ds_internals.zero_fragments(_mapped(path)):
            order = (j, r) if is_routed_expert(name) else (0, r)
            params.setdefault(name, Fragments()).add(order, parts, step)
    return params


def _load_zero(engine, ckpt: Path, P: int, ex) -> None:
    """ZeRO 1-2: this rank's flat partitions (fp32 masters, both moments, Adam's step) from the
    writers' fragments, a routed expert's at this rank's rows of the run's experts."""
    params = zero_params(ckpt, P)
    shapes = {n: p.shape for n, p in engine.module.named_parameters()}

    def part(name: str, start: int, numel: int) -> dict | None:
        whole = params.get(name)
        if whole is None:
            return None
        offset = 0
        if is_routed_expert(name) and ex is not None:  # this rank's rows of the run's experts
            offset = ex.rank * math.prod(shapes[name])
        return whole.read(offset + start, numel)

    ds_internals.zero_write(engine.optimizer, part)
