"""Launches per training step (issue 35 item 5): one eager training step of configs/gpu.yaml's LLM
layout, at width 128 so it runs on a CPU, dispatches at most half the operators the code did before
the GPU work (71c293f, measured with the same counter, eval.bench.common.count_operators: every aten
op but views; AdamW was unfused then), for the MoE baseline and the more_experts reallocation at R =
2, with the CPU's attention (auto: one SDPA per document) and with the packed-mask SDPA the compiled
and GPU paths share. Each dispatched operator is a kernel launch on a GPU in eager mode, so the
count is the launch count's proxy on a machine without one."""

from __future__ import annotations

import pytest
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

BEFORE = {
    ("baseline", "auto"): 6595,
    ("more_experts", "auto"): 7119,
    ("baseline", "sdpa"): 6159,
    ("more_experts", "sdpa"): 6683,
}


def gpu_layout_at_width_128(backend: str) -> ModelConfig:
    """gpu.yaml's LLM layout (2 + 12 + 2 layers, 32 experts top-4 plus a shared one, GQA 2:1) at width 128."""
    return ModelConfig(
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


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
@pytest.mark.parametrize("name", ["baseline", "more_experts"])
def test_one_training_step_launches_at_most_half_what_it_did(name, backend):
    base = gpu_layout_at_width_128(backend)
    cfg = base if name == "baseline" else reallocate(base, 2.0)[name]
    torch.manual_seed(0)
    model = ConceptMoELM(cfg).train()
    # what the trainer builds
    opt = build_optimizer([{"params": list(model.parameters())}], OptimConfig())
    T = 512
    ids = torch.randint(0, cfg.vocab_size, (2, T))
    batch = PackedBatch.stack([PackedBatch.from_documents([r.tolist()]) for r in ids])
    force = boundaries_at_ratio(2, T, 2.0) if cfg.chunk.enabled else None

    def step():
        # the trainer's forward: no [B, T, V] logits, the loss makes them in tiles
        out = model(batch, force=force, context=ForwardContext(logits=False))
        opt.zero_grad(set_to_none=True)
        training_loss(out, batch, model.cfg).backward()
        opt.step()

    step()  # the optimizer's state exists from here on, as in every later step
    n = count_operators(step)
    before = BEFORE[name, backend]
    print(
        f"{name}, {backend}: {n} operators per step, {before / n:.2f}x fewer than before ({before})"
    )
    assert n <= before / 2
