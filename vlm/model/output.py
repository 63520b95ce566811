"""What the model's forward returns: losses and the raw chunking and MoE outcomes, all on the device.

Turning them into logged statistics (per-modality ratios, histograms, expert loads; one host transfer per
step) is the reader's job: `vlm.model.stats.summarize` for one output, the trainer's metrics for a step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlm.model.chunking import Chunks
from vlm.model.moe import MoEStats


@dataclass
class ModelOutput:
    logits: torch.Tensor                    # [B, T, V]
    loss: torch.Tensor                      # lm_loss + weighted ratio loss + balance/z losses
    lm_loss: torch.Tensor                   # mean next-token loss over labelled positions
    ratio_loss: torch.Tensor                # eq. 4 (unweighted; 0 when chunking is off)
    balance_loss: torch.Tensor              # MoE balance + z losses, already weighted by their coefficients
    # The LM loss split by sample kind: "loss/text_only", "loss/image_text" -> (mean, labelled positions).
    loss_split: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    chunks: Chunks | None = None            # the chunking (p, boundaries, ...); None without a chunk module
    moe: dict[str, MoEStats] = field(default_factory=dict)   # per MoE layer: "encoder.0", "concept.3", ...
    # Token-level hidden states when asked: embeddings, each encoder layer, the decoder input (after the
    # dechunk), each decoder layer (the last one normed). The concept layers run on concepts, not tokens.
    hidden_states: tuple[torch.Tensor, ...] | None = None
    token_loss_BT: torch.Tensor | None = None   # detached next-token loss per position (0 where unlabelled)
