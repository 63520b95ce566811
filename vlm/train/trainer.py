"""The training loop: `Trainer(cfg, run_dir).train()` builds the run, loops, checkpoints, exports,
evaluates, summarises.

The run (config as it runs, tokenizer, engine, data, held-out set) is built once by
vlm.train.run.build_run and never changed; the trainer holds it and the loop's own state (the step,
the non-finite counters, the wall time). `train()` reads top to bottom; each component decides for
itself when it acts (the metrics logger which steps it logs, evaluates and draws; the checkpointer
which steps it saves). What runs on the exported model at the end (the built-in VQA check) is handed
in as `on_end` callbacks, registered under the `vlm.run_end` entry points, so the trainer imports
nothing above it.
"""

from __future__ import annotations

import itertools
import signal
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable

from configs.config import to_dict
from vlm.train import checkpoint as ckpt_lib
from vlm.train import ckpt_resume, collectives
from vlm.train.config import TrainConfig
from vlm.train.device_feed import DeviceFeed
from vlm.train.engine import optimizer_settings, resume_schedule
from vlm.train.export import export_final
from vlm.train.loaders import skipped_samples
from vlm.train.metrics import StepRecord
from vlm.train.metrics_sinks import MetricsLogger
from vlm.train.run import Run, build_run
from vlm.train.run_config import config_targets
from vlm.train.run_summary import write_summary
from vlm.train.signals import STEP_IN_FLIGHT, Interrupted, StopFlag
from vlm.train.step import train_step

RUN_END_GROUP = "vlm.run_end"
RunEnd = Callable[[Path, TrainConfig, Path, Callable[[str], None]], dict]


def registered_run_end() -> list[RunEnd]:
    """The end-of-run callbacks installed packages register (eval's VQA check)."""
    return [ep.load() for ep in entry_points(group=RUN_END_GROUP)]


def slowest_rank(scalars: dict, device) -> dict[str, float]:
    """A logged step's wall-clock figures as its slowest rank saw them (a collective): the step
    ends when its last rank does, and a straggler (a slow GPU, a slow mount) is invisible in rank
    0's own figures. Also says which rank was slowest."""
    mine = [scalars.get("step_time_s", 0.0), scalars.get("data/wait_s", 0.0)]
    times = collectives.per_rank(mine, device)
    slow, waits = int(times[:, 0].argmax()), int(times[:, 1].argmax())
    seconds, wait = float(times[slow, 0]), float(times[waits, 1])
    out = {
        "step_time_s": seconds,
        "data/wait_s": wait,
        "data/wait_share": float(times[slow, 1]) / seconds if seconds > 0 else 0.0,
        "time/slowest_rank": slow,
        "data/wait_slowest_rank": waits,
    }
    if "tokens_per_s" in scalars and seconds > 0:
        out["tokens_per_s"] = scalars.get("tokens", 0) / seconds
    return out


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
        warm-up raises Preempted after saving its state. `cfg` is never changed: `self.run.cfg`
        is what runs."""
        self.log_fn, self.on_end, self.loss_hook = log, list(on_end), loss_hook
        self.accept_optim_change = accept_optim_change
        self.stop = stop if stop is not None else StopFlag()
        # what a signal does until the last step (a chain's next stage included)
        self.stop.heard = STEP_IN_FLIGHT
        self.run: Run = build_run(
            cfg,
            Path(run_dir),
            resume=resume,
            overwrite=overwrite,
            accept_optim_change=accept_optim_change,
            log=log,
            stop=self.stop,
        )
        # the loop's state (restored from a checkpoint by `restore`)
        self.step = 0
        self.nonfinite_total = self.nonfinite_in_row = 0
        # expert choices past expert parallelism's capacity (moe/overflow), summed over the run
        self.moe_dropped = 0
        self.wall_before, self.t_start = 0.0, time.time()

    # ---------------------------------------------------------------- the run
    def train(self) -> int:
        """Train to train.max_steps (or the end of the data), then export, evaluate and summarise; the exit code."""
        run, cfg = self.run, self.run.cfg
        if run.resume_from is not None:
            self.restore(run.resume_from)
            run.checkpointer.resumed_at(self.step)
            self.log(f"resumed from {run.resume_from} at step {self.step}")
        run.write_files()
        resume_step = self.step if run.resume_from is not None else None
        metrics = MetricsLogger(
            cfg.logging,
            cfg.train.max_steps,
            run.dir,
            resume_step,
            config_targets(cfg),
            run.is_main,
            self.step,
            run_config=to_dict(cfg),
            groups=list(run.step.groups),
        )
        for line in run.banner:
            self.log(line)
        batches = DeviceFeed(
            run.loader, run.dist.device, run.step.float_dtype, cfg.data.prefetch_to_device
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
                sources = [s.label for s in run.loader.sources]
                skipped, data_stop = skipped_samples(
                    run.loader,
                    sources,
                    cfg.train.max_skip_share,
                    run.dist.device,
                    run.layout.counts_data,
                )
                record.scalars.update(skipped)
                record.scalars.update(slowest_rank(record.scalars, run.dist.device))
            if metrics.should_eval(self.step):
                # a collective
                val, record.pictures = run.held_out.run(window[-1], draw=run.is_main)
                record.scalars.update(val)
            if run.is_main:
                if metrics.should_log(self.step, record.applied):  # the saves' times, once
                    record.scalars.update(run.checkpointer.take_metrics())
                metrics.write(record)
            if self.nonfinite_in_row >= cfg.train.max_nonfinite_in_row:
                path = run.checkpointer.save(self.step, self.trainer_state())
                self.log(
                    f"stopping: {self.nonfinite_in_row} non-finite steps in a row (step "
                    f"{self.step}); nothing was applied for them. Checkpoint: {path}. Lower "
                    "optim.lr (resume with --resume --accept-optim-change optim.lr=...), check "
                    "the data, or raise train.max_nonfinite_in_row."
                )
                self.run.checkpointer.wait()
                rc = 1
                break
            if data_stop is not None:
                self.log(f"{data_stop} (step {self.step})")
                rc = 1
                break
            run.checkpointer.maybe_save(self.step, self.trainer_state)
        if rc == 0:
            run.checkpointer.save_unless_saved(self.step, self.trainer_state)
        run.checkpointer.wait()  # the last checkpoint is complete before the run goes on
        self._say_last_save()
        metrics.close()
        # asked to stop during the last step: no export, no evaluation
        if rc == 0 and self._stop_requested():
            return self._stopped()
        return self._finish(rc)

    def _say_last_save(self) -> None:
        """The last save's times (no step line follows it to carry them into metrics.jsonl)."""
        m = self.run.checkpointer.take_metrics() if self.run.is_main else {}
        if "checkpoint/step" in m:
            self.log(
                f"checkpoint step {m['checkpoint/step']}: the step waited "
                f"{m['checkpoint/stage_s']:.2f} s to stage it, each rank wrote and hashed its "
                f"share in the background (slowest {m['checkpoint/write_s']:.2f} s)"
            )

    def _stop_requested(self) -> bool:
        """A SIGTERM / SIGINT on any rank stops every rank after the same step (a collective when distributed)."""
        run = self.run
        return collectives.stop_requested(self.stop.requested, run.dist.device, run.layout.world)

    def _stopped(self) -> int:
        """Checkpoint the step just finished and say so in one line; the exit code of the signal."""
        signum = self.stop.signum or signal.SIGTERM  # a rank that did not see the signal itself
        name = signal.Signals(signum).name
        if self.step == 0 and self.run.resume_from is None:
            self.log(
                f"stopped by {name} before the first step: nothing to save; the same command "
                "starts the run (--resume included)"
            )
        else:
            # WriteError: reported by the CLI
            self.run.checkpointer.save_unless_saved(self.step, self.trainer_state)
            self.run.checkpointer.wait()
            self.log(
                f"stopped by {name} after step {self.step}: checkpoint "
                f"{self.run.ckpt_root / ckpt_lib.step_dir_name(self.step)}; continue with the "
                "same command and --resume"
            )
        return 128 + int(signum)

    def _finish(self, rc: int) -> int:
        """Export final/, run the end-of-run callbacks, write report.png and summary.json (rank 0 prints)."""
        run = self.run
        wall = self.wall_before + (time.time() - self.t_start)
        results: dict = {"vqa": None}
        if rc == 0:
            self.stop.heard = "stopping once final/ is exported (the last step is in a checkpoint)"
            final = export_final(
                run.engine, run.dir, run.tokenizer, run.logit_scale, run.is_main, self.log
            )
            if final is None:
                rc = 1
            elif not self._stop_requested():  # a collective
                if run.is_main:
                    self._run_end(final, results)
                collectives.barrier()
            # after the export or in the evaluation: no summary
            if final is not None and self._stop_requested():
                return self._stopped_at_the_end()
        if not run.is_main:
            return rc
        lines = write_summary(
            run.dir,
            run.cfg,
            steps=self.step,
            wall=wall,
            results=results,
            nonfinite_total=self.nonfinite_total,
            data_counters=run.loader.counters,
            rc=rc,
            moe_dropped=self.moe_dropped,
        )
        self.log("\n".join(["", "=" * 72, "summary", "=" * 72] + lines))
        return rc

    def _run_end(self, final: Path, results: dict) -> None:
        """Rank 0: the end-of-run callbacks (the VQA eval); a SIGTERM / SIGINT ends them at once."""
        self.stop.heard = "stopping the end-of-run evaluation (the last step is in a checkpoint)"
        try:
            with self.stop.interruptible():
                for fn in self.on_end:
                    results.update(fn(final, self.run.cfg, self.run.dir, self.log))
        except Interrupted:
            pass

    def _stopped_at_the_end(self) -> int:
        """A signal after the last step: final/ is exported, no summary is written; the same command
        (it resumes from the last checkpoint, where nothing is left to train) exports again,
        evaluates and summarises."""
        signum = self.stop.signum or signal.SIGTERM  # a rank that did not see the signal itself
        self.log(
            f"stopped by {signal.Signals(signum).name} after the last step ({self.step}), before "
            "the end-of-run evaluation and summary; the same command finishes the run from "
            f"{self.run.ckpt_root / ckpt_lib.step_dir_name(self.step)}"
        )
        return 128 + int(signum)

    # ---------------------------------------------------------------- one step
    def current_lr(self) -> float:
        """The base `optim.lr` times the schedule's multiplier at this step."""
        s = self.run.scheduler
        return self.run.cfg.optim.lr * s.lr_lambdas[0](s.last_epoch)

    def train_step(self, window, loss_hook=None) -> StepRecord:
        self.run.probe.clear()
        hook = loss_hook or self.loss_hook
        return train_step(self.run.engine, window, self.step, self.run.step, loss_hook=hook)

    def after_step(self, result: StepRecord) -> None:
        """The schedule moves only when the optimizer applied the step (the balancing biases and
        top-k thresholds moved in the step)."""
        self.step += 1
        self._count_dropped(int(result.scalars.get("moe/overflow") or 0))
        if result.applied:
            self.run.scheduler.step()
            self.nonfinite_in_row = 0
        else:
            self.nonfinite_total += 1
            self.nonfinite_in_row += 1

    def _count_dropped(self, dropped: int) -> None:
        """Expert choices the capacity dropped this step: summed for the summary, and said on the
        console the first time (they change what the model computes, not only a metric)."""
        if dropped and not self.moe_dropped:
            self.log(
                f"warning: step {self.step}: {dropped:,} expert choices were past the expert "
                f"capacity (parallel.capacity_factor={self.run.cfg.parallel.capacity_factor}) "
                "and computed by no expert; raise parallel.capacity_factor, or null for none "
                "dropped. Each step's count is moe/overflow in metrics.jsonl, the run's total "
                "goes into summary.json"
            )
        self.moe_dropped += dropped

    def _add_step_scalars(
        self, record: StepRecord, lr: float, seconds: float, data_wait: float = 0.0
    ) -> None:
        """What only the trainer knows of a step: lr, wall time and the part of it spent waiting
        for data, gradient norm, activation probes, skipped steps."""
        record.timed(lr, seconds)
        record.scalars["data/wait_s"] = data_wait
        record.scalars["data/wait_share"] = data_wait / seconds if seconds > 0 else 0.0
        if record.applied:
            record.scalars.update(self.run.probe.read())
            grad_norm = self.run.engine.get_global_grad_norm()
            if grad_norm is not None:
                record.scalars["grad_norm"] = float(grad_norm)
        record.scalars["nonfinite_steps"] = self.nonfinite_total

    def log(self, msg: str) -> None:
        if self.run.is_main:
            self.log_fn(msg)

    # ---------------------------------------------------------------- state
    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "scheduler": self.run.scheduler.state_dict(),
            "rng": ckpt_lib.rng_state(),
            "loader": self.run.loader.state_dict(),
            "nonfinite_total": self.nonfinite_total,
            "nonfinite_in_row": self.nonfinite_in_row,
            "moe_dropped": self.moe_dropped,
            "wall_s": self.wall_before + (time.time() - self.t_start),
        }

    def restore(self, path: Path) -> None:
        run = self.run
        # this config's: the checkpoint's come back with its state
        settings = optimizer_settings(run.optimizer)
        state = ckpt_lib.load_checkpoint(
            run.engine, path, run.layout.rank, run.layout.world, log=self.log,
            expert=run.layout.expert,
        )  # fmt: skip
        # each rank's verification and load times, for the first metrics line (a collective)
        times = collectives.every_rank(dict(ckpt_resume.timings))
        if run.is_main:
            run.checkpointer.record_resume(
                {k: [t.get(k, 0.0) for t in times] for k in ("verify_s", "load_s")}
            )
        resume_schedule(
            run.optimizer,
            run.scheduler,
            state["scheduler"],
            settings if self.accept_optim_change else None,
        )
        ckpt_lib.set_rng_state(state["rng"])
        if state.get("loader") is not None:
            try:
                run.loader.load_state_dict(state["loader"])
            except ValueError as e:  # a data position this loader cannot continue: one line
                raise ckpt_lib.CheckpointRefused(f"checkpoint {path}: {e}") from None
        self.step = state["step"]
        self.nonfinite_total = state["nonfinite_total"]
        self.nonfinite_in_row = state["nonfinite_in_row"]
        self.moe_dropped = int(state.get("moe_dropped", 0))  # absent in older checkpoints
        self.wall_before = state.get("wall_s", 0.0)
