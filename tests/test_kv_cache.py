"""Concept-level KV-cache decoding equals full recompute: same tokens, logits within 1e-4, for a
ragged batch of mixed text and image prompts, for every reallocation of the concept model and for
the MoE baseline.

Legend: B rows, T tokens, D width, P patches, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from configs.batch import IMAGE, TEXT, PackedBatch
from vision.config import VisionConfig
from vision.image_processor import ImageProcessorConfig
from vision.navit import NaViTConfig
from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig
from vlm.model.multimodal import ConceptMoEVLM

V, PAD_IMG, STEPS = 64, 1, 64


def vision_cfg():
    return VisionConfig(
        processor=ImageProcessorConfig(patch_size=4, min_patches=4, max_patches=16, merge=2),
        encoder=NaViTConfig(hidden_size=16, num_layers=1, num_heads=2, max_grid=16),
    )


def lm(**chunk) -> ModelConfig:
    return ModelConfig(
        vocab_size=V,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        encoder_layers=1,
        concept_layers=2,
        decoder_layers=2,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        chunk=ChunkConfig(**chunk),
    )


VARIANTS = {
    # as configs/default.yaml; joint decoding everywhere
    "conceptmoe": lm(merge="sum"),
    "last_merge_one_joint_layer": lm(merge="last", joint_decoding_layers=1),
    "linear_router_mean": lm(merge="mean", router="linear", residual="linear"),
    "fixed_router_last": lm(merge="last", router="fixed", target_ratio=3.0),
    "delta_residual_last": lm(merge="last", residual="delta"),  # the conversion's dechunk
    "local_window": dataclasses.replace(lm(merge="sum"), attention_window=3),
    "topk_router": lm(merge="sum", router="topk"),
    # eq. 3's gate on c and c_in
    "topk_router_delta": lm(merge="last", router="topk", residual="delta"),
    "loop_more_experts": dataclasses.replace(
        lm(), loop_start=0, loop_end=2, loop_times=1, concept_pos="none"
    ),
    "more_experts": dataclasses.replace(
        lm(), concept_moe=MoEConfig(num_experts=8, top_k=3, expert_hidden=32)
    ),
    "wider_concept": dataclasses.replace(
        lm(), concept_hidden_size=48, concept_num_heads=6, concept_num_kv_heads=3
    ),
    "moe_baseline": lm(enabled=False),
}


def picture(seed, size):
    return Image.fromarray(
        np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    )


def prompts(proc, rng):
    """Four one-document rows of different lengths: text only, one image, two images, text + image + text."""
    specs = [
        [list(rng.integers(2, V, 9))],
        [[2], picture(1, (12, 8)), list(rng.integers(2, V, 3))],
        [[2, 5], picture(2, (8, 8)), [7], picture(3, (16, 12)), list(rng.integers(2, V, 4))],
        [list(rng.integers(2, V, 20)), picture(4, (8, 12)), list(rng.integers(2, V, 2))],
    ]
    rows = []
    for segs in specs:
        ids, mod, patches, coords, grids = [], [], [], [], []
        for seg in segs:
            if isinstance(seg, Image.Image):
                pi = proc(seg)
                ids += [PAD_IMG] * pi.num_tokens
                mod += [IMAGE] * pi.num_tokens
                patches.append(pi.patches_PD), coords.append(pi.coords_P2), grids.append(pi.grid)
            else:
                ids += [int(t) for t in seg]
                mod += [TEXT] * len(seg)
        rows.append((ids, mod, patches, coords, grids))
    return rows


def batch_of(rows, generated: list[list[int]]) -> PackedBatch:
    """Right-padded rows: each prompt followed by the tokens generated for it so far."""
    T = max(len(r[0]) + len(g) for r, g in zip(rows, generated))
    cols = {k: [] for k in ("ids", "doc", "pos", "mod")}
    for (ids, mod, *_), g in zip(rows, generated):
        n, pad = len(ids) + len(g), T - len(ids) - len(g)
        cols["ids"].append(ids + g + [0] * pad)
        cols["doc"].append([0] * n + [-1] * pad)
        cols["pos"].append(list(range(n)) + [0] * pad)
        cols["mod"].append(mod + [TEXT] * (len(g) + pad))
    t = {k: torch.tensor(v) for k, v in cols.items()}
    patches = [p for r in rows for p in r[2]]
    return PackedBatch(
        t["ids"],
        torch.full_like(t["ids"], -100),
        t["doc"],
        t["pos"],
        t["mod"],
        torch.cat(patches),
        torch.cat([c for r in rows for c in r[3]]),
        torch.tensor([g for r in rows for g in r[4]]),
    )


def decode_both(model, rows, sample: bool):
    """Token by token, the cached path and full recompute side by side; returns per-step max logit gaps."""
    B = len(rows)
    gen_c = torch.Generator().manual_seed(0)
    gen_f = torch.Generator().manual_seed(0)
    out, cache = model.prefill(batch_of(rows, [[] for _ in rows]), STEPS)
    last = torch.tensor([len(r[0]) - 1 for r in rows])
    logits_c = out.last_logits_BV
    generated: list[list[int]] = [[] for _ in rows]
    gaps = []
    for _ in range(STEPS):
        full = model(batch_of(rows, generated)).logits
        logits_f = full[torch.arange(B), last + torch.tensor([len(g) for g in generated])]
        gaps.append(float((logits_c - logits_f).abs().max()))
        if sample:
            tok_c = torch.multinomial(torch.softmax(logits_c, -1), 1, generator=gen_c)[:, 0]
            tok_f = torch.multinomial(torch.softmax(logits_f, -1), 1, generator=gen_f)[:, 0]
        else:
            tok_c, tok_f = logits_c.argmax(-1), logits_f.argmax(-1)
        assert torch.equal(tok_c, tok_f), f"tokens differ after {len(generated[0])} steps"
        for g, t in zip(generated, tok_c.tolist()):
            g.append(t)
        logits_c = model.step(tok_c, cache)
    return gaps, cache


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_cached_decoding_equals_full_recompute(name, sample):
    torch.manual_seed(0)
    vc = vision_cfg()
    model = ConceptMoEVLM(VARIANTS[name], vc).eval()
    rows = prompts(vc.build_processor(), np.random.default_rng(0))
    gaps, cache = decode_both(model, rows, sample)
    assert max(gaps) < 1e-4, f"largest logit gap {max(gaps):.2e} (step {int(np.argmax(gaps))})"
    assert torch.equal(cache.len_B, torch.tensor([len(r[0]) + STEPS for r in rows]))


def test_topk_decoding_reads_the_learned_threshold():
    """The top-k router's inference rule is score >= threshold, in the full forward and in `step`
    alike. Every model above has threshold 0 (never trained); a non-zero one must move the
    boundaries and leave cached decoding equal to recompute."""
    torch.manual_seed(0)
    vc = vision_cfg()
    model = ConceptMoEVLM(VARIANTS["topk_router"], vc).eval()
    rows = prompts(vc.build_processor(), np.random.default_rng(0))
    batch = batch_of(rows, [[] for _ in rows])
    at_zero = model(batch).chunks.b_BT
    model.lm.chunker.threshold.fill_(0.05)
    assert not torch.equal(model(batch).chunks.b_BT, at_zero)
    gaps, _ = decode_both(model, rows, sample=False)
    assert max(gaps) < 1e-4, f"largest logit gap {max(gaps):.2e} (step {int(np.argmax(gaps))})"


def test_concept_cache_holds_one_entry_per_realized_concept():
    torch.manual_seed(0)
    vc = vision_cfg()
    model = ConceptMoEVLM(VARIANTS["conceptmoe"], vc).eval()
    rows = prompts(vc.build_processor(), np.random.default_rng(0))
    _, cache = decode_both(model, rows, sample=False)
    # the boundaries of the same tokens, recomputed
    full = model(batch_of(rows, [[0] * STEPS for _ in rows]))
    concepts_B = cache.chunk.n_concepts_B
    assert all(torch.equal(c.len_B, concepts_B) for c in cache.concept)
    assert 0 < int(concepts_B.sum()) < int(cache.len_B.sum())
    per_concept = cache.concept_bytes() / int(concepts_B.sum()) / len(cache.concept)
    per_token = (
        cache.token_bytes() / int(cache.len_B.sum()) / (len(cache.encoder) + len(cache.decoder))
    )
    # same width here: the concept cache is 1/R of a token cache
    assert per_concept == per_token
    del full


def test_decode_benchmark_runs_and_writes_its_table(tmp_path):
    """`python -m eval.bench decode` end to end on a tiny context (checks that it runs, not its speed)."""
    import json

    from eval.bench.__main__ import main

    assert main(["decode", "--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode.json").read_text())["rows"]
    assert {r["candidate"] for r in rows} == {
        "baseline (MoE)",
        "more_experts",
        "loop_more_experts",
        "wider_concept",
    }
    base = next(r for r in rows if r["candidate"] == "baseline (MoE)")
    # L/R concepts
    assert all(r["kv_bytes_per_seq"] < base["kv_bytes_per_seq"] for r in rows if r is not base)
    assert (tmp_path / "decode.png").stat().st_size > 0
