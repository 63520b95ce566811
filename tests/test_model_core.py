"""The ConceptMoE LM: causality, packing isolation, lossless start from the baseline, backends, learning.

Legend: B rows, T tokens, Q query heads.
"""

import dataclasses

import pytest
import torch

from configs.batch import PackedBatch
from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig
from vlm.model.context import ForwardContext
from vlm.model.stats import summarize
from vlm.train.losses import training_loss

V = 97


def tiny(**chunk) -> ModelConfig:
    return ModelConfig(
        vocab_size=V,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        encoder_layers=1,
        concept_layers=2,
        decoder_layers=1,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        chunk=ChunkConfig(**chunk),
    )


VARIANTS = {
    "default": tiny(),
    "sum_linear_router": tiny(merge="sum", router="linear", residual="linear"),
    "mean_nope_loop": dataclasses.replace(
        tiny(merge="mean"), concept_pos="none", loop_start=0, loop_end=2, loop_times=1
    ),
    "wider_concept": dataclasses.replace(
        tiny(), concept_hidden_size=48, concept_num_heads=6, concept_num_kv_heads=3
    ),
    "grove_sigmoid": dataclasses.replace(
        tiny(),
        moe=MoEConfig(
            num_experts=4,
            top_k=2,
            expert_hidden=32,
            router="sigmoid",
            grove_groups=2,
            num_shared_experts=1,
            shared_hidden=16,
        ),
    ),
    "fixed_router": tiny(router="fixed", target_ratio=3.0),
    "delta_residual": tiny(merge="last", residual="delta"),
    "local_window": dataclasses.replace(tiny(), attention_window=4),
    "topk_router": tiny(router="topk", target_ratio=3.0),
    "cross_attention": dataclasses.replace(tiny(merge="sum"), decoder_mode="cross_attention"),
    "cross_attention_window_docs": dataclasses.replace(
        tiny(merge="mean"), decoder_mode="cross_attention", attention_window=4, attn_backend="docs"
    ),
    "baseline": tiny(enabled=False),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_causal_eval_mode(name, seeded_lm, rand_docs):
    m = seeded_lm(VARIANTS[name])
    docs = rand_docs(V, [40], 1)
    t = 17
    changed = [docs[0][: t + 1] + rand_docs(V, [40 - t - 1], 2)[0]]
    a = m(PackedBatch.from_documents(docs)).logits
    b = m(PackedBatch.from_documents(changed)).logits
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


@pytest.mark.parametrize("name", ["default", "sum_linear_router", "grove_sigmoid"])
def test_causal_train_mode_with_fixed_boundaries(name, seeded_lm, rand_docs):
    m = seeded_lm(VARIANTS[name]).train()
    docs = rand_docs(V, [40], 3)
    t = 21
    changed = [docs[0][: t + 1] + rand_docs(V, [40 - t - 1], 4)[0]]
    force = torch.rand(1, 40, generator=torch.Generator().manual_seed(5)) < 0.5
    batch = PackedBatch.from_documents(docs)
    a = m(batch, force=force)
    b = m(PackedBatch.from_documents(changed), force=force)
    torch.testing.assert_close(a.logits[:, : t + 1], b.logits[:, : t + 1], rtol=1e-5, atol=1e-5)
    training_loss(a, batch, m.cfg).backward()  # the training graph is complete


@pytest.mark.parametrize("name", list(VARIANTS))
def test_packing_isolation(name, seeded_lm, rand_docs):
    m = seeded_lm(VARIANTS[name])
    docs = rand_docs(V, [23, 31, 9, 17], 7)
    alone = [m(PackedBatch.from_documents([d])).logits[0] for d in docs]
    packed = m(
        PackedBatch.stack(
            [
                PackedBatch.from_documents(docs[:2], row_len=64),
                PackedBatch.from_documents(docs[2:], row_len=64),
            ]
        )
    ).logits
    offsets = [(0, 0), (0, 23), (1, 0), (1, 9)]
    for d, (row, off), ref in zip(docs, offsets, alone):
        torch.testing.assert_close(packed[row, off : off + len(d)], ref, rtol=1e-4, atol=1e-5)


def test_all_boundaries_reproduce_the_baseline(seeded_lm, rand_docs):
    """p = 1 everywhere, `last` merge, zero joint projections, zero residual projection == the MoE baseline."""
    cfg = tiny(merge="last", residual="linear", joint_decoding_zero_init=True)
    base = seeded_lm(cfg.baseline(), seed=3)
    concept = seeded_lm(cfg, seed=4)
    missing, unexpected = concept.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected
    assert all(
        k.startswith(("chunker.", "dechunk.")) or ".attn.c" in k or "concept_norm" in k
        for k in missing
    )
    with torch.no_grad():
        concept.dechunk.residual.weight.zero_()
    batch = PackedBatch.stack(
        [PackedBatch.from_documents(rand_docs(V, [20, 30], 9), row_len=56)] * 2
    )
    valid = batch.doc_ids >= 0  # padding outputs are meaningless and differ
    ref = base(batch).logits[valid]
    got = concept(batch, force="all").logits[valid]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # And the chunker would not, left to itself, reproduce it: the test above is not vacuous.
    assert not torch.allclose(concept(batch).logits[valid], ref, atol=1e-3)


def test_attention_backends_agree(seeded_lm, rand_docs):
    batch = PackedBatch.stack(
        [PackedBatch.from_documents(rand_docs(V, [20, 30], 11), row_len=56)] * 2
    )
    outs = {}
    for backend in ("eager", "sdpa", "docs"):
        for window in (0, 7):
            cfg = dataclasses.replace(tiny(), attn_backend=backend, attention_window=window)
            outs[backend, window] = seeded_lm(cfg)(batch).logits
    # what padding holds after attention is each backend's own (no one reads it)
    valid = batch.doc_ids >= 0
    for window in (0, 7):
        torch.testing.assert_close(
            outs["eager", window][valid], outs["sdpa", window][valid], rtol=1e-4, atol=1e-5
        )
        torch.testing.assert_close(
            outs["docs", window][valid], outs["sdpa", window][valid], rtol=1e-4, atol=1e-5
        )


def test_flash_varlen_layout_matches_the_packed_mask(monkeypatch, seeded_lm, rand_docs):
    """The CUDA flash path's varlen bookkeeping (real-token indices, cu_seqlens, longest segment;
    built once per stack), checked on CPU with a stand-in for flash_attn_varlen_func written from
    its documented contract."""
    import vlm.model.attention as attention
    import vlm.model.block as block

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, window_size):
        assert cu_q.dtype == torch.int32 and max_q == int((cu_q[1:] - cu_q[:-1]).max())
        out = torch.empty_like(q)
        for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            seg = lambda x: x[s:e].transpose(0, 1)[None]  # noqa: E731
            o = torch.nn.functional.scaled_dot_product_attention(
                seg(q), seg(k), seg(v), is_causal=causal, enable_gqa=True
            )
            out[s:e] = o[0].transpose(0, 1)
        return out

    monkeypatch.setattr(attention, "flash_attn_varlen_func", varlen)
    monkeypatch.setattr(block, "resolve_backend", lambda b, d, compiled=False: b)
    batch = PackedBatch.stack(
        [
            PackedBatch.from_documents(rand_docs(V, [20, 30], 11), row_len=56),
            PackedBatch.from_documents(rand_docs(V, [9, 14, 25], 4), row_len=56),
        ]
    )
    valid = batch.doc_ids >= 0
    got = seeded_lm(dataclasses.replace(tiny(), attn_backend="flash"))(batch).logits[valid]
    ref = seeded_lm(dataclasses.replace(tiny(), attn_backend="sdpa"))(batch).logits[valid]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_output_reports_the_lm_loss_and_chunking_stats(seeded_lm, rand_docs):
    m = seeded_lm(tiny())
    batch = PackedBatch.from_documents(rand_docs(V, [30, 20], 12), row_len=64)
    out = m(batch)
    s = summarize(out, batch)
    assert s["tokens/all"] == 50 and s["tokens/text"] == 50 and s["tokens/image"] == 0
    assert s["compression/ratio"] == pytest.approx(50 / s["boundaries/all"])
    assert s["boundaries/all"] == out.chunks.b_BT.sum().item() >= 2
    assert "loss/text_only" in s and "loss/image_text" not in s
    assert s["loss/lm"] == pytest.approx(s["loss/text_only"]) and s["loss/lm"] > 0


@pytest.mark.parametrize("backend", ["sdpa", "eager", "docs"])
def test_sliding_window_attention_sees_itself_and_the_window_before_it(backend):
    """model.attention_window: query i of a document attends to keys i - window + 1 .. i of the same document."""
    from vlm.model.attention import attend

    torch.manual_seed(0)
    window, T = 3, 10
    doc = torch.tensor([[0] * 6 + [1] * 4])
    q, k, v = (torch.randn(1, 2, T, 8) for _ in range(3))
    out = attend(q, k, v, doc, backend, window=window)
    for i in range(T):
        lo = max(i - window + 1, 0 if i < 6 else 6)
        att_QT = torch.softmax(
            (q[0, :, i, None] @ k[0, :, lo : i + 1].transpose(-1, -2))[:, 0] / 8**0.5, -1
        )
        torch.testing.assert_close(
            out[0, :, i], (att_QT[:, None] @ v[0, :, lo : i + 1])[:, 0], rtol=1e-5, atol=1e-5
        )


def test_per_document_backend_trains_like_the_packed_mask(seeded_lm, rand_docs):
    """attn_backend docs (one SDPA per document, no T x T mask): same loss and gradients as SDPA + mask."""
    batch = PackedBatch.stack(
        [PackedBatch.from_documents(rand_docs(V, [12, 25, 9], 5), row_len=50)] * 2
    )
    grads = {}
    for backend in ("sdpa", "docs"):
        m = seeded_lm(dataclasses.replace(tiny(), attn_backend=backend)).train()
        out = m(batch, context=ForwardContext(torch.tensor(0)))
        training_loss(out, batch, m.cfg).backward()
        grads[backend] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert grads["docs"].keys() == grads["sdpa"].keys()
    for n in grads["sdpa"]:
        torch.testing.assert_close(grads["docs"][n], grads["sdpa"][n], rtol=1e-4, atol=1e-5, msg=n)
