"""The vision-language model: vision tower + projector splice image tokens into the
ConceptMoE LM's sequence.

Legend: B rows, T tokens, D width, N flat tokens or patches, I images, P patches.

The chunk module then compresses both modalities jointly (ConceptMoE section 4.2); every statistic
is kept per modality (see vlm/model/stats.py).
"""

from __future__ import annotations

import torch
from torch import nn

from configs.batch import IMAGE, PackedBatch
from configs.config import ConfigError
from vision.projector import token_rows_cols
from vlm.model.conceptmoe import ConceptMoELM
from vlm.model.config import ModelConfig
from vlm.model.context import DEFAULT, ForwardContext
from vlm.model.output import ModelOutput


class ConceptMoEVLM(nn.Module):
    def __init__(self, model_cfg: ModelConfig, vision_cfg=None, lm: ConceptMoELM | None = None):
        """`lm`: the LLM built already (at a rank's share: vlm.train.build_share), else built
        here; the vision tower is built after it either way (the draws of a whole build's order)."""
        super().__init__()
        self.model_cfg, self.vision_cfg = model_cfg, vision_cfg
        self.lm = ConceptMoELM(model_cfg) if lm is None else lm
        self.vision = vision_cfg.build(model_cfg.hidden_size) if vision_cfg is not None else None

    def embed(self, batch: PackedBatch) -> torch.Tensor:
        """Token embeddings with each image-pad position replaced by its projected vision token, in order."""
        x_BTD = self.lm.embed(batch.input_ids)
        image_BT = batch.modality == IMAGE
        if batch.image_grids is None or batch.image_grids.numel() == 0:
            if image_BT.any():
                raise ValueError(f"batch has {int(image_BT.sum())} image positions but no images")
            return self._with_vision_in_graph(x_BTD)
        if self.vision is None:
            raise ConfigError(
                "the data carries images but the config has no vision tower (vision: "
                "null): give it a vision section, or train on text-only sources"
            )
        feats_ND = self.vision(batch.pixel_patches, batch.patch_coords, batch.image_grids)
        if feats_ND.shape[0] != int(image_BT.sum()):
            raise ValueError(
                f"images give {feats_ND.shape[0]} vision tokens but "
                f"the batch has {int(image_BT.sum())} image positions"
            )
        x_BTD = x_BTD.clone()
        x_BTD[image_BT] = feats_ND.to(x_BTD.dtype)
        return x_BTD

    def _with_vision_in_graph(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """A batch without images still takes part in the tower's collectives. Data-parallel ranks
        reduce gradients bucket by bucket as they are produced (ZeRO 0-2): a rank whose batch has
        no image would skip the tower's and hang or garble the others' reductions, so its trainable
        vision weights join the graph with a zero gradient (what LLaVA does with an empty slice of
        image features). ZeRO-3 also gathers the tower's partitioned weights, trainable or not, in
        every forward, on every rank: there the tower runs on one blank image of the smallest grid
        (a few patches) and its output joins with weight zero."""
        if self.vision is None:
            return x_BTD
        params = list(self.vision.parameters())
        if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3: partitioned, gathered per forward
            side = self.vision.merge
            patch_dim = 3 * self.vision.patch_size**2
            patches_PD = torch.zeros(side * side, patch_dim, device=x_BTD.device)
            rows, cols = torch.meshgrid(
                torch.arange(side, device=x_BTD.device),
                torch.arange(side, device=x_BTD.device),
                indexing="ij",
            )
            coords_P2 = torch.stack([rows.flatten(), cols.flatten()], 1)
            grid_12 = torch.tensor([[side, side]], device=x_BTD.device)
            blank_ND = self.vision(patches_PD, coords_P2, grid_12)
            return x_BTD + (blank_ND.sum() * 0.0).to(x_BTD.dtype)
        if not (self.training and torch.is_grad_enabled()):
            return x_BTD
        trainable = [p for p in params if p.requires_grad]
        if not trainable:
            return x_BTD
        zero = torch.stack([p.sum() for p in trainable]).sum() * 0.0
        return x_BTD + zero.to(x_BTD.dtype)

    def above_index(self, batch: PackedBatch) -> torch.Tensor | None:
        """For 2D-aware boundaries: the row position of the token above each image token in its grid, else -1."""
        if (
            not self.model_cfg.chunk.grid_aware_boundaries
            or batch.image_grids is None
            or self.vision is None
        ):
            return None
        token_grids_I2 = torch.div(batch.image_grids, self.vision.merge, rounding_mode="floor")
        bi, ti = (batch.modality == IMAGE).nonzero(as_tuple=True)  # row-major = image order
        row_N, _ = token_rows_cols(token_grids_I2)
        w_N = torch.repeat_interleave(token_grids_I2[:, 1], token_grids_I2.prod(1))
        above = torch.full_like(batch.doc_ids, -1)
        above[bi, ti] = torch.where(row_N > 0, ti - w_N, torch.full_like(ti, -1))
        return above

    def forward(
        self,
        batch: PackedBatch,
        force: str | torch.Tensor | None = None,
        output_hidden_states: bool = False,
        context: ForwardContext = DEFAULT,
    ) -> ModelOutput:
        """The LM's output on the batch with its images encoded and spliced in (image tokens carry
        no LM loss: vlm.model.stats.lm_labels). `context`: what a training forward needs from its
        step (vlm.model.context)."""
        return self.lm(
            batch,
            inputs_embeds=self.embed(batch),
            above_BT=self.above_index(batch),
            force=force,
            output_hidden_states=output_hidden_states,
            context=context,
        )

    @torch.no_grad()
    def prefill(self, batch: PackedBatch, max_new_tokens: int = 0):
        """Logits of the prompts and the inference caches; the images are encoded here, once per prompt."""
        return self.lm.prefill(batch, self.embed(batch), self.above_index(batch), max_new_tokens)

    @torch.no_grad()
    def step(self, ids_B: torch.Tensor, cache) -> torch.Tensor:
        """Logits [B, V] of the next position after one new (text) token per row."""
        return self.lm.step(self.lm.embed(ids_B), cache)
