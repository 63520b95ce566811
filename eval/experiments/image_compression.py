"""image-compression (ConceptMoE Figure 2c, section 4.2): does the VLM see, and how hard are images
compressed? Frozen-at-random vs trained vision encoder x one joint compression target vs one per
modality x 2D-aware boundaries off/on, on the default VL config -> held-out VQA accuracy against the
blind model and the majority answer, and the realized ratio per modality in training and on the
held-out split. At a joint R = 2 the paper finds images compressed more than text."""

from __future__ import annotations

import itertools

from eval.experiments.core import Metric, Recipe, Run, Variant, better, no_worse

# Half the default's vision warm-up and 250 steps (the recipe's single-seed version ran 500 after
# the full warm-up): 16 runs (8 variants x 2 seeds) fit in 30 minutes on 2 cores.
WARMUP, WARMUP_S = 500, 100.0  # steps; calibrated seconds on one thread
METRICS = [
    Metric("vqa", "VQA %", 1),
    Metric("blind", "blind %", 1),
    Metric("majority", "majority %", 1),
    Metric("train_R_text", "R text train", 2),
    Metric("eval_R_text", "R text held-out", 2),
    Metric("train_R_image", "R image train", 2),
    Metric("eval_R_image", "R image held-out", 2),
] + [
    Metric(f"{k}_{m}_p50", f"R {m}, median {k} document (held-out)", 2)
    for k in ("chat", "caption")
    for m in ("text", "image")
]


def read(run: Run, seed_runs: dict[str, Run]) -> dict:
    """VQA vs baselines; realized ratio per modality in training (last 10 %) and held out (the VQA
    split): the aggregate, and per kind the median document's (an aggregate alone can hide
    all-or-nothing kinds)."""
    vqa = run.summary.get("vqa") or {}
    held = vqa.get("held_out_compression") or {}
    row = {
        "vqa": (vqa.get("accuracy") or {}).get("all"),
        "blind": (vqa.get("blind_baseline") or {}).get("all"),
        "majority": (vqa.get("majority_baseline") or {}).get("all"),
        "vqa_by_type": vqa.get("accuracy"),
    }
    for mod in ("text", "image"):
        row[f"train_R_{mod}"] = run.tail(f"compression/{mod}")
        row[f"eval_R_{mod}"] = ((held.get("all") or {}).get(mod) or {}).get("aggregate")
        for kind in ("chat", "caption"):
            med = ((held.get(kind) or {}).get(mod) or {}).get("p50")
            row[f"{kind}_{mod}_p50"] = None if med is None else min(med, 1e3)
    return row


def verdict(t):
    joint, default = t["trained-joint-grid_off"], t["trained-per_modality-grid_off"]
    per_kind = [
        better(
            "at a joint R = 2 images are compressed more "
            f"than text (median held-out {kind} document)",
            "image",
            joint[f"{kind}_image_p50"],
            "text",
            joint[f"{kind}_text_p50"],
            lower=False,
            digits=2,
            what="trained encoder, joint target",
        )
        for kind in ("chat", "caption")
    ]
    return [
        *per_kind,
        better(
            "at a joint R = 2 images are compressed more than text (held-out aggregate)",
            "image",
            joint["eval_R_image"],
            "text",
            joint["eval_R_text"],
            lower=False,
            digits=2,
            what="trained encoder, joint target",
            core=False,
        ),
        better(
            "the VLM answers from the image: VQA above the blind model",
            "VQA",
            default["vqa"],
            "blind",
            default["blind"],
            lower=False,
            digits=1,
            what="trained encoder, per-modality targets",
        ),
        no_worse(
            "a frozen random encoder answers no better than blind",
            "blind",
            t["frozen-per_modality-grid_off"]["blind"],
            "VQA",
            t["frozen-per_modality-grid_off"]["vqa"],
            lower=False,
            digits=1,
            core=False,
        ),
    ]


def recipe() -> Recipe:
    # a frozen encoder stays at its random init (no warm-up: it would train it); a trained one gets
    # the default's warm-up and then trains on with the LLM, whose LM loss is what can pull an image
    # into one concept
    vision = {
        "frozen": ["vision.freeze_encoder=true", "vision_warmup.steps=0"],
        "trained": [
            "vision.freeze_encoder=false",
            f"vision_warmup.steps={WARMUP}",
            "vision_warmup.freeze_after=false",
        ],
    }
    targets = {
        "joint R=2": ["model.chunk.modality_target_ratios=null", "model.chunk.target_ratio=2"],
        "text 2 / image 2": ["model.chunk.modality_target_ratios={text: 2, image: 2}"],
    }
    grid = {
        "off": ["model.chunk.grid_aware_boundaries=false"],
        "on": ["model.chunk.grid_aware_boundaries=true"],
    }
    variants = []
    for (v, vo), (t, to), (g, go) in itertools.product(
        vision.items(), targets.items(), grid.items()
    ):
        name = f"{v}-{'joint' if t.startswith('joint') else 'per_modality'}-grid_{g}"
        variants.append(
            Variant(
                name,
                vo + to + go,
                {"vision encoder": v, "targets": t, "2D-aware": g},
                extra_s=0.0 if v == "frozen" else WARMUP_S,
            )
        )
    return Recipe(
        "image-compression",
        "ConceptMoE Figure 2c",
        "at a joint R = 2 images are compressed more than text; and "
        "the VLM answers from the image (VQA above the blind model)",
        "default.yaml",
        variants,
        METRICS,
        read,
        verdict,
        steps=250,
        held_out="VQA exact match % on the held-out test split (eval mode); R = tokens per concept, "
        "train = last 10 % of steps (sampled boundaries), held-out = the VQA split in eval mode",
        seeds=2,
        common=["train.vqa_max_samples=400"],
        evals=3,
        step_s=0.43,
        startup_s=32,
    )
