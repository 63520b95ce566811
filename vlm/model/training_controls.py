"""The routing statistics training forwards accumulate, as one small typed interface for the step:
the MoE layers' expert loads and the top-k router's score quantiles. The step finds no buffer by
its name and sets no module attribute: what a forward needs from it arrives as an argument
(vlm.model.context.ForwardContext); what the forwards counted is dropped for a skipped step, and
applied after an applied one, summed over ranks in one collective (every rank then holds the same
balancing biases and thresholds).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from vlm.model.chunking import ChunkModule
from vlm.model.moe import MoE

AllReduce = Callable[[torch.Tensor], torch.Tensor]


class TrainingControls:
    def __init__(self, model: nn.Module):
        self.moes = [m for m in model.modules() if isinstance(m, MoE)]
        self.topk = [
            m for m in model.modules() if isinstance(m, ChunkModule) and m.cfg.router == "topk"
        ]

    def statistics(self) -> list[torch.Tensor]:
        """The buffers training forwards add to: each MoE layer's loads, each top-k chunker's quantile sums."""
        return [m.load_accum for m in self.moes] + [m.quantile_accum for m in self.topk]

    def drop_statistics(self) -> None:
        """A skipped step's statistics: its micro-batches never happened."""
        for t in self.statistics():
            t.zero_()

    @torch.no_grad()
    def apply_statistics(self, all_reduce: AllReduce | None = None) -> None:
        """After an applied optimizer step: the statistics summed over ranks in one collective,
        each MoE layer's loss-free balancing step, each top-k threshold's move; the accumulators
        start again from zero."""
        stats = self.statistics()
        if not stats:
            return
        flat = torch.cat([t.float().flatten() for t in stats])
        if all_reduce is not None:
            reduced = all_reduce(flat)
            flat = flat if reduced is None else reduced
        parts = flat.split([t.numel() for t in stats])
        for m, load in zip(self.moes, parts):
            m.update_bias(load)
        for m, q in zip(self.topk, parts[len(self.moes) :]):
            m.update_threshold(q)
