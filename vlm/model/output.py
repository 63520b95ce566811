"""What the model's forward returns: the logits and the raw chunking and MoE outcomes, all on the
device.

The losses are the trainer's (vlm.train.losses: named terms read from this); turning the outcomes
into logged statistics (per-modality ratios, histograms, expert loads; one host transfer per step)
is the reader's job: `vlm.model.stats.summarize` for one output, the trainer's metrics for a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlm.model.chunking import Chunks
from vlm.model.moe import MoEStats


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V]
    # the chunking (p, boundaries, ...); None without a chunk module
    chunks: Chunks | None = None
    # every MoE pass in order, named by layer ("encoder.0", "concept.3", ...): a looped concept
    # layer appears once per pass
    moe_passes: list[tuple[str, MoEStats]] = field(default_factory=list)
    # Token-level hidden states when asked: embeddings, each encoder layer, the decoder input (after
    # the dechunk), each decoder layer (the last one normed). The concept layers run on concepts,
    # not tokens.
    hidden_states: tuple[torch.Tensor, ...] | None = None

    @property
    def moe(self) -> dict[str, MoEStats]:
        """Per MoE layer, its first pass (a looped concept layer's loads are counted once)."""
        first: dict[str, MoEStats] = {}
        for name, s in self.moe_passes:
            first.setdefault(name, s)
        return first
