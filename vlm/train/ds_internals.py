"""The private parts of DeepSpeed that checkpointing and resharding rely on, each behind one function
(tests/test_ds_internals.py pins the DeepSpeed version they were written for: a new DeepSpeed fails
that test until each is checked against it).

- `engine_writes`: every file the engine's save_checkpoint writes goes through its checkpoint
  engine's `save(state_dict, path)`; replacing that method (an attribute of the engine's object)
  is how a save stages the engine's state to host memory and writes it in the background.
- `moe_optimizer_file`: where DeepSpeed's MoE checkpoint keeps each expert rank's optimizer state
  (ZeRO 0: the whole torch optimizer state dict of a rank holding that expert shard).
- `module_file`: the engine's module file (the module, the engine's step counters).
- `restore_engine_counters`: what the engine's own load would set from the module file, for a
  load that regroups expert shards itself (vlm.train.expert_regroup).
- `to_universal`: `deepspeed.checkpoint.ds_to_universal.main`, its arguments a namespace of its
  command line's options.
- `universal_optimizer_file`: where that conversion keeps the optimizer's parameter groups (their
  settings, by name: what vlm.train.reshard.mend_optimizer gives back to each group).
- `fp32_copies`, `fp32_masters`: bf16 at stage 0, where DeepSpeed's unfused fp16 optimizer keeps an
  fp32 copy of each weight that our torch optimizer steps (a run's pairs; a file's copies).
- `zero_optimizer_file`, `zero_fragments`, `zero_write`: a ZeRO 1-2 rank's optimizer file, each
  parameter's fragment of the fp32 master and Adam moments in it, and this run's partitions
  written from whole parameters (vlm.train.expert_regroup, an expert-parallel checkpoint at
  another degree).
- `zero3_model_file`, `zero3_partition_group`, `zero3_write_partition`, `zero3_adam_state`,
  `zero3_rewritten`: under ZeRO-3 (vlm.train.expert_regroup_zero3), a rank's model-states file
  (ZeRO-3 writes no module file), the group a parameter is partitioned over (its
  `ds_process_group`), its partition written (`ds_tensor`), Adam's lazily created state of each
  sub-group's flat fp32 partition (`fp32_partitioned_groups_flat`) with its step count, and the
  optimizer's `checkpoint_event_prologue` / `_epilogue` around writing partitions (its persistent
  parameters gathered again). The fp32 masters and moments themselves go through DeepSpeed's
  documented `safe_set_local_fp32_param` / `safe_set_local_optimizer_state`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

MODULE_FILE = "mp_rank_00_model_states.pt"


@contextlib.contextmanager
def engine_writes(engine, write):
    """Inside, the engine's checkpoint writes call `write(state_dict, path, zipfile)` instead of
    torch.save (`zipfile`: the engine's serialization setting)."""
    ce = getattr(engine, "checkpoint_engine", None)
    if getattr(ce, "save", None) is None:
        yield
        return
    zipfile = getattr(ce, "zipfile_serialization", True)
    ce.save = lambda state_dict, path: write(state_dict, path, zipfile)
    try:
        yield
    finally:
        del ce.save  # back to the class's method


def module_file(ds_dir: Path) -> Path:
    return Path(ds_dir) / MODULE_FILE


def moe_optimizer_file(ds_dir: Path, expert_rank: int) -> Path:
    """DeepSpeed's `_get_optimizer_ckpt_name` (no model parallelism: mp rank 00)."""
    return Path(ds_dir) / f"expp_rank_{expert_rank}_mp_rank_00_optim_states.pt"


def restore_engine_counters(engine, module_state: dict) -> None:
    """The engine's step counters as its `_load_checkpoint` restores them."""
    engine.global_steps = int(module_state["global_steps"])
    engine.global_samples = int(
        module_state.get("global_samples", engine.global_steps * engine.train_batch_size())
    )
    engine.skipped_steps = int(module_state["skipped_steps"])


def to_universal(input_folder: Path, output_folder: Path, workers: int) -> None:
    """DeepSpeed's converter of one checkpoint tag's files into its universal format, with
    `workers` processes for each of its two phases (forked: they load through the caller's
    torch.load)."""
    from deepspeed.checkpoint import ds_to_universal

    args = SimpleNamespace(
        input_folder=str(input_folder),
        output_folder=str(output_folder),
        num_extract_workers=workers,
        num_merge_workers=workers,
        keep_temp_folder=False,
        strict=True,
        # checkpoints written before save_checkpoint stated it (reshard.client_state)
        inject_missing_state=True,
    )
    ds_to_universal.main(args)


def universal_optimizer_file(universal_tag_dir: Path) -> Path:
    """The converter's `zero/optimizer_state.pt` (its `param_groups`) in a universal tag folder."""
    return Path(universal_tag_dir) / "zero" / "optimizer_state.pt"


def fp32_copies(optimizer) -> list[list[tuple]] | None:
    """Under bf16 at stage 0 (DeepSpeed's unfused fp16 optimizer, `fp16_groups` / `fp32_groups`:
    our torch optimizer steps an fp32 copy of each weight, its groups the copies in the order of
    the weights), per group the (weight, its fp32 copy) pairs; None for any other optimizer."""
    lp, hp = getattr(optimizer, "fp16_groups", None), getattr(optimizer, "fp32_groups", None)
    if lp is None or hp is None:
        return None
    return [list(zip(a, b, strict=True)) for a, b in zip(lp, hp, strict=True)]


def fp32_masters(optimizer_state: dict) -> list[list] | None:
    """The fp32 copies (`fp32_groups`) a stage-0 bf16 optimizer's file holds, None in any other."""
    return optimizer_state.get("fp32_groups")


ZERO_FILE = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"  # bf16: with DeepSpeed's "bf16_" prefix


def zero_optimizer_file(ds_dir: Path, dp_rank: int) -> Path | None:
    """DeepSpeed's `_get_zero_ckpt_name` of data-parallel rank `dp_rank` (ZeRO 1-2; the dense
    group's rank: every rank writes one, its expert groups' partitions in it too); None if absent."""
    for prefix in ("", "bf16_"):
        path = Path(ds_dir) / (prefix + ZERO_FILE.format(dp_rank))
        if path.is_file():
            return path
    return None


def zero_fragments(state: dict):
    """(parameter name, {"fp32", "exp_avg", "exp_avg_sq": this writer's fragment, flat}, step)
    for each parameter with a fragment in one ZeRO 1-2 optimizer file (stage_1_and_2 `state_dict`:
    per parameter group one flat fp32 partition, its Adam state in the base optimizer's state of
    that group's one parameter, and `param_slice_mappings`: name -> (numel, start) in it)."""
    osd = state["optimizer_state_dict"]
    base = osd["base_optimizer_state"]
    per_group = (
        base if isinstance(base, list) else [base["state"][g] for g in sorted(base["state"])]
    )
    for g, mapping in enumerate(osd["param_slice_mappings"]):
        flat = osd["single_partition_of_fp32_groups"][g]
        adam = per_group[g]
        for name, addr in mapping.items():
            a, n = int(addr.start), int(addr.numel)
            parts = {"fp32": flat[a : a + n]}
            for key in ("exp_avg", "exp_avg_sq"):
                parts[key] = adam[key][a : a + n]
            step = adam.get("step", osd.get("base_optimizer_state_step"))
            yield name, parts, step


def zero_write(zero_optimizer, part) -> None:
    """This rank's ZeRO 1-2 partitions from the run's parameters: `part(name, start, numel)` gives
    elements [start, start + numel) of a parameter (flattened, as this rank holds it) as
    {"fp32", "exp_avg", "exp_avg_sq": flat tensors, "step"} (None: leave it). Each parameter's
    fragment (`_hp_mapping`: where it lies in the parameter and in the group's flat fp32
    partition) is copied into the partition and into the base optimizer's state of that
    partition, which is created here as the optimizer's first step would (Adam's state is lazy)."""
    import torch

    opt = zero_optimizer.optimizer
    for g, lps in enumerate(zero_optimizer.bit16_groups):
        flat = zero_optimizer.single_partition_of_fp32_groups[g]
        state = opt.state[flat]
        for lp in lps:
            mapping = getattr(lp, "_hp_mapping", None)
            if mapping is None:
                continue
            hp = mapping.get_hp_fragment_address()
            lo = mapping.lp_fragment_address
            got = part(zero_optimizer.param_names[lp], lo.start, lo.numel)
            if got is None:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in state:
                    state[key] = torch.zeros_like(flat)
            step = got["step"]
            state["step"] = step.clone() if torch.is_tensor(step) else step
            for key, dest in (
                ("fp32", flat),
                ("exp_avg", state["exp_avg"]),
                ("exp_avg_sq", state["exp_avg_sq"]),
            ):
                dest.data[hp.start : hp.start + hp.numel].copy_(got[key].to(dest.dtype))


# ---------------------------------------------------------------- ZeRO-3 (expert_regroup_zero3)
ZERO3_MODEL_FILE = "zero_pp_rank_{}_mp_rank_00_model_states.pt"


def zero3_model_file(ds_dir: Path, dp_rank: int) -> Path:
    """DeepSpeed's `_get_zero_ckpt_name` of a ZeRO-3 rank's model states (its buffers, its
    partitions' shapes, the engine's step counters: ZeRO-3 writes no `mp_rank_00` module file)."""
    return Path(ds_dir) / ZERO3_MODEL_FILE.format(dp_rank)


def zero3_partition_group(param) -> tuple[int, int]:
    """(this rank's place in the group ZeRO-3 partitions `param` over, the group's size): the
    parameter's `ds_process_group` (AutoEP's placement: an expert shard's replicas; absent: the
    world)."""
    from vlm.train.collectives import place_in

    return place_in(getattr(param, "ds_process_group", None))


def zero3_write_partition(param, values) -> None:
    """This rank's partition of `param`'s weights (`ds_tensor`, in the parameter's dtype) from
    `values`, the partition's elements flat. Gathered parameters see it after
    `zero3_rewritten`."""
    param.ds_tensor.data.copy_(values.to(param.ds_tensor.dtype).view(-1))


def zero3_adam_state(zero_optimizer, step) -> None:
    """Adam's state of every sub-group's flat fp32 partition (`fp32_partitioned_groups_flat`,
    the base optimizer's `state`), created as the optimizer's first step would (Adam's state is
    lazy: DeepSpeed's local-state setters find none before it) with its step count `step`."""
    import torch

    for flat in zero_optimizer.fp32_partitioned_groups_flat:
        state = zero_optimizer.optimizer.state[flat]
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = torch.zeros_like(flat)
        state["step"] = step.clone() if torch.is_tensor(step) else step


@contextlib.contextmanager
def zero3_rewritten(zero_optimizer):
    """Collective: inside, the partitions of a ZeRO-3 optimizer's parameters are written; on
    leaving the parameters ZeRO-3 keeps gathered (its persistent ones) are gathered from them
    again: the optimizer's `checkpoint_event_prologue` / `_epilogue`, around its own load."""
    zero_optimizer.checkpoint_event_prologue()
    try:
        yield
    finally:
        zero_optimizer.checkpoint_event_epilogue()
