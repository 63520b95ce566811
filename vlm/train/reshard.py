"""A checkpoint written by N ranks, resumed on M: DeepSpeed's universal checkpoint.

ZeRO partitions the optimizer state (ZeRO 1-3, and the bf16 optimizer's fp32 master weights) over the
data-parallel ranks that wrote it, so a checkpoint's `ds/` files only load on as many ranks. Resumed on
another number, the checkpoint is converted once into DeepSpeed's universal format (one file per
parameter for its fp32 weights and each Adam moment: `deepspeed.checkpoint.ds_to_universal`), which
any number of ranks loads (`checkpoint.load_universal`), each taking its own partition. The conversion
runs in worker processes (DeepSpeed's converter parallelises its extraction over the ranks' files
and its merge over the parameters; `vlm reshard RUN --workers K` runs it offline) and goes into the
checkpoint's own folder (`universal/`, written into `.tmp-universal` and renamed, with
the SHA-256 of every file it wrote); a later resume on yet another count reuses it. A plain fp32 run
without ZeRO keeps one full optimizer state and loads on any number of ranks as it is.

The universal loader takes weights, Adam moments and the step count; the schedule, the data position
and the counters are the trainer state's (world-size independent), and the RNG streams are each
rank's where it existed (a new rank takes rank 0's: the run's randomness, boundary noise and data
order, is keyed by global indices, not by rank).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch

from vlm.train import collectives, ds_internals
from vlm.train.checksums import file_digests
from vlm.train.engine import CheckpointRefused

UNIVERSAL = "universal"


def client_state() -> dict:
    """What DeepSpeed's converter needs the engine's checkpoint to state (a model without tensor or
    pipeline parallelism: the format version only)."""
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    return {
        UNIVERSAL_CHECKPOINT_INFO: {
            UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE
        }
    }


def written_by(ckpt: Path) -> int:
    """The number of ranks that wrote `ckpt`."""
    return int(json.loads((ckpt / "meta.json").read_text())["world_size"])


def partitioned(ds_json: dict) -> bool:
    """Whether the engine of `ds_json` partitions its optimizer state over the ranks (ZeRO >= 1, or
    the bf16 optimizer's master weights)."""
    stage = int((ds_json.get("zero_optimization") or {}).get("stage", 0))
    bf16 = bool((ds_json.get("bf16") or {}).get("enabled", False))
    return stage >= 1 or bf16


def needs_universal(ckpt: Path | None, world_size: int, ds_json: dict) -> bool:
    """A resume from `ckpt` on `world_size` ranks goes through the universal checkpoint."""
    return ckpt is not None and written_by(ckpt) != world_size and partitioned(ds_json)


def with_universal_loading(ds_json: dict) -> dict:
    """The engine's JSON for a resume through a universal checkpoint."""
    return {**ds_json, "checkpoint": {**ds_json.get("checkpoint", {}), "load_universal": True}}


@contextlib.contextmanager
def tensors_only():
    """DeepSpeed's converter and its universal loaders read files with torch.load(weights_only=False):
    here they load as tensors and plain containers only (vlm.train.engine.safe_load's rule)."""
    from vlm.train.engine import safe_load

    real = torch.load

    def load(f, map_location=None, weights_only=None, **kwargs):
        return safe_load(f, map_location=map_location, load=real)

    torch.load = load
    try:
        yield
    finally:
        torch.load = real


def universal_intact(ckpt: Path) -> bool:
    """`ckpt/universal` was written whole and its files are unchanged."""
    root = ckpt / UNIVERSAL
    meta = root / "meta.json"
    if not meta.is_file():
        return False
    try:
        recorded = json.loads(meta.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return False
    return recorded == file_digests(root)


def default_workers() -> int:
    """The conversion's worker processes: the cores this process may use (at most 16: each worker
    holds the parameters it converts)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(16, cores))


def convert(ckpt: Path, ds_tag: str, log, workers: int | None = None) -> Path:
    """`ckpt/universal` from `ckpt`'s DeepSpeed files, spread over `workers` processes (default:
    `default_workers`) for each of the converter's phases (once; a damaged earlier conversion is
    made again). Returns the folder."""
    out = ckpt / UNIVERSAL
    if universal_intact(ckpt):
        return out
    tmp = ckpt / f".tmp-{UNIVERSAL}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    workers = workers or default_workers()
    log(
        f"converting {ckpt.name} (written by {written_by(ckpt)} ranks) to a universal checkpoint "
        f"with {workers} worker(s)"
    )
    # the workers are forked: they load through tensors_only too
    with tensors_only(), contextlib.redirect_stdout(None):
        ds_internals.to_universal(ckpt / ds_tag, tmp / ds_tag, workers)
    (tmp / "meta.json").write_text(json.dumps({"files": file_digests(tmp)}))
    tmp.rename(out)
    return out


def universal_folder(ckpt: Path, ds_tag: str, is_main: bool, log) -> Path:
    """Collective: the universal checkpoint of `ckpt`, converted by rank 0's worker processes while
    the others wait (`vlm reshard RUN --workers K` converts it ahead of the resume, offline)."""
    if is_main:
        convert(ckpt, ds_tag, log)
    collectives.barrier()
    return ckpt / UNIVERSAL


def mend_optimizer(optimizer: torch.optim.Optimizer, universal: Path, ds_tag: str) -> None:
    """Undo two slips of DeepSpeed's ZeRO-3 universal loader. It gives every parameter's state the
    same step-count tensor, which torch's AdamW increments in place once per group, so the bias
    correction ran ahead by the number of groups from the first step after a resume (its loss
    still matched, the next did not): each state gets its own copy. And it gives every group the
    first group's settings (weight decay 0 for all, where the first group is the embeddings'): the
    converted optimizer state keeps each group's, matched here by name."""
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    from vlm.train.engine import OPTIM_SETTINGS, safe_load

    saved = safe_load(ds_internals.universal_optimizer_file(universal / ds_tag))
    # (top level in every stage's file; ZeRO-3's also inside its optimizer_state_dict)
    groups = {g.get("name"): g for g in saved["param_groups"]}
    for group in optimizer.param_groups:
        old = groups.get(group.get("name"))
        if old is None:
            raise CheckpointRefused(
                f"checkpoint {universal.parent}: its optimizer has no parameter group "
                f"{group.get('name')!r} (it has {sorted(map(str, groups))})"
            )
        group.update({k: old[k] for k in OPTIM_SETTINGS if k in old})
