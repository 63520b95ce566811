"""Projector from vision tokens to the LLM's hidden size (ConceptMoE sec. 4.2 uses a linear one).

Legend: D width, N flat tokens or patches, I images, f frequencies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from configs.config import ValidatedOnInit, check


@dataclass
class ProjectorConfig(ValidatedOnInit):
    kind: Literal["linear", "mlp"] = "linear"
    hidden_mult: float = 1.0  # mlp: hidden width = hidden_mult * out_dim
    bias: bool = True
    # Learned row and column embeddings of each image token's place in its merged grid, added after
    # the projection (Pix2Struct-style absolute 2D positions): the LLM reads where a token is from
    # its value, which its 1D RoPE over the flattened image cannot give it. 0 disables; else the
    # largest grid side.
    grid_pos: int = 0
    # Fixed Fourier features of each token's centre as a fraction of its image's height and width,
    # through a learned linear map, added after the projection. Unlike grid_pos a place means the
    # same in every image size ("the left third"), and the lowest frequency is monotone across the
    # image, so which of two tokens is further left is a difference of two read-outs. 0 disables;
    # else the number of frequencies per axis.
    frac_pos: int = 0

    def validate(self) -> None:
        check(self.hidden_mult > 0, f"projector.hidden_mult must be > 0, got {self.hidden_mult}")
        check(
            self.grid_pos >= 0, f"projector.grid_pos must be >= 0 (0 disables), got {self.grid_pos}"
        )
        check(
            0 <= self.frac_pos <= 16,
            f"projector.frac_pos must be in 0..16 (0 disables), got {self.frac_pos}",
        )


class Projector(nn.Module):
    def __init__(self, cfg: ProjectorConfig, in_dim: int, out_dim: int):
        super().__init__()
        if in_dim < 1 or out_dim < 1:
            raise ValueError(f"projector dims must be >= 1, got in_dim={in_dim}, out_dim={out_dim}")
        self.cfg, self.in_dim, self.out_dim = cfg, in_dim, out_dim
        if cfg.kind == "linear":
            self.fc = nn.Linear(in_dim, out_dim, bias=cfg.bias)
        else:
            hidden = max(1, int(round(cfg.hidden_mult * out_dim)))
            self.fc1 = nn.Linear(in_dim, hidden, bias=cfg.bias)
            self.fc2 = nn.Linear(hidden, out_dim, bias=cfg.bias)

        if cfg.grid_pos:
            self.row_pos = nn.Parameter(torch.randn(cfg.grid_pos, out_dim) * 0.02)
            self.col_pos = nn.Parameter(torch.randn(cfg.grid_pos, out_dim) * 0.02)
        if cfg.frac_pos:
            self.frac_fc = nn.Linear(4 * cfg.frac_pos, out_dim, bias=False)

    def forward(
        self, x_ND: torch.Tensor, token_grids_I2: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x_ND: every image's tokens, image by image, each in raster order of its merged grid,
        whose (rows, cols) are `token_grids_I2` (needed with grid_pos and frac_pos)."""
        if x_ND.shape[-1] != self.in_dim:
            raise ValueError(f"projector expects {self.in_dim} features, got {x_ND.shape[-1]}")
        y_ND = self.fc(x_ND) if self.cfg.kind == "linear" else self.fc2(F.gelu(self.fc1(x_ND)))
        if self.cfg.grid_pos:
            row_N, col_N = token_rows_cols(token_grids_I2)
            if int(max(row_N.max(), col_N.max())) >= self.cfg.grid_pos:
                raise ValueError(
                    f"an image has {int(max(row_N.max(), col_N.max())) + 1} tokens on a "
                    f"side; projector.grid_pos={self.cfg.grid_pos} covers fewer: raise it"
                )
            y_ND = y_ND + self.row_pos[row_N] + self.col_pos[col_N]
        if self.cfg.frac_pos:
            y_ND = y_ND + self.frac_fc(
                fraction_features(token_grids_I2, self.cfg.frac_pos).to(y_ND.dtype)
            )
        return y_ND


def fraction_features(token_grids_I2: torch.Tensor, n_freq: int) -> torch.Tensor:
    """[N, 4 * n_freq]: sin and cos of pi * 2^k * (y, x), k < n_freq, where (y, x) in (0, 1)
    is each token's centre as a fraction of its image's height and width (images in order,
    each in raster order)."""
    row_N, col_N = token_rows_cols(token_grids_I2)
    n_I = token_grids_I2[:, 0].long() * token_grids_I2[:, 1].long()
    size_N2 = torch.repeat_interleave(token_grids_I2.long(), n_I, dim=0).float()
    yx_N2 = (torch.stack([row_N, col_N], 1).float() + 0.5) / size_N2
    angle_N2f = yx_N2[:, :, None] * (torch.pi * 2.0 ** torch.arange(n_freq, device=yx_N2.device))
    return torch.cat([angle_N2f.sin(), angle_N2f.cos()], -1).flatten(1)


def token_rows_cols(token_grids_I2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every token of images with these token grids, images in order, each in raster order."""
    rows_I, cols_I = token_grids_I2[:, 0].long(), token_grids_I2[:, 1].long()
    n_I = rows_I * cols_I
    start_I = torch.cumsum(n_I, 0) - n_I
    image_N = torch.repeat_interleave(torch.arange(len(n_I), device=n_I.device), n_I)
    k_N = torch.arange(int(n_I.sum()), device=n_I.device) - start_I[image_N]
    return k_N // cols_I[image_N], k_N % cols_I[image_N]
