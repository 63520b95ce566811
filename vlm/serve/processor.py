"""vLLM's multimodal processing for exports with a vision tower.

The export's own transformers processor (`ConceptMoEProcessor`, vlm/model/processing.py) turns each
image into packed patches and each `<image>` into `<image_start>` + one `<image_pad>` per image
token + `<image_end>`; vLLM learns where each image's embeddings go from `_get_prompt_updates`, and
carries the patches per image (`_get_mm_fields_config`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from transformers import BatchFeature
from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdateDetails,
)

from data_pipelines.schema import IMAGE_TOKEN

# large enough that the processor gives it the most patches it allows
_DUMMY_SIDE = 4096


class ConceptMoEProcessingInfo(BaseProcessingInfo):
    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None if self.get_hf_config().vision is not None else 0}

    def image_processor(self):
        return self.get_hf_processor().image_processor

    def max_image_tokens(self) -> int:
        cfg = self.image_processor().processor_config
        return cfg.max_patches // (cfg.merge * cfg.merge)

    def get_mm_max_tokens_per_item(
        self, seq_len: int, mm_counts: Mapping[str, int]
    ) -> Mapping[str, int]:
        return {"image": self.max_image_tokens() + 2}


class ConceptMoEDummyInputsBuilder(BaseDummyInputsBuilder[ConceptMoEProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return IMAGE_TOKEN * mm_counts.get("image", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int], mm_options=None):
        n = mm_counts.get("image", 0)
        return {
            "image": self._get_dummy_images(
                width=_DUMMY_SIDE,
                height=_DUMMY_SIDE,
                num_images=n,
                overrides=(mm_options or {}).get("image"),
            )
        }


class ConceptMoEMultiModalProcessor(BaseMultiModalProcessor[ConceptMoEProcessingInfo]):
    def _call_hf_processor(
        self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        """vLLM also processes images without their text (each item once, for its cache): the image
        processor alone then."""
        if hf_data.get("text") or not hf_data.get("images"):
            return super()._call_hf_processor(hf_data, hf_kwargs)
        out = self.info.image_processor().preprocess(hf_data["images"])
        return BatchFeature(dict(out), tensor_type="pt")

    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        grids = hf_inputs.get("image_grids", torch.zeros(0, 2, dtype=torch.long))
        per_image = grids.prod(-1) if len(grids) else torch.zeros(0, dtype=torch.long)
        return dict(
            pixel_patches=MultiModalFieldConfig.flat_from_sizes("image", per_image),
            patch_coords=MultiModalFieldConfig.flat_from_sizes("image", per_image),
            image_grids=MultiModalFieldConfig.batched("image"),
        )

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs) -> Sequence:
        tok = self.info.get_tokenizer()
        vocab = tok.get_vocab()
        start, pad, end = vocab["<image_start>"], vocab["<image_pad>"], vocab["<image_end>"]
        image_processor = self.info.image_processor()

        def replacement(i: int):
            grid = out_mm_kwargs["image"][i]["image_grids"].data.tolist()
            n = image_processor.tokens_per_image(tuple(grid))
            return PromptUpdateDetails.select_token_id(
                [start] + [pad] * n + [end], embed_token_id=pad
            )

        target = [vocab[IMAGE_TOKEN]] if IMAGE_TOKEN in vocab else IMAGE_TOKEN
        return [PromptReplacement(modality="image", target=target, replacement=replacement)]
