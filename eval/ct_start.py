"""The loss a MoE -> ConceptMoE conversion starts continual training from, with real boundaries.

Legend: B rows, T tokens.

    vlm eval ct-start SRC [--ratio 1.5] [--batches 8] [--data data/default]

With every boundary on, the converted model is the source (tested exactly). What matters for
continual training is the loss once boundaries are real: here every document start plus random
tokens at rate 1/R are boundaries (the converted router is untrained, so its own choices would mean
nothing yet). Printed for the source MoE, the conversion as it is ("delta": each token keeps its own
state and adds the concept model's update) and the earlier conversion (a zero residual projection: a
chunk's tokens all get the same decoder input).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch

from data_pipelines.config import DataConfig
from data_pipelines.loader import build_loader
from data_pipelines.tokenizer import load_tokenizer
from vlm.model.config import ConvertConfig
from vlm.model.convert import convert_state, load_source, to_conceptmoe_config
from vlm.model.layers import doc_starts
from vlm.model.multimodal import ConceptMoEVLM
from vlm.model.stats import lm_loss


def random_boundaries(doc_BT: torch.Tensor, ratio: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    drawn_BT = torch.rand(doc_BT.shape, generator=g) < 1.0 / ratio
    return (drawn_BT | doc_starts(doc_BT)) & (doc_BT >= 0)


@torch.no_grad()
def start_losses(
    src_dir: str, ratio: float, batches: int, data_dir: str, seed: int = 0
) -> dict[str, float]:
    opt = ConvertConfig(target_ratio=ratio)
    sd, base, vision_cfg = load_source(src_dir, opt)
    source = ConceptMoEVLM(base, vision_cfg)
    source.load_state_dict(sd)
    model = convert_state(sd, to_conceptmoe_config(base, opt), vision_cfg)
    zero_cfg = to_conceptmoe_config(base, opt)
    zero_cfg = dataclasses.replace(
        zero_cfg, chunk=dataclasses.replace(zero_cfg.chunk, residual="linear")
    )
    zero = convert_state(sd, zero_cfg, vision_cfg)
    zero.lm.dechunk.residual.weight.zero_()
    # scored as the default run trains: answers of chats, every token of captions and text, rows
    # of 512
    cfg = DataConfig(
        default_dir=data_dir,
        split="val",
        tokenizer=str(src_dir),
        epochs=1,
        shuffle_buffer=0,
        loss_on="assistant",
        row_tokens=512,
        processor=vision_cfg.processor if vision_cfg else DataConfig().processor,
    )
    sums = dict.fromkeys(
        (
            "source MoE",
            "converted (delta)",
            "converted (zero residual)",
            "converted, all boundaries",
        ),
        0.0,
    )
    n = 0
    for i, batch in enumerate(
        itertools.islice(build_loader(cfg, load_tokenizer(src_dir)), batches)
    ):
        force = random_boundaries(batch.doc_ids, ratio, seed + i)
        sums["source MoE"] += float(lm_loss(source.eval()(batch), batch))
        sums["converted (delta)"] += float(lm_loss(model.eval()(batch, force=force), batch))
        sums["converted (zero residual)"] += float(lm_loss(zero.eval()(batch, force=force), batch))
        sums["converted, all boundaries"] += float(lm_loss(model.eval()(batch, force="all"), batch))
        n += 1
    return {k: v / max(n, 1) for k, v in sums.items()}


def run(args: argparse.Namespace) -> int:
    """`vlm eval ct-start` (its arguments are declared in eval/cli.py)."""
    from eval.preflight import default_data

    data = default_data(args.data, "vlm eval ct-start", args.build)()
    losses = start_losses(args.src, args.ratio, args.batches, str(data))
    print(
        "LM loss at the start of continual training, boundaries "
        f"at R = {args.ratio:g} ({args.batches} val batches):"
    )
    for k, v in losses.items():
        print(f"  {k:<28} {v:.4f}")
    return 0
