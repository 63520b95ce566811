"""The DeepSpeed engine: config dict from TrainConfig, a torch AdamW (torch's fused kernel; no
DeepSpeed FusedAdam build), initialise.

The learning-rate schedule is a torch LambdaLR that the trainer steps itself after every
applied optimizer step (a skipped, non-finite step must not advance it); its state travels
in our checkpoint.
"""

from __future__ import annotations

import functools
import json
import logging
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from configs.config import ConfigError
from vlm.train.config import DeepSpeedConfig, OptimConfig, TrainConfig

log = logging.getLogger("vlm.train")


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _generated(ds: DeepSpeedConfig, optim: OptimConfig, world_size: int) -> dict:
    zero: dict = {"stage": ds.zero_stage}
    if ds.zero_stage >= 1:
        zero.update(
            overlap_comm=ds.overlap_comm,
            reduce_bucket_size=ds.reduce_bucket_size,
            contiguous_gradients=True,
        )
        if ds.offload_optimizer != "none":
            zero["offload_optimizer"] = {"device": ds.offload_optimizer}
    if ds.zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True)
        if ds.offload_param != "none":
            zero["offload_param"] = {"device": ds.offload_param}
    return {
        # One "sample" is one packed micro-batch per rank; the row count lives in the data config.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": optim.grad_accum,
        "train_batch_size": optim.grad_accum * world_size,
        "gradient_clipping": optim.clip,
        "zero_optimization": zero,
        "bf16": {"enabled": ds.bf16},
        "fp16": {"enabled": False},
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        # offload with our torch AdamW (no DeepSpeedCPUAdam build)
        "zero_force_ds_cpu_optimizer": False,
    }


def _read_user_json(ds: DeepSpeedConfig) -> dict:
    try:
        user = json.loads(Path(ds.config_file).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"deepspeed.config_file {ds.config_file} cannot be read as JSON: {e}"
        ) from None
    if not isinstance(user, dict):
        raise ConfigError(f"deepspeed.config_file {ds.config_file}: expected a JSON object")
    for section in ("optimizer", "scheduler"):
        if user.pop(section, None) is not None:
            log.warning(
                "deepspeed.config_file %s: its %r section is ignored; the run's "
                "optimizer (torch AdamW) and learning-rate schedule come from optim.*",
                ds.config_file,
                section,
            )
    return user


def deepspeed_config(ds: DeepSpeedConfig, optim: OptimConfig, world_size: int) -> dict:
    """The DeepSpeed JSON for this run (written next to config.yaml for reference): generated from
    `deepspeed.*` and `optim.*`, then the user's JSON file and `deepspeed.extra` on top, their
    "auto" values filled in."""
    user = _read_user_json(ds) if ds.config_file else {}
    stage = (
        user.get("zero_optimization", {}).get("stage")
        if isinstance(user.get("zero_optimization"), dict)
        else None
    )
    # generate the defaults of the stage that will run
    if isinstance(stage, int) and stage in (0, 1, 2, 3):
        ds = replace(ds, zero_stage=stage)
    cfg = _generated(ds, optim, world_size)
    cfg = _merge(cfg, fill_auto(user, cfg))
    return _merge(cfg, fill_auto(ds.extra, cfg))


def fill_auto(user: dict, ours: dict) -> dict:
    """The transformers Trainer's convention for DeepSpeed JSON files (e.g. LLaVA's zero2.json /
    zero3.json): a value "auto" takes what this run computes from its config; one the run does not
    compute is left out, so DeepSpeed uses its default."""
    out = {}
    for k, v in user.items():
        if isinstance(v, dict):
            out[k] = fill_auto(v, ours.get(k) if isinstance(ours.get(k), dict) else {})
        elif v == "auto":
            if k in ours:
                out[k] = ours[k]
        else:
            out[k] = v
    return out


def effective_settings(ds: DeepSpeedConfig, ds_json: dict) -> DeepSpeedConfig:
    """`deepspeed.*` as the merged JSON actually runs it (a config file may set the stage or
    precision): what the banner prints and config.yaml records."""
    zero = ds_json.get("zero_optimization", {})
    offload = {
        k: zero.get(k, {}).get("device", getattr(ds, k))
        for k in ("offload_optimizer", "offload_param")
    }
    return replace(
        ds,
        zero_stage=int(zero.get("stage", ds.zero_stage)),
        bf16=bool(ds_json.get("bf16", {}).get("enabled", ds.bf16)),
        **{k: v for k, v in offload.items() if v in ("none", "cpu")},
    )


def _same_kinds(ours: dict, merged: dict, where: str = "") -> None:
    """A value the user's JSON or `deepspeed.extra` puts where we generate one keeps its
    kind (object, boolean, number): DeepSpeed accepts e.g. `gradient_clipping: "abc"` and
    fails steps later."""
    for k, a in ours.items():
        b, key = merged.get(k), f"{where}{k}"
        kind = (
            dict
            if isinstance(a, dict)
            else bool
            if isinstance(a, bool)
            else (int, float)
            if isinstance(a, (int, float))
            else None
        )
        ok = kind is None or (
            isinstance(b, kind) and not (kind is not bool and isinstance(b, bool))
        )
        if not ok:
            expected = "an object" if kind is dict else "true/false" if kind is bool else "a number"
            raise ConfigError(
                f"deepspeed config key {key}={b!r} (from deepspeed.extra "
                f"or deepspeed.config_file): expected {expected}"
            )
        if kind is dict:
            _same_kinds(a, b, key + ".")


def check_deepspeed_config(ds: DeepSpeedConfig, optim: OptimConfig, world_size: int) -> dict:
    """The merged DeepSpeed JSON, checked by DeepSpeed's own parser before any work, so a
    bad value in `deepspeed.extra` or the config file stops the run with one line instead of
    a traceback mid-start-up."""
    from deepspeed.runtime.config import DeepSpeedConfig as DeepSpeedJSON

    cfg = deepspeed_config(ds, optim, world_size)
    _same_kinds(deepspeed_config(DeepSpeedConfig(zero_stage=ds.zero_stage), optim, world_size), cfg)
    # needs the real world size: checked at init
    probe = {k: v for k, v in cfg.items() if k != "train_batch_size"}
    try:
        DeepSpeedJSON(probe)
    except Exception as e:  # noqa: BLE001 - pydantic ValidationError, AssertionError, TypeError, ...
        lines = [
            ln.strip()
            for ln in str(e).splitlines()
            if ln.strip() and "errors.pydantic.dev" not in ln
        ]
        raise ConfigError(
            "deepspeed config (from deepspeed.* / deepspeed.extra / "
            f"deepspeed.config_file) is invalid: {' | '.join(lines) or type(e).__name__}"
        ) from None
    return cfg


class SkipNonFiniteAdamW(torch.optim.AdamW):
    """torch AdamW that leaves everything as it is when a gradient is not finite on some rank, and
    says so in `overflow`: the attribute DeepSpeed's engine reads after every optimizer step (as
    from its own fp16 / bf16 / ZeRO optimizers) to count the step as skipped (`skipped_steps`) and
    answer `was_step_applied()` with False. For the plain fp32 stage-0 path, where DeepSpeed steps
    this optimizer directly and checks nothing itself: a skipped step then advances DeepSpeed's
    counters as on every other path, through DeepSpeed's own code."""

    def __init__(self, *args, clip=None, **kwargs):
        """`clip(params) -> norm`: clips the gradients itself before each applied step (expert
        parallelism's exact global norm, vlm.train.expert_parallel.ExpertAwareClip, where
        DeepSpeed's own clipping is off); DeepSpeed logs the norm it returns."""
        super().__init__(*args, **kwargs)
        self.clip = clip
        report_step(self, skipped=False)

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        skipped = not grads_finite([p.grad for p in params])
        norm = None if skipped or self.clip is None else self.clip(params)
        report_step(self, skipped, norm)
        if skipped:
            return None
        return super().step(closure)


def report_step(optimizer: torch.optim.Optimizer, skipped: bool, norm=None) -> None:
    """What DeepSpeed's engine reads from a client optimizer after its step
    (`DeepSpeedEngine._take_model_step`): `overflow` (True: the step counts as skipped,
    `was_step_applied()` is False) and, when there is one, `_global_grad_norm` (what
    `get_global_grad_norm()` then says). A private protocol of the engine's, not an API
    (tests/test_deepspeed_internals.py pins the DeepSpeed version this was written for)."""
    optimizer.overflow = skipped
    if norm is not None:
        optimizer._global_grad_norm = norm


def grads_finite(grads: list[torch.Tensor]) -> bool:
    """Every rank's gradients are finite (one host sync; a collective when distributed)."""
    from vlm.train.collectives import all_finite

    ok = (
        torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else torch.tensor(True)
    )
    return all_finite(ok, grads[0].device if grads else torch.device("cpu"))


def build_optimizer(
    groups: list[dict], optim: OptimConfig, skip_nonfinite: bool = False, clip=None
) -> torch.optim.Optimizer:
    """torch AdamW over the groups (per-group lr / weight decay / eps already set); with
    `skip_nonfinite` one that skips a step with a non-finite gradient itself (for the plain fp32
    path: `plain_fp32`), and clips with `clip` (SkipNonFiniteAdamW) when given.

    Fused (one kernel per parameter group and step, on CUDA and CPU alike, instead of about ten per
    parameter tensor: the unfused AdamW took 11-14 % of an H100 step) wherever every parameter is a
    float tensor on a device the fused kernel supports."""
    cls = SkipNonFiniteAdamW if skip_nonfinite else torch.optim.AdamW
    params = [p for g in groups for p in g["params"]]
    fused = bool(params) and all(
        p.is_floating_point() and p.device.type in ("cuda", "cpu") for p in params
    )
    own = {"clip": clip} if skip_nonfinite else {}
    return cls(
        groups,
        **own,
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        fused=fused,
    )


# The optimizer settings a resumed run takes from its config with --accept-optim-change (the
# checkpoint's optimizer state brings the old ones back with the Adam moments).
OPTIM_SETTINGS = ("initial_lr", "betas", "weight_decay", "eps")


def optimizer_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: g[k] for k in OPTIM_SETTINGS if k in g} for g in optimizer.param_groups]


def resume_schedule(
    optimizer: torch.optim.Optimizer, scheduler, saved: dict, settings: list[dict] | None = None
) -> None:
    """The schedule at the checkpoint's step (`saved`: its state dict), and every group's rate from
    it. With `settings` (optimizer_settings taken before the checkpoint was loaded): those settings,
    and the schedule continuing from the saved step with their base rates; one public `step()` from
    the step before recomputes every rate as base x multiplier(step), so that `get_last_lr()` says
    the same. A checkpoint of another number of parameter groups (expert parallelism puts the
    experts in groups of their own: a resume at another degree) continues its step with this
    run's groups and base rates (the same config: vlm.train.run_config), one schedule for all."""
    n = len(optimizer.param_groups)
    if len(saved.get("base_lrs", ())) != n:
        settings = settings or optimizer_settings(optimizer)
        saved = dict(saved, lr_lambdas=[saved["lr_lambdas"][0]] * n, _last_lr=[0.0] * n)
    if settings is None:
        scheduler.load_state_dict(saved)
    else:
        for group, values in zip(optimizer.param_groups, settings):
            group.update(values)
        scheduler.load_state_dict(
            dict(
                saved,
                base_lrs=[v["initial_lr"] for v in settings],
                last_epoch=saved["last_epoch"] - 1,
            )
        )
        # "lr_scheduler.step() before optimizer.step()": a resume, not a mistake
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            scheduler.step()
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr


def build_engine(
    model: torch.nn.Module, groups: list[dict], cfg: TrainConfig, ds_json: dict, clip=None
):
    """The run's optimizer over `groups` (on the plain fp32 path one that skips a non-finite step
    itself, and clips with `clip` when given), its learning-rate schedule and the DeepSpeed engine
    running `ds_json` (deepspeed_config): (optimizer, scheduler, engine)."""
    from vlm.train.schedule import build_scheduler

    o = cfg.optim
    optimizer = build_optimizer(groups, o, skip_nonfinite=plain_fp32(ds_json), clip=clip)
    scheduler = build_scheduler(
        optimizer,
        schedule=o.schedule,
        warmup=o.warmup_steps,
        total=cfg.train.max_steps,
        lr=o.lr,
        min_lr=o.min_lr,
        decay_fraction=o.decay_fraction,
    )
    engine = initialize(model, optimizer, ds_json)
    # plain_fp32 misjudged it
    if is_plain_fp32(engine) and not isinstance(engine.optimizer, SkipNonFiniteAdamW):
        raise RuntimeError(
            "DeepSpeed steps the optimizer directly (stage 0, fp32) but it does not skip "
            "non-finite steps"
        )
    return optimizer, scheduler, engine


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ds_config: dict):
    """deepspeed.initialize with our optimizer; returns the engine (its .optimizer may wrap ours)."""
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    load_checkpoints_safely(engine)
    return engine


def load_checkpoints_safely(engine) -> None:
    """DeepSpeed's checkpoint engine loads every file with a plain torch.load, which unpickles
    arbitrary objects: the engine's `checkpoint_engine.load`, through which its
    `load_checkpoint` reads every file, becomes `safe_load` (tensors and plain containers only).
    An attribute of the engine's, replaced (tests/test_deepspeed_internals.py pins the DeepSpeed
    version this was written for)."""
    engine.checkpoint_engine.load = safe_load


def compile_model(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> int:
    """model.compile (null: on for CUDA, off for CPU): every transformer block compiled in place,
    torchtitan's way (vlm.model.compile). Not under ZeRO-3 unless asked for: its parameter hooks and
    compiled blocks are an untested pair. Returns the number of compiled blocks."""
    from vlm.model.compile import compile_blocks, compile_default

    on = cfg.model.compile
    if on is None:
        on = compile_default(device) and cfg.deepspeed.zero_stage < 3
    if not on:
        return 0
    # Before Hopper the experts run as a loop that reads their counts on the host
    # (vlm.model.moe.expert_swiglu), and the variable expert exchange reads its sizes there
    # (vlm.model.expert_parallel): a graph break per MoE layer, so the blocks compile in pieces
    # instead of refusing
    old_gpu = device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0)
    fullgraph = not (old_gpu or cfg.parallel.variable_exchange)
    return compile_blocks(model, fullgraph=fullgraph)


class CheckpointRefused(RuntimeError):
    """A checkpoint this run will not load (a pickle of other objects than tensors, another
    world size, a missing part); the message is one line naming the file. `vlm train` prints it
    without a traceback."""


def load_mapped(path) -> dict:
    """`safe_load` of a checkpoint file memory-mapped: what is read of it is the pages of the
    tensors' elements that are used (a rank reads its share of the writers' files)."""
    return safe_load(path, map_location="cpu", load=functools.partial(torch.load, mmap=True))


def safe_load(path, map_location=None, load=None):
    """torch.load for DeepSpeed's checkpoint files, tensors and plain containers only (a crafted
    checkpoint cannot run code); anything else is refused with the file named. `load`: the
    torch.load to call (None: torch.load as it is now)."""
    import pickle

    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    # the few plain-data classes ZeRO's optimizer files hold (rebuilt from their fields, no code
    # is called)
    try:
        with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
            return (load or torch.load)(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointRefused(
            f"checkpoint {path}: refused, it holds objects other than "
            f"tensors and plain containers ({str(e).splitlines()[-1][:200]})"
        ) from None


def plain_fp32(ds_json: dict) -> bool:
    """The DeepSpeed JSON runs stage 0 without bf16 / fp16 (what `is_plain_fp32` says of the engine it makes)."""
    return optimizer_form(ds_json) == "zero0"


def optimizer_form(ds_json: dict) -> str:
    """How a run with this DeepSpeed JSON keeps its optimizer state (what a checkpoint's files say
    of the run that wrote it: vlm.train.expert_parallel.written_form): "zero0" (stage 0, fp32: our
    torch optimizer's state dicts), "zero0-bf16" (stage 0, bf16: DeepSpeed's fp16 optimizer's flat
    fp32 groups), "zero12" (stage 1-2, fp32 or bf16: flat fp32 partitions), "zero3" or "fp16"."""
    enabled = lambda k: bool((ds_json.get(k) or {}).get("enabled", False))  # noqa: E731
    stage = int((ds_json.get("zero_optimization") or {}).get("stage", 0))
    if enabled("fp16"):
        return "fp16"
    if stage == 3:
        return "zero3"
    if stage in (1, 2):
        return "zero12"
    return "zero0-bf16" if enabled("bf16") else "zero0"


def is_plain_fp32(engine) -> bool:
    """Stage 0 without bf16: DeepSpeed steps our torch optimizer directly and checks nothing for overflow."""
    return (
        engine.zero_optimization_stage() == 0
        and not engine.bfloat16_enabled()
        and not engine.fp16_enabled()
    )
