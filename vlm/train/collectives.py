"""Every collective a training run makes, named here: all ranks call each one, in the same order, so
each is a function called from one place in the step or the trainer (a call that only rank 0 makes
would hang the others: keeping them here makes that visible). `tests/test_layers.py`-style check:
`tests/test_collectives.py` fails when a module of vlm/train/ other than this one and distributed.py
calls an all-reduce."""

from __future__ import annotations

import torch

from vlm.train.distributed import all_reduce_min, all_reduce_sum


def labelled_tokens(n_local: float, device: torch.device) -> float:
    """The step's labelled tokens over all ranks (each micro-batch's LM loss is weighted by its share)."""
    return float(all_reduce_sum(torch.tensor([n_local], dtype=torch.float64, device=device))[0])


def all_finite(finite: torch.Tensor, device: torch.device) -> bool:
    """Whether a micro-batch's loss (or a step's gradients) is finite on every rank."""
    return float(all_reduce_min(finite.to(torch.float64).reshape(1).to(device))[0]) >= 1.0


def ratio_statistics(sums: torch.Tensor) -> torch.Tensor:
    """DLCM's global parser: the ratio-loss sums of every rank (vlm.train.global_parser)."""
    return all_reduce_sum(sums)


def step_metrics(vec: torch.Tensor) -> torch.Tensor:
    """A step's logged sums, histograms and expert loads (vlm.train.metrics.StepAccumulator.reduce),
    and the held-out evaluation's."""
    return all_reduce_sum(vec)


def model_statistics(flat: torch.Tensor) -> torch.Tensor:
    """The statistics the model's forwards accumulated for the updates after an applied step (expert
    loads, top-k quantiles: vlm.model.training_controls.TrainingControls.apply_statistics)."""
    return all_reduce_sum(flat)


def data_counters(vec: torch.Tensor) -> torch.Tensor:
    """The loader's samples read and skipped by reason, overall and per source."""
    return all_reduce_sum(vec)


def stop_requested(requested: bool, device: torch.device, world_size: int) -> bool:
    """A SIGTERM / SIGINT seen on any rank stops every rank after the same step."""
    if world_size == 1:
        return requested
    return bool(all_reduce_sum(torch.tensor([float(requested)], device=device)).item() > 0)
