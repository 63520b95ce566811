"""router (ConceptMoE 4.5.3): the cosine router (eq. 2) generalizes better than a linear one,
although the linear one reaches a lower training loss."""

from __future__ import annotations

from eval.experiments.core import Recipe, Run, Variant, better
from eval.experiments.text import (
    HELD_OUT,
    TEXT_CONFIG,
    TRAIN_LOSS,
    TRAIN_R,
    VAL_LOSS,
    VAL_R,
    losses,
)


def read(run: Run, seed_runs: dict[str, Run]) -> dict:
    return losses(run)


def verdict(t):
    return [
        better(
            "held-out loss: cosine < linear",
            "cosine",
            t["cosine"]["val_loss"],
            "linear",
            t["linear"]["val_loss"],
        ),
        better(
            "train loss: linear <= cosine (the paper's 'though not on train loss')",
            "linear",
            t["linear"]["train_loss"],
            "cosine",
            t["cosine"]["train_loss"],
            core=False,
        ),
    ]


def recipe() -> Recipe:
    return Recipe(
        "router",
        "ConceptMoE 4.5.3",
        "the cosine router beats a linear router on held-out loss, though not on training loss",
        TEXT_CONFIG,
        [
            Variant("cosine", ["model.chunk.router=cosine"], {"router": "cosine (eq. 2)"}),
            Variant("linear", ["model.chunk.router=linear"], {"router": "linear"}),
        ],
        [VAL_LOSS, TRAIN_LOSS, VAL_R, TRAIN_R],
        read,
        verdict,
        steps=1500,
        held_out=HELD_OUT,
        seeds=4,
        common=["model.chunk.target_ratio=2"],
    )
