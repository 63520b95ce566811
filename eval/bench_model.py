"""Training and prefill throughput of ConceptMoE against the FLOPs/params-matched MoE baseline, same run.

    python -m eval.bench_model [--config configs/default.yaml] [--ratio 2] [--seq-len 1024] [--steps 5]

The baseline is the config's model with chunking off; the ConceptMoE candidates are the three reallocation
strategies of section 3.5 (vlm.model.flops.reallocate). Boundaries are left to the (untrained) router but
its threshold is shifted per run so that the realized ratio equals R, which is what a trained model does.
Prints tokens/s and the ratio to the baseline, plus analytic FLOPs for reference.
"""
from __future__ import annotations

import argparse
import time

import torch

from configs.batch import PackedBatch
from vlm.flops_cli import load_model_config
from vlm.model.conceptmoe import ConceptMoELM
from vlm.model.config import ModelConfig, MoEConfig
from vlm.model.flops import flops_per_token
from vlm.model.reallocate import reallocate


def boundaries_at_ratio(B: int, T: int, R: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, T, generator=g) < 1.0 / R


def time_model(cfg: ModelConfig, batch: PackedBatch, force, steps: int, train: bool) -> float:
    torch.manual_seed(0)
    m = ConceptMoELM(cfg).train(train)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4) if train else None
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        if train:
            out = m(batch, force=force)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
        else:
            with torch.no_grad():
                m(batch, force=force)
        if i:  # first step warms caches and allocators
            times.append(time.perf_counter() - t0)
    return batch.input_ids.numel() / (sum(times) / len(times))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="YAML with a `model:` section (default: a small MoE)")
    ap.add_argument("--ratio", type=float, default=2.0)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    if args.config:
        base = load_model_config(args.config, []).baseline()
    else:
        base = ModelConfig(vocab_size=512, hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=32,
                           encoder_layers=1, concept_layers=6, decoder_layers=1,
                           moe=MoEConfig(num_experts=32, top_k=4, expert_hidden=128)).baseline()
    ids = torch.randint(0, base.vocab_size, (args.rows, args.seq_len))
    batch = PackedBatch.stack([PackedBatch.from_documents([r.tolist()]) for r in ids])
    force = boundaries_at_ratio(args.rows, args.seq_len, args.ratio)
    runs = {"baseline (MoE)": base, **reallocate(base, args.ratio)}
    f0 = flops_per_token(base)["total"]
    print(f"seq_len={args.seq_len} rows={args.rows} R={args.ratio} threads={torch.get_num_threads()}")
    print(f"{'model':<22}{'FLOPs/tok':>11}{'train tok/s':>13}{'x base':>8}{'prefill tok/s':>15}{'x base':>8}")
    ref = {}
    for name, cfg in runs.items():
        chunked = cfg.chunk.enabled
        tr = time_model(cfg, batch, force if chunked else None, args.steps, True)
        pf = time_model(cfg, batch, force if chunked else None, args.steps, False)
        ref.setdefault("tr", tr), ref.setdefault("pf", pf)
        f = flops_per_token(cfg, args.ratio if chunked else None)["total"] / f0
        print(f"{name:<22}{f:>11.3f}{tr:>13.0f}{tr / ref['tr']:>8.2f}{pf:>15.0f}{pf / ref['pf']:>8.2f}")


if __name__ == "__main__":
    main()
