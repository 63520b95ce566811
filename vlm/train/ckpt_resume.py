"""Which checkpoint a run resumes from, verified in parallel, and the load itself.

Every rank verifies its share of a candidate (vlm.train.ckpt_manifest.share_of: the files of the
writers that map to it), the ranks compare their verdicts, and the newest checkpoint every rank
found intact is the resume point; a damaged one is skipped with a warning naming its file. No rank
reads the whole checkpoint. A checkpoint written by another number of ranks loads through
DeepSpeed's universal checkpoint (vlm.train.reshard), an expert-parallel one at another degree or
on other ranks by regrouping its shards (vlm.train.expert_regroup).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

from vlm.train import collectives, expert_regroup, reshard
from vlm.train import expert_parallel as ep_lib
from vlm.train.ckpt_layout import DS_TAG, list_checkpoints, read_meta
from vlm.train.ckpt_manifest import damaged_file, damaged_share
from vlm.train.engine import CheckpointRefused, safe_load

log = logging.getLogger(__name__)

# this process's resume timings (seconds), for the run's metrics (vlm.train.trainer)
timings: dict[str, float] = {}


def basic_optimizer(engine):
    """The torch optimizer under DeepSpeed's wrapper (ZeRO, bf16), or the engine's own."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def newest_intact_checkpoint(ckpt_root: Path, warn=log.warning) -> Path | None:
    """One process: the newest checkpoint whose every file matches its checksum."""
    for _, ckpt in reversed(list_checkpoints(ckpt_root)):
        bad = damaged_file(ckpt, ("step", "world_size"))
        if bad is None:
            return ckpt
        warn(f"checkpoint {ckpt} is damaged: {bad}; trying the one before it")
    return None


def find_resume_point(ckpt_root: Path, rank: int, world: int = 1, warn=log.warning) -> Path | None:
    """Collective: the newest checkpoint every rank found intact in its share (rank 0 lists the
    candidates, every rank checks its files of each, newest first, until all agree)."""
    listed = [str(p) for _, p in list_checkpoints(ckpt_root)] if rank == 0 else None
    listed = collectives.decision_of_rank0(listed)
    t0 = time.perf_counter()
    found = None
    for ckpt in map(Path, reversed(listed)):
        mine = damaged_share(ckpt, rank, world, ("step", "world_size"))
        bad = next((v for v in collectives.every_rank(mine) if v is not None), None)
        if bad is None:
            found = ckpt
            break
        if rank == 0:
            warn(f"checkpoint {ckpt} is damaged: {bad}; trying the one before it")
    timings["verify_s"] = time.perf_counter() - t0
    return found


def resume_point(
    ckpt_root: Path, rank: int, resume: bool | None, log=log.info, world: int = 1
) -> Path | None:
    """The checkpoint a run resumes from (None: it starts from the beginning). resume: True = it
    must (a run preempted before its first checkpoint starts over, with a line saying so); None =
    when there is one; False = there must be none. Damaged checkpoints are skipped with a warning,
    all damaged is an error."""
    from configs.config import ConfigError

    found = find_resume_point(ckpt_root, rank, world, warn=lambda m: log(f"warning: {m}"))
    if resume is True and found is None:
        if list_checkpoints(ckpt_root):  # there are some, all damaged: starting over would hide it
            raise ConfigError(f"--resume: no intact checkpoint in {ckpt_root}")
        # a requeue script can always pass --resume: a run preempted before its first checkpoint
        # starts over
        log(f"--resume: no checkpoint in {ckpt_root} yet: starting the run from the beginning")
    if resume is False and found is not None:
        raise ConfigError(
            f"{ckpt_root.parent} already has checkpoints "
            f"({found.name}); resume it or use a new --out"
        )
    return found


def _load_engine(engine, ckpt: Path, rank: int, world_size: int, expert: int, log) -> str | None:
    """The engine's module and optimizer from `ckpt`; why a rank cannot use its part, or None."""
    if expert_regroup.needed(ckpt, expert, world_size):
        expert_regroup.load(engine, ckpt, basic_optimizer(engine))
        return None
    written = read_meta(ckpt, ("world_size",))["world_size"]  # checked by the resume point
    universal = written != world_size and engine.load_universal_checkpoint()
    load_dir = reshard.universal_folder(ckpt, DS_TAG, rank == 0, log) if universal else ckpt
    with reshard.tensors_only() if universal else contextlib.nullcontext():
        load_path, _ = engine.load_checkpoint(
            str(load_dir),
            tag=DS_TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
            load_module_strict=True,
        )
    if load_path is None:
        raise CheckpointRefused(f"DeepSpeed could not load the checkpoint in {load_dir / DS_TAG}")
    if universal:
        reshard.mend_optimizer(basic_optimizer(engine), load_dir, DS_TAG)
    # each rank's own routed experts (expert parallelism; the module file held rank 0's)
    return ep_lib.restore_shard(engine.module, ckpt, rank)


def load_checkpoint(
    engine, ckpt: Path, rank: int, world_size: int, log=log.info, expert: int = 1
) -> dict:
    """Collective: restore the engine from `ckpt` and return this rank's trainer state.
    CheckpointRefused (one line naming the file) on every rank when a rank cannot use its part."""
    t0 = time.perf_counter()
    written = read_meta(ckpt, ("world_size",))["world_size"]
    why = None
    try:
        why = _load_engine(engine, ckpt, rank, world_size, expert, log)
    except CheckpointRefused as e:
        why = str(e)
    # the trainer state is the same on every rank but for its RNG streams: a rank the checkpoint
    # did not have takes rank 0's
    state_file = ckpt / f"rank_{rank if rank < written else 0:05d}.pt"
    state = None
    try:
        if not state_file.is_file():
            raise CheckpointRefused(
                f"checkpoint {ckpt} has no trainer state for rank {rank} ({state_file.name})"
            )
        # tensors and plain containers only: a crafted checkpoint cannot run code
        state = safe_load(state_file)
    except CheckpointRefused as e:
        why = why or str(e)
    # a rank alone with its refusal would leave the others waiting in the first step's collective
    refused = [w for w in collectives.every_rank(why) if w is not None]
    if refused:
        raise CheckpointRefused(why or refused[0])
    timings["load_s"] = time.perf_counter() - t0
    return state
