"""The vision tower the LLM calls: packed encoder (NaViT or a timm backbone) followed by the projector."""

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
        patch = int(getattr(encoder, "patch_size", 0) or 0)
        # Held as the float32 values' bits in int32: `model.to(torch.bfloat16)` (DeepSpeed's bf16)
        # casts every floating buffer, which would round the mean and std, but moves integer ones
        # unchanged. Not in the state dict: they come from the config, checkpoints stay as they were.
        for name, values in (("pixel_mean_bits_D", mean), ("pixel_std_bits_D", std)):
            bits = channel_stats(values, patch).view(torch.int32)
            self.register_buffer(name, bits, persistent=False)

    def pixels_to_input(self, patches_PD: torch.Tensor) -> torch.Tensor:
        """uint8 pixels -> normalised float32 (the encoder casts to its own dtype); floats as they are."""
        if patches_PD.dtype != torch.uint8:
            return patches_PD
        mean_D = self.pixel_mean_bits_D.view(torch.float32)
        if patches_PD.shape[-1] != mean_D.shape[0]:
            raise ValueError(
                f"uint8 patches of {patches_PD.shape[-1]} values, but the tower's patches hold "
                f"{mean_D.shape[0]} (3 x patch_size**2)"
            )
        return normalize_pixels(patches_PD, mean_D, self.pixel_std_bits_D.view(torch.float32))

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
