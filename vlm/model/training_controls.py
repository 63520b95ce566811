"""What a training step needs from a model, as one small typed interface. The trainer and the step
call this and reach into no module: no attribute set on a chunk module from outside, no buffer found
by its name.

- the boundary noise's seed (one per micro-batch, so that a step's statistics pass and real pass
  draw alike);
- the chunk module's statistics hook (DLCM's global parser: ratio-loss sums over the
  whole global batch);
- when the top-k router's inference threshold moves: once per applied optimizer step,
  not per forward;
- the statistics training forwards accumulate for the updates after a step (the MoE layers' expert
  loads, the top-k router's score quantiles): to set aside around a pass that must not count, to
  drop for a skipped step, and to apply after an applied one, summed over ranks in one collective.
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
        self.chunkers = [m for m in model.modules() if isinstance(m, ChunkModule)]
        self.moes = [m for m in model.modules() if isinstance(m, MoE)]
        self.topk = [m for m in self.chunkers if m.cfg.router == "topk"]

    def seed_boundaries(self, seed: int | None) -> None:
        """The boundary noise of the next training forwards (None: a fresh seed per forward)."""
        for m in self.chunkers:
            m.seed_boundaries(seed)

    def set_statistics_hook(self, hook: Callable[[torch.Tensor], torch.Tensor] | None) -> bool:
        """Route the chunk module's local ratio-loss sums through `hook` (None: local sums); False without one."""
        for m in self.chunkers:
            m.stats_hook = hook
        return bool(self.chunkers)

    def move_thresholds_per_step(self) -> None:
        """Training forwards only accumulate the top-k threshold's statistics; `apply_statistics` moves it."""
        for m in self.topk:
            m.threshold_per_step = True

    def statistics(self) -> list[torch.Tensor]:
        """The buffers training forwards add to: each MoE layer's loads, each top-k chunker's quantile sums."""
        return [m.load_accum for m in self.moes] + [m.quantile_accum for m in self.topk]

    def save_statistics(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.statistics()]

    def restore_statistics(self, saved: list[torch.Tensor]) -> None:
        for t, before in zip(self.statistics(), saved):
            t.copy_(before)

    def drop_statistics(self) -> None:
        """A skipped step's statistics: its micro-batches never happened."""
        for t in self.statistics():
            t.zero_()

    @torch.no_grad()
    def apply_statistics(self, all_reduce: AllReduce | None = None) -> None:
        """After an applied optimizer step: the statistics summed over ranks in one collective
        (every rank then holds the same biases and thresholds), each MoE layer's loss-free balancing
        step, each top-k threshold's move; the accumulators start again from zero."""
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
