"""ct-conversion (ConceptMoE 4.3, Figure 3): a pretrained MoE converted into a ConceptMoE starts
where the MoE is (the conversion loses nothing), and continual training (CT) with the freed FLOPs
spent on concept-layer loops beats spending them on more activated experts, at matched FLOPs.

Per seed: a MoE is pretrained from scratch (source, 1x steps), then three CT runs of half as many
steps start from it with everything else equal: the MoE itself (moe), its conversion at R = 2 with 4
instead of 2 activated concept experts (topk, strategy 1), and with 3 activated concept experts plus
one looped middle concept layer (loop, strategy 2; the paper's top11-loop8 at R = 1.5). Step-0 loss
= the first step's LM loss, i.e. the model before any CT update, on the first training batch (the
same batch in every CT run of a seed; conversions draw real boundaries from the fresh chunk module).
A one-step run of the conversion alone (no reallocation) gives the conversion's own step-0 gap.
(With every boundary forced on the conversion reproduces the source exactly:
tests/test_convert.py.)"""

from __future__ import annotations

from eval.experiments.core import Metric, Recipe, Run, Variant, at_most, better, no_worse
from eval.experiments.text import (
    HELD_OUT,
    TEXT_CONFIG,
    TRAIN_LOSS,
    VAL_LOSS,
    VAL_R,
    flops_vs,
    losses,
)

RATIO = 2.0
CONCEPT_LAYERS = 4
LOSSLESS_TOL = 0.05  # nats: "lossless at init" when the step-0 gap is at most this
METRICS = [
    Metric("step0", "step-0 loss"),
    Metric("step0_gap", "step-0 gap to the MoE"),
    VAL_LOSS,
    TRAIN_LOSS,
    VAL_R,
    Metric("flops", "FLOPs/token vs MoE"),
]


def read(run: Run, seed_runs: dict[str, Run]) -> dict:
    row = losses(run)
    row["step0"] = run.first("loss/lm")
    moe, src = seed_runs.get("moe"), seed_runs.get("source")
    ct = moe is not None and run.path != src.path and row["step0"] is not None
    # the source starts from scratch
    row["step0_gap"] = row["step0"] - moe.first("loss/lm") if ct else None
    row["flops"] = flops_vs(run, src, RATIO) if src is not None else None
    # one step: only its start means anything
    if run.path == getattr(seed_runs.get("convert"), "path", None):
        row = {k: (v if k in ("step0", "step0_gap", "flops") else None) for k, v in row.items()}
    return row


def verdict(t):
    return [
        at_most(
            "lossless at init: the converted MoE's step-0 "
            f"loss within {LOSSLESS_TOL:g} of the MoE's",
            "step-0 gap",
            t["convert"]["step0_gap"],
            LOSSLESS_TOL,
        ),
        at_most(
            f"the top-k conversion's step-0 loss within {LOSSLESS_TOL:g} of the MoE's",
            "step-0 gap",
            t["topk"]["step0_gap"],
            LOSSLESS_TOL,
            core=False,
        ),
        better(
            "after CT, loops beat more experts at matched FLOPs (held-out loss)",
            "top-k + loop",
            t["loop"]["val_loss"],
            "top-k",
            t["topk"]["val_loss"],
        ),
        no_worse(
            "after CT, the top-k conversion is no worse "
            "than the MoE trained as long (held-out loss)",
            "top-k",
            t["topk"]["val_loss"],
            "MoE",
            t["moe"]["val_loss"],
        ),
    ]


def recipe() -> Recipe:
    src = "{run:source}"
    ct = ["train.stage=ct", f"train.convert_from={src}/final", f"convert.target_ratio={RATIO}"]
    half = 0.5
    return Recipe(
        "ct-conversion",
        "ConceptMoE 4.3",
        "MoE -> ConceptMoE conversion is lossless at init; in "
        "continual training, loops beat more experts at matched FLOPs",
        TEXT_CONFIG,
        [
            Variant(
                "source",
                ["model.chunk.enabled=false"],
                {"run": "MoE pretrained from scratch (1x steps)"},
            ),
            Variant(
                "moe",
                ["model.chunk.enabled=false", f"train.init_from={src}"],
                {"run": "CT: the MoE, trained on (0.5x)"},
                after="source",
                steps_mult=half,
            ),
            Variant(
                "convert",
                ct,
                {"run": "converted as it is (no reallocation), one step: its start"},
                after="source",
                steps_mult=1e-9,
            ),
            Variant(
                "topk",
                [*ct, "convert.concept_top_k=4"],
                {"run": "CT: converted, concept top-k 2 -> 4"},
                after="source",
                steps_mult=half,
                cost=1.1,
            ),
            Variant(
                "loop",
                [*ct, "convert.concept_top_k=3", "convert.loop=[1,2,1]"],
                {"run": "CT: converted, top-k 2 -> 3 + loop concept layer 1"},
                after="source",
                steps_mult=half,
                cost=1.1,
            ),
        ],
        METRICS,
        read,
        verdict,
        steps=2000,
        held_out=HELD_OUT,
        seeds=3,
        common=[f"model.concept_layers={CONCEPT_LAYERS}"],
        note=f"R = {RATIO:g}; FLOPs at the target R; a CT run's model is the converted "
        "architecture of its config.yaml; the source row is the pretrained MoE before CT",
    )
