"""Atomic checkpoints with exact resume.

Layout of RUN_DIR/checkpoints/step_00000100/:
    ds/               DeepSpeed's save_checkpoint (module, optimizer / ZeRO partitions, engine counters)
    rank_00000.pt     per-rank trainer state: step, scheduler, RNG (python, numpy, torch), data-loader state
    meta.json         written last: step, world size and parallel layout, SHA-256 of every other file

Everything is written into `.tmp-step_...`, fsynced, then renamed; a crash mid-save leaves only a
`.tmp-` folder that `latest_checkpoint` never picks (and the next run deletes). Old checkpoints are
renamed to `.del-` before removal for the same reason. A checkpoint damaged after it was written (a
truncated file, a flipped bit, a meta.json cut short or not a JSON object) fails its checks on
resume, and the newest intact one is used instead, with a warning.

A save that cannot be written (a full disk, a quota, a read-only mount) raises `WriteError`: one
line with the path and the system's reason ("No space left on device"), after the `.tmp-` folder was
removed; the previous checkpoint, untouched, stays the resume point. torch.save reports a failed
write as "iostream error" or "unexpected pos" without the errno, so every torch.save here
(DeepSpeed's included) writes through a file object that keeps the OSError (vlm.train.write_errors).
With several ranks a failed write is held until every rank has written its part, then all ranks
compare and all raise the same WriteError: a disk full on one rank ends every rank in one line
instead of leaving the others in a collective.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlm.train import collectives, reshard
from vlm.train import expert_parallel as ep_lib
from vlm.train.checksums import file_digests
from vlm.train.engine import CheckpointRefused, safe_load
from vlm.train.layout import ParallelLayout
from vlm.train.write_errors import (
    WriteError,
    describe_write_error,
    disk_full_guess,
    torch_save,
)

log = logging.getLogger(__name__)

STEP_RE = re.compile(r"^step_(\d{8})$")
DS_TAG = "ds"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(Path(root))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class DamagedMeta(ValueError):
    """A checkpoint's meta.json that cannot be what a save wrote (cut short, not an object, a
    field of the wrong type); the message says what is wrong with it."""


def read_meta(ckpt: Path, need: tuple[str, ...] = ()) -> dict:
    """`ckpt`/meta.json as a save wrote it: a JSON object whose `files` (when present) maps names
    to SHA-256 digests and whose `step` / `world_size` (when present, and always the keys in
    `need`) are whole numbers. DamagedMeta otherwise."""
    try:
        meta = json.loads((ckpt / "meta.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DamagedMeta(f"not valid JSON ({type(e).__name__}: {str(e)[:80]})") from None
    except OSError as e:
        raise DamagedMeta(f"cannot be read ({e.strerror or e})") from None
    if not isinstance(meta, dict):
        raise DamagedMeta(f"a JSON {type(meta).__name__}, not an object")
    files = meta.get("files")
    if files is not None and not (
        isinstance(files, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
    ):
        raise DamagedMeta("its 'files' is not a mapping of file names to SHA-256 digests")
    for key in ("step", "world_size"):
        v = meta.get(key)
        if (key in need or v is not None) and not (
            isinstance(v, int) and not isinstance(v, bool) and v >= (key == "world_size")
        ):
            raise DamagedMeta(f"its {key!r} is {v!r}, not a whole number")
    return meta


def checkpoint_step(ckpt: Path) -> int:
    """The step a checkpoint was saved at (its folder's name)."""
    m = STEP_RE.match(ckpt.name)
    return int(m.group(1)) if m else read_meta(ckpt, ("step",))["step"]


def damaged_file(ckpt: Path, need: tuple[str, ...] = ()) -> str | None:
    """The first file of `ckpt` that is missing, differs from its recorded checksum, or is a
    meta.json that no save wrote (`read_meta`) (None: intact, or a checkpoint written before
    checksums were recorded)."""
    try:
        recorded = read_meta(ckpt, need).get("files")
    except DamagedMeta as e:
        return f"meta.json ({e})"
    if recorded is None:
        return None
    for rel, digest in recorded.items():
        path = ckpt / rel
        if not path.is_file():
            return f"{rel} (missing)"
        with open(path, "rb") as fh:
            if hashlib.file_digest(fh, "sha256").hexdigest() != digest:
                return f"{rel} (checksum mismatch)"
    return None


def _numpy_rng_state() -> dict[str, Any]:
    """numpy's global RNG state with its key array as a tensor: loadable with torch.load(weights_only=True)."""
    st = np.random.get_state(legacy=False)
    return {
        **st,
        "state": {
            "key": torch.from_numpy(st["state"]["key"].astype(np.int64)),
            "pos": st["state"]["pos"],
        },
    }


def _set_numpy_rng_state(st: dict[str, Any]) -> None:
    key = st["state"]["key"].numpy().astype(np.uint32)
    np.random.set_state({**st, "state": {"key": key, "pos": st["state"]["pos"]}})


def rng_state() -> dict[str, Any]:
    """Every generator a run draws from. CUDA's only where this process has initialised CUDA (a run
    on the GPU has, before its first step): a CPU run on a machine with a GPU drew nothing from
    them, and `is_available()` says that a GPU exists, not that the run uses it."""
    state = {
        "python": random.getstate(),
        "numpy": _numpy_rng_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    _set_numpy_rng_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    # a GPU run (its model is on the GPU by now), as above
    if "cuda" in state and torch.cuda.is_initialized():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (renamed into place, meta.json present), oldest first."""
    if not ckpt_root.is_dir():
        return []
    out = []
    for p in ckpt_root.iterdir():
        m = STEP_RE.match(p.name)
        if m and (p / "meta.json").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    ckpts = list_checkpoints(ckpt_root)
    return ckpts[-1][1] if ckpts else None


def clean_partial(ckpt_root: Path) -> None:
    """Remove leftovers of interrupted saves or deletions (rank 0, before training starts)."""
    if ckpt_root.is_dir():
        for p in ckpt_root.iterdir():
            if p.name.startswith((".tmp-", ".del-")):
                shutil.rmtree(p, ignore_errors=True)


def save_checkpoint(
    engine,
    ckpt_root: Path,
    step: int,
    trainer_state: dict,
    layout: ParallelLayout,
    keep_last: int,
) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory; WriteError (the
    `.tmp-` folder removed, older checkpoints untouched) when the files cannot be written, on
    every rank when any rank's write failed: a rank never leaves the save alone (the others would
    wait for it in the next collective forever), it holds its error until all ranks have done
    their part and compared."""
    rank, world_size = layout.rank, layout.world
    final = ckpt_root / step_dir_name(step)
    tmp = ckpt_root / f".tmp-{step_dir_name(step)}"
    held = _HeldError()
    if rank == 0:
        held.run(_make_tmp, ckpt_root, tmp)
    _agree(held, step, ckpt_root, tmp, rank)
    ds_save = getattr(getattr(engine, "checkpoint_engine", None), "save", None)
    # DeepSpeed's own torch.save, through the errno-keeping writer, its error held
    if ds_save is not None:
        # DeepSpeed's setting
        zipfile = getattr(engine.checkpoint_engine, "zipfile_serialization", True)
        engine.checkpoint_engine.save = lambda state_dict, path: held.run(
            torch_save, state_dict, path, _use_new_zipfile_serialization=zipfile
        )
    try:
        held.run(
            engine.save_checkpoint,
            str(tmp),
            tag=DS_TAG,
            # what a resume on other ranks needs; expert parallelism resumes on the same ranks
            # only, and DeepSpeed's MoE checkpoint reserves that key for itself
            client_state={} if getattr(engine, "has_moe_layers", False) else reshard.client_state(),
            save_latest=False,
        )
    finally:
        if ds_save is not None:
            del engine.checkpoint_engine.save  # back to the class's method
    held.run(torch_save, trainer_state, tmp / f"rank_{rank:05d}.pt")
    # this rank's routed experts where they are split over ranks (DeepSpeed's module file: rank 0's)
    held.run(ep_lib.save_shard, engine.module, tmp, rank, world_size, torch_save)
    _agree(held, step, ckpt_root, tmp, rank)
    if rank == 0:
        held.run(_commit, ckpt_root, tmp, final, step, layout, keep_last)
    _agree(held, step, ckpt_root, tmp, rank)
    return final


class _HeldError:
    """The first error of this rank's part of a save, kept until every rank has done its part (`_agree`)."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def run(self, fn, *args, **kwargs) -> None:
        if self.error is not None:  # the save failed here already: nothing more to write
            return
        try:
            fn(*args, **kwargs)
        except (OSError, RuntimeError) as e:
            self.error = e


def _make_tmp(ckpt_root: Path, tmp: Path) -> None:
    ckpt_root.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()


def _commit(
    ckpt_root: Path, tmp: Path, final: Path, step: int, layout: ParallelLayout, keep_last: int
) -> None:
    """Rank 0, once every rank wrote its files: meta.json (written last), the rename into place, the pruning."""
    (tmp / "meta.json").write_text(
        json.dumps(
            {
                "step": step,
                "world_size": layout.world,
                "layout": layout.as_dict(),
                "time": time.time(),
                "files": file_digests(tmp),
            }
        )
    )
    _fsync_tree(tmp)
    if final.exists():  # same step saved twice (e.g. a final save right after a periodic one)
        old = ckpt_root / f".del-{final.name}"
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(ckpt_root)
    for _, old in list_checkpoints(ckpt_root)[:-keep_last]:
        trash = ckpt_root / f".del-{old.name}"
        os.replace(old, trash)
        shutil.rmtree(trash, ignore_errors=True)


def _agree(held: _HeldError, step: int, ckpt_root: Path, tmp: Path, rank: int) -> None:
    """Collective: every rank learns whether any rank's part of the save failed. If one did, rank 0
    removes the partial folder and every rank raises: WriteError (one line) for the machine's
    errors, the error itself for a bug on this rank."""
    mine = held.error
    if isinstance(mine, RuntimeError):
        mine = disk_full_guess(mine, ckpt_root)
    said = None if mine is None else describe_write_error(mine, tmp)
    failed = [(r, d) for r, d in enumerate(collectives.every_rank(said)) if d is not None]
    if not failed:
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(mine, RuntimeError):
        raise held.error  # not the machine's doing: a bug, with its traceback
    r, what = next(((r, d) for r, d in failed if r == rank), failed[0])
    previous = latest_checkpoint(ckpt_root)
    keep = previous if previous is not None else "the start of the run (no checkpoint yet)"
    on = f" (on rank {r})" if r != rank else ""
    raise WriteError(
        f"cannot write checkpoint step {step}: {what}{on}; removed "
        f"the partial {tmp.name}, the resume point stays {keep}"
    ) from None


def save_state_dir(root: Path, name: str, state: dict) -> Path:
    """One process's state (tensors and plain containers) as root/name/state.pt with its checksum,
    written into `.tmp-name` and renamed: an interrupted write leaves the previous one in place.
    WriteError on a failed write."""
    final, tmp = root / name, root / f".tmp-{name}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        torch_save(state, tmp / "state.pt")
        (tmp / "meta.json").write_text(
            json.dumps({"time": time.time(), "files": file_digests(tmp)})
        )
        _fsync_tree(tmp)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise WriteError(
            f"cannot write {final}: {describe_write_error(e, tmp)}; removed the partial {tmp.name}"
        ) from None
    if final.exists():
        old = root / f".del-{name}"
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(root)
    return final


def load_state_dir(root: Path, name: str, warn=log.warning) -> dict | None:
    """The state `save_state_dir` wrote, or None (absent, or damaged: with a warning)."""
    d = root / name
    if not (d / "meta.json").is_file():
        return None
    bad = damaged_file(d)
    if bad is not None:
        warn(f"{d} is damaged: {bad}; not using it")
        return None
    return safe_load(d / "state.pt")


def basic_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer under DeepSpeed's wrapper (ZeRO, bf16), or the engine's own."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def load_checkpoint(engine, ckpt: Path, rank: int, world_size: int, log=log.info) -> dict:
    """Collective: restore the engine from `ckpt` and return this rank's trainer state. A checkpoint
    written by another number of ranks loads through DeepSpeed's universal checkpoint
    (vlm.train.reshard; the engine was built for it). CheckpointRefused (one line naming the file)
    on every rank when a rank cannot use its part."""
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
    experts_why = ep_lib.restore_shard(engine.module, ckpt, rank)
    # the trainer state is the same on every rank but for its RNG streams: a rank the checkpoint
    # did not have takes rank 0's
    state_file = ckpt / f"rank_{rank if rank < written else 0:05d}.pt"
    state, why = None, None
    try:
        if not state_file.is_file():
            raise CheckpointRefused(
                f"checkpoint {ckpt} has no trainer state for rank {rank} ({state_file.name})"
            )
        # tensors and plain containers only: a crafted checkpoint cannot run code
        state = safe_load(state_file)
    except CheckpointRefused as e:
        why = str(e)
    why = why or experts_why
    # a rank alone with its refusal would leave the others waiting in the first step's collective
    refused = [w for w in collectives.every_rank(why) if w is not None]
    if refused:
        raise CheckpointRefused(why or refused[0])
    return state


def newest_intact_checkpoint(ckpt_root: Path, warn=log.warning) -> Path | None:
    for _, ckpt in reversed(list_checkpoints(ckpt_root)):
        bad = damaged_file(ckpt, ("step", "world_size"))
        if bad is None:
            return ckpt
        warn(f"checkpoint {ckpt} is damaged: {bad}; trying the one before it")
    return None


def find_resume_point(ckpt_root: Path, rank: int, warn=log.warning) -> Path | None:
    """Rank 0 decides which checkpoint every rank resumes from: the newest whose files match their checksums."""
    found = newest_intact_checkpoint(ckpt_root, warn) if rank == 0 else None
    choice = str(found) if found is not None else None
    choice = collectives.decision_of_rank0(choice)
    return Path(choice) if choice else None


def resume_point(ckpt_root: Path, rank: int, resume: bool | None, log=log.info) -> Path | None:
    """The checkpoint a run resumes from (None: it starts from the beginning). resume: True = it
    must (a run preempted before its first checkpoint starts over, with a line saying so); None =
    when there is one; False = there must be none. Damaged checkpoints are skipped with a warning,
    all damaged is an error."""
    from configs.config import ConfigError

    found = find_resume_point(ckpt_root, rank, warn=lambda m: log(f"warning: {m}"))
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


class Checkpointer:
    """Writes the run's checkpoints and decides by itself when (`maybe_save`: every `save_every` steps)."""

    def __init__(self, engine, root: Path, save_every: int, keep_last: int, layout: ParallelLayout):
        self.engine, self.root = engine, root
        self.save_every, self.keep_last = save_every, keep_last
        self.layout = layout
        self.last_saved = -1

    def save(self, step: int, state: dict) -> Path:
        """Collective: every rank calls it."""
        path = save_checkpoint(self.engine, self.root, step, state, self.layout, self.keep_last)
        self.last_saved = step
        return path

    def resumed_at(self, step: int) -> None:
        """The run continues from the checkpoint of `step`: it is saved already."""
        self.last_saved = step

    def maybe_save(self, step: int, state_fn) -> Path | None:
        if self.save_every and step % self.save_every == 0:
            return self.save(step, state_fn())
        return None

    def save_unless_saved(self, step: int, state_fn) -> Path | None:
        """At the end of a run: the last step is always in a checkpoint."""
        return None if self.last_saved == step else self.save(step, state_fn())
