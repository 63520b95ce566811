"""Learning-rate schedules with linear warm-up: cosine, WSD (warm-up, stable, decay) and constant.

Each schedule is a pure function of the optimizer step, returning the multiplier applied to every
parameter group's base rate, so resuming only needs the step (kept by torch's LambdaLR state).
"""
from __future__ import annotations

import math
from functools import partial

import torch


def lr_multiplier(step: int, *, schedule: str, warmup: int, total: int, min_ratio: float,
                  decay_fraction: float = 0.2) -> float:
    """Multiplier of the peak rate at optimizer step `step` (0-based: the rate used by the step'th update).

    - warm-up: linear from 1/warmup up to 1 over `warmup` steps (never 0, so step 0 already learns);
    - cosine: 1 -> min_ratio over the remaining steps;
    - wsd: 1 until the last `decay_fraction` of the run, then linear down to min_ratio (MiniCPM's WSD);
    - constant: 1 after warm-up.
    """
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(total - warmup, 1)
    t = min(max(step - warmup, 0), span)
    if schedule == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t / span))
    if schedule == "wsd":
        decay_steps = max(int(round(decay_fraction * span)), 1)
        start = span - decay_steps
        if t < start:
            return 1.0
        return 1.0 - (1.0 - min_ratio) * min((t - start) / decay_steps, 1.0)
    raise ValueError(f"unknown schedule {schedule!r}; allowed: 'cosine', 'wsd', 'constant'")


def build_scheduler(optimizer: torch.optim.Optimizer, *, schedule: str, warmup: int, total: int,
                    lr: float, min_lr: float, decay_fraction: float) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose multiplier is `lr_multiplier` (the same for every group, so muP ratios hold)."""
    fn = partial(lr_multiplier, schedule=schedule, warmup=warmup, total=total,
                 min_ratio=(min_lr / lr) if lr > 0 else 0.0, decay_fraction=decay_fraction)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
