"""Vision + ConceptMoE: interleaving, joint compression, per-modality statistics, isolation, learning.

Legend: B rows, T tokens, D width, P patches.
"""

import numpy as np
import pytest
import torch
from PIL import Image

from configs.batch import IGNORE_INDEX, IMAGE, TEXT, PackedBatch
from vision.config import VisionConfig
from vision.image_processor import ImageProcessorConfig
from vision.navit import NaViTConfig
from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig
from vlm.model.multimodal import ConceptMoEVLM
from vlm.model.stats import summarize
from vlm.train.loss_config import LossConfig
from vlm.train.losses import ratio_groups, training_loss

V, PAD_IMG = 64, 1


def vision_cfg():
    return VisionConfig(
        processor=ImageProcessorConfig(patch_size=4, min_patches=4, max_patches=16, merge=2),
        encoder=NaViTConfig(hidden_size=16, num_layers=1, num_heads=2, max_grid=16),
    )


def lm_cfg(**chunk):
    return ModelConfig(
        vocab_size=V,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        encoder_layers=1,
        concept_layers=1,
        decoder_layers=1,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        chunk=ChunkConfig(**chunk),
    )


def image(seed, size=(12, 8)):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def row(docs, proc, row_len):
    """docs: list of documents, each a list of segments (list of token ids, or a PIL image)."""
    ids, doc, mod, patches, coords, grids = [], [], [], [], [], []
    for d, segs in enumerate(docs):
        for seg in segs:
            if isinstance(seg, Image.Image):
                pi = proc(seg)
                ids += [PAD_IMG] * pi.num_tokens
                mod += [IMAGE] * pi.num_tokens
                patches.append(pi.patches_PD), coords.append(pi.coords_P2), grids.append(pi.grid)
            else:
                ids += seg
                mod += [TEXT] * len(seg)
        doc += [d] * (len(ids) - len(doc))
    n = len(ids)
    labels = [
        ids[i + 1]
        if i + 1 < n and doc[i + 1] == doc[i] and mod[i + 1] == TEXT and mod[i] == TEXT
        else IGNORE_INDEX
        for i in range(n)
    ]
    pos = [0] * n
    for i in range(1, n):
        pos[i] = pos[i - 1] + 1 if doc[i] == doc[i - 1] else 0
    pad = row_len - n
    t = lambda xs, fill: torch.tensor(xs + [fill] * pad)[None]  # noqa: E731
    return PackedBatch(
        t(ids, 0),
        t(labels, IGNORE_INDEX),
        t(doc, -1),
        t(pos, 0),
        t(mod, TEXT),
        torch.cat(patches) if patches else None,
        torch.cat(coords) if coords else None,
        torch.tensor(grids) if grids else None,
    )


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    vc = vision_cfg()
    return ConceptMoEVLM(lm_cfg(), vc).eval(), vc.build_processor()


def test_mixed_packing_isolation(setup):
    m, proc = setup
    docs = [
        [[5, 6, 7], image(0), [8, 9, 10, 11]],
        [[12, 13], image(1, (8, 16)), [14], image(2, (16, 8)), [15, 16]],
        [[20, 21, 22, 23, 24]],
    ]
    alone = [m(row([d], proc, 0 + len(row([d], proc, 64).input_ids[0]))).logits[0] for d in docs]
    packed = m(row(docs, proc, 96)).logits[0]
    off = 0
    for d, ref in zip(docs, alone):
        n = ref.shape[0]
        trimmed = row([d], proc, 96)
        n = int((trimmed.doc_ids >= 0).sum())
        torch.testing.assert_close(packed[off : off + n], ref[:n], rtol=1e-4, atol=1e-5)
        off += n


def test_mixed_causality(setup):
    m, proc = setup
    a = row([[[5, 6], image(0), [7, 8, 9, 10, 11, 12]]], proc, 40)
    b = row([[[5, 6], image(0), [7, 8, 30, 31, 32, 33]]], proc, 40)
    la, lb = m(a).logits, m(b).logits
    n_img = int((a.modality == IMAGE).sum())
    t = 2 + n_img + 2
    torch.testing.assert_close(la[:, :t], lb[:, :t], rtol=1e-5, atol=1e-5)
    # and the image itself is causal for later text: a different image changes later logits only
    c = row([[[5, 6], image(9), [7, 8, 9, 10, 11, 12]]], proc, 40)
    lc = m(c).logits
    torch.testing.assert_close(la[:, :2], lc[:, :2], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(la[:, t:], lc[:, t:])


def test_per_modality_statistics_hand_counted(setup):
    m, proc = setup
    b = row([[[5, 6, 7], image(0, (16, 16)), [8, 9]], [[10, 11, 12, 13]]], proc, 24)
    # 4x4 patches, 2x2 merged
    assert (b.modality[0] == IMAGE).nonzero().flatten().tolist() == [3, 4, 5, 6]
    # Boundaries by hand: doc starts (0 and 9) plus position 2 (text), 3 and 5 (image), 11 (text)
    force = torch.zeros_like(b.doc_ids, dtype=torch.bool)
    force[0, [2, 3, 5, 11]] = True
    out = m(b, force=force)
    s = summarize(out, b)
    # text: 3 + 2 + 4 = 9 tokens, boundaries at 0, 2, 9, 11 -> 4; image: 4 tokens, boundaries at 3,
    # 5 -> 2
    assert (
        s["tokens/text"] == 9
        and s["boundaries/text"] == 4
        and s["compression/text"] == pytest.approx(9 / 4)
    )
    assert (
        s["tokens/image"] == 4
        and s["boundaries/image"] == 2
        and s["compression/image"] == pytest.approx(2.0)
    )
    assert s["compression/ratio"] == pytest.approx(13 / 6)
    p = out.chunks.p_BT[0]
    img = b.modality[0] == IMAGE
    assert s["boundary_p/image"] == pytest.approx(p[img].mean().item(), rel=1e-5)
    assert s["boundary_p/text"] == pytest.approx(
        p[(b.doc_ids[0] >= 0) & ~img].mean().item(), rel=1e-5
    )
    assert "loss/image_text" in s and "loss/text_only" in s


def test_grid_aware_boundaries_compare_with_the_token_above():
    torch.manual_seed(0)
    vc = vision_cfg()
    m = ConceptMoEVLM(lm_cfg(grid_aware_boundaries=True), vc).eval()
    proc = vc.build_processor()
    b = row([[[5], image(3, (16, 16))]], proc, 24)
    above = m.above_index(b)[0]
    # 2x2 merged grid at positions 1..4
    img_pos = (b.modality[0] == IMAGE).nonzero().flatten().tolist()
    assert [above[i].item() for i in img_pos] == [-1, -1, img_pos[0], img_pos[1]]
    base = ConceptMoEVLM(lm_cfg(), vc).eval()
    base.load_state_dict(m.state_dict())
    assert not torch.allclose(m(b).chunks.p_BT, base(b).chunks.p_BT)


def test_separate_ratio_targets_per_modality(setup):
    _, proc = setup
    torch.manual_seed(0)
    m = ConceptMoEVLM(lm_cfg(modality_target_ratios={"text": 2.0, "image": 4.0}), vision_cfg())
    b = row([[[5, 6, 7], image(0, (16, 16)), [8, 9]]], proc, 24)
    groups = ratio_groups(m.model_cfg.chunk, b.doc_ids, b.modality)
    assert (
        [r for _, r in groups] == [4.0, 2.0]
        and int(groups[0][0].sum()) == 4
        and int(groups[1][0].sum()) == 5
    )
    out = m.train()(b)
    training_loss(out, b, m.model_cfg).backward()
    assert m.lm.chunker.q_proj.weight.grad.abs().sum() > 0


def test_caption_training_lowers_loss_and_reports_both_ratios():
    """Tiny generated image-caption set: the caption token names the image's colour."""
    torch.manual_seed(0)
    vc = vision_cfg()
    m = ConceptMoEVLM(lm_cfg(), vc).train()
    proc = vc.build_processor()
    colours = {30: (255, 0, 0), 31: (0, 255, 0), 32: (0, 0, 255), 33: (255, 255, 0)}
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    losses, ratios_img, ratios_txt = [], [], []
    for step in range(60):
        rows = []
        for _ in range(4):
            docs = []
            for _ in range(2):
                tok = int(rng.choice(list(colours)))
                img = Image.new("RGB", (12, 12), colours[tok])
                # "<bos> <image> a photo of <colour> <eos>"
                docs.append([[2], img, [40, 41, tok, 3]])
            rows.append(row(docs, proc, 40))
        batch = PackedBatch.stack(rows)
        out = m(batch)
        opt.zero_grad()
        training_loss(out, batch, m.model_cfg, LossConfig(ratio=0.1)).backward()
        opt.step()
        s = summarize(out, batch)
        losses.append(s["loss/image_text"])
        ratios_img.append(s["compression/image"])
        ratios_txt.append(s["compression/text"])
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.5
    assert np.mean(ratios_img[-10:]) >= 1.0 and np.mean(ratios_txt[-10:]) >= 1.0


def test_export_round_trips_the_vision_config(tmp_path):
    """The vision config travels in the transformers config.json; exports written while the encoder
    still repeated the processor's patch_size and merge load too."""
    import json

    from vlm.model.hf import load_vlm, save_pretrained

    torch.manual_seed(0)
    vc = vision_cfg()
    model = ConceptMoEVLM(lm_cfg(), vc)
    save_pretrained(model, tmp_path)
    info = json.loads((tmp_path / "config.json").read_text())
    assert (
        "patch_size" not in info["vision"]["encoder"]
        and info["vision"]["processor"]["patch_size"] == 4
    )
    loaded = load_vlm(tmp_path)
    assert (
        loaded.vision_cfg == vc
        and loaded.vision.merge == 2
        and loaded.vision.encoder.patch_size == 4
    )
    sd = model.state_dict()
    assert all(torch.equal(t, sd[k]) for k, t in loaded.state_dict().items())
    info["vision"]["encoder"].update(patch_size=4, merge=2)  # an export from before
    (tmp_path / "config.json").write_text(json.dumps(info))
    assert load_vlm(tmp_path).vision_cfg == vc
