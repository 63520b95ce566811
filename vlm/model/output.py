"""What the model's forward returns."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ModelOutput:
    logits: torch.Tensor                    # [B, T, V]
    loss: torch.Tensor                      # lm_loss + weighted ratio loss + balance/z losses
    lm_loss: torch.Tensor                   # mean next-token loss over labelled positions
    ratio_loss: torch.Tensor                # eq. 4 (unweighted; 0 when chunking is off)
    balance_loss: torch.Tensor              # MoE balance + z losses, already weighted by their coefficients
    # Scalar statistics for logging (python floats), e.g. "compression/ratio", "compression/text",
    # "compression/image", "boundary_p/text", "boundary_p/image", "tokens/text", "boundaries/text",
    # "loss/text_only", "loss/image_text", "moe/adjugate_per_token".
    stats: dict[str, float] = field(default_factory=dict)
    # Detached per-token tensors for dashboards: "p" [B, T], "boundary" [B, T] bool, "modality" [B, T].
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
