"""The training run: `Trainer(cfg, run_dir).train()` sets up, loops, checkpoints, exports, evaluates, summarises.

`train()` reads top to bottom; each component decides for itself when it acts (the metrics logger which steps
it logs, evaluates and draws; the checkpointer which steps it saves). What runs on the exported model at the
end (the built-in VQA check) is handed in as `on_end` callbacks, registered under the `vlm.run_end` entry
points, so the trainer imports nothing above it.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import signal
import time
from dataclasses import replace
from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import yaml

from configs.config import ConfigError, to_dict
from data_pipelines.default_dataset import ensure_default_dataset
from data_pipelines.loader import build_loader
from data_pipelines.schema import REASONS
from vlm.model.moe import update_moe_biases
from vlm.train import checkpoint as ckpt_lib
from vlm.train.config import TrainConfig
from vlm.train.distributed import DistInfo, all_reduce_sum, barrier, broadcast_module, init_distributed
from vlm.train.engine import build_optimizer, deepspeed_config, effective_settings, initialize
from vlm.train.export import export_final, write_extras
from vlm.train.global_parser import GlobalParser, install
from vlm.train.metrics import MetricsLogger, group_names, load_imbalance, read_metrics, step_record
from vlm.train.param_groups import (
    apply_mup_init,
    build_param_groups,
    describe_groups,
    freeze_prefixes,
    install_logit_scale,
    mup_logit_scale,
    mup_width_multipliers,
)
from vlm.train.probes import ActivationProbe
from vlm.train.report import model_card, summary_lines, write_report
from vlm.train.run_config import check_resume_config, config_targets
from vlm.train.schedule import build_scheduler
from vlm.train.signals import Preempted, StopFlag
from vlm.train.sizes import check_buildable
from vlm.train.stages import build_model, pretrained_tower, run_tokenizer, vision_load_report
from vlm.train.step import StepResult, train_step
from vlm.train.validation import HeldOut
from vlm.train.vision_warmup import run_vision_warmup

RUN_END_GROUP = "vlm.run_end"
RunEnd = Callable[[Path, TrainConfig, Path, Callable[[str], None]], dict]


def registered_run_end() -> list[RunEnd]:
    """The end-of-run callbacks installed packages register (eval's VQA check)."""
    return [ep.load() for ep in entry_points(group=RUN_END_GROUP)]


class Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: str | Path, resume: bool | None = None, log=print,
                 accept_optim_change: bool = False, on_end: list[RunEnd] = (), loss_hook=None, stop: StopFlag | None = None):
        """resume: True = must resume; None = resume when RUN_DIR has a checkpoint; False = refuse if it has one.
        accept_optim_change: a resumed run takes this config's optimiser settings (learning rate, schedule, ...)
        instead of refusing them. on_end: run on rank 0 with the exported final/; their dicts go into the
        summary. loss_hook(out, k) may replace micro-batch k's output (fault injection in tests).
        stop: raised by SIGTERM / SIGINT (vlm.train.signals): the run checkpoints after the step in flight and
        `train` returns 128 + the signal number; the vision warm-up raises Preempted after saving its state."""
        self.cfg, self.run_dir, self.log_fn = cfg, Path(run_dir), log
        self.on_end, self.loss_hook = list(on_end), loss_hook
        self.stop = stop if stop is not None else StopFlag()
        check_buildable(cfg)   # before the run folder exists: a size that cannot be allocated leaves nothing behind
        self.dist: DistInfo = init_distributed()
        run = cfg.train
        if run.threads:
            torch.set_num_threads(run.threads)
        if run.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS on GPU
            torch.use_deterministic_algorithms(True, warn_only=True)
        self._seed_all(run.seed)
        self.ckpt_root = self.run_dir / "checkpoints"
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt_lib.clean_partial(self.ckpt_root)
        barrier()
        self.resume_from = self._resume_point(resume)
        self._prepare_data_dir()
        self.tokenizer = run_tokenizer(cfg)   # a continued pretrained model keeps its own (stages.run_tokenizer)
        self.bytes_per_id = torch.as_tensor(self.tokenizer.bytes_per_id, device=self.dist.device)
        self._build_model()   # stage ct: cfg.model becomes the converted checkpoint's architecture
        if cfg.model.vocab_size < self.tokenizer.vocab_size:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                              f"{self.tokenizer.vocab_size} ids ({cfg.data.tokenizer_path}); raise model.vocab_size")
        if self.resume_from is not None and (self.run_dir / "config.yaml").is_file():
            check_resume_config(yaml.safe_load((self.run_dir / "config.yaml").read_text()), to_dict(cfg),
                                accept_optim_change)
        self.accept_optim_change = accept_optim_change
        self.step = 0
        self.nonfinite_total = 0
        self.nonfinite_in_row = 0
        self.wall_before = 0.0
        self.t_start = time.time()
        self._build_data()
        self.checkpointer = ckpt_lib.Checkpointer(self.engine, self.ckpt_root, cfg.checkpoint.save_every,
                                                  cfg.checkpoint.keep_last, self.dist.rank, self.dist.world_size)

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
        metrics = MetricsLogger(cfg.logging, cfg.train.max_steps, self.run_dir, resume_step,
                                config_targets(cfg), self.is_main, self.step, run_config=to_dict(cfg),
                                groups=group_names(self.source_names))
        self.log(f"model: {self.n_params:,} parameters ({self.n_trainable:,} trainable); {self.dist.world_size} "
                 f"rank(s) on {self.dist.device}; ZeRO {cfg.deepspeed.zero_stage}{', bf16' if cfg.deepspeed.bf16 else ''}")
        for line in self.groups_desc:
            self.log(f"  group {line}")
        batches = iter(self.loader)
        self.t_start = time.time()
        rc = 0
        while self.step < cfg.train.max_steps:
            if self._stop_requested():
                metrics.close()
                return self._stopped()
            t0 = time.perf_counter()   # throughput counts data loading too
            window = list(itertools.islice(batches, cfg.optim.grad_accum))
            if len(window) < cfg.optim.grad_accum:
                self.log(f"data exhausted after {self.step} steps (data.epochs={cfg.data.epochs})")
                break
            lr = self.current_lr()
            result = self.train_step(window)
            self.after_step(result)
            rec = self._step_record(result, lr, time.perf_counter() - t0)
            if metrics.should_log(self.step, result.applied):
                rec.update(self._skipped_samples())                       # a collective
            pictures = None
            if metrics.should_eval(self.step):
                val, pictures = self.held_out.run(window[-1], draw=self.is_main)   # a collective
                rec.update(val)
            if self.is_main:
                metrics.write(rec, result, pictures)
            if self.nonfinite_in_row >= cfg.train.max_nonfinite_in_row:
                path = self.checkpointer.save(self.step, self.trainer_state())
                self.log(f"stopping: {self.nonfinite_in_row} non-finite steps in a row (step {self.step}); nothing "
                         f"was applied for them. Checkpoint: {path}. Lower optim.lr (resume with --resume "
                         f"--accept-optim-change optim.lr=...), check the data, or raise train.max_nonfinite_in_row.")
                rc = 1
                break
            self.checkpointer.maybe_save(self.step, self.trainer_state)
        if rc == 0:
            self.checkpointer.save_unless_saved(self.step, self.trainer_state)
        metrics.close()
        if rc == 0 and self._stop_requested():   # asked to stop during the last step: no export, no evaluation
            return self._stopped()
        return self._finish(rc)

    def _stop_requested(self) -> bool:
        """A SIGTERM / SIGINT on any rank stops every rank after the same step (a collective when distributed)."""
        if self.dist.world_size == 1:
            return self.stop.requested
        flag = torch.tensor([float(self.stop.requested)], device=self.dist.device)
        return bool(all_reduce_sum(flag).item() > 0)

    def _stopped(self) -> int:
        """Checkpoint the step just finished and say so in one line; the exit code of the signal."""
        signum = self.stop.signum or signal.SIGTERM   # a rank that did not see the signal itself
        name = signal.Signals(signum).name
        if self.step == 0 and self.resume_from is None:
            self.log(f"stopped by {name} before the first step: nothing to save; the same command starts the run "
                     f"(--resume included)")
        else:
            self.checkpointer.save_unless_saved(self.step, self.trainer_state)   # WriteError: reported by the CLI
            self.log(f"stopped by {name} after step {self.step}: checkpoint "
                     f"{self.ckpt_root / ckpt_lib.step_dir_name(self.step)}; continue with the same command and --resume")
        return 128 + int(signum)

    def _finish(self, rc: int) -> int:
        """Export final/, run the end-of-run callbacks, write report.png and summary.json (rank 0 prints)."""
        wall = self.wall_before + (time.time() - self.t_start)
        results: dict = {"vqa": None}
        if rc == 0:
            final = export_final(self.engine, self.run_dir, self.tokenizer, self.logit_scale, self.is_main, self.log)
            if final is None:
                rc = 1
            elif self.is_main:
                for fn in self.on_end:
                    results.update(fn(final, self.cfg, self.run_dir, self.log))
            barrier()
        if not self.is_main:
            return rc
        records = read_metrics(self.run_dir / "metrics.jsonl")
        targets = config_targets(self.cfg)
        picture = write_report(records, self.run_dir / "report.png", targets,
                               title=f"{self.run_dir.name}: stage {self.cfg.train.stage}")
        counters = self.loader.counters
        warm_file = self.run_dir / "vision_warmup.json"
        warmup = json.loads(warm_file.read_text()) if warm_file.is_file() else None
        lines = summary_lines(records, targets, results["vqa"], self.run_dir, wall, self.nonfinite_total, counters,
                              warmup)
        (self.run_dir / "summary.json").write_text(json.dumps(
            {"steps": self.step, "wall_s": wall, **results, "vision_warmup": warmup,
             "nonfinite_steps": self.nonfinite_total, "last": records[-1] if records else None, "exit_code": rc},
            indent=2, default=str))
        if rc == 0:   # final/ was exported: it gets a model card and the report picture
            final = self.run_dir / "final"
            card = model_card(to_dict(self.cfg), lines, f"{self.run_dir.name}: ConceptMoE VLM")
            write_extras(final, {"report.png": picture, "README.md": card})   # a full disk: one line, nothing partial
        self.log("\n".join(["", "=" * 72, "summary", "=" * 72] + lines))
        return rc

    # ---------------------------------------------------------------- one step
    def current_lr(self) -> float:
        """The base `optim.lr` times the schedule's multiplier at this step."""
        return self.cfg.optim.lr * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)

    def train_step(self, window, loss_hook=None) -> StepResult:
        cfg = self.cfg
        self.probe.clear()
        return train_step(self.engine, window, self.step, seed=cfg.train.seed, rank=self.dist.rank,
                          world_size=self.dist.world_size, parser=self.parser,
                          ratio_weight=cfg.model.chunk.ratio_loss_weight if cfg.model.chunk.enabled else 0.0,
                          device=self.dist.device, float_dtype=self.float_dtype, loss_hook=loss_hook or self.loss_hook,
                          bytes_per_id=self.bytes_per_id, n_sources=len(self.source_names))

    def after_step(self, result: StepResult) -> None:
        """Schedule and loss-free balancing move only when the optimizer applied the step."""
        self.step += 1
        if result.applied:
            self.scheduler.step()
            update_moe_biases(self.engine.module, all_reduce_sum)
            self.nonfinite_in_row = 0
        else:
            self.nonfinite_total += 1
            self.nonfinite_in_row += 1

    def _step_record(self, result: StepResult, lr: float, seconds: float) -> dict:
        cfg = self.cfg
        if result.applied:
            rec = step_record(self.step, result.vec, result.ratio_loss, cfg.model.chunk.ratio_loss_weight, lr, seconds,
                              group_names(self.source_names))
            rec.update(load_imbalance(result.loads))
            rec.update(self.probe.read())
            grad_norm = self.engine.get_global_grad_norm()
            if grad_norm is not None:
                rec["grad_norm"] = float(grad_norm)
        else:
            rec = {"step": self.step, "skipped": True, "lr": lr, "step_time_s": seconds}
        rec["nonfinite_steps"] = self.nonfinite_total
        return rec

    def _skipped_samples(self) -> dict[str, int]:
        """Data-loader skip counters summed over ranks (a collective: every rank calls it)."""
        counters = self.loader.counters
        vec = torch.tensor([float(counters.get(r, 0)) for r in REASONS], dtype=torch.float64)
        vec = all_reduce_sum(vec.to(self.dist.device)).cpu()
        return {f"skipped/{r}": int(v) for r, v in zip(REASONS, vec.tolist())}

    # ---------------------------------------------------------------- setup
    @property
    def is_main(self) -> bool:
        return self.dist.is_main

    def log(self, msg: str) -> None:
        if self.is_main:
            self.log_fn(msg)

    @staticmethod
    def _seed_all(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _resume_point(self, resume: bool | None) -> Path | None:
        found = ckpt_lib.find_resume_point(self.ckpt_root, self.dist.rank, warn=lambda m: self.log(f"warning: {m}"))
        if resume is True and found is None:
            if ckpt_lib.list_checkpoints(self.ckpt_root):   # there are some, all damaged: starting over would hide it
                raise ConfigError(f"--resume: no intact checkpoint in {self.ckpt_root}")
            # a requeue script can always pass --resume: a run preempted before its first checkpoint starts over
            self.log(f"--resume: no checkpoint in {self.ckpt_root} yet: starting the run from the beginning")
        if resume is False and found is not None:
            raise ConfigError(f"{self.run_dir} already has checkpoints ({found.name}); resume it or use a new --out")
        return found

    def _warmup_fingerprint(self) -> str:
        """The settings that decide what the vision warm-up computes: its checkpoint resumes only under them."""
        c = self.cfg
        return json.dumps({"vision": to_dict(c.vision), "warmup": to_dict(c.vision_warmup), "data": to_dict(c.data),
                           "seed": c.train.seed}, sort_keys=True, default=str)

    def _prepare_data_dir(self) -> None:
        """The default dataset is built once (rank 0) before any rank opens it."""
        if not self.cfg.data.sources:
            if self.is_main:
                ensure_default_dataset(self.cfg.data.default_dir)
            barrier()

    def _build_model(self) -> None:
        cfg = self.cfg
        model, fresh = build_model(cfg, self.tokenizer)
        if cfg.train.stage == "ct":
            cfg.model, cfg.vision = model.model_cfg, model.vision_cfg
        if cfg.params.freeze:
            freeze_prefixes(model, cfg.params.freeze)
        if "vision" in fresh and cfg.vision_warmup.steps and cfg.train.stage == "vl" and self.resume_from is None:
            # before the engine exists: rank 0's result is what every rank starts from
            warm = run_vision_warmup(model.vision.encoder.to(self.dist.device), cfg.vision.build_processor(),
                                     cfg.vision_warmup, cfg.data, seed=cfg.train.seed, device=self.dist.device,
                                     run_dir=self.run_dir if self.is_main else None, log=self.log,
                                     state_dir=self.ckpt_root if self.is_main else None,
                                     fingerprint=self._warmup_fingerprint(), stop=self.stop)
            if warm.get("stopped"):
                name = signal.Signals(self.stop.signum or signal.SIGTERM).name
                raise Preempted(self.stop.code or 143,
                                f"stopped by {name} in the vision warm-up at step {warm['step']}/{warm['steps']}: "
                                f"its state is in {warm['checkpoint']}; the same command (--resume included) "
                                f"continues it")
            broadcast_module(model.vision.encoder)
        if cfg.vision_warmup.steps and cfg.vision_warmup.freeze_after and cfg.train.stage == "vl" \
                and cfg.vision is not None and not pretrained_tower(cfg):
            freeze_prefixes(model, ["vision.encoder"])
        report = vision_load_report(model)
        if report is not None:
            self.log(f"vision checkpoint {cfg.vision.timm_checkpoint}: {report}")
            if self.is_main:
                (self.run_dir / "vision_load_report.txt").write_text(report + "\n")
        self.logit_scale = 1.0
        if cfg.params.mup:
            s_tok, s_con = mup_width_multipliers(cfg.model.hidden_size, cfg.model.c_hidden, cfg.params.mup_base_width)
            self.logit_scale = mup_logit_scale(s_tok)
            if "lm" in fresh:
                apply_mup_init(model, s_tok, s_con)
            else:   # pretrained weights compute plain logits: unfold so that hook x weights is the same function
                with torch.no_grad():
                    model.lm.lm_head.weight.div_(self.logit_scale)
            install_logit_scale(model, self.logit_scale)
        groups = build_param_groups(model, cfg.optim, cfg.params, cfg.model.hidden_size, cfg.model.c_hidden)
        self.groups_desc = describe_groups(groups)
        self.optimizer = build_optimizer(groups, cfg.optim)
        o = cfg.optim
        self.scheduler = build_scheduler(self.optimizer, schedule=o.schedule, warmup=o.warmup_steps,
                                         total=cfg.train.max_steps, lr=o.lr, min_lr=o.min_lr,
                                         decay_fraction=o.decay_fraction)
        self.ds_config = deepspeed_config(cfg.deepspeed, cfg.optim, self.dist.world_size)
        cfg.deepspeed = effective_settings(cfg.deepspeed, self.ds_config)   # the banner and config.yaml say what runs
        self.engine = initialize(model, self.optimizer, self.ds_config)
        self.float_dtype = torch.bfloat16 if self.engine.bfloat16_enabled() else torch.float32
        self.probe = ActivationProbe(self.engine.module)
        self.parser = GlobalParser(all_reduce_sum) if cfg.train.global_parser else None
        if self.parser is not None and not install(self.engine.module, self.parser):
            self.parser = None
        self.n_params = sum(p.numel() for p in model.parameters())
        self.n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    def _build_data(self) -> None:
        d, lg, data = self.dist, self.cfg.logging, self.cfg.data
        self.loader = build_loader(data, self.tokenizer, d.rank, d.world_size)
        self.source_names = [s.label for s in self.loader.sources]
        val_cfg = None
        if lg.eval_every and lg.eval_sources:
            val_cfg = replace(data, sources=lg.eval_sources, num_workers=0, epochs=None)
        elif lg.eval_every and not data.sources:
            val_cfg = replace(data, split="val", num_workers=0, epochs=None)
        eval_batches = []
        if val_cfg is not None:
            eval_batches = list(itertools.islice(build_loader(val_cfg, self.tokenizer, d.rank, d.world_size),
                                                 lg.eval_batches))
        self.held_out = HeldOut(self.engine, eval_batches, self.parser, d.device, self.float_dtype,
                                data.processor, self.tokenizer)

    # ---------------------------------------------------------------- state
    def trainer_state(self) -> dict:
        return {"step": self.step, "scheduler": self.scheduler.state_dict(), "rng": ckpt_lib.rng_state(),
                "loader": self.loader.state_dict(),
                "nonfinite_total": self.nonfinite_total, "nonfinite_in_row": self.nonfinite_in_row,
                "wall_s": self.wall_before + (time.time() - self.t_start)}

    def restore(self, path: Path) -> None:
        keys = ("initial_lr", "betas", "weight_decay", "eps")
        new_settings = [{k: g[k] for k in keys if k in g} for g in self.optimizer.param_groups]
        new_base_lrs = list(self.scheduler.base_lrs)
        state = ckpt_lib.load_checkpoint(self.engine, path, self.dist.rank, self.dist.world_size)
        self.scheduler.load_state_dict(state["scheduler"])
        if self.accept_optim_change:   # the checkpoint brought the old settings back: this config's win
            for group, settings in zip(self.optimizer.param_groups, new_settings):
                group.update(settings)
            self.scheduler.base_lrs = new_base_lrs
            self.scheduler._last_lr = [b * fn(self.scheduler.last_epoch)
                                       for b, fn in zip(new_base_lrs, self.scheduler.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
        ckpt_lib.set_rng_state(state["rng"])
        if state.get("loader") is not None:
            self.loader.load_state_dict(state["loader"])
        self.step = state["step"]
        self.nonfinite_total, self.nonfinite_in_row = state["nonfinite_total"], state["nonfinite_in_row"]
        self.wall_before = state.get("wall_s", 0.0)

    def _write_run_files(self) -> None:
        if self.is_main:
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(self.cfg), sort_keys=False))
            (self.run_dir / "deepspeed_config.json").write_text(json.dumps(self.ds_config, indent=2))
