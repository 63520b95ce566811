"""The training run: `Trainer(cfg, run_dir).train()` sets up, loops, checkpoints, exports,
evaluates, summarises.

`train()` reads top to bottom; each component decides for itself when it acts (the metrics logger
which steps it logs, evaluates and draws; the checkpointer which steps it saves). What runs on the
exported model at the end (the built-in VQA check) is handed in as `on_end` callbacks, registered
under the `vlm.run_end` entry points, so the trainer imports nothing above it.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import yaml

from configs.config import ConfigError, to_dict
from data_pipelines.default_dataset import ensure_default_dataset
from vlm.model.training_controls import TrainingControls
from vlm.train import checkpoint as ckpt_lib
from vlm.train import collectives
from vlm.train.config import TrainConfig
from vlm.train.device_feed import DeviceFeed
from vlm.train.distributed import DistInfo, barrier, init_distributed
from vlm.train.engine import (
    build_engine,
    compile_model,
    effective_settings,
    optimizer_settings,
    resume_schedule,
)
from vlm.train.export import export_final
from vlm.train.global_parser import GlobalParser
from vlm.train.loaders import build_loaders, check_row_fits, skipped_samples
from vlm.train.metrics import MetricsLogger, StepRecord, group_names
from vlm.train.param_groups import apply_mup, build_param_groups, describe_groups, freeze_prefixes
from vlm.train.probes import ActivationProbe
from vlm.train.run_config import check_resume_config, config_targets, evolve
from vlm.train.run_dir import check_start, clear_run, made_by_this_run
from vlm.train.run_summary import write_summary
from vlm.train.signals import STEP_IN_FLIGHT, Interrupted, StopFlag
from vlm.train.sizes import check_buildable
from vlm.train.stages import (
    build_stage_model,
    load_run_tokenizer,
    resolve_tokenizer,
    with_built_model,
)
from vlm.train.step import train_step
from vlm.train.validation import HeldOut
from vlm.train.vision_warmup import warm_up_vision

RUN_END_GROUP = "vlm.run_end"
RunEnd = Callable[[Path, TrainConfig, Path, Callable[[str], None]], dict]


def registered_run_end() -> list[RunEnd]:
    """The end-of-run callbacks installed packages register (eval's VQA check)."""
    return [ep.load() for ep in entry_points(group=RUN_END_GROUP)]


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        run_dir: str | Path,
        resume: bool | None = None,
        log=print,
        accept_optim_change: bool = False,
        on_end: list[RunEnd] = (),
        loss_hook=None,
        stop: StopFlag | None = None,
        overwrite: bool | None = None,
    ):
        """resume: True = must resume; None = resume when RUN_DIR has a checkpoint; False = refuse
        if it has one. overwrite (vlm.train.run_dir): False = a run with nothing to resume refuses a
        RUN_DIR holding an earlier run's outputs; True = start over, deleting them (checkpoints
        included) first; None = no check (a caller that owns the folder: vlm chain's stages).
        accept_optim_change: a resumed run takes this config's optimiser settings (learning rate,
        schedule, ...) instead of refusing them. on_end: run on rank 0 with the exported final/;
        their dicts go into the summary. loss_hook(out, k) may replace micro-batch k's output (fault
        injection in tests). stop: raised by SIGTERM / SIGINT (vlm.train.signals): the run
        checkpoints after the step in flight and `train` returns 128 + the signal number; the vision
        warm-up raises Preempted after saving its state.

        `cfg` is never changed. `self.cfg` is what runs, a new object where setup learns more than
        `cfg` says (a continued model's tokenizer and model section, the DeepSpeed settings the
        merged JSON runs): config.yaml, the banner and the summary show it."""
        self.cfg, self.run_dir, self.log_fn = cfg, Path(run_dir), log
        self.on_end, self.loss_hook, self.accept_optim_change = (
            list(on_end),
            loss_hook,
            accept_optim_change,
        )
        self.stop = stop if stop is not None else StopFlag()
        # what a signal does until the last step (a chain's next stage included)
        self.stop.heard = STEP_IN_FLIGHT
        # before the run folder exists: a size that cannot be allocated leaves nothing behind
        check_buildable(cfg)
        self.dist: DistInfo = init_distributed()
        self._set_up_process()
        # a config error found from here on leaves no folder
        with made_by_this_run(self.run_dir, self.is_main):
            self.resume_from = self._open_run_dir(resume, overwrite)
            self._prepare_data()
            model, fresh = self._build_model()
            warm_up_vision(
                model,
                fresh,
                self.cfg,
                resuming=self.resume_from is not None,
                device=self.dist.device,
                run_dir=self.run_dir,
                is_main=self.is_main,
                log=self.log,
                stop=self.stop,
            )
            self._build_engine(model, fresh)
            self._check_resume_config()
            self._reset_state()
            self._build_loaders()
        ck = self.cfg.checkpoint
        self.checkpointer = ckpt_lib.Checkpointer(
            self.engine,
            self.ckpt_root,
            ck.save_every,
            ck.keep_last,
            self.dist.rank,
            self.dist.world_size,
        )

    # ---------------------------------------------------------------- the run
    def train(self) -> int:
        """Train to train.max_steps (or the end of the data), then export, evaluate and summarise; the exit code."""
        cfg = self.cfg
        if self.resume_from is not None:
            self.restore(self.resume_from)
            self.checkpointer.resumed_at(self.step)
            self.log(f"resumed from {self.resume_from} at step {self.step}")
        self._write_run_files()
        resume_step = self.step if self.resume_from is not None else None
        metrics = MetricsLogger(
            cfg.logging,
            cfg.train.max_steps,
            self.run_dir,
            resume_step,
            config_targets(cfg),
            self.is_main,
            self.step,
            run_config=to_dict(cfg),
            groups=group_names(self.source_names),
        )
        self.log(
            f"model: {self.n_params:,} parameters ({self.n_trainable:,} trainable); "
            f"{self.dist.world_size} rank(s) on {self.dist.device}; ZeRO "
            f"{cfg.deepspeed.zero_stage}{', bf16' if cfg.deepspeed.bf16 else ''}"
            f"{f'; {self.compiled_blocks} blocks compiled' if self.compiled_blocks else ''}"
        )
        for line in self.groups_desc:
            self.log(f"  group {line}")
        batches = DeviceFeed(
            self.loader, self.dist.device, self.float_dtype, cfg.data.prefetch_to_device
        )
        self.t_start = time.time()
        rc = 0
        while self.step < cfg.train.max_steps:
            if self._stop_requested():
                metrics.close()
                return self._stopped()
            t0 = time.perf_counter()  # throughput counts data loading too
            window = list(itertools.islice(batches, cfg.optim.grad_accum))
            if len(window) < cfg.optim.grad_accum:
                self.log(f"data exhausted after {self.step} steps (data.epochs={cfg.data.epochs})")
                break
            lr = self.current_lr()
            record = self.train_step(window)
            self.after_step(record)
            self._add_step_scalars(record, lr, time.perf_counter() - t0, batches.take_wait())
            data_stop = None
            if metrics.should_log(self.step, record.applied):
                # a collective; the same answer on every rank
                skipped, data_stop = skipped_samples(
                    self.loader, self.source_names, cfg.train.max_skip_share, self.dist.device
                )
                record.scalars.update(skipped)
            if metrics.should_eval(self.step):
                # a collective
                val, record.pictures = self.held_out.run(window[-1], draw=self.is_main)
                record.scalars.update(val)
            if self.is_main:
                metrics.write(record)
            if self.nonfinite_in_row >= cfg.train.max_nonfinite_in_row:
                path = self.checkpointer.save(self.step, self.trainer_state())
                self.log(
                    f"stopping: {self.nonfinite_in_row} non-finite steps in a row (step "
                    f"{self.step}); nothing was applied for them. Checkpoint: {path}. "
                    "Lower optim.lr (resume with --resume --accept-optim-change "
                    "optim.lr=...), check the data, or raise train.max_nonfinite_in_row."
                )
                rc = 1
                break
            if data_stop is not None:
                self.log(f"{data_stop} (step {self.step})")
                rc = 1
                break
            self.checkpointer.maybe_save(self.step, self.trainer_state)
        if rc == 0:
            self.checkpointer.save_unless_saved(self.step, self.trainer_state)
        metrics.close()
        # asked to stop during the last step: no export, no evaluation
        if rc == 0 and self._stop_requested():
            return self._stopped()
        return self._finish(rc)

    def _stop_requested(self) -> bool:
        """A SIGTERM / SIGINT on any rank stops every rank after the same step (a collective when distributed)."""
        return collectives.stop_requested(
            self.stop.requested, self.dist.device, self.dist.world_size
        )

    def _stopped(self) -> int:
        """Checkpoint the step just finished and say so in one line; the exit code of the signal."""
        signum = self.stop.signum or signal.SIGTERM  # a rank that did not see the signal itself
        name = signal.Signals(signum).name
        if self.step == 0 and self.resume_from is None:
            self.log(
                f"stopped by {name} before the first step: nothing to save; "
                "the same command starts the run (--resume included)"
            )
        else:
            # WriteError: reported by the CLI
            self.checkpointer.save_unless_saved(self.step, self.trainer_state)
            self.log(
                f"stopped by {name} after step {self.step}: checkpoint "
                f"{self.ckpt_root / ckpt_lib.step_dir_name(self.step)}; "
                "continue with the same command and --resume"
            )
        return 128 + int(signum)

    def _finish(self, rc: int) -> int:
        """Export final/, run the end-of-run callbacks, write report.png and summary.json (rank 0 prints)."""
        wall = self.wall_before + (time.time() - self.t_start)
        results: dict = {"vqa": None}
        if rc == 0:
            self.stop.heard = "stopping once final/ is exported (the last step is in a checkpoint)"
            final = export_final(
                self.engine, self.run_dir, self.tokenizer, self.logit_scale, self.is_main, self.log
            )
            if final is None:
                rc = 1
            elif not self._stop_requested():  # a collective
                if self.is_main:
                    self._run_end(final, results)
                barrier()
            # after the export or in the evaluation: no summary
            if final is not None and self._stop_requested():
                return self._stopped_at_the_end()
        if not self.is_main:
            return rc
        lines = write_summary(
            self.run_dir,
            self.cfg,
            steps=self.step,
            wall=wall,
            results=results,
            nonfinite_total=self.nonfinite_total,
            data_counters=self.loader.counters,
            rc=rc,
        )
        self.log("\n".join(["", "=" * 72, "summary", "=" * 72] + lines))
        return rc

    def _run_end(self, final: Path, results: dict) -> None:
        """Rank 0: the end-of-run callbacks (the VQA eval); a SIGTERM / SIGINT ends them at once."""
        self.stop.heard = "stopping the end-of-run evaluation (the last step is in a checkpoint)"
        try:
            with self.stop.interruptible():
                for fn in self.on_end:
                    results.update(fn(final, self.cfg, self.run_dir, self.log))
        except Interrupted:
            pass

    def _stopped_at_the_end(self) -> int:
        """A signal after the last step: final/ is exported, no summary is written; the same command
        (it resumes from the last checkpoint, where nothing is left to train) exports again,
        evaluates and summarises."""
        signum = self.stop.signum or signal.SIGTERM  # a rank that did not see the signal itself
        self.log(
            f"stopped by {signal.Signals(signum).name} after the last step ({self.step}), "
            "before the end-of-run evaluation and summary; the same command finishes the "
            f"run from {self.ckpt_root / ckpt_lib.step_dir_name(self.step)}"
        )
        return 128 + int(signum)

    # ---------------------------------------------------------------- one step
    def current_lr(self) -> float:
        """The base `optim.lr` times the schedule's multiplier at this step."""
        return self.cfg.optim.lr * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)

    def train_step(self, window, loss_hook=None) -> StepRecord:
        cfg = self.cfg
        self.probe.clear()
        return train_step(
            self.engine,
            window,
            self.step,
            seed=cfg.train.seed,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            parser=self.parser,
            device=self.dist.device,
            float_dtype=self.float_dtype,
            loss_hook=loss_hook or self.loss_hook,
            bytes_per_id=self.bytes_per_id,
            sources=self.source_names,
            controls=self.controls,
        )

    def after_step(self, result: StepRecord) -> None:
        """Schedule and loss-free balancing move only when the optimizer applied the step."""
        self.step += 1
        # the balancing biases and top-k thresholds moved in the step (TrainingControls)
        if result.applied:
            self.scheduler.step()
            self.nonfinite_in_row = 0
        else:
            self.nonfinite_total += 1
            self.nonfinite_in_row += 1

    def _add_step_scalars(
        self, record: StepRecord, lr: float, seconds: float, data_wait: float = 0.0
    ) -> None:
        """What only the trainer knows of a step: lr, wall time and the part of it spent waiting
        for data, gradient norm, activation probes, skipped steps."""
        record.timed(lr, seconds)
        record.scalars["data/wait_s"] = data_wait
        record.scalars["data/wait_share"] = data_wait / seconds if seconds > 0 else 0.0
        if record.applied:
            record.scalars.update(self.probe.read())
            grad_norm = self.engine.get_global_grad_norm()
            if grad_norm is not None:
                record.scalars["grad_norm"] = float(grad_norm)
        record.scalars["nonfinite_steps"] = self.nonfinite_total

    # ---------------------------------------------------------------- setup
    @property
    def is_main(self) -> bool:
        return self.dist.is_main

    def log(self, msg: str) -> None:
        if self.is_main:
            self.log_fn(msg)

    def _set_up_process(self) -> None:
        """Threads, determinism and seeds, before anything draws a random number."""
        run = self.cfg.train
        if run.threads:
            torch.set_num_threads(run.threads)
        if run.deterministic:
            # deterministic cuBLAS on GPU
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        random.seed(run.seed)
        np.random.seed(run.seed)
        torch.manual_seed(run.seed)

    def _open_run_dir(self, resume: bool | None, overwrite: bool | None) -> Path | None:
        """RUN_DIR exists without a partial checkpoint; the checkpoint to resume from (None: a fresh
        start, which may not replace an earlier run's outputs unless `overwrite`:
        vlm.train.run_dir)."""
        self.ckpt_root = self.run_dir / "checkpoints"
        if self.is_main:
            if overwrite and (gone := clear_run(self.run_dir)):
                self.log(
                    f"--overwrite: deleted the earlier run's {', '.join(gone)} in {self.run_dir}"
                )
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt_lib.clean_partial(self.ckpt_root)
        barrier()
        found = ckpt_lib.resume_point(self.ckpt_root, self.dist.rank, resume, log=self.log)
        # rank 0 decides for every rank
        check_start(self.run_dir, resume, overwrite, found, self.is_main)
        return found

    def _prepare_data(self) -> None:
        """The default dataset (built once, by rank 0, before any rank opens it) and the run's
        tokenizer: a continued pretrained model keeps its own (stages.resolve_tokenizer)."""
        if not self.cfg.data.sources:
            if self.is_main:
                ensure_default_dataset(self.cfg.data.default_dir)
            barrier()
        self.cfg = resolve_tokenizer(self.cfg)
        self.tokenizer = load_run_tokenizer(self.cfg)
        check_row_fits(self.cfg, self.tokenizer)  # before the model is built
        self.bytes_per_id = torch.as_tensor(self.tokenizer.bytes_per_id, device=self.dist.device)

    def _build_model(self) -> tuple[torch.nn.Module, set[str]]:
        """The stage's model and its fresh parts, with params.freeze applied; `self.cfg` names the model built."""
        model, fresh = build_stage_model(self.cfg, self.tokenizer)
        self.cfg = cfg = with_built_model(self.cfg, model)
        if cfg.model.vocab_size < self.tokenizer.vocab_size:
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size} is smaller "
                f"than the tokenizer's {self.tokenizer.vocab_size} ids "
                f"({cfg.data.tokenizer_path}); raise model.vocab_size"
            )
        if cfg.params.freeze:
            freeze_prefixes(model, cfg.params.freeze)
        return model, fresh

    def _build_engine(self, model: torch.nn.Module, fresh: set[str]) -> None:
        """muP, the parameter groups, optimizer, schedule and DeepSpeed engine, and what hooks into its module."""
        cfg = self.cfg
        self.logit_scale = apply_mup(
            model, cfg.params, cfg.model.hidden_size, cfg.model.c_hidden, "lm" in fresh
        )
        groups = build_param_groups(
            model, cfg.optim, cfg.params, cfg.model.hidden_size, cfg.model.c_hidden
        )
        self.groups_desc = describe_groups(groups)
        self.compiled_blocks = compile_model(model, self.cfg, self.dist.device)
        self.optimizer, self.scheduler, self.ds_config, self.engine = build_engine(
            model, groups, cfg, self.dist.world_size
        )
        # what runs
        self.cfg = evolve(cfg, deepspeed=effective_settings(cfg.deepspeed, self.ds_config))
        self.float_dtype = torch.bfloat16 if self.engine.bfloat16_enabled() else torch.float32
        self.probe = ActivationProbe(self.engine.module)
        self.controls = TrainingControls(self.engine.module)
        self.parser = (
            GlobalParser(collectives.ratio_statistics) if cfg.train.global_parser else None
        )
        if self.parser is not None and not self.controls.set_statistics_hook(self.parser):
            self.parser = None
        self.n_params = sum(p.numel() for p in model.parameters())
        self.n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    def _check_resume_config(self) -> None:
        """A resumed run's config (as it runs) matches the checkpointed run's, but for what may change."""
        if self.resume_from is not None and (self.run_dir / "config.yaml").is_file():
            check_resume_config(
                yaml.safe_load((self.run_dir / "config.yaml").read_text()),
                to_dict(self.cfg),
                self.accept_optim_change,
            )

    def _reset_state(self) -> None:
        self.step = 0
        self.nonfinite_total = 0
        self.nonfinite_in_row = 0
        self.wall_before = 0.0
        self.t_start = time.time()

    def _build_loaders(self) -> None:
        """The training stream and the held-out evaluation (a collective when distributed)."""
        d = self.dist
        self.loader, eval_batches = build_loaders(self.cfg, self.tokenizer, d.rank, d.world_size)
        self.source_names = [s.label for s in self.loader.sources]
        self.held_out = HeldOut(
            self.engine,
            eval_batches,
            self.parser,
            d.device,
            self.float_dtype,
            self.cfg.data.processor,
            self.tokenizer,
        )

    # ---------------------------------------------------------------- state
    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "rng": ckpt_lib.rng_state(),
            "loader": self.loader.state_dict(),
            "nonfinite_total": self.nonfinite_total,
            "nonfinite_in_row": self.nonfinite_in_row,
            "wall_s": self.wall_before + (time.time() - self.t_start),
        }

    def restore(self, path: Path) -> None:
        # this config's: the checkpoint's come back with its state
        settings = optimizer_settings(self.optimizer)
        state = ckpt_lib.load_checkpoint(self.engine, path, self.dist.rank, self.dist.world_size)
        resume_schedule(
            self.optimizer,
            self.scheduler,
            state["scheduler"],
            settings if self.accept_optim_change else None,
        )
        ckpt_lib.set_rng_state(state["rng"])
        if state.get("loader") is not None:
            self.loader.load_state_dict(state["loader"])
        self.step = state["step"]
        self.nonfinite_total, self.nonfinite_in_row = (
            state["nonfinite_total"],
            state["nonfinite_in_row"],
        )
        self.wall_before = state.get("wall_s", 0.0)

    def _write_run_files(self) -> None:
        if self.is_main:
            (self.run_dir / "config.yaml").write_text(
                yaml.safe_dump(to_dict(self.cfg), sort_keys=False)
            )
            (self.run_dir / "deepspeed_config.json").write_text(
                json.dumps(self.ds_config, indent=2)
            )
