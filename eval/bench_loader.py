"""Loader benchmark: samples/s and tokens/s (per worker) and packing efficiency on the default dataset.

    python -m eval.bench_loader [--data DIR] [--workers 0 1 2] [--batches 100] [--row-tokens 1024]

Packing efficiency is the share of non-padding positions (target >= 97 %). Throughput counts packed
samples and non-padding tokens per wall-clock second after the first batch of every worker (start-up
excluded), and "per worker" divides by the number of worker processes (1 for in-process loading).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from data_pipelines.config import DataConfig
from data_pipelines.default_dataset import build_default, default_info, ensure_default_dataset
from data_pipelines.loader import build_loader
from data_pipelines.tokenizer import load_tokenizer
from configs.batch import IMAGE


def bench(data_dir: str, workers: int, batches: int, row_tokens: int, rows: int, tokenizer: str = "byte",
          pack_buffer: int = 64, seed: int = 0) -> dict:
    cfg = DataConfig(default_dir=data_dir, row_tokens=row_tokens, rows_per_batch=rows, num_workers=workers,
                     pack_buffer=pack_buffer, seed=seed, tokenizer=tokenizer)
    tok = load_tokenizer(tokenizer)
    loader = build_loader(cfg, tok)
    warm = max(workers, 1)
    t_start = time.perf_counter()
    samples = tokens = slots = image_tokens = 0
    t0 = None
    for i, batch in enumerate(loader):
        if i == warm - 1:
            t0 = time.perf_counter()
            before = loader.stats
            continue
        if i >= warm + batches - 1:
            break
        valid = batch.valid
        tokens += int(valid.sum())
        slots += valid.numel()
        image_tokens += int((batch.modality == IMAGE).sum())
    elapsed = time.perf_counter() - t0
    after = loader.stats
    samples = after["samples_packed"] - before["samples_packed"]
    procs = max(workers, 1)
    return {"workers": workers, "batches": batches, "row_tokens": row_tokens, "rows_per_batch": rows,
            "seconds": round(elapsed, 3), "startup_seconds": round(t0 - t_start, 3),
            "samples_per_s": round(samples / elapsed, 1), "tokens_per_s": round(tokens / elapsed, 1),
            "samples_per_s_per_worker": round(samples / elapsed / procs, 1),
            "tokens_per_s_per_worker": round(tokens / elapsed / procs, 1),
            "packing_efficiency": round(tokens / max(slots, 1), 4),
            "image_token_share": round(image_tokens / max(tokens, 1), 4), "skipped": loader.counters}


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r["workers"]) for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for ax, key, title in zip(axes, ("samples_per_s", "tokens_per_s", "packing_efficiency"),
                              ("samples / s", "non-padding tokens / s", "packing efficiency")):
        vals = [r[key] * (100 if key == "packing_efficiency" else 1) for r in runs]
        ax.bar(labels, vals, color="tab:blue")
        ax.set_title(title)
        ax.set_xlabel("DataLoader workers (0 = in process)")
        if key == "packing_efficiency":
            ax.axhline(97, color="tab:red", ls="--", label="target 97 %")
            ax.set_ylim(90, 100)
            ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", help="default dataset folder (built there if missing; default: a temp folder)")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--row-tokens", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--pack-buffer", type=int, default=64)
    ap.add_argument("--tokenizer", default="byte")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--plot", help="write a bar chart of throughput and packing per worker count here (.png)")
    args = ap.parse_args(argv)
    tmp = None
    if args.data is None:
        tmp = tempfile.TemporaryDirectory()
        args.data = str(Path(tmp.name) / "default")
    t0 = time.perf_counter()
    fresh = default_info(args.data) is None
    if fresh:
        build_default(args.data, progress=False)
    else:
        ensure_default_dataset(args.data, progress=False)
    result = {"build_seconds": round(time.perf_counter() - t0, 2) if fresh else None, "runs": []}
    print(f"default dataset: {args.data}" + (f" (built in {result['build_seconds']} s)" if fresh else ""))
    print(f"{'workers':>7} {'samples/s':>10} {'tokens/s':>10} {'samples/s/w':>12} {'tokens/s/w':>11} "
          f"{'packing':>8} {'img tok':>8}")
    for w in args.workers:
        r = bench(args.data, w, args.batches, args.row_tokens, args.rows, args.tokenizer, args.pack_buffer)
        result["runs"].append(r)
        print(f"{w:>7} {r['samples_per_s']:>10.0f} {r['tokens_per_s']:>10.0f} {r['samples_per_s_per_worker']:>12.0f} "
              f"{r['tokens_per_s_per_worker']:>11.0f} {100 * r['packing_efficiency']:>7.2f}% "
              f"{100 * r['image_token_share']:>7.1f}%")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result["runs"], args.plot)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
