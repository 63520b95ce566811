"""A training run, built once: `build_run(...) -> Run`.

Building a run learns what the config alone does not say: a continued model's tokenizer and model
section, the DeepSpeed settings the merged JSON runs. `build_run` works that out first, in order
(the run folder and the resume point, the data and the tokenizer, the model, the engine's
settings), and makes the effective config once; everything else (the engine, the loaders, the
held-out set) is built from it. The `Run` it returns is never changed: the trainer
(vlm.train.trainer) only loops over it, and RUN_DIR/config.yaml, the banner and the summary show
its config.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import yaml

from configs.config import ConfigError, to_dict
from data_pipelines.default_dataset import ensure_default_dataset
from vlm.model.shares import WHOLE, Sharding
from vlm.model.training_controls import TrainingControls
from vlm.train import checkpoint as ckpt_lib
from vlm.train import collectives, reshard
from vlm.train import expert_parallel as ep_lib
from vlm.train import sequence_shard as sp_lib
from vlm.train.build_share import prepare_for_engine, transients_returned
from vlm.train.config import RunConfig, TrainConfig
from vlm.train.distributed import DistInfo, ProcessGroups, init_distributed, make_groups
from vlm.train.engine import (
    build_engine,
    compile_model,
    deepspeed_config,
    effective_settings,
    optimizer_form,
    plain_fp32,
)
from vlm.train.layout import ParallelLayout
from vlm.train.loaders import build_loaders, check_row_fits
from vlm.train.losses import Loss
from vlm.train.metrics import group_names
from vlm.train.param_groups import apply_mup, build_param_groups, describe_groups, freeze_prefixes
from vlm.train.probes import ActivationProbe
from vlm.train.run_config import (
    check_resume_config,
    check_resume_steps,
    evolve,
    saved_global_batch,
    saved_run_config,
    with_global_batch,
)
from vlm.train.run_dir import check_start, clear_run, made_by_this_run
from vlm.train.sizes import check_buildable
from vlm.train.stages import (
    build_stage_model,
    load_run_tokenizer,
    resolve_tokenizer,
    with_built_model,
)
from vlm.train.step import StepSettings
from vlm.train.validation import HeldOut
from vlm.train.vision_warmup import warm_up_vision


@dataclass(frozen=True)
class Run:
    cfg: TrainConfig  # the effective config: what runs
    dir: Path
    dist: DistInfo
    layout: ParallelLayout  # how the ranks share the work (vlm.train.layout)
    groups: ProcessGroups  # this rank's process groups of the layout
    resume_from: Path | None  # the checkpoint the run continues from (None: a fresh start)
    tokenizer: Any
    engine: Any  # DeepSpeed's engine; its .module is the model
    optimizer: torch.optim.Optimizer
    scheduler: Any
    ds_config: dict  # the DeepSpeed JSON the engine runs
    loader: Any  # the training stream (data_pipelines.loader.PackedLoader)
    held_out: HeldOut
    step: StepSettings  # what each optimizer step needs
    checkpointer: ckpt_lib.Checkpointer
    probe: ActivationProbe
    logit_scale: float | None  # muP's output scale (None without muP)
    banner: tuple[str, ...]  # what the run is, for the log

    @property
    def is_main(self) -> bool:
        return self.dist.is_main

    @property
    def ckpt_root(self) -> Path:
        return self.dir / "checkpoints"

    def write_files(self) -> None:
        """RUN_DIR/config.yaml (the effective config) and deepspeed_config.json (rank 0)."""
        if self.is_main:
            (self.dir / "config.yaml").write_text(
                yaml.safe_dump(to_dict(self.cfg), sort_keys=False)
            )
            (self.dir / "deepspeed_config.json").write_text(json.dumps(self.ds_config, indent=2))


def check_trainable(cfg: TrainConfig, layout: ParallelLayout) -> None:
    """ConfigError (one line) for a layout the trainer cannot run (sequence parallelism's limits:
    vlm.train.sequence_shard)."""
    sp_lib.check(cfg, layout)


def set_up_process(run: RunConfig) -> None:
    """Threads, determinism and seeds, before anything draws a random number."""
    if run.threads:
        torch.set_num_threads(run.threads)
    if run.deterministic:
        # deterministic cuBLAS on GPU
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    random.seed(run.seed)
    np.random.seed(run.seed)
    torch.manual_seed(run.seed)


def open_run_dir(
    run_dir: Path, resume: bool | None, overwrite: bool | None, dist: DistInfo, log
) -> Path | None:
    """RUN_DIR exists without a partial checkpoint; the checkpoint to resume from (None: a fresh
    start, which may not replace an earlier run's outputs unless `overwrite`: vlm.train.run_dir)."""
    ckpt_root = run_dir / "checkpoints"
    if dist.is_main:
        if overwrite and (gone := clear_run(run_dir)):
            log(f"--overwrite: deleted the earlier run's {', '.join(gone)} in {run_dir}")
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt_lib.clean_partial(ckpt_root)
    collectives.barrier()
    found = ckpt_lib.resume_point(ckpt_root, dist.rank, resume, log=log, world=dist.world_size)
    # rank 0 decides for every rank
    check_start(run_dir, resume, overwrite, found, dist.is_main)
    return found


def prepare_data(cfg: TrainConfig, dist: DistInfo):
    """The default dataset (built once, by rank 0, before any rank opens it) and the run's
    tokenizer: a continued pretrained model keeps its own (stages.resolve_tokenizer). Returns the
    config naming that tokenizer, and the tokenizer."""
    if not cfg.data.sources:
        if dist.is_main:
            ensure_default_dataset(cfg.data.default_dir)
        collectives.barrier()
    cfg = resolve_tokenizer(cfg)
    tokenizer = load_run_tokenizer(cfg)
    check_row_fits(cfg, tokenizer)  # before the model is built
    return cfg, tokenizer


def model_sharding(cfg: TrainConfig, layout: ParallelLayout) -> tuple[Sharding, dict]:
    """What this rank builds and keeps of the model (vlm.model.shares), from the ZeRO stage and
    precision the DeepSpeed JSON will run, and that JSON as the build sees it (ZeRO-3's
    construction reads it). Expert parallelism under ZeRO-3: the experts are built at their shard
    and the dense weights whole, and the engine partitions both when it is built (its AutoEP
    placement: vlm.train.expert_parallel.deepspeed_view); zero.Init would partition the experts
    over the world, not over their replicas."""
    ds_json = deepspeed_config(cfg.deepspeed, cfg.optim, layout.world)
    ds = effective_settings(cfg.deepspeed, ds_json)
    stage = 0 if layout.expert > 1 and ds.zero_stage == 3 else ds.zero_stage
    return Sharding.of(layout, stage, ds.bf16), ds_json


def build_model(cfg: TrainConfig, tokenizer, sharding: Sharding = WHOLE, ds_json=None):
    """The stage's model at this rank's share, its fresh parts, and the config naming the model
    built; params.freeze applied."""
    with contextlib.nullcontext() if sharding.whole else transients_returned():
        model, fresh = build_stage_model(cfg, tokenizer, sharding, ds_json)
    cfg = with_built_model(cfg, model)
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} ids ({cfg.data.tokenizer_path}); raise model.vocab_size"
        )
    if cfg.params.freeze:
        freeze_prefixes(model, cfg.params.freeze)
    return model, fresh, cfg


def saved_config(run_dir: Path, resume_from: Path | None, warn) -> dict | None:
    """The config.yaml of the run a resume continues, its global batch stated (a run written before
    there was one states rows x accumulation x the ranks that wrote it); None: a fresh start, or a
    config.yaml missing or damaged (with a warning: the checkpoint is what the run resumes from)."""
    saved = saved_run_config(run_dir, warn) if resume_from is not None else None
    if saved is None:
        return None
    optim = saved.get("optim") if isinstance(saved.get("optim"), dict) else {}
    optim["global_batch_rows"] = saved_global_batch(saved, reshard.written_by(resume_from))
    saved["optim"] = optim
    return saved


def build_run(
    cfg: TrainConfig,
    run_dir: Path,
    *,
    resume: bool | None,
    overwrite: bool | None,
    accept_optim_change: bool,
    log: Callable[[str], None],
    stop,
) -> Run:
    """The run of `cfg` in `run_dir` (arguments as vlm.train.trainer.Trainer's). A config error
    found here leaves no run folder behind (vlm.train.run_dir.made_by_this_run)."""
    check_buildable(cfg)  # before the run folder exists: nothing is left behind
    dist = init_distributed(cfg.parallel.timeout_s, stop)
    layout = ParallelLayout.of(cfg.parallel, dist.world_size, dist.rank)
    check_trainable(cfg, layout)
    groups = make_groups(layout)
    set_up_process(cfg.train)
    say = log if dist.is_main else (lambda msg: None)
    with made_by_this_run(run_dir, dist.is_main):
        resume_from = open_run_dir(run_dir, resume, overwrite, dist, say)
        cfg, tokenizer = prepare_data(cfg, dist)
        sharding, ds_build = model_sharding(cfg, layout)
        model, fresh, cfg = build_model(cfg, tokenizer, sharding, ds_build)
        warm_up_vision(
            model,
            fresh,
            cfg,
            resuming=resume_from is not None,
            device=dist.device,
            run_dir=run_dir,
            is_main=dist.is_main,
            log=say,
            stop=stop,
        )
        logit_scale = apply_mup(
            model, cfg.params, cfg.model.hidden_size, cfg.model.c_hidden, "lm" in fresh
        )
        # each rank keeps its shard of the routed experts (None: every rank holds them all)
        ep = ep_lib.set_up(model, cfg.parallel, layout, groups)
        # each rank computes its part of every row (None: whole rows)
        shard = sp_lib.set_up(model, layout, groups)
        param_groups = build_param_groups(
            model, cfg.optim, cfg.params, cfg.model.hidden_size, cfg.model.c_hidden
        )
        param_groups = ep_lib.split_groups(param_groups, ep)
        compiled_blocks = compile_model(model, cfg, dist.device)
        if resume_from is not None:  # not below the step the checkpoint reached
            step = ckpt_lib.checkpoint_step(resume_from)
            check_resume_steps(step, cfg.train.max_steps, resume_from)
        saved = saved_config(run_dir, resume_from, say)
        kept = saved["optim"]["global_batch_rows"] if saved else None
        cfg = with_global_batch(cfg, layout.data, kept)
        # DeepSpeed averages every gradient over the world; with sequence parallelism each rank's
        # part of a row counts as one of micro x world parts (vlm.train.step)
        ds_json = deepspeed_config(cfg.deepspeed, cfg.optim, layout.world)
        cfg = evolve(cfg, deepspeed=effective_settings(cfg.deepspeed, ds_json))  # what runs
        if resume_from is not None:
            ep_lib.check_resume(resume_from, layout.expert, layout.world, optimizer_form(ds_json))
        if reshard.needs_universal(resume_from, dist.world_size, ds_json):
            ds_json = reshard.with_universal_loading(ds_json)
        if saved is not None:  # what may not change on resume
            check_resume_config(saved, to_dict(cfg), accept_optim_change, say=say)
        ds_json, clip = ep_lib.plain_fp32_clip(ep, ds_json, plain_fp32(ds_json))
        prepare_for_engine(model, sharding, dist.device)
        with ep_lib.deepspeed_view(model, ep, cfg.deepspeed.zero_stage):
            optimizer, scheduler, engine = build_engine(model, param_groups, cfg, ds_json, clip)
        loader, eval_batches = build_loaders(cfg, tokenizer, layout.data_rank, layout.data)
        eval_batches = ep_lib.even_eval_batches(eval_batches, ep, dist.device)
        float_dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
        settings = StepSettings(
            loss=Loss(cfg.model, cfg.loss, global_parser=cfg.train.global_parser, shard=shard),
            controls=TrainingControls(engine.module),
            seed=cfg.train.seed,
            layout=layout,
            device=dist.device,
            float_dtype=float_dtype,
            shard=shard,
            bytes_per_id=torch.as_tensor(tokenizer.bytes_per_id, device=dist.device),
            groups=tuple(group_names([s.label for s in loader.sources])),
        )
        held_out = HeldOut(engine, eval_batches, settings, cfg.data.processor, tokenizer)
    # ZeRO-3 leaves each rank a partition: ds_numel is the whole parameter's size
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
    n_params, n_trainable = sum(n for n, _ in sizes), sum(n for n, t in sizes if t)
    if ep is not None:  # the experts the other expert ranks hold
        n_params += ep.total_params - ep.local_params
        n_trainable += ep.total_params - ep.local_params if ep_lib.experts_train(model) else 0
    summary = (
        f"model: {n_params:,} parameters ({n_trainable:,} trainable); "
        f"{layout.describe()} on {dist.device}; ZeRO {cfg.deepspeed.zero_stage}"
        f"{', bf16' if cfg.deepspeed.bf16 else ''}"
        f"{f'; {compiled_blocks} blocks compiled' if compiled_blocks else ''}"
    )
    banner = (summary, *([ep.banner()] if ep else []))
    banner += tuple(f"  group {line}" for line in describe_groups(param_groups))
    ck = cfg.checkpoint
    checkpointer = ckpt_lib.Checkpointer(
        engine, run_dir / "checkpoints", ck.save_every, ck.keep_last, layout, ck.background
    )
    return Run(
        cfg=cfg,
        dir=run_dir,
        dist=dist,
        layout=layout,
        groups=groups,
        resume_from=resume_from,
        tokenizer=tokenizer,
        engine=engine,
        optimizer=optimizer,
        scheduler=scheduler,
        ds_config=ds_json,
        loader=loader,
        held_out=held_out,
        step=settings,
        checkpointer=checkpointer,
        probe=ActivationProbe(engine.module),
        logit_scale=logit_scale,
        banner=banner,
    )
