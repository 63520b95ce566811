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

Under ZeRO 0 (fp32, the engine's plain path) the optimizer state is one torch state dict per expert
rank. Under ZeRO 1-2 (fp32 or bf16: the same optimizer, bf16 weights beside its fp32 masters) it is
in flat partitions: per parameter group one flat fp32 tensor of its
parameters in order, padded, split in equal partitions over the group's ranks (the dense group over
every rank, an expert group over its shard's replicas), every rank's file (`zero_pp_rank_R`) naming
each parameter's fragment in its partition; each parameter's fp32 master and moments are put
together from the writers' fragments and written into this run's partitions after the module loads
(vlm.train.ds_internals.zero_fragments / zero_write). Other forms (ZeRO 3, bf16 at stage 0, fp16)
and a change of form are refused in one line (vlm.train.expert_parallel.check_resume).
"""

from __future__ import annotations

from pathlib import Path

import torch

from vlm.model.shares import is_routed_expert
from vlm.train import ds_internals, expert_regroup_zero3
from vlm.train.checkpoint_tensors import checkpoint_tensors
from vlm.train.ckpt_layout import read_meta
from vlm.train.engine import CheckpointRefused, safe_load
from vlm.train.expert_parallel import SHARD_FILE, sharded_layers, written_degree


def needed(ckpt: Path, expert: int, world: int) -> bool:
    """A resume from `ckpt` at degree `expert` on `world` ranks regroups the expert shards (the
    degree or, with experts split, the ranks differ from the writer's)."""
    P, W = written_degree(ckpt)
    if P == 1 and expert == 1:
        return False
    return (P, W) != (expert, world)


def _named_states(ckpt: Path, optim_file: Path, writer: int) -> dict[str, dict]:
    """The optimizer state of writer `writer`'s file by parameter name."""
    rank_file = Path(ckpt) / f"rank_{writer:05d}.pt"
    names = safe_load(rank_file).get("optimizer_names")
    if names is None:
        raise CheckpointRefused(
            f"checkpoint {ckpt}: {rank_file.name} does not name its optimizer's parameters "
            "(written before expert shards could be regrouped): resume with the expert degree "
            "and ranks that wrote it"
        )
    sd = safe_load(optim_file)["optimizer"]
    out = {}
    for group, group_names in zip(sd["param_groups"], names, strict=True):
        for idx, name in zip(group["params"], group_names, strict=True):
            if idx in sd["state"]:
                out[name] = sd["state"][idx]
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


def _expert_rows(per_shard: list[torch.Tensor], a: int, b: int) -> torch.Tensor:
    return torch.cat(per_shard)[a:b]


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
    if ds_internals.zero_optimizer_file(ckpt / "ds", 0) is not None:
        _load_zero(engine, ckpt, P, ex)
    else:
        _load_plain(module, ckpt, P, ex, optimizer)
    ds_internals.restore_engine_counters(
        engine, safe_load(ds_internals.module_file(ckpt / "ds"), map_location="cpu")
    )


def _load_plain(module, ckpt: Path, P: int, ex, optimizer) -> None:
    """ZeRO 0: each parameter's torch optimizer state, expert rows regrouped."""
    dense, shards = _old_states(ckpt, P)
    for name, p in module.named_parameters():
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
                    state[key] = _expert_rows([s[key] for s in per], a, a + n).clone()
                else:
                    state[key] = v.clone() if torch.is_tensor(v) else v
        else:
            old = dense.get(name)
            if old is None:
                continue
            state = {k: v.clone() if torch.is_tensor(v) else v for k, v in old.items()}
        optimizer.state[p] = {
            k: v.to(p.device) if torch.is_tensor(v) and v.dim() >= 1 else v
            for k, v in state.items()
        }


def _zero_wholes(ckpt: Path, P: int) -> dict[tuple[int | None, str], dict]:
    """ZeRO 1-2: each parameter's whole fp32 master and Adam moments (flat) as the writers kept
    them, keyed (expert rank, name) for routed experts and (None, name) otherwise. A parameter's
    fragments lie in its group's partitions in the order of the group's ranks: the dense group's
    are all ranks, an expert group's the ranks holding that shard, each in global rank order."""
    ds = ckpt / "ds"
    W = read_meta(ckpt, ("world_size",))["world_size"]
    frags: dict[tuple[int | None, str], list] = {}
    for r in range(W):
        path = ds_internals.zero_optimizer_file(ds, r)
        if path is None:
            raise CheckpointRefused(f"checkpoint {ckpt}: no ZeRO optimizer file of rank {r} in ds/")
        j = int(safe_load(ckpt / SHARD_FILE.format(r))["expert_rank"]) if P > 1 else 0
        for name, parts, step in ds_internals.zero_fragments(safe_load(path, map_location="cpu")):
            key = (j if is_routed_expert(name) else None, name)
            frags.setdefault(key, []).append((r, parts, step))
    out = {}
    for key, got in frags.items():
        got.sort(key=lambda t: t[0])
        out[key] = {k: torch.cat([g[1][k] for g in got]) for k in ("fp32", "exp_avg", "exp_avg_sq")}
        out[key]["step"] = got[0][2]
    return out


def _load_zero(engine, ckpt: Path, P: int, ex) -> None:
    """ZeRO 1-2: this rank's flat partitions (fp32 masters, both moments, Adam's step) rebuilt
    from the whole parameters, routed experts' rows regrouped for this rank's shard."""
    wholes = _zero_wholes(ckpt, P)
    shapes = {n: p.shape for n, p in engine.module.named_parameters()}

    def full(name: str) -> dict | None:
        shape = shapes[name]
        if not is_routed_expert(name):
            w = wholes.get((None, name))
            return None if w is None else {k: _shaped(v, shape) for k, v in w.items()}
        per = [wholes.get((j, name)) for j in range(P)]
        if any(w is None for w in per):
            return None
        n = shape[0]
        a = ex.rank * n if ex is not None else 0
        out = {"step": per[0]["step"]}
        for k in ("fp32", "exp_avg", "exp_avg_sq"):
            rows = torch.cat([w[k].view(-1, *shape[1:]) for w in per])
            out[k] = rows[a : a + n]
        return out

    ds_internals.zero_write(engine.optimizer, full)


def _shaped(v, shape):
    return v.view(shape) if torch.is_tensor(v) and v.dim() >= 1 else v
