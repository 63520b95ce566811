"""Small building blocks shared by every stack: RMSNorm, rotary embeddings, packed-row positions."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: bf16 sums of squares lose too much at large widths.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_cos_sin(positions_BT: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables [B, T, head_dim/2] for arbitrary (per-document) positions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions_BT.device, dtype=torch.float32) / head_dim))
    ang_BTF = positions_BT.float()[..., None] * inv_freq
    return ang_BTF.cos().to(dtype), ang_BTF.sin().to(dtype)


def apply_rope(x_BHTd: torch.Tensor, cos_BTF: torch.Tensor, sin_BTF: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Llama/Qwen layout, so converted checkpoints keep their meaning)."""
    x1, x2 = x_BHTd.chunk(2, dim=-1)
    cos, sin = cos_BTF[:, None], sin_BTF[:, None]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def doc_starts(doc_BT: torch.Tensor) -> torch.Tensor:
    """True where a document begins (first position of the row, or the doc id changes). Padding (-1) never starts."""
    start = torch.ones_like(doc_BT, dtype=torch.bool)
    start[:, 1:] = doc_BT[:, 1:] != doc_BT[:, :-1]
    return start & (doc_BT >= 0)


def positions_in_doc(doc_BT: torch.Tensor) -> torch.Tensor:
    """Index of each position within its (contiguous) document; padding gets 0."""
    T = doc_BT.shape[1]
    idx = torch.arange(T, device=doc_BT.device).expand_as(doc_BT)
    first = torch.where(doc_starts(doc_BT) | (doc_BT < 0), idx, torch.zeros_like(idx)).cummax(dim=1).values
    return torch.where(doc_BT >= 0, idx - first, torch.zeros_like(idx))
