"""Small building blocks shared by every stack: RMSNorm, rotary embeddings, packed-row positions.

Legend: B rows, T tokens, Q query heads, d head width, f rotary frequencies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _RMSNormFn(torch.autograd.Function):
    """y = x * rsqrt(mean(x^2) + eps) * w in fp32 with a hand-written backward: half the
    kernels autograd's derivative of the composite takes (the norm runs several times per
    layer, so this shows in launches per step). `w` broadcasts against x (e.g. one weight per
    head: [heads, 1, head_dim])."""

    @staticmethod
    def forward(ctx, x, w, eps):
        xf = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        xhat = xf * rstd
        ctx.save_for_backward(xhat, w, rstd)
        return (xhat * w.to(xf.dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        xhat, w, rstd = ctx.saved_tensors
        gf = g.to(xhat.dtype)
        gw_hat = gf * w.to(xhat.dtype)
        # d/dx of xhat * w: rstd * (g w - xhat * mean(g w xhat))
        gx = rstd * torch.addcmul(gw_hat, xhat, (gw_hat * xhat).mean(-1, keepdim=True), value=-1)
        gw = (gf * xhat).sum_to_size(w.shape) if ctx.needs_input_grad[1] else None
        return gx.to(g.dtype), None if gw is None else gw.to(w.dtype), None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, normalised in fp32 (bf16 sums of squares lose too much at
    large widths), times `w` (the last dimension's size, or broadcasting to x). On CUDA aten's fused
    rms_norm (one kernel forward, one backward); elsewhere, where that op is a composite of
    elementwise ones, the same formula with a hand-written backward."""
    if x.is_cuda:
        w = w if w.dtype == x.dtype else w.to(x.dtype)
        if w.dim() == 1:
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        return F.rms_norm(x, (x.shape[-1],), None, eps) * w
    return _RMSNormFn.apply(x, w, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions_BT: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """RoPE tables [B, T, head_dim] for arbitrary (per-document) positions, laid out for
    `apply_rope`: (cos, cos) and (-sin, sin) over the two halves. Built once per stack."""
    even = torch.arange(0, head_dim, 2, device=positions_BT.device, dtype=torch.float32)
    inv_freq = 1.0 / (theta ** (even / head_dim))
    ang_BTf = positions_BT.float()[..., None] * inv_freq
    cos, sin = ang_BTf.cos(), ang_BTf.sin()
    return torch.cat([cos, cos], -1).to(dtype), torch.cat([-sin, sin], -1).to(dtype)


def apply_rope(x_BQTd: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Llama/Qwen layout, so converted checkpoints keep their meaning):
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), as x * (cos, cos) + (x2, x1) * (-sin,
    sin): four kernels."""
    x1, x2 = x_BQTd.chunk(2, dim=-1)
    return x_BQTd * cos_BTd[:, None] + torch.cat((x2, x1), dim=-1) * sin_BTd[:, None]


def doc_starts(doc_BT: torch.Tensor) -> torch.Tensor:
    """True where a document begins (first position of the row, or the doc id changes). Padding (-1) never starts."""
    start = torch.ones_like(doc_BT, dtype=torch.bool)
    start[:, 1:] = doc_BT[:, 1:] != doc_BT[:, :-1]
    return start & (doc_BT >= 0)


def positions_in_doc(doc_BT: torch.Tensor) -> torch.Tensor:
    """Index of each position within its (contiguous) document; padding gets 0."""
    T = doc_BT.shape[1]
    idx = torch.arange(T, device=doc_BT.device).expand_as(doc_BT)
    first = (
        torch.where(doc_starts(doc_BT) | (doc_BT < 0), idx, torch.zeros_like(idx))
        .cummax(dim=1)
        .values
    )
    return torch.where(doc_BT >= 0, idx - first, torch.zeros_like(idx))
