"""The vision tower the LLM calls: packed encoder (NaViT or a timm backbone) followed by the projector.

Legend: D width, I images, P patches.
"""

from __future__ import annotations

import torch
from torch import nn

from vision.image_processor import CLIP_MEAN, CLIP_STD, channel_stats, normalize_pixels
from vision.projector import Projector


class VisionTower(nn.Module):
    """Pixels enter the model here. The training loader ships uint8 patches (a quarter of the
    bytes); they are normalised on the tower's device with the processor's mean and std, as the
    processor's float path does on the host. Float patches (prompts, tools) are normalised
    already and pass as they are."""

    def __init__(
        self,
        encoder: nn.Module,
        projector: Projector,
        merge: int,
        mean: tuple[float, float, float] = CLIP_MEAN,
        std: tuple[float, float, float] = CLIP_STD,
    ):
        super().__init__()
        if projector.in_dim != encoder.out_dim:
            raise ValueError(
                f"projector in_dim={projector.in_dim} != encoder out_dim={encoder.out_dim}"
            )
        self.encoder, self.projector, self.merge = encoder, projector, merge
        self.patch_size = int(getattr(encoder, "patch_size", 0) or 0)
        self.pixel_mean, self.pixel_std = tuple(mean), tuple(std)
        # Per device, made there and kept out of the module's buffers: a buffer would be rounded by
        # `model.to(torch.bfloat16)` (DeepSpeed's bf16), and a non-persistent one is left
        # uninitialised by transformers' from_pretrained (it builds the model on the meta device).
        self._pixel_stats: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def pixels_to_input(self, patches_PD: torch.Tensor) -> torch.Tensor:
        """uint8 pixels -> normalised float32 (the encoder casts to its own dtype); floats as they are."""
        if patches_PD.dtype != torch.uint8:
            return patches_PD
        if patches_PD.shape[-1] != 3 * self.patch_size**2:
            raise ValueError(
                f"uint8 patches of {patches_PD.shape[-1]} values, but the tower's patches hold "
                f"{3 * self.patch_size**2} (3 x patch_size**2)"
            )
        stats = self._pixel_stats.get(patches_PD.device)
        if stats is None:
            stats = tuple(
                channel_stats(v, self.patch_size, patches_PD.device)
                for v in (self.pixel_mean, self.pixel_std)
            )
            self._pixel_stats[patches_PD.device] = stats
        return normalize_pixels(patches_PD, *stats)

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
            self.encoder(self.pixels_to_input(patches_PD), coords_P2, image_grids_I2, valid_P),
            torch.div(image_grids_I2, self.merge, rounding_mode="floor"),
        )
