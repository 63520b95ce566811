"""What a run folder holds, and what a new run may do with it.

A run's outputs are what it is read by afterwards: `final/` (the model), `summary.json`, and
`metrics.jsonl` once it holds a step. A run that has a checkpoint to resume from continues (the same
command resumes it); one that does not starts from step 0, and then must not silently replace an
earlier run's outputs: `vlm train` refuses, in one line, unless told `--overwrite` (start over: the
earlier run's files, checkpoints included, are deleted first) or given a new `--out`. `--resume` may
start a run over that never saved a checkpoint and never finished (no `final/`, no `summary.json`:
it was stopped before its first save), as the requeue of a preempted job does. `config.yaml` (and an
empty `metrics.jsonl`) alone are not outputs: a run stopped before its first step leaves them, and
the same command then starts it.

A config error found once the run folder exists removes the folder when this run made it
(`made_by_this_run`), so that a bad config leaves nothing behind.

One writer per run folder: `vlm train` and each stage of `vlm chain` hold the folder's lock
(configs.folder_lock; rank 0 for all ranks) while they run (`hold_run_dir`), so a second `vlm
train` into the same --out (a resubmitted job, the same command in another terminal) is refused in
one line naming the first, instead of both appending to one metrics.jsonl. `--overwrite` deletes
only from a folder that holds a run's `config.yaml`: a folder that merely holds files named like a
run's outputs is not a run's.

The lock covers the folders inside the run folder too (a `vlm convert --out RUN/final` while RUN
trains is refused), and the trainer's export replaces `final/` only when it is the one that was there
when the run took its lock (`export_refusal`): a `final/` another writer made during the run (where
locks do not hold) is left as it is, and the export refused in one line.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from configs.config import ConfigError
from configs.folder_lock import FolderBusy, folder_problem, held_lock, lock_folder

# what a run writes into its folder (vlm.train.trainer, metrics, tracking, vision_warmup,
# run_summary): what --overwrite deletes; anything else in the folder is left alone
RUN_FILES = (
    "checkpoints",
    "final",
    ".tmp-final",
    ".del-final",
    "summary.json",
    "metrics.jsonl",
    "report.png",
    "config.yaml",
    "deepspeed_config.json",
    "tb",
    "vision_warmup.json",
    "vision_load_report.txt",
    "wandb_id",
    "wandb",
)


def logged_steps(metrics: Path) -> int:
    """Lines of metrics.jsonl that record a step (0 when it is missing or unreadable)."""
    try:
        lines = metrics.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return 0
    n = 0
    for line in lines:
        try:
            n += isinstance(rec := json.loads(line), dict) and "step" in rec
        except ValueError:
            continue
    return n


def run_outputs(run_dir: Path) -> list[str]:
    """The outputs of an earlier run in `run_dir`, as the refusal names them (empty: none)."""
    out = []
    if (run_dir / "final").is_dir() and any((run_dir / "final").iterdir()):
        out.append("final/")
    if (run_dir / "summary.json").is_file():
        out.append("summary.json")
    steps = logged_steps(run_dir / "metrics.jsonl")
    if steps:
        out.append(f"metrics.jsonl with {steps} logged step{'s' if steps > 1 else ''}")
    return out


def refusal(run_dir: Path, resume: bool | None) -> str | None:
    """Why a run that starts from step 0 may not train into `run_dir` (None: it may)."""
    found = run_outputs(run_dir)
    if not found:
        return None
    finished = any(f in ("final/", "summary.json") for f in found)
    # a requeued run that was stopped before its first checkpoint
    if resume is True and not finished:
        return None
    again = "" if finished else ", --resume to start this unfinished run over from step 0"
    return (
        f"{run_dir} holds the outputs of an earlier run ({', '.join(found)}) "
        "and no checkpoint to resume from: training here would replace them. "
        f"Give a new --out{again}, or --overwrite to delete them and start over"
    )


def clear_run(run_dir: Path) -> list[str]:
    """--overwrite: delete what an earlier run wrote into `run_dir` (RUN_FILES only); the names
    deleted. ConfigError, deleting nothing, when `run_dir` holds such names but no run's
    config.yaml (a folder of something else)."""
    present = [n for n in RUN_FILES if (run_dir / n).exists() or (run_dir / n).is_symlink()]
    if present and not _holds_run_config(run_dir / "config.yaml"):
        raise ConfigError(
            f"--overwrite: {run_dir} is not a run folder (no run config.yaml in it), so nothing "
            f"in it is deleted, though it holds {', '.join(present[:5])}"
            f"{f' and {len(present) - 5} more' if len(present) > 5 else ''}; give the run's own "
            "folder or a new --out"
        )
    gone = []
    # the cut lines a resume kept beside metrics.jsonl (vlm.train.metrics_sinks.MetricsFile)
    cut = sorted(p.name for p in run_dir.glob("metrics.jsonl.cut-*")) if run_dir.is_dir() else []
    for name in (*RUN_FILES, *cut):
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        gone.append(name)
    return gone


def _holds_run_config(path: Path) -> bool:
    """`path` is a config.yaml a run wrote: a YAML mapping with a model and a train section."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and isinstance(data.get("model"), dict) and "train" in data


def check_out_dir(run_dir: Path) -> None:
    """ConfigError (one line) unless a run can write into `run_dir`: a file where the folder or a
    parent should be, a folder that refuses new files. Before any work."""
    problem = folder_problem(run_dir)
    if problem is not None:
        raise ConfigError(f"--out {run_dir}: {problem}; give a folder you can write to")


@contextmanager
def hold_run_dir(run_dir: Path, is_main: bool, command: str, keep_contents: bool = False):
    """Rank 0 holds `run_dir`'s lock for the block (configs.folder_lock.FolderBusy when another
    process holds it); a ConfigError inside removes the folders that making `run_dir` for the lock
    created, as `made_by_this_run` does (`keep_contents`: only when nothing else was written into
    them: a chain's folder keeps the stages that finished)."""
    if not is_main:
        yield
        return
    check_out_dir(run_dir)
    made = first_missing(run_dir)
    lock = lock_folder(run_dir, command)
    real = os.path.realpath(run_dir)
    _FINAL_AT_START[real] = _identity(run_dir / "final")
    try:
        yield
    except ConfigError:
        lock.release()
        lock = None
        if made is not None and made.exists():
            if not keep_contents:
                shutil.rmtree(made, ignore_errors=True)
            elif not any(run_dir.iterdir()):
                for p in (run_dir, *run_dir.parents):
                    p.rmdir()
                    if p == made:
                        break
        raise
    finally:
        _FINAL_AT_START.pop(real, None)
        if lock is not None:
            lock.release()


# `final/` of each run folder this process holds, as it was when the lock was taken (or as this
# run's export left it): what the export may replace
_FINAL_AT_START: dict[str, tuple | None] = {}


def _identity(path: Path) -> tuple | None:
    """Which folder `path` is and when its entries last changed (None: nothing there)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns)


def export_refusal(run_dir: Path) -> str | None:
    """Why the export may not replace `run_dir/final` now (None: it may): the run folder's lock
    was removed or replaced during the run, or `final/` is not what it was when the run took the
    lock (another writer made or changed it). A run not held by `hold_run_dir` (a Trainer built
    directly) is not checked."""
    lock = held_lock(run_dir)
    if lock is not None:
        try:
            lock.check()
        except FolderBusy as e:
            return str(e)
    real = os.path.realpath(run_dir)
    if real not in _FINAL_AT_START:
        return None
    final = run_dir / "final"
    now = _identity(final)
    if now is None or now == _FINAL_AT_START[real]:
        return None
    return (
        f"{final} was {'made' if _FINAL_AT_START[real] is None else 'changed'} during this run by "
        "another writer; it is left as it is"
    )


def exported(run_dir: Path) -> None:
    """This run's export made `run_dir/final`: a later export of the same run may replace it."""
    real = os.path.realpath(run_dir)
    if real in _FINAL_AT_START:
        _FINAL_AT_START[real] = _identity(run_dir / "final")


def first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` (itself included) that does not exist yet: what making it creates."""
    path = path.absolute()
    if path.exists():
        return None
    while not path.parent.exists():
        path = path.parent
    return path


@contextmanager
def made_by_this_run(run_dir: Path, is_main: bool):
    """A ConfigError inside the block removes the folders that making `run_dir` created (rank 0), and goes on."""
    made = first_missing(run_dir) if is_main else None
    try:
        yield
    except ConfigError:
        if made is not None and made.exists():
            shutil.rmtree(made, ignore_errors=True)
        raise


def check_start(
    run_dir: Path, resume: bool | None, overwrite: bool | None, resume_from, is_main: bool
) -> None:
    """Collective when distributed. ConfigError on every rank when a run that found nothing to
    resume (`resume_from` None) would replace an earlier run's outputs (rank 0 looks); overwrite
    None (a caller that owns the folder, as `vlm chain` does its stages') skips the check."""
    from vlm.train import collectives

    if overwrite is not False or resume_from is not None:
        return
    why = collectives.decision_of_rank0(refusal(run_dir, resume) if is_main else None)
    if why is not None:
        raise ConfigError(why)
