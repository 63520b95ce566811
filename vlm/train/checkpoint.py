"""Atomic checkpoints with exact resume: the names the trainer and the tools use, from the files that
hold one idea each.

- vlm.train.ckpt_layout: a checkpoint's folder (its files, meta.json, which folders count).
- vlm.train.ckpt_manifest: which rank hashes and verifies which files (each rank its own).
- vlm.train.ckpt_save: the save protocol (staged to host memory, written in the background by every
  rank, committed by rank 0 once complete).
- vlm.train.ckpt_resume: which checkpoint a run resumes from (verified in parallel) and its load.
- vlm.train.rng_state, vlm.train.state_dir: the RNG streams; one process's state folder.
"""

from __future__ import annotations

from vlm.train.checksums import file_digests
from vlm.train.ckpt_layout import (
    DS_TAG,
    STEP_RE,
    DamagedMeta,
    checkpoint_step,
    clean_partial,
    latest_checkpoint,
    list_checkpoints,
    read_meta,
    step_dir_name,
)
from vlm.train.ckpt_manifest import damaged_file, damaged_share
from vlm.train.ckpt_resume import (
    basic_optimizer,
    find_resume_point,
    load_checkpoint,
    newest_intact_checkpoint,
    resume_point,
)
from vlm.train.ckpt_save import Checkpointer, stage, write_file
from vlm.train.engine import CheckpointRefused
from vlm.train.rng_state import rng_state, set_rng_state
from vlm.train.state_dir import load_state_dir, save_state_dir
from vlm.train.write_errors import WriteError

__all__ = [
    "DS_TAG",
    "STEP_RE",
    "CheckpointRefused",
    "Checkpointer",
    "DamagedMeta",
    "WriteError",
    "basic_optimizer",
    "checkpoint_step",
    "clean_partial",
    "damaged_file",
    "damaged_share",
    "file_digests",
    "find_resume_point",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_state_dir",
    "newest_intact_checkpoint",
    "read_meta",
    "resume_point",
    "rng_state",
    "save_state_dir",
    "set_rng_state",
    "stage",
    "step_dir_name",
    "write_file",
]
