"""DLCM's Global Parser: ratio-loss statistics over the whole global batch (DLCM eq. 8-10, section 8.2).

The chunk module hands its local sums (boundaries, sum of p, tokens) for each ratio loss to
`stats_hook`; this object sums them over data-parallel ranks and adds the sums of the earlier
micro-batches of the same optimizer step. The chunk module then forms F and G from the global sums
(gradients still reach only the local p), so compression is regulated on the global batch rather than
per sequence or per device.
"""
from __future__ import annotations

from typing import Callable

import torch

from vlm.train.distributed import all_reduce_sum


class GlobalParser:
    """Callable stats hook; `start_step()` before the first micro-batch of each optimizer step."""

    def __init__(self, all_reduce: Callable[[torch.Tensor], torch.Tensor] = all_reduce_sum):
        self.all_reduce = all_reduce
        self.earlier_K3: torch.Tensor | None = None   # global sums of this step's earlier micro-batches
        self.calls = 0

    def start_step(self) -> None:
        self.earlier_K3 = None
        self.calls = 0

    def __call__(self, local_K3: torch.Tensor) -> torch.Tensor:
        """DLCM eq. 8-9 sums: local [K, 3] -> global [K, 3] (ranks + earlier micro-batches of the step)."""
        ranks_K3 = self.all_reduce(local_K3.detach().float())
        total_K3 = ranks_K3 if self.earlier_K3 is None else ranks_K3 + self.earlier_K3
        self.earlier_K3 = total_K3
        self.calls += 1
        return total_K3


def install(model: torch.nn.Module, parser: GlobalParser | None) -> bool:
    """Attach (or with None detach) the parser to the model's chunk module; False when the model has none."""
    lm = getattr(model, "lm", model)
    chunker = getattr(lm, "chunker", None)
    if chunker is None:
        return False
    chunker.stats_hook = parser
    return True
