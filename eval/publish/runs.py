"""Tables from a run's summary.json / vqa.json (as the trainer writes them) and from the default's
three seeds (recorded in the same schema), and the README's results-at-a-glance table that cites
them all."""

from __future__ import annotations

import re
from typing import Any

from eval.publish import bench
from eval.publish.markdown import num, span, table
from eval.publish.recorded import lookup

SEEDS = "docs/results/data/recorded/default_seeds.json"
RUN = "docs/results/data/default_run/"
RUN_SUMMARY, RUN_VQA = RUN + "summary.json", RUN + "vqa.json"
BATCH_LOSS = "docs/results/data/recorded/batch_loss_default.json"
IMAGE_RUNS = "docs/results/data/recorded/image_runs.json"
CLAIMS = "docs/results/data/recorded/claims.json"
SCALING = "docs/results/data/recorded/scaling_fit.json"
KIND_LABELS = (
    ("prompt", "VQA prompt"),
    ("chat", "VQA sample"),
    ("caption", "caption"),
    ("interleaved", "interleaved"),
    ("text", "text document"),
)
VQA_TYPES = (
    ("colour", "colour"),
    ("count", "count"),
    ("position", "position"),
    ("shape", "shape"),
    ("yesno", "yes/no"),
    ("all", "all"),
)


def seeds(src: dict[str, Any]) -> list[dict[str, Any]]:
    got = src[SEEDS]["seeds"]
    return [got[k] for k in sorted(got, key=int)]


def doc_stats(run: dict[str, Any], kind: str, modality: str) -> dict[str, float] | None:
    """p10 / p50 / p90 of one kind's held-out documents; `prompt` is the VQA prompt alone."""
    held_out = run["held_out_compression"]
    by_kind = run["prompt_compression"] if kind == "prompt" else held_out.get(kind, {})
    return by_kind.get(modality)


def medians(runs: list[dict[str, Any]]) -> list[float]:
    """Every kind's and modality's median document over the runs."""
    return [
        s["p50"]
        for run in runs
        for kind, _ in KIND_LABELS
        for mod in ("text", "image")
        if (s := doc_stats(run, kind, mod))
    ]


def readme_compression(src: dict[str, Any]) -> str:
    """Per kind: the median document per seed, and the 10th-90th percentile span over all seeds."""
    runs = seeds(src)
    n_prompts = runs[0]["prompt_compression"]["text"]["docs"]
    labels = {
        "prompt": f"VQA prompt, as chat and the demo prefill it ({n_prompts} per seed)",
        "chat": "VQA sample with its answer",
        "caption": "caption",
        "interleaved": "interleaved document",
        "text": "text document",
    }
    rows = []
    for kind, _ in KIND_LABELS:
        cells = [labels[kind]]
        for mod in ("text", "image"):
            got = [doc_stats(run, kind, mod) for run in runs]
            if any(g is None for g in got):
                cells.append("-")
                continue
            lo, hi = min(g["p10"] for g in got), max(g["p90"] for g in got)
            cells.append(
                " / ".join(num(g["p50"], 2) for g in got) + f" ({num(lo, 2)}-{num(hi, 2)})"
            )
        rows.append(cells)
    return table(["kind of sample", "text: median (p10-p90)", "image: median (p10-p90)"], rows)


def seeds_compression(src: dict[str, Any]) -> str:
    """docs/results/compression.md: median (p10-p90) per kind and modality, one column per seed,
    and the aggregates."""
    runs = seeds(src)
    rows = []
    for kind, label in KIND_LABELS:
        for mod in ("text", "image"):
            got = [doc_stats(run, kind, mod) for run in runs]
            if any(g is None for g in got):
                continue
            name = label if kind == "text" else f"{label}, {mod}"
            rows.append(
                [
                    name,
                    *(f"{num(g['p50'], 2)} ({num(g['p10'], 2)}-{num(g['p90'], 2)})" for g in got),
                ]
            )
    agg = [run["held_out_compression"]["all"] for run in runs]
    rows.append(
        [
            "aggregate over all held-out documents, text / image",
            *(f"{num(a['text']['aggregate'], 2)} / {num(a['image']['aggregate'], 2)}" for a in agg),
        ]
    )
    return table(
        ["kind, modality", *(f"seed {k}" for k in sorted(src[SEEDS]["seeds"], key=int))], rows
    )


def seeds_vqa(src: dict[str, Any]) -> str:
    """docs/results/compression.md: held-out VQA per question type, model / majority answer / blind
    model, per seed."""
    runs = seeds(src)
    rows = []
    for key, label in VQA_TYPES:
        cells = []
        for run in runs:
            v = run["vqa"]
            model = num(v["accuracy"][key], 1)
            cells.append(
                f"{f'**{model}**' if key == 'all' else model} / "
                f"{num(v['majority_baseline'][key], 1)} / {num(v['blind_baseline'][key], 1)}"
            )
        rows.append([label, *cells])
    return table(["type", *(f"seed {k}" for k in sorted(src[SEEDS]["seeds"], key=int))], rows)


def seeds_vqa_prose(src: dict[str, Any]) -> str:
    """The README's sentence on the seeds' VQA: model per seed, the majority answer, the blind model
    per seed."""
    runs = [run["vqa"] for run in seeds(src)]
    majority = {num(v["majority_baseline"]["all"], 1) for v in runs}
    return (
        " / ".join(num(v["accuracy"]["all"], 1) for v in runs)
        + f" % against {'/'.join(majority)} % for the majority answer and "
        + " / ".join(num(v["blind_baseline"]["all"], 1) for v in runs)
        + " %"
    )


def readme_results(src: dict[str, Any]) -> str:
    """Results at a glance: one row per headline, each figure from the JSON its
    page's table reads."""
    runs = seeds(src)
    vqa = [run["vqa"] for run in runs]
    run_vqa, run_s = src[RUN_VQA], src[RUN_SUMMARY]
    default = (
        f"the default run (`vlm train` on configs/default.yaml, 2 threads: {run_s['steps']} steps "
        f"in {num(run_s['wall_s'] / 60, 1)} min, held-out VQA "
        f"{num(run_vqa['accuracy']['all'], 1)} % against "
        f"{num(run_vqa['blind_baseline']['all'], 1)} % blind; seeds 0 / 1 / 2 on one thread each)"
    )
    seeds_cell = (
        f"held-out VQA {' / '.join(num(v['accuracy']['all'], 1) for v in vqa)} % "
        f"against {num(vqa[0]['majority_baseline']['all'], 1)} % for the majority "
        f"answer and {span((v['blind_baseline']['all'] for v in vqa), 1)} % for "
        "the blind model; every kind of sample's median document at "
        f"{span(medians(runs), 1)} tokens per concept in both modalities"
    )
    img, batch = src[IMAGE_RUNS], src[BATCH_LOSS]
    before = [
        lookup(img, "**the default**", "all"),
        *lookup(img, "the default, `train.seed=1`", "all"),
    ]
    chat_img = lookup(batch, "VQA chat", "image tokens per concept")
    chat_txt = lookup(batch, "VQA chat", "text tokens per concept")
    model, decode = src[bench.MODEL], src[bench.DECODE]
    claim = src[CLAIMS]["rows"][0]
    m = re.search(
        r"dynamic ([\d.]+) \(.*?\) < fixed ([\d.]+) .*?x (\d+) seeds.*?median ([\d.]+)", claim[1]
    )
    rows = [
        [default, seeds_cell, "[compression](docs/results/compression.md)"],
        [
            "the default before per-document ratio bands",
            (
                f"held-out VQA {' / '.join(num(x, 1) for x in before)} %, "
                f"but VQA prompts compressed {num(chat_img, 2)} (image) / "
                f"{num(chat_txt, 2)} (text) and captions merged whole"
            ),
            "[images](docs/results/images.md)",
        ],
        [
            "prefill at 16K tokens, best reallocation vs the MoE baseline",
            (
                f"{bench.ratio(bench.best(model, 'prefill', 16384)[1])} tokens/s "
                f"({bench.above_limit_pct(model)} % above the attention-bound limit)"
            ),
            "[benchmarks](docs/benchmarks.md)",
        ],
        [
            "training step at 4K tokens",
            f"{bench.ratio(bench.best(model, 'train', 4096)[1])} tokens/s",
            "[benchmarks](docs/benchmarks.md)",
        ],
        [
            "decode KV bytes per sequence (more experts)",
            f"{num(bench.kv_ratio(decode, 'more_experts'), 3)}x the baseline's",
            "[benchmarks](docs/benchmarks.md)",
        ],
        [
            "learned boundaries vs a boundary every 2 tokens",
            (
                f"held-out loss {m[1]} < {m[2]} ({m[3]} seeds), median document {m[4]} tokens "
                f"per concept: {claim[2]}; most other paper claims inconclusive at this scale"
            ),
            "[claims](docs/results/claims.md)",
        ],
        [
            "the compression-aware scaling law (DLCM eq. 22)",
            (
                f"fitted over {src[SCALING]['points']} runs; at this "
                "scale the sweep exercises the machinery, not the law"
            ),
            "[scaling](docs/results/scaling.md)",
        ],
    ]
    return table(["what", "result", "details"], rows)
