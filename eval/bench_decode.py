"""Decode speed and KV-cache size of ConceptMoE against its MoE baseline, measured side by side in one run.

    python -m eval.bench_decode [--quick] [--out DIR] [--ratio 2] [--contexts 1024 4096 8192 16384]

For each context length and batch size, every model gets caches filled to that length (random keys and values:
decode cost depends on how much is cached, not on what) and then decodes `--steps` tokens; the mean per-token
latency gives tokens/s. ConceptMoE's caches hold the context's L/R concepts and its boundaries fire at rate 1/R
(forced, as a trained model at realized ratio R does), so the concept model runs for ~1/R of the rows per step.
Models: the baseline (chunking off) and the three FLOPs-matched reallocations of ConceptMoE section 3.5.
Writes bench_decode.json (with the machine) and bench_decode.png (tokens/s ratio vs context, like Figures 5-6).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from vlm.model.cache import ChunkState, InferenceCache
from vlm.model.conceptmoe import ConceptMoELM
from vlm.model.config import ModelConfig, MoEConfig
from vlm.model.reallocate import reallocate

BASE = ModelConfig(vocab_size=512, hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=32,
                   encoder_layers=1, concept_layers=6, decoder_layers=1,
                   moe=MoEConfig(num_experts=16, top_k=2, expert_hidden=128))


def filled_cache(model: ConceptMoELM, B: int, L: int, ratio: float | None, steps: int, gen) -> InferenceCache:
    """Caches as a prompt of L tokens (L/R concepts) would leave them, with room for `steps` more."""
    cfg, D = model.cfg, model.cfg.hidden_size
    like = torch.zeros((), dtype=torch.float32)
    cache = model.allocate_inference_cache(B, L + steps, like)
    n_concepts = L if ratio is None else max(1, round(L / ratio))
    cache.concept = model._caches(cfg.c_kv_heads, len(cfg.concept_schedule), B, n_concepts + steps, like)
    for c, n in [(c, L) for c in cache.encoder + cache.decoder] + [(c, n_concepts) for c in cache.concept]:
        c.k_BKSd[:, :, :n].normal_(generator=gen)
        c.v_BKSd[:, :, :n].normal_(generator=gen)
        c.len_B.fill_(n)
    cache.len_B = torch.full((B,), L, dtype=torch.long)
    if model.chunker is not None:
        cache.chunk = ChunkState(torch.randn(B, D, generator=gen), torch.zeros(B, D), torch.zeros(B, dtype=torch.long),
                                 torch.randn(B, D, generator=gen), torch.full((B,), n_concepts, dtype=torch.long))
    return cache


@torch.no_grad()
def time_decode(model: ConceptMoELM, B: int, L: int, ratio: float | None, steps: int, warmup: int = 2) -> dict:
    gen = torch.Generator().manual_seed(0)
    cache = filled_cache(model, B, L, ratio, steps + warmup, gen)
    kv_bytes = (cache.token_bytes() + cache.concept_bytes()) / B
    ids = torch.randint(0, model.cfg.vocab_size, (steps + warmup, B), generator=gen)
    fire = torch.rand(steps + warmup, B, generator=gen) < (1.0 / ratio if ratio else 1.0)
    times = []
    for i in range(steps + warmup):
        x = model.embed(ids[i])
        t0 = time.perf_counter()
        model.step(x, cache, force_B=fire[i] if ratio else None)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    # The mean, not the median: a ConceptMoE step costs more when boundaries fire (the concept model runs), and
    # the mean over steps is what a stream of tokens at realized ratio R pays.
    lat = statistics.fmean(times)
    return {"ms_per_token": 1000 * lat, "tokens_per_s": B / lat, "kv_bytes_per_seq": kv_bytes,
            "median_ms": 1000 * statistics.median(times), "spread_ms": 1000 * (max(times) - min(times))}


def run(contexts: list[int], batches: list[int], ratio: float, steps: int, log=print) -> dict:
    torch.manual_seed(0)
    base = BASE.baseline()
    models = {"baseline (MoE)": (base, None), **{k: (v, ratio) for k, v in reallocate(base, ratio).items()}}
    built = {name: ConceptMoELM(cfg).eval() for name, (cfg, _) in models.items()}
    rows = []
    for L in contexts:
        for B in batches:
            ref = None
            for name, (cfg, r) in models.items():
                res = time_decode(built[name], B, L, r, steps)
                ref = ref or res
                row = {"model": name, "context": L, "batch": B, **res,
                       "speedup": res["tokens_per_s"] / ref["tokens_per_s"],
                       "kv_ratio": res["kv_bytes_per_seq"] / ref["kv_bytes_per_seq"]}
                rows.append(row)
                log(f"L={L:>6} B={B} {name:<20} {res['ms_per_token']:8.2f} ms/token {res['tokens_per_s']:9.1f} tok/s"
                    f"  x{row['speedup']:.2f}   KV {res['kv_bytes_per_seq'] / 2**20:8.1f} MiB (x{row['kv_ratio']:.2f})")
    return {"ratio": ratio, "steps": steps, "threads": torch.get_num_threads(),
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "torch": torch.__version__, "device": "cpu"},
            "base_config": {k: v for k, v in vars(BASE).items() if isinstance(v, (int, float, str))},
            "rows": rows}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 3.6), squeeze=False)
    for ax, B in zip(axes[0], batches):
        for name in dict.fromkeys(r["model"] for r in result["rows"]):
            rs = [r for r in result["rows"] if r["model"] == name and r["batch"] == B]
            ax.plot([r["context"] for r in rs], [r["speedup"] for r in rs], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("decode tokens/s vs MoE baseline")
        ax.set_title(f"batch {B}, realized R = {result['ratio']:g}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1K and 4K contexts, batch 1 and 8, few steps (< 5 min)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--ratio", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default="runs/bench_decode")
    args = ap.parse_args(argv)
    contexts, steps = ([1024, 4096], 16) if args.quick else (args.contexts, args.steps)
    result = run(contexts, args.batches, args.ratio, steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_decode.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "bench_decode.png")
    print(f"wrote {out / 'bench_decode.json'} and {out / 'bench_decode.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
