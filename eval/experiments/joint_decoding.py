"""joint-decoding (ConceptMoE 4.5.4): decoding from tokens and concepts jointly (eq. 11) helps held-out loss."""

from __future__ import annotations

from eval.experiments.core import Recipe, Run, Variant, better
from eval.experiments.text import HELD_OUT, TEXT_CONFIG, TRAIN_LOSS, VAL_LOSS, VAL_R, losses


def read(run: Run, seed_runs: dict[str, Run]) -> dict:
    return losses(run)


def verdict(t):
    return [
        better(
            "held-out loss: with joint decoding < without",
            "with",
            t["joint"]["val_loss"],
            "without",
            t["none"]["val_loss"],
        ),
        better(
            "train loss: without <= with (the paper's train-eval discrepancy)",
            "without",
            t["none"]["train_loss"],
            "with",
            t["joint"]["train_loss"],
            core=False,
        ),
    ]


def recipe() -> Recipe:
    return Recipe(
        "joint-decoding",
        "ConceptMoE 4.5.4",
        "joint decoding of concepts and tokens lowers held-out loss",
        TEXT_CONFIG,
        [
            Variant(
                "joint",
                ["model.chunk.joint_decoding_layers=-1"],
                {"joint decoding": "all decoder layers"},
            ),
            Variant("none", ["model.chunk.joint_decoding_layers=0"], {"joint decoding": "off"}),
        ],
        [VAL_LOSS, TRAIN_LOSS, VAL_R],
        read,
        verdict,
        steps=1500,
        held_out=HELD_OUT,
        seeds=4,
        common=["model.chunk.target_ratio=2"],
    )
