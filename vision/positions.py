"""2D position information for packed patches: factorised learned embeddings or 2D RoPE.

Legend: P patches, Q query heads, d head width, f frequencies.

Both read only a patch's own (row, col), so an image's encoding does not depend on what it
is packed with.
"""

from __future__ import annotations

import torch
from torch import nn


class FactorisedPosEmbed(nn.Module):
    """NaViT's factorised learned embedding: pos(r, c) = row[r] + col[c]."""

    def __init__(self, max_grid: int, dim: int):
        super().__init__()
        self.max_grid = max_grid
        self.row = nn.Parameter(torch.empty(max_grid, dim))
        self.col = nn.Parameter(torch.empty(max_grid, dim))
        nn.init.trunc_normal_(self.row, std=0.02)
        nn.init.trunc_normal_(self.col, std=0.02)

    def forward(self, coords_P2: torch.Tensor) -> torch.Tensor:
        if coords_P2.numel() and int(coords_P2.max()) >= self.max_grid:
            raise ValueError(
                f"a patch coordinate {int(coords_P2.max())} is >= encoder.max_grid={self.max_grid}; "
                "raise max_grid or lower the processor's max_patches"
            )
        return self.row[coords_P2[:, 0]] + self.col[coords_P2[:, 1]]


class Rope2D(nn.Module):
    """Axial 2D rotary embedding (Qwen2-VL's vision RoPE): half of each head's channels rotate with
    the row index, the other half with the column index."""

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"rope2d needs head_dim divisible by 4, got {head_dim}")
        axis_dim = head_dim // 2
        inv_freq = 1.0 / theta ** (torch.arange(0, axis_dim, 2, dtype=torch.float32) / axis_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, coords_P2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[P, head_dim] cos and sin for each patch (float32)."""
        pos_P2 = coords_P2.to(torch.float32)
        freqs_Pf = torch.cat([pos_P2[:, :1] * self.inv_freq, pos_P2[:, 1:] * self.inv_freq], dim=1)
        emb_Pd = torch.cat([freqs_Pf, freqs_Pf], dim=1)
        return emb_Pd.cos(), emb_Pd.sin()


def apply_rope(x_QPd: torch.Tensor, cos_Pd: torch.Tensor, sin_Pd: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, computed in float32 and cast back."""
    x = x_QPd.float()
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos_Pd + rotated * sin_Pd).to(x_QPd.dtype)
