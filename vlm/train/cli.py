"""`vlm train [--config PATH] [--out RUN_DIR] [--max-steps N] [--save-every N] [--resume |
--overwrite] [key=value ...]`.

The config is read and validated before anything else happens; a bad key or value prints one line
(`config error: <dotted.key>: ...`) and exits with code 2. One process needs no launcher; for many,
`torchrun --nproc_per_node N -m vlm.cli train ...` or `deepspeed --num_gpus N -m vlm.cli train ...`.

The trainer (torch, DeepSpeed) is imported when the command runs, not when `vlm` registers it: every
subcommand's registration runs on each `vlm` call, and `vlm data ...` should not wait for DeepSpeed.

Preemption and failures the machine causes are one line each: SIGTERM / SIGINT / SIGHUP checkpoint
after the step in flight and exit 143 / 130 / 129 (a second signal exits at once; vlm.train.signals); a checkpoint,
export or log that cannot be written (a full disk) names the path and the reason and exits 1, on
every rank; a checkpoint refused on resume (a pickle, another world size) is one line too, exit 1. A
RUN_DIR that holds an earlier run's outputs and no checkpoint to resume from is refused unless
--overwrite, and a RUN_DIR another process is training into is refused in one line naming it
(vlm.train.run_dir). SIGHUP (the terminal closed) stops a run as SIGTERM does, exit 129.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from configs.config import ConfigError, to_dict

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"


def default_config_path() -> Path:
    if DEFAULT_CONFIG.is_file():
        return DEFAULT_CONFIG
    try:  # an installed package carries configs/ as package data
        import configs

        return Path(configs.__file__).parent / "default.yaml"
    except ImportError:
        return DEFAULT_CONFIG


def add_train_command(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a ConceptMoE VLM (the main job)",
        description="Train with DeepSpeed on CPU or GPU. Overrides are "
        "dotted keys, e.g. optim.lr=0.001 model.chunk.target_ratio=3",
    )
    p.add_argument("--config", default=None, help="YAML config (default: configs/default.yaml)")
    p.add_argument("--out", default="runs/default", help="run directory (default: runs/default)")
    p.add_argument("--max-steps", type=int, default=None, help="override train.max_steps")
    p.add_argument("--save-every", type=int, default=None, help="override checkpoint.save_every")
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--resume",
        action="store_true",
        help="resume from RUN_DIR's latest checkpoint (a "
        "run without one yet starts from the beginning)",
    )
    g.add_argument(
        "--no-resume",
        action="store_true",
        help="refuse to start if RUN_DIR already has checkpoints",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start from step 0 in a RUN_DIR that holds an earlier run, deleting "
        "what that run wrote there (checkpoints, final/, metrics, summary); "
        "without it such a RUN_DIR with nothing to resume from is refused",
    )
    p.add_argument(
        "--print-config", action="store_true", help="print the resolved config (YAML) and exit"
    )
    p.add_argument(
        "--accept-optim-change",
        action="store_true",
        help="on resume, take this config's optim.* settings "
        "(e.g. a lower optim.lr) instead of refusing",
    )
    # deepspeed launcher
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.set_defaults(func=train_command)
    # `vlm reshard`, registered with `vlm train` (the entry points are the installed package's)
    from vlm.train.reshard_cli import add_reshard_command

    add_reshard_command(subparsers)


def resolve_config(args):
    """Config from --config / overrides / flags, validated (raises ConfigError)."""
    from vlm.train.config import load_train_config

    overrides = list(args.overrides)
    for text in overrides:
        if "=" not in text:
            raise ConfigError(
                f"argument {text!r}: expected a dotted override KEY=VALUE (e.g. optim.lr=0.001)"
            )
    if args.max_steps is not None:
        overrides.append(f"train.max_steps={args.max_steps}")
    if args.save_every is not None:
        overrides.append(f"checkpoint.save_every={args.save_every}")
    path = args.config or default_config_path()
    return load_train_config(path, overrides)


def train_command(args) -> int:
    from vlm.train.signals import stop_on_signals

    # from here on Ctrl-C is a flag, never a KeyboardInterrupt traceback
    with stop_on_signals() as stop:
        try:
            rc = _train(args, stop)
        finally:
            if "vlm.train.distributed" in sys.modules:  # a run started: never imported for nothing
                from vlm.train.distributed import leave_process_group

                leave_process_group()
    if rc is None and stop.requested:  # stopped before training began: nothing was written
        print(f"vlm train: stopped by {stop.name} before the run started", file=sys.stderr)
        return stop.code
    return rc


def _train(args, stop) -> int | None:
    cfg = resolve_config(args)  # ConfigError -> one line, exit 2 (vlm.cli.main)
    if args.print_config:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    from vlm.train.distributed import fill_launcher_env
    from vlm.train.run_dir import check_out_dir

    fill_launcher_env()  # SLURM tasks learn their rank before rank 0 alone takes the folder's lock
    check_out_dir(Path(args.out))  # every rank: a file named as --out is one line, not a traceback
    from vlm.train.engine import check_deepspeed_config

    check_deepspeed_config(cfg.deepspeed, cfg.optim, int(os.environ.get("WORLD_SIZE", "1")))
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    from vlm.train.distributed import StartupFailed, is_timeout, timeout_line, who_fell_behind
    from vlm.train.engine import CheckpointRefused
    from vlm.train.signals import Preempted
    from vlm.train.trainer import Trainer, registered_run_end
    from vlm.train.write_errors import WriteError, describe_write_error, is_disk_error

    if stop.requested:
        return None
    resume = True if args.resume else (False if args.no_resume else None)
    from vlm.train.run_dir import hold_run_dir

    try:
        # one writer per run folder (rank 0 holds it for every rank)
        with hold_run_dir(Path(args.out), int(os.environ.get("RANK", "0")) == 0, "vlm train"):
            trainer = Trainer(
                cfg,
                args.out,
                resume=resume,
                accept_optim_change=args.accept_optim_change,
                on_end=registered_run_end(),
                stop=stop,
                overwrite=args.overwrite,
            )
            return trainer.train()
    except Preempted as e:
        print(e)
        return e.code
    except (WriteError, CheckpointRefused) as e:
        print(f"vlm train: {e}", file=sys.stderr)
        return 1
    except StartupFailed as e:
        print(e, file=sys.stderr)
        return e.code
    except RuntimeError as e:
        if not is_timeout(e):
            raise
        # every rank stuck in the collective gets here; the lowest one says which rank they
        # waited for, and all leave at once: tearing the group down would wait for that rank too
        behind, report = who_fell_behind(min(30.0, max(5.0, cfg.parallel.timeout_s / 4)))
        if report:
            print(timeout_line(cfg.parallel.timeout_s, behind), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    except OSError as e:
        if not is_disk_error(e):
            raise
        print(f"vlm train: cannot write {describe_write_error(e, args.out)}", file=sys.stderr)
        return 1
