"""The one producer `vlm results --rerun launches` runs (seconds on a CPU): the operators one eager
training step of configs/gpu.yaml's LLM layout dispatches at width 128 (2 rows x 512 tokens,
boundaries forced at R = 2), counted by `eval.bench.common.count_operators`, for the MoE baseline
and the more-experts reallocation with the CPU's attention (auto: one SDPA per document) and the
packed-mask SDPA of the compiled and GPU layout; the layout of tests/test_launches.py. Written as a
bench-style result to docs/results/data/launches.json.

The counts at 71c293f (before the GPU work; AdamW unfused then) are recorded figures: that code is
not this code, so they cannot be re-counted here; they are the ones tests/test_launches.py holds the
count against."""

from __future__ import annotations

import subprocess
from pathlib import Path

BEFORE = {
    ("baseline", "auto"): 6595,
    ("more_experts", "auto"): 7119,
    ("baseline", "sdpa"): 6159,
    ("more_experts", "sdpa"): 6683,
}
BEFORE_PROVENANCE = {
    "command": "eval.bench.common.count_operators over "
    "one eager training step of this layout, at 71c293f",
    "commit": "71c293f (measured), 2b95f5a (published)",
    "outputs": "the counts were kept only as tests/test_launches.py's BEFORE; recorded here once",
}
SETTINGS = {
    "layout": "configs/gpu.yaml's LLM at width 128",
    "rows": 2,
    "seq_len": 512,
    "ratio": 2.0,
    "optimizer": "the trainer's (vlm.train.engine.build_optimizer)",
}


def _commit(root: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def count(name: str, backend: str) -> int:
    """Operators per eager training step of one candidate (after one step, so the
    optimizer state exists)."""
    import torch

    from configs.batch import PackedBatch
    from eval.bench.common import count_operators
    from eval.bench.model import boundaries_at_ratio
    from vlm.model.conceptmoe import ConceptMoELM
    from vlm.model.config import ModelConfig, MoEConfig
    from vlm.model.context import ForwardContext
    from vlm.model.reallocate import reallocate
    from vlm.train.config import OptimConfig
    from vlm.train.engine import build_optimizer
    from vlm.train.losses import training_loss

    base = ModelConfig(
        vocab_size=1024,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        encoder_layers=2,
        concept_layers=12,
        decoder_layers=2,
        moe=MoEConfig(
            num_experts=32, top_k=4, expert_hidden=64, num_shared_experts=1, shared_hidden=128
        ),
        attn_backend=backend,
    ).baseline()
    cfg = base if name == "baseline" else reallocate(base, 2.0)[name]
    torch.manual_seed(0)
    model = ConceptMoELM(cfg).train()
    opt = build_optimizer([{"params": list(model.parameters())}], OptimConfig())
    T = SETTINGS["seq_len"]
    ids = torch.randint(0, cfg.vocab_size, (SETTINGS["rows"], T))
    batch = PackedBatch.stack([PackedBatch.from_documents([r.tolist()]) for r in ids])
    force = (
        boundaries_at_ratio(SETTINGS["rows"], T, SETTINGS["ratio"]) if cfg.chunk.enabled else None
    )

    def step():
        # the trainer's forward: no [B, T, V] logits, the loss makes them in tiles
        out = model(batch, force=force, context=ForwardContext(logits=False))
        opt.zero_grad(set_to_none=True)
        training_loss(out, batch, model.cfg).backward()
        opt.step()

    step()
    return count_operators(step)


def run(root: Path, log=print) -> dict:
    """Count every candidate; the result in the bench's shape (part, machine, settings, rows)."""
    from eval.bench.common import OPERATORS_METRIC, machine

    rows = []
    for backend in ("auto", "sdpa"):
        for name in ("baseline", "more_experts"):
            n = count(name, backend)
            log(f"launches: {name}, attention {backend}: {n} operators per step")
            rows.append(
                {
                    "candidate": name,
                    "setting": {"attention": backend},
                    "metric": OPERATORS_METRIC,
                    "operators_per_step": n,
                    "before_71c293f": BEFORE[name, backend],
                }
            )
    return {
        "part": "launches",
        "machine": machine(),
        "settings": SETTINGS,
        "commit": _commit(root),
        "rows": rows,
        "before_provenance": BEFORE_PROVENANCE,
    }
