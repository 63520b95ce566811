"""An expert-parallel ZeRO-3 checkpoint resumed at another expert degree or on another number of
ranks (issue 50 item 2; the ZeRO 0-2 forms: vlm.train.expert_regroup).

ZeRO-3 keeps no whole module: every parameter exists as its partitions, each optimizer sub-group
partitioned over its own ranks (AutoEP's placement, vlm.train.expert_parallel.deepspeed_view: an
expert shard over the ranks holding it, everything else over the world), a partition holding
the parameter's weights (bf16 or fp32), its fp32 master and its Adam moments. The writers' fp32
partitions and moments are read memory-mapped (vlm.train.checkpoint_tensors.Zero3Checkpoint: the
whole run's expert k is row k of the shards put end to end), and each rank takes, one parameter
at a time, the elements of its own partition of its own tensor (a routed expert: its E/P' rows):
the weights, the fp32 master and both moments through DeepSpeed's local-state setters, Adam's step
count and the engine's counters as the writers kept them; module buffers whole. The schedule, the
data position and the RNG streams come with the trainer state as for any resume.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from vlm.model.shares import is_routed_expert, zero3_partition
from vlm.train import ds_internals
from vlm.train.checkpoint_tensors import checkpoint_tensors
from vlm.train.engine import CheckpointRefused, safe_load
from vlm.train.expert_parallel import sharded_layers

MOMENTS = ("exp_avg", "exp_avg_sq")


def load(engine, ckpt: Path) -> None:
    """Every rank (collective): the ZeRO-3 engine's parameters, optimizer state and counters from
    the ZeRO-3 checkpoint `ckpt`, the routed experts regrouped for this rank's expert shard.
    CheckpointRefused (one line) where the checkpoint lacks a tensor or holds another shape."""
    ckpt = Path(ckpt)
    stored = checkpoint_tensors(ckpt)
    if not hasattr(stored, "elements"):
        raise CheckpointRefused(
            f"checkpoint {ckpt}: not written under ZeRO-3 (no partitions in ds/)"
        )
    module = engine.module
    layers = sharded_layers(module)
    ex = layers[0].exchange if layers else None
    have = stored.shapes()
    zero, step = engine.optimizer, stored.adam_step()
    with ds_internals.zero3_rewritten(zero):
        if step is not None:  # None: written before the first step, no Adam state yet
            ds_internals.zero3_adam_state(zero, step)
        for name, p in module.named_parameters():
            expert = ex is not None and is_routed_expert(name)
            _check_shape(ckpt, name, have, _whole_shape(p, ex.size if expert else 1))
            _load_partition(stored, name, p, ex.rank if expert else 0, step is not None)
        kept = set(module.state_dict())  # persistent buffers only
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in kept:
                    _check_shape(ckpt, name, have, tuple(b.shape))
                    b.copy_(stored.whole(name))
    ds_internals.restore_engine_counters(
        engine, safe_load(ds_internals.zero3_model_file(ckpt / "ds", 0), map_location="cpu")
    )


def _whole_shape(p, shards: int) -> tuple[int, ...]:
    """The whole run's shape of parameter `p` (ZeRO-3's `ds_shape`: its shape before
    partitioning), a routed expert's `shards` shards put end to end."""
    shape = tuple(p.ds_shape)
    return (shape[0] * shards, *shape[1:]) if shards > 1 else shape


def _check_shape(ckpt: Path, name: str, have: dict, want: tuple[int, ...]) -> None:
    if name not in have:
        raise CheckpointRefused(f"checkpoint {ckpt}: no tensor {name} in its ZeRO-3 partitions")
    if tuple(have[name]) != want:
        raise CheckpointRefused(
            f"checkpoint {ckpt}: {name} has shape {tuple(have[name])}, this model {want}: "
            "resume with the model that wrote it"
        )


def _load_partition(stored, name: str, p, shard: int, moments: bool) -> None:
    """Parameter `p`'s partition on this rank: its elements of this rank's tensor (the `shard`-th
    of a routed expert's shards, the whole tensor otherwise), padded as ZeRO-3 pads the last
    partition, into its weights and, if it trains, its fp32 master and (`moments`) its Adam
    moments."""
    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

    index, count = ds_internals.zero3_partition_group(p)
    a, b, part = zero3_partition(p.ds_numel, count, index)
    start = shard * p.ds_numel  # this rank's tensor in the whole one, flat
    lo, hi = start + a, start + b

    def mine(key: str) -> torch.Tensor:
        t = stored.elements(name, lo, hi, key).float()
        return F.pad(t, (0, part - t.numel()))

    fp32 = mine("fp32")
    ds_internals.zero3_write_partition(p, fp32)
    if not p.requires_grad:
        return
    safe_set_local_fp32_param(p, fp32)
    if moments and stored.optimized(name):  # else trained from here: moments zero, as Adam starts
        for key in MOMENTS:
            safe_set_local_optimizer_state(p, mine(key), key)
