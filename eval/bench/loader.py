"""Loader throughput (samples/s, non-padding tokens/s) and packing efficiency per number of
DataLoader workers.

Each round builds a fresh loader per worker count and reads `batches` batches after the first batch
of every worker, so process start-up is not timed. Packing efficiency is the share of non-padding
positions (target >= 97 %); it does not depend on the round. Baseline: in-process loading (0
workers). The full setting reads the default dataset (`--data`, built there if missing); quick and
smoke build a small one into a temp folder.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from configs.batch import IMAGE
from data_pipelines.config import DEFAULT_DIR, DataConfig
from data_pipelines.default_dataset import (
    DefaultDatasetConfig,
    build_default,
    ensure_default_dataset,
)
from data_pipelines.loader import build_loader
from data_pipelines.tokenizer import load_tokenizer
from eval.bench import common

PART = "loader"


@dataclass
class Settings:
    workers: list[int] = field(default_factory=lambda: [0, 1, 2])
    batches: int = 100
    row_tokens: int = 1024
    rows: int = 8
    pack_buffer: int = 64
    tokenizer: str = "byte"
    repeats: int = 3
    # every round starts fresh processes; their start-up is excluded anyway
    warmup: int = 0
    data: str | None = DEFAULT_DIR  # None: a small default dataset in a temp folder,
    # with this many training scenes (a tenth as many text documents)
    temp_scenes: int = 200


SETTINGS = {
    "full": Settings(),
    "quick": Settings(batches=40, data=None),
    "smoke": Settings(
        workers=[0, 1], batches=3, row_tokens=256, rows=2, repeats=2, data=None, temp_scenes=40
    ),
}


def reader(s: Settings, data_dir: str, workers: int, counts: list):
    """A self-timed pass over `s.batches` batches; appends (samples, tokens, slots, image tokens) to `counts`."""
    cfg = DataConfig(
        default_dir=data_dir,
        row_tokens=s.row_tokens,
        rows_per_batch=s.rows,
        num_workers=workers,
        pack_buffer=s.pack_buffer,
        seed=0,
        tokenizer=s.tokenizer,
    )
    tok = load_tokenizer(s.tokenizer)

    def read() -> float:
        loader = build_loader(cfg, tok)
        warm = max(workers, 1)
        tokens = slots = image_tokens = 0
        for i, batch in enumerate(loader):
            if i == warm - 1:  # every worker has delivered once
                t0, before = time.perf_counter(), loader.stats["samples_packed"]
                continue
            if i >= warm + s.batches - 1:
                break
            tokens += int(batch.valid.sum())
            slots += batch.valid.numel()
            image_tokens += int((batch.modality == IMAGE).sum())
        elapsed = time.perf_counter() - t0
        counts.append((loader.stats["samples_packed"] - before, tokens, slots, image_tokens))
        return elapsed

    return read


def run(s: Settings, log=print) -> dict:
    tmp = tempfile.TemporaryDirectory() if s.data is None else None
    try:
        data_dir = str(Path(tmp.name) / "default") if tmp else s.data
        t0 = time.perf_counter()
        if tmp:
            small = DefaultDatasetConfig(
                train_scenes=s.temp_scenes,
                val_scenes=4,
                test_scenes=4,
                interleaved_docs=max(1, s.temp_scenes // 12),
                text_docs=s.temp_scenes // 10,
            )
            build_default(data_dir, small, progress=False)
        else:
            ensure_default_dataset(data_dir, progress=False)
        build_s = time.perf_counter() - t0
        counts = {f"workers={w}": [] for w in s.workers}
        fns = {name: reader(s, data_dir, w, counts[name]) for name, w in zip(counts, s.workers)}
        secs = common.measure(fns, s.repeats, s.warmup)
    finally:
        if tmp:
            tmp.cleanup()
    timed = {n: c[-s.repeats :] for n, c in counts.items()}  # the warm-up passes come first
    extra = {}
    for n, c in timed.items():
        _, tokens, slots, image = c[-1]
        extra[n] = {
            "packing_efficiency": round(tokens / max(slots, 1), 4),
            "image_token_share": round(image / max(tokens, 1), 4),
        }
    setting = {"row_tokens": s.row_tokens, "rows": s.rows}
    out = []
    for i, metric, unit in ((0, "samples/s", "sample/s"), (1, "tokens/s", "tok/s")):
        values = {n: [c[i] / t for c, t in zip(timed[n], secs[n])] for n in secs}
        out += common.rows(values, next(iter(secs)), setting, metric, unit, extra)
    log("  loader: " + ", ".join(f"{r['candidate']} {r['median']:.0f} {r['metric']}" for r in out))
    return common.result(
        PART,
        asdict(s),
        out,
        dataset_build_seconds=round(build_s, 2),
        dataset="small default (temp)" if tmp else data_dir,
        notes=["tokens/s counts non-padding tokens; 'per worker' = value / max(workers, 1)"],
    )


def plot(res: dict, path) -> None:
    # Candidates are worker counts: one point each, against the worker count.
    rows = [
        {
            **r,
            "setting": {**r["setting"], "workers": int(r["candidate"].split("=")[1])},
            "candidate": r["metric"],
        }
        for r in res["rows"]
    ]
    common.plot(
        {**res, "rows": rows},
        path,
        x="workers",
        panels=("metric",),
        y="median",
        logx=False,
        title="loader throughput vs DataLoader workers (0 = in process)",
    )
