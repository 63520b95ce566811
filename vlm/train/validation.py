"""Held-out evaluation during training: loss and compression in eval mode, and the chunking pictures.

Legend: B rows, T tokens.
"""

from __future__ import annotations

import torch

from vision.image_processor import ImageProcessor
from vlm.model.context import ForwardContext
from vlm.train import collectives
from vlm.train.device_feed import prepare
from vlm.train.metrics import StepAccumulator, token_losses
from vlm.train.render import image_concept_picture, text_with_boundaries
from vlm.train.sequence_shard import local_batch
from vlm.train.step import StepSettings

# a held-out forward computes no [B, T, V] logits: the loss makes them a tile of tokens at a time
SCORING = ForwardContext(logits=False)

EVAL_KEYS = (
    "loss/lm",
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

    def __init__(self, engine, batches: list, s: StepSettings, processor_cfg, tokenizer):
        self.engine, self.batches, self.s = engine, batches, s
        self.processor_cfg, self.tokenizer = processor_cfg, tokenizer

    @torch.no_grad()
    def run(self, fallback_batch, draw: bool) -> tuple[dict, tuple | None]:
        """({"val/...": value}, (picture, text) or None): the LM loss is the mean over the
        labelled tokens of every held-out batch of every rank."""
        engine, s = self.engine, self.s
        engine.eval()
        acc = StepAccumulator(s.device, s.bytes_per_id)
        first = None
        try:
            for b in self.batches or [fallback_batch]:
                b = prepare(b, s.device, s.float_dtype)
                out = engine(b, context=SCORING)
                part = local_batch(b, s.shard)  # what this rank's output is of
                row = None
                if s.shard is not None:  # the whole rows, for the per-document statistics
                    row = (b, out.chunks.row_b_BT if out.chunks is not None else None, s.shard)
                if self.batches:
                    acc.add_output(out, part, token_loss_BT=token_losses(out, part), row=row)
                if first is None and out.chunks is not None:
                    row_b = out.chunks.row_b_BT  # the whole rows' (sequence parallelism)
                    first = (b, out.chunks.b_BT if row_b is None else row_b)
        finally:
            engine.train()
        val = {}
        if self.batches:
            rec = acc.record(0, collectives.step_metrics).scalars
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
