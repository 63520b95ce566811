"""The vision tower the LLM calls: packed encoder (NaViT or a timm backbone) followed by the projector."""

from __future__ import annotations

import torch
from torch import nn

from vision.projector import Projector


class VisionTower(nn.Module):
    def __init__(self, encoder: nn.Module, projector: Projector, merge: int):
        super().__init__()
        if projector.in_dim != encoder.out_dim:
            raise ValueError(
                f"projector in_dim={projector.in_dim} != encoder out_dim={encoder.out_dim}"
            )
        self.encoder, self.projector, self.merge = encoder, projector, merge

    @property
    def out_dim(self) -> int:
        return self.projector.out_dim

    def tokens_per_image(self, grid: tuple[int, int] | torch.Tensor) -> int:
        """LLM tokens for an image with this (rows, cols) patch grid."""
        rows, cols = (int(v) for v in grid)
        if rows % self.merge or cols % self.merge or rows < self.merge or cols < self.merge:
            raise ValueError(
                f"grid {(rows, cols)} must have positive multiples of merge={self.merge}"
            )
        return (rows // self.merge) * (cols // self.merge)

    def forward(
        self,
        patches_PD: torch.Tensor,
        coords_P2: torch.Tensor,
        image_grids_I2: torch.Tensor,
        valid_P: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """All images' packed patches -> [N, llm_hidden] tokens in image order (N = sum of tokens_per_image)."""
        return self.projector(
            self.encoder(patches_PD, coords_P2, image_grids_I2, valid_P),
            torch.div(image_grids_I2, self.merge, rounding_mode="floor"),
        )
