"""A checkpoint's folder: its name, its meta.json, and which folders are complete checkpoints.

Layout of RUN_DIR/checkpoints/step_00000100/:
    ds/               DeepSpeed's save_checkpoint (module, optimizer / ZeRO partitions, engine counters)
    rank_00000.pt     per-rank trainer state: step, scheduler, RNG (python, numpy, torch), data-loader state
    experts_rank_NNNNN.pt   each rank's routed experts under expert parallelism (vlm.train.expert_parallel)
    meta.json         written last: step, world size and parallel layout, the SHA-256 of every other
                      file and the rank that wrote (and hashed) it

A checkpoint is written into `.tmp-step_...` and renamed once complete; a folder counts only with
its meta.json (`list_checkpoints`), so a crash mid-save leaves a `.tmp-` folder that is never picked
(and the next run deletes). Old checkpoints are renamed to `.del-` before removal for the same reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

STEP_RE = re.compile(r"^step_(\d{8})$")
DS_TAG = "ds"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fsync_file(Path(root) / f)
        fsync_dir(Path(root))


def fsync_dir(path: Path) -> None:
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
    to SHA-256 digests, whose `writers` (when present) maps names to ranks, and whose `step` /
    `world_size` (when present, and always the keys in `need`) are whole numbers. DamagedMeta
    otherwise."""
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
    writers = meta.get("writers")
    if writers is not None and not (
        isinstance(writers, dict)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in writers.values())
    ):
        raise DamagedMeta("its 'writers' is not a mapping of file names to ranks")
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


def remove(ckpt_root: Path, ckpt: Path) -> None:
    """Delete a checkpoint: renamed to `.del-` first (a crash mid-delete leaves no half checkpoint
    that looks complete), then removed."""
    trash = ckpt_root / f".del-{ckpt.name}"
    os.replace(ckpt, trash)
    shutil.rmtree(trash, ignore_errors=True)
