"""Learning-rate schedules: transformers' own (linear warm-up, then cosine to a floor,
WSD or constant).

Each is a LambdaLR whose multiplier is a pure function of the optimizer step, so resuming needs only
the step (kept in the scheduler's state dict); the same multiplier scales every parameter group, so
muP's per-group rate ratios hold at every step.
"""

from __future__ import annotations

import torch
from transformers.optimization import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup_lr_rate,
    get_wsd_schedule,
)


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    schedule: str,
    warmup: int,
    total: int,
    lr: float,
    min_lr: float,
    decay_fraction: float,
) -> torch.optim.lr_scheduler.LambdaLR:
    """- cosine: linear warm-up from 1/warmup (step 0 already learns), then cosine down to
      min_lr at `total`;
    - wsd (MiniCPM): warm-up, stable at lr, then linear down to min_lr over the last
      `decay_fraction` of the post-warm-up steps;
    - constant: lr after the warm-up."""
    floor = (min_lr / lr) if lr > 0 else 0.0
    if schedule == "cosine":
        return get_cosine_with_min_lr_schedule_with_warmup_lr_rate(
            optimizer, num_warmup_steps=warmup, num_training_steps=total, min_lr_rate=floor
        )
    if schedule == "wsd":
        decay = max(int(round(decay_fraction * max(total - warmup, 1))), 1)
        return get_wsd_schedule(
            optimizer,
            num_warmup_steps=warmup,
            num_decay_steps=decay,
            num_training_steps=total,
            decay_type="linear",
            min_lr_ratio=floor,
        )
    if schedule == "constant":
        return get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)
    raise ValueError(f"unknown schedule {schedule!r}; allowed: 'cosine', 'wsd', 'constant'")
