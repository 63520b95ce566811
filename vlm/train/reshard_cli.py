"""`vlm reshard RUN [--checkpoint STEP] [--workers K]`: a checkpoint converted ahead of a resume on
another number of ranks, offline, spread over K worker processes (vlm.train.reshard). A resume
on another number of ranks finds the conversion in the checkpoint's folder and loads it at once;
without it, rank 0 converts while the other ranks wait (with as many workers as it has cores).

Refused in one line: a run without checkpoints, a checkpoint that needs no conversion (ZeRO 0 in
fp32 keeps one whole optimizer state; expert-parallel ones regroup on load).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def add_reshard_command(subparsers) -> None:
    p = subparsers.add_parser(
        "reshard",
        help="convert a run's checkpoint for a resume on another number of ranks (offline)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("run", type=Path, help="the run folder (or a checkpoint folder in it)")
    p.add_argument(
        "--checkpoint", type=int, default=None, help="its step (default: the newest intact)"
    )
    p.add_argument(
        "--workers", type=int, default=None, help="worker processes (default: the cores)"
    )
    p.set_defaults(func=reshard_command)


def _checkpoint(run: Path, step: int | None) -> Path:
    from configs.config import ConfigError
    from vlm.train.checkpoint import newest_intact_checkpoint, read_meta, step_dir_name
    from vlm.train.ckpt_manifest import damaged_file

    if (run / "meta.json").is_file() and step is None:  # a checkpoint folder itself
        ckpt = run
    else:
        root = run / "checkpoints"
        ckpt = root / step_dir_name(step) if step is not None else newest_intact_checkpoint(root)
        if ckpt is None or not (ckpt / "meta.json").is_file():
            which = f"step {step}" if step is not None else "an intact one"
            raise ConfigError(f"{run}: no checkpoint to convert ({which} not in {root})")
    bad = damaged_file(ckpt, ("world_size",))
    if bad is not None:
        raise ConfigError(f"{ckpt} is damaged: {bad}")
    read_meta(ckpt, ("world_size",))
    return ckpt


def reshard_command(args) -> int:
    from configs.config import ConfigError
    from vlm.train import reshard
    from vlm.train.ckpt_layout import DS_TAG
    from vlm.train.expert_parallel import written_degree

    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    ckpt = _checkpoint(args.run, args.checkpoint)
    if written_degree(ckpt)[0] > 1:
        raise ConfigError(
            f"{ckpt} is expert-parallel: its shards regroup on load (vlm.train.expert_regroup), "
            "no conversion needed"
        )
    if not any((ckpt / DS_TAG).glob("*zero_pp_rank_*_optim_states.pt")) and not any(
        (ckpt / DS_TAG).glob("bf16_zero_pp_rank_*")
    ):
        raise ConfigError(
            f"{ckpt} needs no conversion: its optimizer state is not partitioned (ZeRO 0, fp32); "
            "it resumes on any number of ranks as it is"
        )
    t0 = time.perf_counter()
    out = reshard.convert(ckpt, DS_TAG, lambda m: print(m, file=sys.stderr), args.workers)
    print(f"{out} ({time.perf_counter() - t0:.1f} s)")
    return 0
