"""DLCM's causal cross-attention decoder (`model.decoder_mode: cross_attention`, DLCM eq. 12-14 by
concept replication, eq. 17): causal, packing-safe, cached decoding equal to full recompute, counted
by `vlm flops`, trainable, convertible, exportable. Its layer equal to the L x M masked form of eq.
14: tests/test_cross_attention_eq14.py.

Legend: B rows, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from configs.batch import PackedBatch
from configs.config import ConfigError, from_dict
from vlm.model.conceptmoe import ConceptMoELM
from vlm.model.config import ChunkConfig, ConvertConfig, ModelConfig, MoEConfig
from vlm.model.flops import attention_map_flops, count_params, flops_per_token, kv_cache_bytes
from vlm.model.stats import lm_loss
from vlm.train.losses import training_loss

V = 97


def tiny(decoder_layers=2, **chunk) -> ModelConfig:
    return ModelConfig(
        vocab_size=V,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        encoder_layers=1,
        concept_layers=2,
        decoder_layers=decoder_layers,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        chunk=ChunkConfig(**chunk),
        decoder_mode="cross_attention",
    )


VARIANTS = {
    "sum": tiny(merge="sum"),
    "last_delta_one_layer": tiny(merge="last", residual="delta", joint_decoding_layers=1),
    "mean_window_docs": dataclasses.replace(
        tiny(merge="mean"), attention_window=4, attn_backend="docs"
    ),
    "wider_concept": dataclasses.replace(
        tiny(), concept_hidden_size=48, concept_num_heads=6, concept_num_kv_heads=3
    ),
    # Synergy's gated concepts and inputs
    "topk_delta": tiny(router="topk", merge="last", residual="delta"),
}


# ---------------------------------------------------------------- config
def test_config_names_the_modes_and_refuses_meaningless_combinations():
    with pytest.raises(ConfigError, match="'joint', 'cross_attention'"):
        from_dict(ModelConfig, {"decoder_mode": "cross"})
    with pytest.raises(ConfigError, match="'joint', 'cross_attention'"):
        dataclasses.replace(tiny(), decoder_mode="dlcm").validate()
    with pytest.raises(ConfigError, match="chunk.enabled"):
        tiny(enabled=False).validate()
    with pytest.raises(ConfigError, match="no decoder layer a cross-attention"):
        tiny(joint_decoding_layers=0).validate()
    with pytest.raises(ConfigError, match="no decoder layer a cross-attention"):
        tiny(decoder_layers=0).validate()
    with pytest.raises(
        ConfigError, match="decoder_mode: got 'cross', allowed values: 'joint', 'cross_attention'"
    ):
        ConvertConfig(decoder_mode="cross")  # built in Python, it validates itself too
    with pytest.raises(ConfigError, match="convert.decoder_mode: got 'cross'"):
        from_dict(ConvertConfig, {"decoder_mode": "cross"}, "convert")
    # the MoE twin has no concepts: it falls back to the (inert) joint mode
    base = tiny().baseline()
    base.validate()
    assert base.decoder_mode == "joint" and not base.chunk.enabled
    assert (
        from_dict(ModelConfig, {"decoder_mode": "cross_attention"}).decoder_mode
        == "cross_attention"
    )
    assert ModelConfig().decoder_mode == "joint"


# ---------------------------------------------------------------- the model causality in eval mode
# and packing isolation of these variants: tests/test_model_core.py's VARIANTS


def test_causal_train_mode_with_fixed_boundaries(seeded_lm, rand_docs):
    m = seeded_lm(VARIANTS["sum"]).train()
    docs = rand_docs(V, [40], 3)
    for t in (0, 8, 21, 38):
        changed = [docs[0][: t + 1] + rand_docs(V, [40 - t - 1], 4 + t)[0]]
        force = torch.rand(1, 40, generator=torch.Generator().manual_seed(5)) < 0.4
        batch = PackedBatch.from_documents(docs)
        a = m(batch, force=force)
        c = m(PackedBatch.from_documents(changed), force=force)
        torch.testing.assert_close(a.logits[:, : t + 1], c.logits[:, : t + 1], rtol=1e-5, atol=1e-5)
    training_loss(a, batch, m.cfg).backward()  # the training graph is complete
    assert all(blk.cross.o_proj.weight.grad.abs().sum() > 0 for blk in m.decoder)


@pytest.mark.parametrize("name", ["sum", "mean_window_docs"])
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
    for d, (row, off), ref in zip(docs, [(0, 0), (0, 23), (1, 0), (1, 9)], alone):
        torch.testing.assert_close(packed[row, off : off + len(d)], ref, rtol=1e-4, atol=1e-5)


def test_backends_agree_and_the_cross_attention_matters(seeded_lm, rand_docs):
    batch = PackedBatch.stack(
        [PackedBatch.from_documents(rand_docs(V, [20, 30], 11), row_len=56)] * 2
    )
    valid = batch.doc_ids >= 0
    outs = {
        be: seeded_lm(dataclasses.replace(tiny(), attn_backend=be, attention_window=5))(
            batch
        ).logits[valid]
        for be in ("eager", "sdpa", "docs")
    }
    torch.testing.assert_close(outs["eager"], outs["sdpa"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs["docs"], outs["sdpa"], rtol=1e-4, atol=1e-5)
    # the concept read is live: silencing the cross-attention (W_O = 0, the conversion's start)
    # changes the logits
    m = seeded_lm(dataclasses.replace(tiny(), attention_window=5))
    m.zero_joint_projections()
    assert not torch.allclose(m(batch).logits[valid], outs["sdpa"], atol=1e-3)


def _rows_batch(rows: list[list[int]]) -> PackedBatch:
    """Right-padded rows, one document each."""
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    doc = torch.tensor([[0] * len(r) + [-1] * (T - len(r)) for r in rows])
    pos = torch.tensor([list(range(len(r))) + [0] * (T - len(r)) for r in rows])
    return PackedBatch(ids, torch.full_like(ids, -100), doc, pos, torch.zeros_like(ids))


@pytest.mark.parametrize("name", ["sum", "last_delta_one_layer", "wider_concept", "topk_delta"])
def test_cached_decoding_equals_full_recompute(name, seeded_lm, rand_docs):
    """prefill + step (one concept key/value per realized concept, appended when a boundary
    fires) gives the logits of a full forward over the same tokens, for ragged rows, past
    the allocated capacity."""
    m = seeded_lm(VARIANTS[name])
    rows = [list(r) for r in rand_docs(V, [9, 4, 15, 1], 21)]
    B, steps = len(rows), 30
    out, cache = m.prefill(_rows_batch(rows), max_new_tokens=5)  # the caches must grow on the way
    logits = out.last_logits_BV
    fired = []
    for _ in range(steps):
        full = m(_rows_batch(rows)).logits[
            torch.arange(B), torch.tensor([len(r) - 1 for r in rows])
        ]
        torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)
        tok = logits.argmax(-1)
        for r, t in zip(rows, tok.tolist()):
            r.append(t)
        before = cache.chunk.n_concepts_B.clone()
        logits = m.step(m.embed(tok), cache)
        fired.append(cache.chunk.n_concepts_B - before)
    fired = torch.stack(fired)
    # boundaries both fired and did not: both paths ran
    assert 0 < int(fired.sum()) < fired.numel()
    assert len(cache.cross) == m.cfg.num_joint_layers
    # one entry per concept
    assert all(torch.equal(c.len_B, cache.chunk.n_concepts_B) for c in cache.cross)
    assert cache.cross_bytes() > 0


def test_decode_benchmark_fills_counts_and_rewinds_the_cross_caches(seeded_lm):
    """`python -m eval.bench decode` on a cross-attention model: its synthetic context fills the
    cross caches to the context's concept count, its KV bytes include them, and each round starts
    from the same lengths."""
    from eval.bench.decode import decoder, filled_cache

    m = seeded_lm(VARIANTS["sum"])
    B, T, R, steps = 2, 24, 2.0, 6
    cache = filled_cache(m, B, T, R, steps, torch.Generator().manual_seed(0))
    assert len(cache.cross) == m.cfg.num_joint_layers
    assert all(torch.equal(c.len_B, torch.full((B,), T // 2)) for c in cache.cross)
    round_, kv_bytes = decoder(m, B, T, R, steps)
    joint_bytes = (cache.token_bytes() + cache.concept_bytes()) / B
    assert kv_bytes == joint_bytes + cache.cross_bytes() / B and cache.cross_bytes() > 0
    # the second round rewinds (it would overrun the room otherwise)
    assert round_() > 0 and round_() > 0


# ---------------------------------------------------------------- accounting
def test_flops_count_the_cross_attention():
    cfg = ModelConfig(
        vocab_size=10,
        hidden_size=8,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        qk_norm=True,
        encoder_layers=1,
        concept_layers=1,
        decoder_layers=2,
        moe=MoEConfig(num_experts=2, top_k=1, expert_hidden=4),
        chunk=ChunkConfig(target_ratio=2.0, joint_decoding_layers=1),
        decoder_mode="cross_attention",
    )
    joint = dataclasses.replace(cfg, decoder_mode="joint")
    p, pj = count_params(cfg), count_params(joint)
    # one layer: 2 RMSNorms (block pre-norm, concepts) 16 | q 8*2*4=64, k 8*1*4=32, v 32, o 64 | q/k
    # norms 8
    assert p["cross_attention"] == 16 + 64 + 32 + 32 + 64 + 8 and p["joint_decoding"] == 0
    assert p["total"] == pj["total"] - pj["joint_decoding"] + 216
    # MACs per token: W_Q 64 and W_O 64 per token, W_K and W_V 64 per concept = 32 per token at R
    # = 2
    f, fj = flops_per_token(cfg), flops_per_token(joint)
    assert f["cross_attention"] == 2 * (64 + 64 + 64 / 2) and f["joint_decoding"] == 0
    assert flops_per_token(cfg, ratio=4.0)["cross_attention"] == 2 * (64 + 64 + 64 / 4)
    assert f["total"] == pytest.approx(fj["total"] - fj["joint_decoding"] + 320)
    # attention map: the replicated L x L causal kernel, 4 * Hq * hd per pair, 8 * 9 / 2 pairs,
    # 1 layer
    a, aj = attention_map_flops(cfg, 8), attention_map_flops(joint, 8)
    assert a["cross_attention"] == 4 * 2 * 4 * 36 and aj["cross_attention"] == 0
    assert a["total"] == aj["total"] + 4 * 2 * 4 * 36
    # KV cache: one key and value per concept (8 / R = 4), 2 bytes each
    kv = kv_cache_bytes(cfg, 8, bytes_per_el=2)
    assert (
        kv["cross_attention"] == 2 * 1 * 4 * 2 * 4
        and kv["total"] == kv_cache_bytes(joint, 8)["total"] + 64
    )
    # and the analytic parameter count is the real model's
    for c in (
        cfg,
        dataclasses.replace(cfg, qk_norm=False),
        VARIANTS["wider_concept"],
        VARIANTS["sum"],
    ):
        assert count_params(c)["total"] == sum(q.numel() for q in ConceptMoELM(c).parameters())


def test_vlm_flops_cli_reports_a_cross_attention_config(tmp_path, capsys):
    from vlm.flops_cli import main

    path = tmp_path / "x.yaml"
    path.write_text("model:\n  decoder_layers: 2\n  decoder_mode: cross_attention\n")
    assert main(["flops", "--config", str(path), "--json", "--seq-len", "256"]) == 0
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out)}
    cfg = from_dict(ModelConfig, {"decoder_layers": 2, "decoder_mode": "cross_attention"})
    this = rows["this config"]
    assert this["flops_per_token"] == pytest.approx(flops_per_token(cfg)["total"])
    assert this["attn_map_flops"] == pytest.approx(attention_map_flops(cfg, 256)["total"])
    assert this["total_params"] == count_params(cfg)["total"]


# ---------------------------------------------------------------- training, conversion, export
def test_training_lowers_the_loss():
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        encoder_layers=1,
        concept_layers=1,
        decoder_layers=1,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        chunk=ChunkConfig(target_ratio=2.0),
        decoder_mode="cross_attention",
    )
    m = ConceptMoELM(cfg).train()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    pattern = torch.randint(3, 64, (12,), generator=g).tolist()  # a learnable, repetitive language
    w0 = m.decoder[0].cross.o_proj.weight.detach().clone()
    losses = []
    for _ in range(30):
        docs = [
            (pattern * 4)[int(s) : int(s) + n]
            for s, n in zip(torch.randint(0, 12, (4,), generator=g), (30, 17, 25, 22))
        ]
        batch = PackedBatch.stack(
            [
                PackedBatch.from_documents(docs[:2], row_len=48),
                PackedBatch.from_documents(docs[2:], row_len=48),
            ]
        )
        out = m(batch)
        opt.zero_grad()
        training_loss(out, batch, m.cfg).backward()
        opt.step()
        losses.append(lm_loss(out, batch).item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, (first, last)
    # the cross-attention itself learns
    assert not torch.equal(m.decoder[0].cross.o_proj.weight, w0)


def test_conversion_to_cross_attention_is_lossless(tmp_path, rand_docs):
    from vlm.model.convert import convert
    from vlm.model.hf import save_pretrained
    from vlm.model.multimodal import ConceptMoEVLM

    torch.manual_seed(2)
    base = dataclasses.replace(tiny(decoder_layers=1), concept_layers=2).baseline()
    src = ConceptMoEVLM(base).eval()
    save_pretrained(src, tmp_path / "base")
    model, _ = convert(
        tmp_path / "base",
        ConvertConfig(encoder_layers=1, decoder_layers=1, decoder_mode="cross_attention"),
    )
    assert (
        model.model_cfg.decoder_mode == "cross_attention" and model.lm.decoder[0].cross is not None
    )
    batch = PackedBatch.stack(
        [PackedBatch.from_documents(rand_docs(V, [20, 30], 9), row_len=56)] * 2
    )
    valid = batch.doc_ids >= 0
    with torch.no_grad():
        torch.testing.assert_close(
            model.eval()(batch, force="all").logits[valid],
            src(batch).logits[valid],
            rtol=1e-5,
            atol=1e-5,
        )
    # the same through the CLI
    from vlm.cli import main
    from vlm.model.hf import load_vlm

    assert (
        main(
            [
                "convert",
                str(tmp_path / "base"),
                "--out",
                str(tmp_path / "ct"),
                "--encoder-layers",
                "1",
                "--decoder-layers",
                "1",
                "--decoder-mode",
                "cross_attention",
            ]
        )
        == 0
    )
    assert load_vlm(tmp_path / "ct").model_cfg.decoder_mode == "cross_attention"


def test_export_round_trip_and_cached_generate(tmp_path, rand_docs):
    from vlm.model.hf import ConceptMoEForCausalLM, hf_config_for, load_vlm, save_pretrained
    from vlm.model.multimodal import ConceptMoEVLM

    torch.manual_seed(0)
    vlm = ConceptMoEVLM(tiny(merge="sum")).eval()
    save_pretrained(vlm, tmp_path / "x")
    back = load_vlm(tmp_path / "x").eval()
    assert back.model_cfg.decoder_mode == "cross_attention"
    batch = PackedBatch.from_documents(rand_docs(V, [20, 15], 3), row_len=40)
    torch.testing.assert_close(back(batch).logits, vlm(batch).logits)
    hf = ConceptMoEForCausalLM(hf_config_for(vlm), vlm=vlm).eval()
    ids = torch.tensor(rand_docs(V, [6, 6], 5))
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    cached = hf.generate(ids, attention_mask=torch.ones_like(ids), use_cache=True, **kw)
    plain = hf.generate(ids, attention_mask=torch.ones_like(ids), use_cache=False, **kw)
    assert torch.equal(cached, plain)
