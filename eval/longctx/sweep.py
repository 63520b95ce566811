"""Run a lengths x depths x tasks sweep against an EvalModel and summarize it as JSON.

Two scorings per cell: generation scored like RULER (string_match_all / _part, x100), and a
log-likelihood ranking (each reference against `num_distractors` same-kind wrong answers; accuracy
x100, ties share credit so an uninformative model sits at chance). The model's compression
statistics are reset at the start of each length and read at its end, giving the realized ratio per
length. Cells whose target length the task cannot meet (too short for its fixed text) are listed
under "skipped" with the reason instead of aborting the sweep.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from statistics import mean
from typing import Iterator

from tqdm import tqdm

from configs.config import to_dict
from eval.longctx.config import LongCtxConfig
from eval.longctx.sample import Sample
from eval.longctx.scoring import METRICS, rank_credit, string_match_all, string_match_part
from eval.longctx.sizing import SizingError
from eval.longctx.tasks import generate_sample, task_def
from eval.protocol import EvalModel


def depth_key(depth: float | None) -> str:
    return "all" if depth is None else f"{depth:g}"


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def generate_predictions(model: EvalModel, samples: list[Sample], cfg: LongCtxConfig) -> list[str]:
    preds: list[str] = []
    for batch in _chunks(samples, cfg.batch_size):
        budget = cfg.max_new_tokens or max(s.max_new_tokens for s in batch)
        preds += model.generate(
            [s.prompt for s in batch], None, max_new_tokens=budget, temperature=0.0
        )
    return preds


def loglik_credits(model: EvalModel, samples: list[Sample], cfg: LongCtxConfig) -> list[float]:
    """Per-sample mean over references of the ranking credit of the reference among distractors."""
    k = cfg.num_distractors
    requests: list[tuple[int, int, str, str]] = []  # (sample, reference, context, continuation)
    for si, s in enumerate(samples):
        if len(s.distractors) < k:
            raise ValueError(
                f"{s.task}: only {len(s.distractors)} distractors for num_distractors={k}"
            )
        for ri, ref in enumerate(s.answers):
            for cand in [ref] + s.distractors[:k]:
                requests.append((si, ri, s.prompt, " " + cand))
    scores: list[float] = []
    for batch in _chunks(requests, cfg.batch_size * (k + 1)):
        out = model.loglikelihood([r[2] for r in batch], [r[3] for r in batch])
        scores += [float(lp) for lp, _ in out]
    credits: list[list[float]] = [[] for _ in samples]
    for start in range(0, len(requests), k + 1):
        si = requests[start][0]
        credits[si].append(rank_credit(scores[start : start + k + 1], correct=0))
    return [mean(c) for c in credits]


def run_cell(
    model: EvalModel, samples: list[Sample], cfg: LongCtxConfig, records: list[dict]
) -> dict:
    metric = task_def(samples[0].task).metric
    cell: dict = {
        "n": len(samples),
        "metric": metric,
        "mean_length": mean(s.length for s in samples),
        "min_length": min(s.length for s in samples),
        "max_length": max(s.length for s in samples),
    }
    preds: list[str | None] = [None] * len(samples)
    credits: list[float | None] = [None] * len(samples)
    if cfg.mode in ("generate", "both"):
        preds = generate_predictions(model, samples, cfg)
        refs = [s.answers for s in samples]
        cell["string_match_all"] = string_match_all(preds, refs)
        cell["string_match_part"] = string_match_part(preds, refs)
        cell["score"] = METRICS[metric](preds, refs)
    if cfg.mode in ("loglik", "both"):
        credits = loglik_credits(model, samples, cfg)
        cell["loglik_acc"] = 100.0 * mean(credits)
        cell["loglik_chance"] = 100.0 / (cfg.num_distractors + 1)
        cell.setdefault("score", cell["loglik_acc"])
    for s, p, c in zip(samples, preds, credits):
        records.append(
            {
                "task": s.task,
                "target_length": s.target_length,
                "length": s.length,
                "depth": s.depth,
                "answers": s.answers,
                "prediction": p,
                "loglik_credit": c,
            }
        )
    return cell


def run_sweep(
    model: EvalModel,
    cfg: LongCtxConfig,
    *,
    label: str = "model",
    progress: bool = True,
    records: list[dict] | None = None,
) -> dict:
    cfg.validate()
    records = [] if records is None else records
    tokenizer = model.tokenizer
    results: dict = {t: {} for t in cfg.tasks}
    skipped: list[dict] = []
    compression: dict = {}
    cells = [
        (L, t, d)
        for L in cfg.lengths
        for t in cfg.tasks
        for d in (cfg.depths if task_def(t).has_depth else [None])
    ]
    t0 = time.time()
    bar = tqdm(total=len(cells), desc=f"longctx[{label}]", disable=None if progress else True)
    for length in cfg.lengths:
        model.reset_stats()
        for task, depth in [(t, d) for L, t, d in cells if L == length]:
            bar.set_postfix_str(f"{task} L={length} d={depth_key(depth)}")
            try:
                samples = [
                    generate_sample(task, tokenizer, length, depth, cfg.seed, i)
                    for i in range(cfg.num_samples)
                ]
            except SizingError as e:
                skipped.append({"task": task, "length": length, "depth": depth, "reason": str(e)})
                bar.update(1)
                continue
            results[task].setdefault(str(length), {})[depth_key(depth)] = run_cell(
                model, samples, cfg, records
            )
            bar.update(1)
        compression[str(length)] = dict(model.compression_stats())
    bar.close()
    return {
        "label": label,
        "config": to_dict(cfg),
        "results": results,
        "task_means": task_means(results),
        "compression": compression,
        "skipped": skipped,
        "elapsed_s": round(time.time() - t0, 3),
    }


def task_means(results: dict) -> dict:
    """Mean over depths of each task x length, per available score."""
    out: dict = {}
    for task, by_len in results.items():
        for length, by_depth in by_len.items():
            cells = list(by_depth.values())
            out.setdefault(task, {})[length] = {
                k: mean(c[k] for c in cells)
                for k in ("score", "string_match_all", "string_match_part", "loglik_acc")
                if all(k in c for c in cells)
            }
    return out


def write_summary(summary: dict, out_dir: str | Path, records: list[dict] | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "summary.json"
    path.write_text(json.dumps(summary, indent=2))
    if records is not None:
        with open(out / "samples.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return path
