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
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

from configs.config import ConfigError

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
    """--overwrite: delete what an earlier run wrote into `run_dir` (RUN_FILES only); the names deleted."""
    gone = []
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        gone.append(name)
    return gone


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
