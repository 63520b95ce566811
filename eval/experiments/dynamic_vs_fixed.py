"""dynamic-vs-fixed (ConceptMoE 4.5.2): learned boundaries beat a boundary every R tokens, and no
chunking, when the chunked models get the MoE's per-token FLOPs back (section 3.5, strategy 1: more
activated concept experts)."""

from __future__ import annotations

from eval.experiments.core import Metric, Recipe, Run, Variant, better
from eval.experiments.text import (
    HELD_OUT,
    TEXT_CONFIG,
    TRAIN_LOSS,
    VAL_LOSS,
    VAL_R,
    VAL_R_DOC,
    flops_vs,
    losses,
    matched_overrides,
)

RATIO = 2.0
FLOPS = Metric("flops", "FLOPs/token vs MoE", 3)


def read(run: Run, seed_runs: dict[str, Run]) -> dict:
    row = losses(run)
    row["flops"] = flops_vs(run, seed_runs["moe"], RATIO) if "moe" in seed_runs else None
    return row


def verdict(t):
    c = "held-out loss: dynamic < fixed"
    return [
        better(c, "dynamic", t["dynamic"]["val_loss"], "fixed", t["fixed"]["val_loss"]),
        better(
            "held-out loss: dynamic < MoE (no chunking)",
            "dynamic",
            t["dynamic"]["val_loss"],
            "MoE",
            t["moe"]["val_loss"],
        ),
        better(
            "held-out loss: fixed worse than MoE",
            "MoE",
            t["moe"]["val_loss"],
            "fixed",
            t["fixed"]["val_loss"],
            core=False,
        ),
    ]


def recipe() -> Recipe:
    common = [f"model.chunk.target_ratio={RATIO}"]
    matched, how = matched_overrides(common, RATIO)
    return Recipe(
        "dynamic-vs-fixed",
        "ConceptMoE 4.5.2",
        "learned (dynamic) boundaries beat a boundary every R = "
        f"{RATIO:g} tokens (fixed) and no chunking (MoE) at matched FLOPs",
        TEXT_CONFIG,
        [
            Variant("moe", ["model.chunk.enabled=false"], {"chunking": "none (MoE)"}),
            Variant(
                "fixed",
                [*matched, "model.chunk.router=fixed"],
                {"chunking": f"fixed, every {RATIO:g} tokens"},
            ),
            Variant(
                "dynamic",
                [*matched, "model.chunk.router=cosine"],
                {"chunking": "dynamic (cosine router)"},
            ),
        ],
        [VAL_LOSS, TRAIN_LOSS, VAL_R, *VAL_R_DOC, FLOPS],
        read,
        verdict,
        steps=1500,
        held_out=HELD_OUT,
        seeds=3,
        common=common,
        note=f"chunked variants reallocated: {how} (FLOPs at the target R)",
    )
