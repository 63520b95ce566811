"""global-parser (DLCM 3.3.3, 8.2, Table 4): ratio-loss statistics over the whole global batch (all
micro-batches and ranks) keep the realized compression near the target; statistics per micro-batch
drift low.

The same global batch (4 rows of 256 tokens per optimizer step) is split three ways: one micro-batch
(there the local statistics are the global ones), 4 micro-batches of gradient accumulation, 2
data-parallel ranks (gloo, the launcher of tests/test_train_distributed.py). Target R = 4, as in
Table 4."""

from __future__ import annotations

from eval.experiments.core import Metric, Recipe, Run, Variant, at_most, better
from eval.experiments.text import HELD_OUT, TEXT_CONFIG, TRAIN_R, VAL_LOSS, VAL_R, VAL_R_DOC, losses

RATIO = 4.0
PER_BATCH = "train.global_parser=false"  # each micro-batch's (rank's) own statistics
METRICS = [
    *VAL_R_DOC,
    Metric("R_gap_doc", f"|held-out R - {RATIO:g}|, median document", 2),
    Metric("val_R", VAL_R.label, 2, ref=RATIO),
    Metric("train_R", TRAIN_R.label, 2, ref=RATIO),
    Metric("R_gap", f"|held-out R - {RATIO:g}| (aggregate)", 2),
    VAL_LOSS,
]


def read(run: Run, seed_runs: dict[str, Run]) -> dict:
    row = losses(run)
    row["R_gap"] = abs(row["val_R"] - RATIO) if row["val_R"] is not None else None
    row["R_gap_doc"] = abs(row["val_R_p50"] - RATIO) if row["val_R_p50"] is not None else None
    return row


def verdict(t):
    out = []
    for lay in ("4mb", "2ranks"):
        g, p = t[f"global-{lay}"], t[f"local-{lay}"]
        out.append(
            better(
                f"{lay}: global statistics keep the median held-out "
                f"document's R closer to {RATIO:g} than per-batch ones",
                "global",
                g["R_gap_doc"],
                "per-batch",
                p["R_gap_doc"],
                digits=2,
                what=f"|R - {RATIO:g}|, median document",
            )
        )
        out.append(
            better(
                f"{lay}: ... and the aggregate held-out R",
                "global",
                g["R_gap"],
                "per-batch",
                p["R_gap"],
                digits=2,
                what=f"|R - {RATIO:g}|, aggregate",
                core=False,
            )
        )
        out.append(
            at_most(
                f"{lay}: per-batch statistics drift below the target (median document)",
                "per-batch R",
                p["val_R_p50"],
                RATIO,
                digits=2,
                core=False,
            )
        )
    return out


def recipe() -> Recipe:
    one = ["data.rows_per_batch=4", "optim.grad_accum=1"]
    four = ["data.rows_per_batch=1", "optim.grad_accum=4"]
    two = ["data.rows_per_batch=2", "optim.grad_accum=1"]
    lab = lambda s, lay: {"statistics": s, "layout": lay}  # noqa: E731
    return Recipe(
        "global-parser",
        "DLCM Table 4",
        "global ratio-loss statistics keep the realized R near the "
        f"target (R = {RATIO:g}); per-batch statistics drift low",
        TEXT_CONFIG,
        [
            Variant("1mb", one, lab("global = local", "1 micro-batch x 4 rows")),
            Variant("global-4mb", four, lab("global", "4 micro-batches x 1 row"), cost=2.0),
            Variant(
                "local-4mb",
                [*four, PER_BATCH],
                lab("per micro-batch", "4 micro-batches x 1 row"),
                cost=1.5,
            ),
            Variant("global-2ranks", two, lab("global", "2 ranks x 2 rows"), ranks=2, cost=0.6),
            Variant(
                "local-2ranks",
                [*two, PER_BATCH],
                lab("per rank", "2 ranks x 2 rows"),
                ranks=2,
                cost=0.6,
            ),
        ],
        METRICS,
        read,
        verdict,
        steps=1200,
        held_out=HELD_OUT,
        seeds=2,
        common=[f"model.chunk.target_ratio={RATIO}"],
    )
