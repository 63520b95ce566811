"""The save protocol: the step waits while the state is staged to host memory; each rank then writes
and hashes its own files in a background thread, and rank 0 commits the checkpoint once every rank
has written its share.

1. Staging (collective, the step waits): rank 0 makes `.tmp-step_N/`; the engine's save_checkpoint
   runs with its writes captured (vlm.train.ds_internals.engine_writes) and each state dict copied
   to host memory (`host_copy`), with this rank's trainer state and expert shard.
2. Writing (a background thread per rank): each rank writes its staged files, hashing them as they
   are written and fsyncing them; no rank reads another's bytes. The ranks exchange their lists of
   digests over a group of their own (collectives.side_group: the main thread's collectives go on
   meanwhile).
3. Commit (rank 0's thread): meta.json, with every file's digest and writer, written last; the
   rename into place; only then does the checkpoint count (vlm.train.ckpt_layout). The pruning of
   the oldest follows, in the same thread: off the step's path.

The next save, the end of the run and a stop by a signal wait for an in-flight save (`wait`), and a
process that exits with one in flight finishes it first (the writer is not a daemon thread).

A save that cannot be written (a full disk, a quota, a read-only mount) on any rank ends every rank
with the same one-line WriteError (the path and the system's reason, "No space left on device"),
after the `.tmp-` folder was removed; the previous checkpoint, untouched, stays the resume point. A
failure while staging is reported at once, one while writing at the next `wait` (the next save, the
end of the run or a stop), on every rank alike: every rank learns the outcome from rank 0's commit.
torch.save reports a failed write as "iostream error" without the errno, so every write keeps the
OSError (vlm.train.write_errors).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from vlm.train import collectives, ds_internals, reshard
from vlm.train import expert_parallel as ep_lib
from vlm.train.ckpt_layout import (
    DS_TAG,
    fsync_dir,
    fsync_file,
    latest_checkpoint,
    list_checkpoints,
    remove,
    step_dir_name,
)
from vlm.train.ckpt_manifest import host_copy, sha256_of, write_hashed
from vlm.train.layout import ParallelLayout
from vlm.train.write_errors import (
    WriteError,
    describe_write_error,
    disk_full_guess,
    torch_save_file,
)


@dataclass
class Staged:
    """A save's state in host memory, before it is written: (path relative to the folder, state)."""

    step: int
    tmp: Path
    final: Path
    files: list[tuple[str, object, bool]] = field(default_factory=list)  # rel, state, zipfile
    stage_s: float = 0.0


def write_file(obj, path: Path, zipfile: bool = True) -> tuple[str, float]:
    """One staged state into `path`, fsynced: (its SHA-256, seconds hashing). OSError (errno, path)
    where the write fails."""
    return write_hashed(
        lambda o, fh: torch_save_file(o, fh, path, _use_new_zipfile_serialization=zipfile),
        obj,
        path,
    )


def optimizer_names(engine) -> list[list[str]] | None:
    """The names of the optimizer's parameters, group by group, in the order torch's optimizer
    state dict numbers them: what maps DeepSpeed's optimizer files back to parameters
    (vlm.train.expert_regroup). Under bf16 at stage 0 the torch optimizer steps fp32 copies,
    group by group in the order of the weights they copy (vlm.train.ds_internals.fp32_copies)."""
    opt = getattr(engine, "optimizer", None)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    copied = ds_internals.fp32_copies(opt)
    if copied is not None:
        return [[names.get(id(p), "") for p, _ in group] for group in copied]
    opt = getattr(opt, "optimizer", opt)
    if opt is None or not hasattr(opt, "param_groups"):
        return None
    return [[names.get(id(p), "") for p in g["params"]] for g in opt.param_groups]


def stage(
    engine, ckpt_root: Path, step: int, trainer_state: dict, layout: ParallelLayout
) -> Staged:
    """Collective: the checkpoint of `step` in host memory, its `.tmp-` folder made (WriteError on
    every rank where any rank failed)."""
    rank = layout.rank
    final = ckpt_root / step_dir_name(step)
    staged = Staged(step, ckpt_root / f".tmp-{step_dir_name(step)}", final)
    tmp = staged.tmp
    held = _HeldError()
    if rank == 0:
        held.run(_make_tmp, ckpt_root, tmp)
    _agree(held, step, ckpt_root, tmp, rank)
    t0 = time.perf_counter()

    def keep(state_dict, path, zipfile=True):
        staged.files.append(
            (Path(path).relative_to(tmp).as_posix(), host_copy(state_dict), zipfile)
        )

    with ds_internals.engine_writes(engine, keep):
        held.run(
            engine.save_checkpoint,
            str(tmp),
            tag=DS_TAG,
            # what a resume on other ranks needs; DeepSpeed's MoE checkpoint reserves that key
            client_state={} if getattr(engine, "has_moe_layers", False) else reshard.client_state(),
            save_latest=False,
        )
    own = {**trainer_state, "optimizer_names": optimizer_names(engine)}
    keep(own, tmp / f"rank_{rank:05d}.pt")
    # this rank's routed experts where they are split over ranks (DeepSpeed's module file: rank 0's)
    held.run(ep_lib.save_shard, engine.module, tmp, rank, layout.world, keep)
    staged.stage_s = time.perf_counter() - t0
    _agree(held, step, ckpt_root, tmp, rank)
    return staged


def write_share(staged: Staged) -> dict:
    """This rank's staged files written and hashed: its part of the manifest."""
    t0, hash_s, files = time.perf_counter(), 0.0, {}
    for rel, obj, zipfile in staged.files:
        path = staged.tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        files[rel], h = write_file(obj, path, zipfile)
        hash_s += h
    return {"files": files, "write_s": time.perf_counter() - t0, "hash_s": hash_s}


def commit(staged: Staged, reports: list[dict], layout: ParallelLayout) -> float:
    """Rank 0, once every rank wrote its files: meta.json (written last) and the rename into place;
    the seconds it took. The few files the engine wrote itself on rank 0 (ZeRO's zero_to_fp32.py)
    are hashed here."""
    t0 = time.perf_counter()
    tmp, final = staged.tmp, staged.final
    files, writers = {}, {}
    for r, rep in enumerate(reports):
        for rel, digest in rep["files"].items():
            files[rel], writers[rel] = digest, r
    for p in sorted(tmp.rglob("*")):
        rel = p.relative_to(tmp).as_posix()
        if p.is_file() and rel not in files and rel != "meta.json":
            fsync_file(p)
            files[rel], writers[rel] = sha256_of(p), 0
    meta = {
        "step": staged.step,
        "world_size": layout.world,
        "layout": layout.as_dict(),
        "time": time.time(),
        "files": files,
        "writers": writers,
    }
    (tmp / "meta.json").write_text(json.dumps(meta))
    fsync_file(tmp / "meta.json")
    for d in sorted({p.parent for p in tmp.rglob("*")} | {tmp}, reverse=True):
        fsync_dir(d)
    if final.exists():  # same step saved twice (e.g. a final save right after a periodic one)
        remove(final.parent, final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return time.perf_counter() - t0


def prune(ckpt_root: Path, keep_last: int) -> None:
    for _, old in list_checkpoints(ckpt_root)[:-keep_last]:
        remove(ckpt_root, old)


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


def _said(error: BaseException | None, ckpt_root: Path, tmp: Path) -> str | None:
    """A rank's failed part as the line every rank reports."""
    if isinstance(error, RuntimeError):
        error = disk_full_guess(error, ckpt_root)
    return None if error is None else describe_write_error(error, tmp)


def _failure(step: int, ckpt_root: Path, tmp: Path, what: str, on_rank: int | None) -> WriteError:
    previous = latest_checkpoint(ckpt_root)
    keep = previous if previous is not None else "the start of the run (no checkpoint yet)"
    on = f" (on rank {on_rank})" if on_rank is not None else ""
    return WriteError(
        f"cannot write checkpoint step {step}: {what}{on}; removed "
        f"the partial {tmp.name}, the resume point stays {keep}"
    )


def _a_bug(error: BaseException | None, ckpt_root: Path) -> bool:
    """Not the machine's doing (a RuntimeError that is no disk's): raised with its traceback."""
    return isinstance(error, RuntimeError) and isinstance(
        disk_full_guess(error, ckpt_root), RuntimeError
    )


def _agree(held: _HeldError, step: int, ckpt_root: Path, tmp: Path, rank: int) -> None:
    """Collective: every rank learns whether any rank's part of the staging failed. If one did,
    rank 0 removes the partial folder and every rank raises: WriteError (one line) for the
    machine's errors, the error itself for a bug on this rank."""
    mine = held.error
    said = _said(mine, ckpt_root, tmp)
    failed = [(r, d) for r, d in enumerate(collectives.every_rank(said)) if d is not None]
    if not failed:
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if _a_bug(mine, ckpt_root):
        raise held.error  # not the machine's doing: a bug, with its traceback
    r, what = next(((r, d) for r, d in failed if r == rank), failed[0])
    raise _failure(step, ckpt_root, tmp, what, r if r != rank else None) from None


class BackgroundSave:
    """One staged checkpoint being written: each rank's share by its own thread, the commit by
    rank 0's; `outcome` (the same on every rank once `join`ed): None, or the line of the failure,
    and the ranks' timings."""

    def __init__(
        self, staged: Staged, layout: ParallelLayout, ckpt_root: Path, keep_last: int, group
    ):
        self.staged, self.layout, self.root = staged, layout, ckpt_root
        self.keep_last, self.group = keep_last, group
        self.outcome: dict | None = None
        self.recorded = False  # rank 0: its timings are in the metrics
        self.error: BaseException | None = None  # a bug of this rank's writer: raised by `join`
        self.thread = threading.Thread(
            target=self._run, name=f"checkpoint-{staged.step}", daemon=False
        )

    def start(self, background: bool) -> None:
        if background:
            self.thread.start()
        else:
            self._run()

    def _run(self) -> None:
        try:
            self._write_and_commit()
        except BaseException as e:  # noqa: BLE001 - a peer gone, a bug: raised by `join`
            self.error = self.error or e

    def _write_and_commit(self) -> None:
        staged, rank = self.staged, self.layout.rank
        try:
            report = write_share(staged)
        except (OSError, RuntimeError) as e:
            said = _said(e, self.root, staged.tmp)
            if _a_bug(e, self.root):
                self.error = e
            report = {"error": said or f"{type(e).__name__}: {e}", "files": {}}
        staged.files = []  # the host copies: written
        report["stage_s"] = staged.stage_s
        reports = collectives.side_gather(report, self.group)
        outcome = None
        if rank == 0:
            outcome = self._finish(reports)
        outcome = collectives.side_broadcast(outcome, self.group)
        self.outcome = outcome
        if rank == 0 and outcome["error"] is None:
            prune(self.root, self.keep_last)  # after every rank knows: nobody waits for it

    def _finish(self, reports: list[dict]) -> dict:
        staged = self.staged
        ranks = {k: [r.get(k, 0.0) for r in reports] for k in ("stage_s", "write_s", "hash_s")}
        failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep.get("error")]
        commit_s = 0.0
        if not failed:
            try:
                commit_s = commit(staged, reports, self.layout)
            except Exception as e:  # noqa: BLE001 - every rank waits for this outcome
                failed = [(0, describe_write_error(e, staged.tmp))]
        if failed:
            shutil.rmtree(staged.tmp, ignore_errors=True)
            r, what = failed[0]
            r = r if self.layout.world > 1 else None
            return {
                "error": str(_failure(staged.step, self.root, staged.tmp, what, r)),
                "ranks": ranks,
            }
        return {"error": None, "ranks": ranks, "commit_s": commit_s, "step": staged.step}

    def join(self) -> dict:
        """Wait for it; WriteError (the same line on every rank) where it failed."""
        if self.thread.is_alive() or self.thread.ident is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error
        if self.outcome is None:  # pragma: no cover - _run always sets one or an error
            raise RuntimeError(f"the checkpoint writer of step {self.staged.step} left no outcome")
        if self.outcome["error"] is not None:
            raise WriteError(self.outcome["error"])
        return self.outcome


class Checkpointer:
    """Writes the run's checkpoints and decides by itself when (`maybe_save`: every `save_every` steps)."""

    def __init__(
        self,
        engine,
        root: Path,
        save_every: int,
        keep_last: int,
        layout: ParallelLayout,
        background: bool = True,
    ):
        self.engine, self.root = engine, root
        self.save_every, self.keep_last = save_every, keep_last
        self.layout, self.background = layout, background
        self.last_saved = -1
        self.in_flight: BackgroundSave | None = None
        self.group = collectives.side_group()
        self.blocked_s = 0.0  # the last save's wait for the one before it
        self.metrics: dict = {}  # rank 0: what the next metrics line records

    def save(self, step: int, state: dict) -> Path:
        """Collective: every rank calls it. Returns when the state is staged; the checkpoint's
        folder exists once the save is complete (`wait`)."""
        t0 = time.perf_counter()
        self.wait()
        self.blocked_s = time.perf_counter() - t0
        staged = stage(self.engine, self.root, step, state, self.layout)
        self.in_flight = BackgroundSave(staged, self.layout, self.root, self.keep_last, self.group)
        self.in_flight.start(self.background)
        self.last_saved = step
        return staged.final

    def wait(self) -> None:
        """Collective: the save in flight is complete (every rank); WriteError where it failed."""
        save, self.in_flight = self.in_flight, None
        if save is None:
            return
        save.join()
        self._record_save(save)

    def _record_save(self, save: BackgroundSave) -> None:
        if self.layout.rank != 0 or save.recorded:
            return
        save.recorded, outcome = True, save.outcome
        ranks = outcome["ranks"]
        self.metrics.update(
            {
                "checkpoint/step": outcome["step"],
                "checkpoint/stage_s": max(ranks["stage_s"]),
                "checkpoint/write_s": max(ranks["write_s"]),
                "checkpoint/hash_s": max(ranks["hash_s"]),
                "checkpoint/commit_s": outcome["commit_s"],
                "checkpoint/blocked_s": self.blocked_s,
                "checkpoint/ranks": ranks,
            }
        )

    def record_resume(self, ranks: dict[str, list[float]]) -> None:
        """Rank 0: the resume's timings by rank (verification, load), for the next metrics line."""
        self.metrics.update({f"resume/{k}": max(v) for k, v in ranks.items()})
        self.metrics["resume/ranks"] = ranks

    def take_metrics(self) -> dict:
        """Rank 0: what the checkpoints finished since the last call recorded (a save finished
        in the background is taken without waiting for it)."""
        save = self.in_flight
        if save is not None and save.outcome is not None and not save.thread.is_alive():
            if save.outcome["error"] is None:
                self._record_save(save)
        out, self.metrics = self.metrics, {}
        return out

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
