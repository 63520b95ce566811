"""Prefill and training tokens/s of the three FLOPs-matched reallocations against the MoE baseline.

Legend: B rows, T tokens, M concept slots.

The baseline is a small MoE (`BASE`: hidden 256, 1 + 6 + 1 layers, 16 experts top-2) with chunking
off; the candidates are ConceptMoE section 3.5's reallocations of it (vlm.model.reallocate). Their
boundaries are forced at exactly T/R positions per row (the row's start included), which is what a
trained model at realized ratio R does; the router still runs. A training step is forward, backward
and an AdamW step.

Next to the measured prefill ratio the part reports two limits: the FLOPs ratio (vlm.model.flops,
attention map excluded, so ~1 by construction) and the attention-bound time ratio of the layer
split, (L_E + L_D + L_C / R^2) / (L_E + L_C + L_D): at long contexts attention dominates and the
concept model attends over T/R concepts, so prefill time can fall to that share of the baseline's
(0.44 for 1 + 6 + 1 at R = 2, a 2.3x speedup) and no lower.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from configs.batch import PackedBatch
from eval.bench import common
from vlm.model.conceptmoe import ConceptMoELM
from vlm.model.config import ModelConfig, MoEConfig
from vlm.model.context import ForwardContext
from vlm.model.flops import attention_map_flops, flops_per_token
from vlm.model.reallocate import reallocate
from vlm.train.losses import training_loss

PART = "model"
BASELINE = "baseline (MoE)"
BASE = ModelConfig(
    vocab_size=512,
    hidden_size=256,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    encoder_layers=1,
    concept_layers=6,
    decoder_layers=1,
    moe=MoEConfig(num_experts=16, top_k=2, expert_hidden=128),
)


@dataclass
class Settings:
    seq_lens: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384])
    rows: int = 1
    ratio: float = 2.0
    repeats: int = 5
    warmup: int = 1
    modes: tuple[str, ...] = ("prefill", "train")
    # lengths measured in prefill only: the long-context row that watches the attention-bound regime
    # (a 16K prefill at R = 2 is where a slower concept path would show first)
    prefill_only: list[int] = field(default_factory=list)


SETTINGS = {
    "full": Settings(),
    "quick": Settings(seq_lens=[1024, 2048], repeats=5, prefill_only=[16384]),
    "smoke": Settings(seq_lens=[64, 128], repeats=2, prefill_only=[256]),
}


def boundaries_at_ratio(B: int, T: int, R: float, seed: int = 0) -> torch.Tensor:
    """[B, T] bool with exactly round(T / R) boundaries per row, position 0 (the document start) among them."""
    g = torch.Generator().manual_seed(seed)
    score_BT = torch.rand(B, T, generator=g)
    score_BT[:, 0] = 2.0
    idx_BM = score_BT.topk(max(1, round(T / R)), dim=1).indices
    return torch.zeros(B, T, dtype=torch.bool).scatter_(1, idx_BM, True)


def attention_bound(cfg: ModelConfig, base: ModelConfig, R: float) -> float:
    """The layer-split limit: attention time relative to the baseline's when every layer is attention-bound."""
    L_E, L_C, L_D = cfg.encoder_layers, len(cfg.concept_schedule), cfg.decoder_layers
    return (L_E + L_D + L_C / R**2) / (
        base.encoder_layers + base.concept_layers + base.decoder_layers
    )


def _step(model: ConceptMoELM, opt, batch: PackedBatch, force, train: bool):
    def run():
        model.train(train)
        if train:
            # the trainer's forward: no [B, T, V] logits, the loss makes them in tiles
            out = model(batch, force=force, context=ForwardContext(logits=False))
            opt.zero_grad(set_to_none=True)
            training_loss(out, batch, model.cfg).backward()
            opt.step()
        else:
            with torch.no_grad():
                model(batch, force=force)

    return run


def run(s: Settings, log=print) -> dict:
    torch.manual_seed(0)
    base = BASE.baseline()
    configs = {BASELINE: base, **reallocate(base, s.ratio)}
    models = {n: ConceptMoELM(c) for n, c in configs.items()}
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, m in models.items()}
    f0 = flops_per_token(base)["total"]
    limits = {
        n: {
            "flops_ratio": flops_per_token(c, s.ratio if c.chunk.enabled else None)["total"] / f0,
            "attn_bound_time_ratio": attention_bound(c, base, s.ratio) if c.chunk.enabled else 1.0,
        }
        for n, c in configs.items()
    }
    out = []
    for T in s.seq_lens + [t for t in s.prefill_only if t not in s.seq_lens]:
        ids = torch.randint(0, base.vocab_size, (s.rows, T))
        batch = PackedBatch.stack([PackedBatch.from_documents([r.tolist()]) for r in ids])
        force = boundaries_at_ratio(s.rows, T, s.ratio)
        a0 = attention_map_flops(base, T)["total"]
        extra = {
            n: {
                **{k: round(v, 3) for k, v in limits[n].items()},
                "attn_map_flops_ratio": round(
                    attention_map_flops(c, T, s.ratio if c.chunk.enabled else None)["total"] / a0, 3
                ),
            }
            for n, c in configs.items()
        }
        for mode in s.modes if T in s.seq_lens else ("prefill",):
            fns = {
                n: _step(
                    m, opts[n], batch, force if configs[n].chunk.enabled else None, mode == "train"
                )
                for n, m in models.items()
            }
            secs = common.measure(fns, s.repeats, s.warmup)
            rs = common.rows(
                common.per_second(secs, s.rows * T),
                BASELINE,
                {"mode": mode, "seq_len": T},
                "tokens/s",
                "tok/s",
                extra,
            )
            # one counted step per candidate: it changes little with T
            if mode == "train" and T == s.seq_lens[0]:
                for r in rs:
                    r["operators_per_step"] = common.count_operators(fns[r["candidate"]])
            out += rs
            log(
                f"  model {mode} T={T}: "
                + ", ".join(f"{r['candidate']} x{r['ratio_vs_baseline']:.2f}" for r in rs)
            )
    b = attention_bound(configs["more_experts"], base, s.ratio)
    notes = [
        (
            f"attention-bound prefill time ratio of the 1+6+1 split at R={s.ratio:g}: (L_E + L_D "
            f"+ L_C/R^2)/(L_E + L_C + L_D) = {b:.2f}, i.e. at most {1 / b:.2f}x prefill tokens/s "
            "when attention dominates; flops_ratio ~ 1 is what the reallocations were matched to"
        ),
        "boundaries forced at exactly T/R positions per row; one document per row",
        (
            f"operators_per_step (train rows at T={s.seq_lens[0]}): "
            f"{common.OPERATORS_METRIC} of one eager training step (forward, backward, "
            "AdamW), eval.bench.common.count_operators, the CPU proxy for kernel launches; "
            "no compiled count here (compiled code does not run under its dispatch mode): "
            "`vlm bench gpu` counts the CUDA kernels of eager and compiled steps"
        ),
    ]
    return common.result(
        PART,
        asdict(s),
        out,
        notes=notes,
        base_config={k: v for k, v in vars(BASE).items() if isinstance(v, (int, float, str))},
    )


def plot(res: dict, path) -> None:
    R = res["settings"]["ratio"]
    bound = attention_bound(BASE, BASE, R)
    common.plot(
        res,
        path,
        x="seq_len",
        panels=("mode",),
        ylabel="tokens/s vs MoE baseline",
        title=f"ConceptMoE reallocations vs MoE baseline, R = {R:g}",
        hlines=[(1 / bound, f"attention-bound limit {1 / bound:.2f}x")],
    )
