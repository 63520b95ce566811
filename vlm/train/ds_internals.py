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
