"""The CUDA paths: every attention backend gives the same logits and gradients in bf16 on the GPU (flash-attn varlen
included when installed), grouped_mm expert dispatch equals the per-expert loop, and cached decoding equals a full
forward. Skipped, with the reason, where there is no GPU; `vlm bench all` on a GPU gives the speed."""
import dataclasses

import pytest
import torch

from configs.batch import PackedBatch
from vlm.model.conceptmoe import ConceptMoELM
from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")

V = 97
CUDA = torch.device("cuda")


def cfg(**kw) -> ModelConfig:
    # head_dim 64: flash-attn's kernels want head dims that are multiples of 8 and expert rows 16-byte aligned
    return ModelConfig(vocab_size=V, hidden_size=128, num_heads=2, num_kv_heads=1, head_dim=64,
                       encoder_layers=1, concept_layers=2, decoder_layers=1,
                       moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=64), chunk=ChunkConfig(), **kw)


def docs_batch(lengths, row_len, seed=0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, V, (n,), generator=g).tolist() for n in lengths]
    return PackedBatch.stack([PackedBatch.from_documents(docs, row_len=row_len)] * 2).to(CUDA)


def run(backend: str, dtype: torch.dtype, batch: PackedBatch, window: int = 0):
    """Logits and parameter gradients of one training-mode forward. The boundaries are forced (every third
    token): sampled or thresholded ones would flip between dtypes where p sits near the threshold."""
    torch.manual_seed(0)
    m = ConceptMoELM(dataclasses.replace(cfg(attention_window=window), attn_backend=backend)).to(CUDA, dtype).train()
    force = torch.zeros_like(batch.input_ids, dtype=torch.bool)
    force[:, ::3] = True
    out = m(batch, force=force)
    out.loss.backward()
    return out.logits.detach().float(), {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}


def available_backends() -> list[str]:
    from vlm.model.attention import flash_attn_varlen_func
    return ["eager", "sdpa", "docs"] + (["flash"] if flash_attn_varlen_func is not None else [])


@pytest.mark.parametrize("window", [0, 16])
def test_backends_agree_in_bf16_against_fp32(window):
    batch = docs_batch([70, 130, 50], row_len=256)
    ref_logits, ref_grads = run("eager", torch.float32, batch, window)
    for backend in available_backends():
        logits, grads = run(backend, torch.bfloat16, batch, window)
        assert torch.isfinite(logits).all(), backend
        # bf16 keeps ~3 significant digits: compare against the fp32 reference at that precision
        err = (logits - ref_logits).abs().max() / ref_logits.abs().max()
        assert err < 3e-2, (backend, float(err))
        for n, g in ref_grads.items():
            rel = (grads[n] - g).norm() / g.norm().clamp_min(1e-12)
            assert rel < 0.1, (backend, n, float(rel))


@pytest.mark.skipif(not torch.cuda.is_available() or "flash" not in available_backends(),
                    reason="no CUDA device, or flash-attn is not installed")
def test_flash_varlen_equals_sdpa_in_fp16_and_bf16():
    batch = docs_batch([33, 200, 7, 16], row_len=256, seed=3)
    for dtype in (torch.float16, torch.bfloat16):
        a, _ = run("flash", dtype, batch)
        b, _ = run("sdpa", dtype, batch)
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="no CUDA device, or one older than Hopper (grouped_mm's bf16 kernel needs 9.0)")
def test_grouped_mm_dispatch_equals_the_expert_loop_in_bf16():
    from vlm.model.moe import MoE

    torch.manual_seed(0)
    moe = MoE(MoEConfig(num_experts=8, top_k=2, expert_hidden=128), 256).to(CUDA, torch.bfloat16)
    x = torch.randn(1000, 256, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    outs = {}
    for dispatch in ("grouped_mm", "loop"):
        moe.dispatch = dispatch
        moe.zero_grad(set_to_none=True)
        x.grad = None
        y = moe(x)[0]
        y.float().square().sum().backward()
        outs[dispatch] = (y.float(), x.grad.float(), moe.w_gate_EDH.grad.float())
    for a, b in zip(outs["grouped_mm"], outs["loop"]):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)


def test_cached_decoding_equals_full_forward_on_cuda():
    torch.manual_seed(0)
    m = ConceptMoELM(cfg()).to(CUDA).eval()
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, V, (n,), generator=g).tolist() for n in (9, 17)]

    def batch(rows):
        T = max(map(len, rows))
        ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
        doc = torch.tensor([[0] * len(r) + [-1] * (T - len(r)) for r in rows])
        pos = torch.tensor([list(range(len(r))) + [0] * (T - len(r)) for r in rows])
        return PackedBatch(ids, torch.full_like(ids, -100), doc, pos, torch.zeros_like(ids)).to(CUDA)

    last = lambda rows: torch.tensor([len(r) - 1 for r in rows], device=CUDA)  # noqa: E731
    with torch.no_grad():
        out, cache = m.prefill(batch(rows), max_new_tokens=8)
        logits = out.logits[torch.arange(2, device=CUDA), last(rows)]
        for _ in range(8):
            full = m(batch(rows)).logits[torch.arange(2, device=CUDA), last(rows)]
            torch.testing.assert_close(logits, full, rtol=1e-3, atol=1e-3)
            tok = logits.argmax(-1)
            for r, t in zip(rows, tok.tolist()):
                r.append(t)
            logits = m.step(m.embed(tok), cache)
