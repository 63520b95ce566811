"""nope-middle (Synergy 3.3, Table 1): the concept (middle) model works best without positional encoding."""

from __future__ import annotations

from eval.experiments.core import Metric, Recipe, Run, Variant, better
from eval.experiments.text import HELD_OUT, TEXT_CONFIG, TRAIN_LOSS, VAL_LOSS, VAL_R, losses

BPB = Metric("val_bpb", "held-out bits per byte")


def read(run: Run, seed_runs: dict[str, Run]) -> dict:
    return {**losses(run), "val_bpb": run.last_val("bpb/text")}


def verdict(t):
    return [
        better(
            "held-out bits per byte: no positions in the concept model < RoPE",
            "none",
            t["none"]["val_bpb"],
            "rope",
            t["rope"]["val_bpb"],
        )
    ]


def recipe() -> Recipe:
    return Recipe(
        "nope-middle",
        "Synergy 3.3",
        "no positional encoding in the concept (middle) "
        "model beats RoPE there (encoder/decoder keep RoPE)",
        TEXT_CONFIG,
        [
            Variant("rope", ["model.concept_pos=rope"], {"concept positions": "RoPE"}),
            Variant("none", ["model.concept_pos=none"], {"concept positions": "none"}),
        ],
        [BPB, VAL_LOSS, TRAIN_LOSS, VAL_R],
        read,
        verdict,
        steps=1500,
        held_out=HELD_OUT,
        seeds=4,
        common=["model.chunk.target_ratio=2"],
    )
