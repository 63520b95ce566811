"""Held-out evaluation during training: loss and compression in eval mode, and the chunking pictures."""

from __future__ import annotations

import torch

from vision.image_processor import ImageProcessor
from vlm.train import collectives
from vlm.train.device_feed import prepare
from vlm.train.global_parser import install
from vlm.train.metrics import StepAccumulator
from vlm.train.render import image_concept_picture, text_with_boundaries

EVAL_KEYS = (
    "lm_loss",
    "loss/text_only",
    "bpb/text",
    "loss/image_text",
    "compression/ratio",
    "compression/text",
    "compression/image",
    "boundary_p/all",
    "boundary_p/text",
    "boundary_p/image",
)


class HeldOut:
    """Held-out batches read once at start-up (eval mode: p >= 0.5 boundaries, no sampling);
    without any, the pictures come from the current training batch. `run` is a collective: every
    rank calls it."""

    def __init__(
        self,
        engine,
        batches: list,
        parser,
        device: torch.device,
        float_dtype: torch.dtype,
        processor_cfg,
        tokenizer,
    ):
        self.engine, self.batches, self.parser = engine, batches, parser
        self.device, self.float_dtype = device, float_dtype
        self.processor_cfg, self.tokenizer = processor_cfg, tokenizer
        self.bytes_per_id = torch.as_tensor(tokenizer.bytes_per_id, device=device)

    @torch.no_grad()
    def run(self, fallback_batch, draw: bool) -> tuple[dict, tuple | None]:
        """({"val/...": value}, (picture, text) or None)."""
        engine = self.engine
        engine.eval()
        # eval statistics stay local: no collective inside the forward
        install(engine.module, None)
        acc = StepAccumulator(self.device, self.bytes_per_id)
        first = None
        try:
            for b in self.batches or [fallback_batch]:
                b = prepare(b, self.device, self.float_dtype)
                out = engine(b)
                if self.batches:
                    acc.add(out, b)
                if first is None and out.chunks is not None:
                    first = (b, out.chunks.b_BT)
        finally:
            engine.train()
            install(engine.module, self.parser)
        val = {}
        if self.batches:
            rec = acc.record(0, collectives.step_metrics, ratio_weight=0.0).scalars
            # the aggregates, and per kind of sample the documents' ratio per modality (eval mode):
            # p10 / p50 / p90
            val = {
                f"val/{k}": v
                for k, v in rec.items()
                if k in EVAL_KEYS or k.startswith("doc_ratio/")
            }
        return val, (self._pictures(*first) if draw and first is not None else None)

    def _pictures(self, batch, boundary_BT) -> tuple:
        proc = self.processor_cfg
        img = image_concept_picture(
            batch, boundary_BT, proc.patch_size, proc.merge, ImageProcessor(proc).denormalize
        )
        txt = text_with_boundaries(
            batch, boundary_BT, lambda ids: self.tokenizer.decode(ids, skip_special=False)
        )
        return img, txt
