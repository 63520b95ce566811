"""`vlm chain CONFIG... [key=value ...] --out DIR`: training stages run in order, each one starting
from the previous stage's exported model (`train.init_from`), e.g. LLaVA's recipe:

    vlm chain configs/llava_text.yaml configs/llava_align.yaml configs/llava_full.yaml --out runs/llava

`key=value` overrides (dotted, as for `vlm train`) apply to every stage.

Stage k trains into DIR/<k>_<config name>. A finished stage (its summary says exit code 0 and
final/ is there) is not run again, and an interrupted one resumes from its last checkpoint, so the
same command continues a chain. SIGTERM / Ctrl-C stops the chain as it stops `vlm train`: the
stage in flight saves a checkpoint after its step, no later stage starts, and the exit code is 128
+ the signal (a second signal exits at once). The trainer is imported when the command runs (as
for `vlm train`).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

from configs.config import ConfigError, check_unique_overrides
from vlm.cli import refuse_set_option


def stage_dirs(configs: list[str], out: Path) -> list[Path]:
    return [out / f"{k}_{Path(c).stem}" for k, c in enumerate(configs)]


def finished(run_dir: Path) -> bool:
    summary = run_dir / "summary.json"
    if not summary.is_file() or not (run_dir / "final" / "config.json").is_file():
        return False
    try:  # a summary cut short by a kill mid-write means the stage did not finish
        return json.loads(summary.read_text()).get("exit_code") == 0
    except (OSError, ValueError, AttributeError):
        return False


def run_chain(configs: list[str], out: Path, overrides: list[str], log=print, stop=None) -> int:
    """0 when every stage is done; else the exit code of the stage that stopped. `stop`: the
    StopFlag that SIGTERM / SIGINT set (vlm.train.signals), polled by each stage's trainer and
    between stages."""
    from vlm.train.config import load_train_config
    from vlm.train.distributed import fill_launcher_env
    from vlm.train.engine import check_deepspeed_config
    from vlm.train.run_dir import check_out_dir, hold_run_dir
    from vlm.train.signals import StopFlag

    fill_launcher_env()  # SLURM tasks learn their rank before rank 0 alone takes the lock
    stop = stop if stop is not None else StopFlag()
    check_out_dir(out)  # a file named as --out: one line before the configs are read
    dirs = stage_dirs(configs, out)
    # every stage's config is read and validated before any work starts
    for k, path in enumerate(configs):
        with stage_named(k, path):
            cfg = load_train_config(path, overrides)
            check_deepspeed_config(cfg.deepspeed, cfg.optim, int(os.environ.get("WORLD_SIZE", "1")))
        if k and cfg.train.init_from:
            raise ConfigError(
                f"{configs[k]}: train.init_from is set by the chain (the "
                "previous stage's final/); remove it from the stage config"
            )
    is_main = int(os.environ.get("RANK", "0")) == 0
    # one chain per folder: a second `vlm chain` into it is refused before a stage starts
    with hold_run_dir(out, is_main, "vlm chain", keep_contents=True):
        return _run_stages(configs, dirs, overrides, log, stop, is_main)


def _run_stages(configs, dirs, overrides, log, stop, is_main) -> int:
    from vlm.train.config import load_train_config
    from vlm.train.run_dir import hold_run_dir
    from vlm.train.signals import Preempted
    from vlm.train.trainer import Trainer, registered_run_end

    for k, (path, run_dir) in enumerate(zip(configs, dirs)):
        if finished(run_dir):
            log(f"stage {k} ({path}): done earlier, {run_dir / 'final'}")
            continue
        if stop.requested:
            log(
                f"stopped by {stop.name} before stage {k} "
                f"({path}); run the same command again to continue"
            )
            return stop.code
        extra = [f"train.init_from={dirs[k - 1] / 'final'}"] if k else []
        with stage_named(k, path):
            cfg = load_train_config(path, overrides + extra)
        log(f"stage {k} ({path}) -> {run_dir}" + (f", from {dirs[k - 1] / 'final'}" if k else ""))
        try:
            # a config error found once the stage's run is built names the stage too
            with stage_named(k, path), hold_run_dir(run_dir, is_main, "vlm chain"):
                trainer = Trainer(cfg, run_dir, resume=None, on_end=registered_run_end(), stop=stop)
                rc = trainer.train()
        except Preempted as e:  # stopped in the vision warm-up, its state saved
            log(str(e))
            rc = e.code
        if rc != 0:
            log(f"stage {k} stopped with exit code {rc}; run the same command again to resume it")
            return rc
    log(f"chain done: {dirs[-1] / 'final'}")
    return 0


@contextmanager
def stage_named(k: int, path: str):
    """A ConfigError inside names the stage and its file (`stage 1 (b.yaml): optim.lr: ...`)."""
    try:
        yield
    except ConfigError as e:
        raise ConfigError(f"stage {k} ({path}): {e}") from None


def split_configs(items: list[str]) -> tuple[list[str], list[str]]:
    """The positionals of `vlm chain`: stage configs, and `key=value` overrides wherever they stand."""
    configs = [a for a in items if "=" not in a]
    if not configs:
        raise ConfigError(
            "vlm chain needs at least one stage config before its key=value overrides"
        )
    return configs, [a for a in items if "=" in a]


def _chain_command(args) -> int:
    from vlm.train.signals import stop_on_signals

    configs, overrides = split_configs(args.configs)
    overrides = [*overrides, *args.overrides]
    check_unique_overrides(overrides)
    # Ctrl-C is a flag the stages poll, never a KeyboardInterrupt traceback
    with stop_on_signals() as stop:
        return run_chain(configs, Path(args.out), overrides, stop=stop)


def add_chain_command(subparsers) -> None:
    p = subparsers.add_parser(
        "chain",
        help="run training stages in order, each from the previous stage's final/",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "configs",
        nargs="+",
        metavar="CONFIG [key=value]",
        help="stage configs, in order; then dotted overrides applied to every stage",
    )
    p.add_argument("--out", required=True, help="chain directory (one sub-directory per stage)")
    refuse_set_option(p)
    p.set_defaults(func=_chain_command, overrides=[])
