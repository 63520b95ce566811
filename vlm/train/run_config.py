"""What a run's config says beyond training itself: its compression targets for the dashboards, and
which of its keys a resumed run may change."""

from __future__ import annotations

from dataclasses import replace

from configs.config import ConfigError, flatten
from vlm.model.config import resolve_targets
from vlm.train.config import TrainConfig

# Config keys a resumed run may change (everything else must match the checkpointed run).
RESUMABLE_CHANGES = (
    "train.max_steps",
    "checkpoint.",
    "logging.",
    "train.vqa_eval",
    "train.vqa_max_samples",
    "train.threads",
    "train.max_skip_share",
)


def evolve(cfg: TrainConfig, **sections) -> TrainConfig:
    """A new TrainConfig with `sections` replaced (validated again); `cfg` stays as it is. The model
    keys its file stated (load_train_config's `model_stated`, not a field) come along."""
    out = replace(cfg, **sections)
    out.model_stated = getattr(cfg, "model_stated", None)
    return out


def config_targets(cfg: TrainConfig) -> dict[str, float]:
    """Compression targets for dashboards: the joint R, or one per modality."""
    ch = cfg.model.chunk
    if not ch.enabled:
        return {}
    targets = ch.modality_targets()
    if targets:
        return {f"ratio/{m}": r for m, r in targets.items()}
    return {"ratio": ch.target_ratio}


# With --accept-optim-change (the documented fix after non-finite steps: a lower optim.lr) these may
# change too; grad_accum may not (it changes how the data stream is cut into steps).
OPTIM_CHANGES = (
    "optim.lr",
    "optim.min_lr",
    "optim.weight_decay",
    "optim.betas",
    "optim.eps",
    "optim.clip",
    "optim.warmup_steps",
    "optim.schedule",
    "optim.decay_fraction",
)


def _resolved(flat: dict) -> dict:
    """A flattened config with each per-modality target stated as null read as the target_ratio it
    follows (what the run trained with), so that a run written before nulls were allowed resumes
    under a config using them."""
    prefix = "model.chunk.modality_target_ratios."
    per = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}
    targets = resolve_targets(flat.get("model.chunk.target_ratio"), per) or {}
    return {**flat, **{prefix + m: r for m, r in targets.items()}}


def check_resume_config(saved: dict, now: dict, accept_optim_change: bool = False) -> None:
    a, b = _resolved(flatten(saved)), _resolved(flatten(now))
    allowed = RESUMABLE_CHANGES + (OPTIM_CHANGES if accept_optim_change else ())
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key) and not key.startswith(allowed):
            hint = " (or --accept-optim-change)" if key.startswith(OPTIM_CHANGES) else ""
            raise ConfigError(
                f"cannot resume: {key} was {a.get(key)!r} in the checkpointed run, now "
                f"{b.get(key)!r}; use a new --out directory or the same config{hint}"
            )
