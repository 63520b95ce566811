"""End-of-run picture (RUN_DIR/report.png) and console summary, both from metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vlm.model.config import ChunkConfig, resolve_targets
from vlm.model.doc_stats import MODS, format_distribution


def _series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    if not pts:
        return np.zeros(0), np.zeros(0)
    s, v = zip(*pts)
    return np.asarray(s), np.asarray(v, dtype=float)


def _smooth(v: np.ndarray, k: int) -> np.ndarray:
    if len(v) < 3 or k <= 1:
        return v
    k = min(k, len(v))
    c = np.cumsum(np.insert(v, 0, 0.0))
    head = c[1:k] / np.arange(1, k)
    return np.concatenate([head, (c[k:] - c[:-k]) / k])


def write_report(
    records: list[dict], out: Path, targets: dict[str, float], title: str = ""
) -> Path | None:
    """Four panels: loss by sample kind; the batch's compression ratio per modality vs target; the
    documents' ratio per kind of sample (median, p10-p90 band); mean p per modality vs 1/R."""
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = max(len(records) // 30, 1)
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.5))
    ax = axes[0]
    for key, label in (
        ("loss/lm", "LM loss (all)"),
        ("loss/text_only", "text-only samples"),
        ("loss/image_text", "image-text samples"),
        ("val/loss/lm", "held-out"),
    ):
        s, v = _series(records, key)
        if len(s):
            ax.plot(
                s,
                v if key.startswith("val/") else _smooth(v, k),
                label=label,
                marker="o" if key.startswith("val/") else None,
            )
    ax.set_xlabel("step"), ax.set_ylabel("loss (nats/token)"), ax.set_title("loss by sample kind")
    ax.legend()
    colours = {"ratio": "k", "text": "tab:blue", "image": "tab:orange"}
    ax = axes[1]
    spans = []
    for mod in ("ratio", "text", "image"):
        s, v = _series(records, f"compression/{mod}")
        if len(s):
            ax.plot(
                s,
                _smooth(v, k),
                color=colours[mod],
                label=f"{'all' if mod == 'ratio' else mod} tokens (train)",
            )
            spans.append(v[v > 0])
        s, v = _series(records, f"val/compression/{mod}")
        if len(s):
            ax.plot(
                s,
                v,
                color=colours[mod],
                ls="none",
                marker="o",
                label=f"{'all' if mod == 'ratio' else mod} (eval)",
            )
            spans.append(v[v > 0])
    for name, tgt in targets.items():
        if name.startswith("ratio"):
            mod = name.split("/")[-1] if "/" in name else "ratio"
            ax.axhline(
                tgt,
                ls="--",
                color=colours.get(mod, "gray"),
                label=f"target R ({mod if mod != 'ratio' else 'joint'})",
            )
    span = np.concatenate(spans) if spans else np.zeros(0)
    # e.g. whole images merged early in a run
    if len(span) and span.max() / max(span.min(), 1e-9) > 10:
        ax.set_yscale("log")
    (
        ax.set_xlabel("step"),
        ax.set_ylabel("tokens per concept"),
        ax.set_title("realized compression N/M"),
    )
    ax.legend()
    ax = axes[2]
    kind_colours = {
        "chat": "tab:green",
        "caption": "tab:purple",
        "interleaved": "tab:brown",
        "text": "tab:blue",
    }
    drew = False
    for kind, c in kind_colours.items():
        for mod, ls in (("text", "-"), ("image", "--")):
            key = f"doc_ratio/{kind}/{mod}"
            # null quantile = no concept: drawn at 100
            recs = [r for r in records if f"{key}/docs" in r]
            if not recs:
                continue
            s = np.asarray([r["step"] for r in recs])
            lo, mid, hi = (
                np.asarray(
                    [
                        100.0 if r.get(f"{key}/{q}") is None else min(r[f"{key}/{q}"], 100.0)
                        for r in recs
                    ]
                )
                for q in ("p10", "p50", "p90")
            )
            ax.plot(s, _smooth(mid, k), color=c, ls=ls, label=f"{kind} {mod}")
            ax.fill_between(s, _smooth(lo, k), _smooth(hi, k), color=c, alpha=0.12)
            drew = True
    for name, tgt in targets.items():
        if name.startswith("ratio"):
            ax.axhline(tgt, ls=":", color="gray")
    if drew:
        ax.set_yscale("log")
        ax.legend(fontsize=7, ncol=2)
    ax.set_xlabel("step"), ax.set_ylabel("tokens per concept (one document)")
    ax.set_title("per document, by kind: median, p10-p90 (train)")
    ax = axes[3]
    for mod in ("all", "text", "image"):
        s, v = _series(records, f"boundary_p/{mod}")
        if len(s):
            ax.plot(
                s,
                _smooth(v, k),
                color=colours["ratio" if mod == "all" else mod],
                label=f"mean p ({mod})",
            )
    for name, tgt in targets.items():
        if name.startswith("ratio"):
            mod = name.split("/")[-1] if "/" in name else "ratio"
            ax.axhline(
                1.0 / tgt,
                ls="--",
                color=colours.get(mod, "gray"),
                label=f"1/R ({mod if mod != 'ratio' else 'joint'})",
            )
    (
        ax.set_xlabel("step"),
        ax.set_ylabel("mean boundary probability"),
        ax.set_title("mean p vs target"),
    )
    ax.set_ylim(0, 1)
    ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _tail_mean(records: list[dict], key: str, frac: float = 0.1) -> float | None:
    vals = [r[key] for r in records if r.get(key) is not None]
    if not vals:
        return None
    n = max(int(len(vals) * frac), 1)
    return float(np.mean(vals[-n:]))


def train_distribution(records: list[dict]) -> dict:
    """{kind: {modality: {p10, p50, p90, docs, no_concept}}} from the last record that has per-document figures."""
    for r in reversed(records):
        keys = [k for k in r if k.startswith("doc_ratio/")]
        if not keys:
            continue
        out: dict = {}
        for k in keys:
            # a source's name may hold slashes
            group, mod, stat = k[len("doc_ratio/") :].rsplit("/", 2)
            if mod in MODS:
                v = r[k]
                out.setdefault(group, {}).setdefault(mod, {})[stat] = (
                    float("inf") if v is None else v
                )
        return {
            g: {
                m: st
                for m, st in per.items()
                if {"p10", "p50", "p90", "docs", "no_concept"} <= set(st)
            }
            for g, per in out.items()
        }
    return {}


def summary_lines(
    records: list[dict],
    targets: dict[str, float],
    vqa: dict | None,
    run_dir: Path,
    wall_s: float,
    skipped_steps: int,
    data_counters: dict | None,
    warmup: dict | None = None,
) -> list[str]:
    """Human-readable end-of-run summary (means over the last 10 % of steps; `warmup`: vision_warmup.json)."""
    if not records:
        return ["no steps were logged"]
    first, last = records[0], records[-1]
    fmt = lambda v, p=3: "n/a" if v is None else f"{v:.{p}f}"  # noqa: E731
    lines = [
        f"run: {run_dir}  steps: {last['step']}  wall time: {wall_s / 60:.1f} min",
        (
            f"loss: {fmt(first.get('loss/lm'))} (first step) -> "
            f"{fmt(_tail_mean(records, 'loss/lm'))} (last 10 %)"
        ),
        (
            f"  text-only samples:  {fmt(_tail_mean(records, 'loss/text_only'))}   "
            f"({fmt(_tail_mean(records, 'bpb/text'))} bits per byte)"
        ),
        f"  image-text samples: {fmt(_tail_mean(records, 'loss/image_text'))}",
    ]
    if warmup:
        held = warmup.get("held_out_all_words_right")
        lines.insert(
            1,
            f"vision warm-up before step 0: {warmup['steps']} steps, {warmup['seconds'] / 60:.1f} "
            f"min, word loss {warmup['loss_first']:.3f} -> {warmup['loss_last']:.3f}"
            + (
                f", every caption word right on {100 * held:.1f} % "
                f"of {warmup['held_out_captions']} held-out images"
                if held is not None
                else ""
            ),
        )
    val = [r for r in records if r.get("val/loss/lm") is not None]
    if val:
        lines.append(
            f"  held-out LM loss:   {fmt(val[-1]['val/loss/lm'])} (step {val[-1]['step']})"
        )
    joint = targets.get("ratio")
    lines.append(
        "compression (tokens per concept; train: the last "
        "logged step's documents, sampled boundaries"
        + (
            f"; target R = {joint:g}"
            if joint
            else "; targets "
            + ", ".join(
                f"{k.split('/')[-1]} {v:g}" for k, v in targets.items() if k.startswith("ratio/")
            )
        )
        + "):"
    )
    for mod, label in (("ratio", "all"), ("text", "text"), ("image", "image")):
        r = _tail_mean(records, f"compression/{mod}")
        p = _tail_mean(records, f"boundary_p/{'all' if mod == 'ratio' else mod}")
        lines.append(
            f"  {label:<6} batch aggregate N/M = {fmt(r, 2)} (last 10 %)   mean p = {fmt(p)}"
        )
    train_docs = train_distribution(records)
    if train_docs:
        lines.append(
            "  per document, by kind of sample (train, last logged step; histogram bins of 9 %):"
        )
        lines += format_distribution(train_docs, indent="    ")
    held = (vqa or {}).get("held_out_compression") or {}
    if held:
        lines.append("  per document, whole held-out samples (eval mode, p >= 0.5):")
        lines += format_distribution(held, indent="    ")
    prompts = (vqa or {}).get("prompt_compression")
    if prompts:
        lines.append(
            "  per prompt, the VQA eval's prefill (eval mode; what chat and the demo run):"
        )
        lines += format_distribution({"vqa prompt": prompts}, indent="    ")
    if vqa:
        types = [t for t in vqa["accuracy"] if t != "all"] + ["all"]
        blind = vqa.get("blind_baseline") or {}
        lines.append(
            f"VQA exact match, {vqa.get('split', 'held-out')} split (unseen "
            f"colour-shape pairs), {vqa.get('n', '?')} questions (%):"
        )
        lines.append(f"  {'type':<10}{'model':>8}{'majority':>10}{'blind':>8}")
        for t in types:
            blind_t = blind.get(t, float("nan"))
            lines.append(
                f"  {t:<10}{vqa['accuracy'][t]:>8.1f}{vqa['majority_baseline'][t]:>10.1f}{blind_t:>8.1f}"
            )
    else:
        lines.append("VQA: not run")
    tps = _tail_mean(records, "tokens_per_s", 0.5)
    lines.append(
        f"throughput: {fmt(tps, 0)} tokens/s   skipped (non-finite) steps: {skipped_steps}"
    )
    if data_counters:
        bad = {k: v for k, v in data_counters.items() if v}
        if bad:
            lines.append(
                "data: skipped samples " + ", ".join(f"{k}={v}" for k, v in sorted(bad.items()))
            )
    final = f", {run_dir / 'final'}" if (run_dir / "final").is_dir() else " (no final/ exported)"
    lines.append(
        f"outputs: {run_dir / 'metrics.jsonl'}, {run_dir / 'report.png'}, "
        f"{run_dir / 'tb'} (tensorboard){final}"
    )
    return lines


def model_card(cfg: dict, summary: list[str], title: str) -> str:
    """final/README.md: what was trained on what, how it went (the run's summary) and the report picture."""
    m, data, run = cfg["model"], cfg["data"], cfg["train"]
    chunk = m.get("chunk", {})
    R = chunk.get("target_ratio", ChunkConfig.target_ratio)
    ratios = resolve_targets(R, chunk.get("modality_target_ratios")) or {"joint": R}
    sources = (
        ", ".join(s["path"] for s in data.get("sources") or [])
        or f"the embedded default dataset ({data['default_dir']})"
    )
    chunking = (
        "on, target ratios " + ", ".join(f"{k} {v:g}" for k, v in ratios.items())
        if chunk.get("enabled", True)
        else "off (MoE baseline)"
    )
    lines = [
        f"# {title}",
        "",
        (
            "A ConceptMoE vision-language model trained with `vlm train` (ConceptMoE-VLM). "
            "Load it with `AutoModelForCausalLM.from_pretrained(this_dir)` after `import "
            "vlm.model.hf`, or chat with `vlm chat --ckpt this_dir`."
        ),
        "",
        "| | |",
        "|---|---|",
        (
            f"| layers (encoder / concept / decoder) | {m['encoder_layers']} "
            f"/ {m['concept_layers']} / {m['decoder_layers']} |"
        ),
        f"| hidden size | {m['hidden_size']} |",
        f"| experts (top-k of E) | {m['moe']['top_k']} of {m['moe']['num_experts']} |",
        f"| chunking | {chunking} |",
        f"| vision encoder | {'yes' if cfg.get('vision') else 'none'} |",
        f"| data | {sources} |",
        f"| stage, steps | {run['stage']}, {run['max_steps']} |",
        "",
        "## The run",
        "",
        "```",
        *summary,
        "```",
        "",
        "![training report](report.png)",
        "",
    ]
    return "\n".join(lines)
