"""What the model's forward returns: losses and the raw chunking and MoE outcomes, all
on the device.

Turning them into logged statistics (per-modality ratios, histograms, expert loads; one host
transfer per step) is the reader's job: `vlm.model.stats.summarize` for one output, the trainer's
metrics for a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlm.model.chunking import Chunks
from vlm.model.config import ModelConfig
from vlm.model.moe import MoEStats


def ratio_weight(cfg: ModelConfig) -> float:
    """The ratio loss's weight in the total: `chunk.ratio_loss_weight`, 0 without a chunk module."""
    return cfg.chunk.ratio_loss_weight if cfg.chunk.enabled else 0.0


def total_loss(lm, ratio, balance, weight: float):
    """The total loss, built here only (tensors or floats): the LM loss + `weight` times the ratio
    loss (eq. 4)
    + the MoE balance and z losses (already weighted by their own coefficients)."""
    return lm + weight * ratio + balance


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V]
    # total_loss(lm_loss, ratio_loss, balance_loss, ratio_weight)
    loss: torch.Tensor
    lm_loss: torch.Tensor  # mean next-token loss over labelled positions
    ratio_loss: torch.Tensor  # eq. 4 (unweighted; 0 when chunking is off)
    # MoE balance + z losses, already weighted by their coefficients
    balance_loss: torch.Tensor
    # The LM loss split by sample kind: "loss/text_only", "loss/image_text" -> (mean,
    # labelled positions).
    loss_split: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # the chunking (p, boundaries, ...); None without a chunk module
    chunks: Chunks | None = None
    # per MoE layer: "encoder.0", "concept.3", ...
    moe: dict[str, MoEStats] = field(default_factory=dict)
    # Token-level hidden states when asked: embeddings, each encoder layer, the decoder input (after
    # the dechunk), each decoder layer (the last one normed). The concept layers run on concepts,
    # not tokens.
    hidden_states: tuple[torch.Tensor, ...] | None = None
    # detached next-token loss per position (0 where unlabelled)
    token_loss_BT: torch.Tensor | None = None
    # the ratio loss's weight in `loss` (`ratio_weight(cfg)`)
    ratio_weight: float = 0.0

    def total(self, lm_scale: float = 1.0, ratio_scale: float = 1.0) -> torch.Tensor:
        """`loss` with the LM part scaled by `lm_scale` (a micro-batch's share of the global batch's
        labelled tokens) and the ratio part by `ratio_scale` (the global parser's K W): what a
        training step back-propagates. `total()` is `loss`."""
        return total_loss(
            self.lm_loss * lm_scale,
            self.ratio_loss,
            self.balance_loss,
            self.ratio_weight * ratio_scale,
        )
