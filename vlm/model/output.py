"""What the model's forward returns: the logits (or what makes them) and the raw chunking and MoE
outcomes, all on the device.

Legend: B rows, T tokens, D width, V vocabulary.

The losses are the trainer's (vlm.train.losses: named terms read from this); turning the outcomes
into logged statistics (per-modality ratios, histograms, expert loads; one host transfer per step)
is the reader's job: `vlm.model.stats.summarize` for one output, the trainer's metrics for a step.

Every output carries the final hidden states (after the norm) and the output layer: the LM loss is
computed from them in tiles of tokens (vlm.model.tiled_loss), never from `[B, T, V]` logits. The
forward computes the logits of every position only where its caller asks for them
(`ForwardContext.logits`, the default of a model used alone); a training forward does not, and the
prefill computes those of each row's last token only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from vlm.model.chunking import Chunks
from vlm.model.moe import MoEStats


@dataclass
class ModelOutput:
    # [B, T, V]; None where the forward was asked not to compute them (a training forward, the
    # prefill)
    logits: torch.Tensor | None
    # the chunking (p, boundaries, ...); None without a chunk module
    chunks: Chunks | None = None
    # every MoE pass in order, named by layer ("encoder.0", "concept.3", ...): a looped concept
    # layer appears once per pass
    moe_passes: list[tuple[str, MoEStats]] = field(default_factory=list)
    # Token-level hidden states when asked: embeddings, each encoder layer, the decoder input (after
    # the dechunk), each decoder layer (the last one normed). The concept layers run on concepts,
    # not tokens.
    hidden_states: tuple[torch.Tensor, ...] | None = None
    # [B, T, D] the final hidden states after the norm, and the output layer that turns them into
    # logits, or into each token's loss a tile at a time (vlm.model.tiled_loss.LMHead)
    final_BTD: torch.Tensor | None = None
    head: nn.Module | None = None
    # tokens per tile of the loss's logits (vlm.model.tiled_loss.tokens_per_tile)
    tile_tokens: int = 0
    # prefill: [B, V] the logits at each row's last token, what predicts its first new token
    last_logits_BV: torch.Tensor | None = None

    @property
    def moe(self) -> dict[str, MoEStats]:
        """Per MoE layer, its first pass (a looped concept layer's loads are counted once)."""
        first: dict[str, MoEStats] = {}
        for name, s in self.moe_passes:
            first.setdefault(name, s)
        return first

    def logits_at(self, pos_BT: torch.Tensor) -> torch.Tensor:
        """[B, T, V] the logits at positions `pos_BT` of each row (T of them per row), and of no
        other position."""
        D = self.final_BTD.shape[-1]
        return self.head(self.final_BTD.gather(1, pos_BT[..., None].expand(-1, -1, D)))
