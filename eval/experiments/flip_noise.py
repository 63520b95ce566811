"""flip-noise (ConceptMoE 4.6): noise on the training boundaries (eq. 5-6's Bernoulli draw on the
sharpened p, or Gaussian noise on p) keeps the compression held out near the one in training and the
mean p near 1/R, where training with the eval-mode threshold lets p crowd around 0.5 and the
held-out compression drift. Target R = 1.5, as in the paper."""

from __future__ import annotations

from eval.experiments.core import Metric, Recipe, Run, Variant, better
from eval.experiments.text import (
    HELD_OUT,
    TEXT_CONFIG,
    TRAIN_R,
    TRAIN_R_DOC,
    VAL_LOSS,
    VAL_R,
    VAL_R_DOC,
    losses,
)

RATIO = 1.5
METRICS = [
    *VAL_R_DOC,
    Metric("train_R_p50", TRAIN_R_DOC.label, 2, ref=RATIO),
    Metric("R_drift_doc", "|held-out R - train R|, median document", 3),
    Metric("train_R", TRAIN_R.label, 2, ref=RATIO),
    Metric("val_R", VAL_R.label, 2, ref=RATIO),
    Metric("R_drift", "|held-out R - train R| (aggregate)", 3),
    Metric("mean_p", "mean p (train)", 3, ref=1 / RATIO),
    Metric("p_gap", f"|mean p - 1/R| (1/R = {1 / RATIO:.3f})", 3),
    VAL_LOSS,
]


def read(run: Run, seed_runs: dict[str, Run]) -> dict:
    row = losses(run)
    p = run.tail("boundary_p/all")
    row["mean_p"] = p
    row["p_gap"] = abs(p - 1 / RATIO) if p is not None else None
    ok = row["val_R"] is not None and row["train_R"] is not None
    row["R_drift"] = abs(row["val_R"] - row["train_R"]) if ok else None
    ok = row["val_R_p50"] is not None and row["train_R_p50"] is not None
    row["R_drift_doc"] = abs(row["val_R_p50"] - row["train_R_p50"]) if ok else None
    return row


def verdict(t):
    out = []
    for name, core in (("tau6", True), ("gaussian", False), ("tau4", False)):
        out.append(
            better(
                f"|held-out R - train R| of the median document: {name} < no noise",
                name,
                t[name]["R_drift_doc"],
                "none",
                t["none"]["R_drift_doc"],
                core=core,
            )
        )
        out.append(
            better(
                f"|held-out R - train R| (aggregate): {name} < no noise",
                name,
                t[name]["R_drift"],
                "none",
                t["none"]["R_drift"],
                core=False,
            )
        )
        out.append(
            better(
                f"|mean p - 1/R|: {name} < no noise",
                name,
                t[name]["p_gap"],
                "none",
                t["none"]["p_gap"],
                core=core,
            )
        )
    return out


def recipe() -> Recipe:
    return Recipe(
        "flip-noise",
        "ConceptMoE 4.6",
        "with tau = 6 Bernoulli boundary noise the held-out R stays near the "
        f"training R and the mean p near 1/R (R = {RATIO:g}), unlike training "
        "without noise; Gaussian noise (sigma 0.1) and tau = 4 for comparison",
        TEXT_CONFIG,
        [
            Variant(
                "none",
                ["model.chunk.boundary_noise=none"],
                {"training boundaries": "p >= 0.5 (no noise)"},
            ),
            Variant(
                "gaussian",
                ["model.chunk.boundary_noise=gaussian", "model.chunk.noise_sigma=0.1"],
                {"training boundaries": "p + N(0, 0.1) >= 0.5"},
            ),
            Variant(
                "tau4",
                ["model.chunk.boundary_noise=bernoulli", "model.chunk.tau=4"],
                {"training boundaries": "Bernoulli, tau = 4"},
            ),
            Variant(
                "tau6",
                ["model.chunk.boundary_noise=bernoulli", "model.chunk.tau=6"],
                {"training boundaries": "Bernoulli, tau = 6"},
            ),
        ],
        METRICS,
        read,
        verdict,
        steps=1200,
        held_out=HELD_OUT,
        seeds=3,
        common=[f"model.chunk.target_ratio={RATIO}"],
    )
