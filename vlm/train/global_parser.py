"""DLCM's Global Parser: ratio-loss statistics over the whole global batch (DLCM eq.
8-10, section 8.2).

The chunk module hands its local sums (boundaries, sum of p, tokens) for each ratio loss to
`stats_hook`; this object answers with the sums over the whole global batch: every data-parallel
rank and every micro-batch of the optimizer step. The chunk module forms F and G from them, and
gradients still reach only the local p, so summing the micro-batches' gradients gives exactly the
one-big-batch gradient.

With gradient accumulation the later micro-batches are not known when the first one runs backward,
so `train_step` makes a statistics pass first: each micro-batch runs forward without gradients (same
boundary samples, seeded per micro-batch) while the parser `collect`s their sums; `settle()` sums
them over ranks, and every real micro-batch then sees those totals. One micro-batch per step needs
no extra pass.
"""

from __future__ import annotations

from typing import Callable

import torch

from vlm.model.training_controls import TrainingControls
from vlm.train.collectives import ratio_statistics


class GlobalParser:
    """Callable stats hook; `start_step()` before each optimizer step."""

    def __init__(self, all_reduce: Callable[[torch.Tensor], torch.Tensor] = ratio_statistics):
        self.across_ranks = all_reduce
        self.total_Z3: torch.Tensor | None = None  # the step's global sums, once known
        self.collected: list[torch.Tensor] | None = None
        self.calls = 0

    def start_step(self) -> None:
        self.total_Z3, self.collected, self.calls = None, None, 0

    def collect(self) -> None:
        """Statistics pass: the following forwards only report their local sums."""
        self.collected = []

    def settle(self) -> torch.Tensor:
        """End of the statistics pass: the sums over this rank's micro-batches and over ranks (a collective)."""
        self.total_Z3 = self.across_ranks(torch.stack(self.collected).sum(0))
        self.collected = None
        return self.total_Z3

    def __call__(self, local_Z3: torch.Tensor) -> torch.Tensor:
        """DLCM eq. 8-9 sums: local [Z, 3] -> global [Z, 3]."""
        local_Z3 = local_Z3.detach().float()
        if self.collected is not None:
            self.collected.append(local_Z3)
            return local_Z3  # the statistics pass's own loss is never used
        self.calls += 1
        # one micro-batch: its sums over ranks are the global ones
        if self.total_Z3 is None:
            return self.across_ranks(local_Z3)
        return self.total_Z3


def install(model: torch.nn.Module, parser: GlobalParser | None) -> bool:
    """Attach (or with None detach) the parser to the model's chunk module; False when the model has none."""
    return TrainingControls(model).set_statistics_hook(parser)
