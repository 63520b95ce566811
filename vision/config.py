"""VisionConfig: the one config for the vision side (processor, encoder, projector) and its builder."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from configs.config import ConfigError, ValidatedOnInit, check
from vision.hf_vision import hf_vision_architecture
from vision.image_processor import ImageProcessor, ImageProcessorConfig
from vision.navit import NaViTConfig, NaViTEncoder
from vision.projector import Projector, ProjectorConfig
from vision.timm_backbone import TimmBackbone, load_timm_vit_state_dict
from vision.tower import VisionTower


@dataclass
class VisionConfig(ValidatedOnInit):
    """`processor` states the patch geometry (patch_size, merge) for the whole vision side: the
    encoder (NaViT or timm) is built for the patches it makes. Its sections validated themselves
    when they were made."""

    processor: ImageProcessorConfig = field(default_factory=ImageProcessorConfig)
    encoder: NaViTConfig = field(default_factory=NaViTConfig)
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    backbone: Literal["navit", "timm"] = "navit"
    timm_model: str | None = None  # e.g. "naflexvit_base_patch16_gap" (backbone: timm)
    # LOCAL timm weights file or HF SigLIP / CLIP folder; navit: loaded by name
    timm_checkpoint: str | None = None
    # how a checkpoint's pos table fits max_grid
    pos_resample: Literal["copy", "interpolate"] = "copy"
    # freeze the ViT body; merger and projector still train (LLaVA stage 1)
    freeze_encoder: bool = False

    def __post_init__(self) -> None:
        """A Hugging Face SigLIP / CLIP folder states its tower: the encoder is built as it says
        (widths, depth, heads, stem, layer scale, patch size), whatever the config's encoder section
        or its base file says, so that every pretrained tensor has its place (the load report lists
        what was taken from the checkpoint)."""
        arch = self.checkpoint_architecture()
        if arch is not None:
            fields, patch = arch
            self.encoder = replace(self.encoder, **fields)
            self.processor = replace(self.processor, patch_size=patch)
        super().__post_init__()

    def checkpoint_architecture(self) -> tuple[dict, int] | None:
        if not self.timm_checkpoint or self.backbone != "navit":
            return None
        return hf_vision_architecture(self.timm_checkpoint)

    def validate(self) -> None:
        try:
            self.encoder.out_dim_for(self.processor.merge)
        except ConfigError as e:
            raise ConfigError(f"encoder.{e}") from None
        if self.backbone == "timm":
            check(
                bool(self.timm_model),
                "backbone 'timm' needs timm_model (e.g. naflexvit_base_patch16_gap)",
            )
        if self.encoder.pos == "learned2d" and self.backbone == "navit":
            m = self.processor.merge
            # a thin strip: one merge unit wide
            longest = (self.processor.max_patches // (m * m)) * m
            check(
                self.encoder.max_grid >= longest,
                f"encoder.max_grid={self.encoder.max_grid} is smaller than the "
                f"longest grid side the processor can make ({longest} patches, "
                "for a thin strip); raise max_grid or use pos=rope2d",
            )

    def build_processor(self) -> ImageProcessor:
        return ImageProcessor(self.processor)

    def build(self, llm_hidden: int) -> VisionTower:
        """Encoder (+ optional local checkpoint) and projector to `llm_hidden`."""
        patch_size, merge = self.processor.patch_size, self.processor.merge
        if self.backbone == "timm":
            enc = TimmBackbone(
                self.timm_model,
                merge=merge,
                patch_size=patch_size,
                checkpoint=self.timm_checkpoint,
                merger=self.encoder.merger,
                out_dim=self.encoder.out_dim,
            )
        else:
            enc = NaViTEncoder(self.encoder, patch_size=patch_size, merge=merge)
            if self.timm_checkpoint:
                report = enc.load_report = load_timm_vit_state_dict(
                    enc, self.timm_checkpoint, self.pos_resample
                )
                if not report.loaded:
                    raise ConfigError(
                        f"timm_checkpoint {self.timm_checkpoint}: no tensor matched the encoder "
                        f"(check encoder.hidden_size and processor.patch_size):\n{report}"
                    )
                if self.checkpoint_architecture() is not None:
                    report.notes.append(
                        "architecture read from the checkpoint's config.json: "
                        + ", ".join(
                            f"{k}={getattr(self.encoder, k)}"
                            for k in self.checkpoint_architecture()[0]
                        )
                        + f", patch_size={patch_size}"
                    )
                bad = report.mismatches()
                # a pretrained tower is loaded whole: a part left at its init is not what was
                # asked for
                if bad:
                    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
                    raise ConfigError(
                        f"timm_checkpoint {self.timm_checkpoint}: the tower "
                        f"does not match the checkpoint: {bad[0]}{more}"
                    )
        # the merger stays trainable: it is part of the adapter, like the projector
        if self.freeze_encoder:
            for name, p in enc.named_parameters():
                p.requires_grad_(name.startswith("merger."))
        return VisionTower(
            enc,
            Projector(self.projector, enc.out_dim, llm_hidden),
            merge,
            self.processor.mean,
            self.processor.std,
        )
