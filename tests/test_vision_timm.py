"""timm interop without timm: hand-built timm-layout checkpoints load into the packed encoder
and give the same features as a hand-written timm ViT forward; the wrapper is tested only
where timm imports.

Legend: P patches, H height, W width.
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from configs.config import ConfigError, from_dict
from vision.config import VisionConfig
from vision.image_processor import grid_coords, patchify
from vision.navit import NaViTConfig, NaViTEncoder
from vision.timm_backbone import factorise_pos_embed, load_timm_vit_state_dict, resample_table

# hidden, heads, layers, patch size, checkpoint grid side
D, HEADS, LAYERS, P, GRID = 32, 4, 2, 4, 4


def _timm_state_dict(cls_token: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=0.1: torch.randn(*s, generator=g) * scale  # noqa: E731
    # An additive position grid row[r] + col[c], so its factorised fit is exact.
    pos = (r(GRID, 1, D) + r(1, GRID, D)).reshape(1, GRID * GRID, D)
    sd = {
        "patch_embed.proj.weight": r(D, 3, P, P),
        "patch_embed.proj.bias": r(D),
        "norm.weight": 1 + r(D),
        "norm.bias": r(D),
        "head.weight": r(10, D),
        "head.bias": r(10),
    }
    if cls_token:
        sd["cls_token"] = r(1, 1, D)
        pos = torch.cat([r(1, 1, D), pos], dim=1)
    sd["pos_embed"] = pos
    for i in range(LAYERS):
        b = f"blocks.{i}."
        sd.update(
            {
                b + "norm1.weight": 1 + r(D),
                b + "norm1.bias": r(D),
                b + "attn.qkv.weight": r(3 * D, D, scale=0.3),
                b + "attn.qkv.bias": r(3 * D),
                b + "attn.proj.weight": r(D, D),
                b + "attn.proj.bias": r(D),
                b + "norm2.weight": 1 + r(D),
                b + "norm2.bias": r(D),
                b + "mlp.fc1.weight": r(4 * D, D),
                b + "mlp.fc1.bias": r(4 * D),
                b + "mlp.fc2.weight": r(D, 4 * D),
                b + "mlp.fc2.bias": r(D),
            }
        )
    return sd


def _reference_vit(sd: dict, img_13HW: torch.Tensor) -> torch.Tensor:
    """timm VisionTransformer.forward_features written out by hand (no class token): [N, D]."""
    x = F.conv2d(img_13HW, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=P)
    x = x.flatten(2).transpose(1, 2)[0]  # [N, D]
    x = x + sd["pos_embed"][0, -x.shape[0] :]
    for i in range(LAYERS):
        b = f"blocks.{i}."
        h = F.layer_norm(x, (D,), sd[b + "norm1.weight"], sd[b + "norm1.bias"], eps=1e-6)
        q, k, v = (
            (h @ sd[b + "attn.qkv.weight"].T + sd[b + "attn.qkv.bias"])
            .view(-1, 3, HEADS, D // HEADS)
            .unbind(1)
        )
        att = torch.einsum("nhd,mhd->hnm", q, k) / (D // HEADS) ** 0.5
        o = torch.einsum("hnm,mhd->nhd", att.softmax(-1), v).reshape(-1, D)
        x = x + o @ sd[b + "attn.proj.weight"].T + sd[b + "attn.proj.bias"]
        h = F.layer_norm(x, (D,), sd[b + "norm2.weight"], sd[b + "norm2.bias"], eps=1e-6)
        h = F.gelu(h @ sd[b + "mlp.fc1.weight"].T + sd[b + "mlp.fc1.bias"])
        x = x + h @ sd[b + "mlp.fc2.weight"].T + sd[b + "mlp.fc2.bias"]
    return F.layer_norm(x, (D,), sd["norm.weight"], sd["norm.bias"], eps=1e-6)


def _encoder(**kw) -> NaViTEncoder:
    torch.manual_seed(1)
    return NaViTEncoder(
        NaViTConfig(hidden_size=D, num_heads=HEADS, num_layers=LAYERS, max_grid=8, **kw),
        patch_size=P,
        merge=2,
    ).eval()


def _features(enc, img_13HW):
    rows, cols = img_13HW.shape[2] // P, img_13HW.shape[3] // P
    layout = enc.layout(grid_coords(rows, cols), torch.tensor([[rows, cols]]))
    with torch.no_grad():
        return enc.encode_patches(patchify(img_13HW[0], P), layout)


def test_safetensors_checkpoint_matches_reference_vit(tmp_path):
    sd = _timm_state_dict(cls_token=False)
    save_file(sd, str(tmp_path / "vit.safetensors"))
    enc = _encoder()
    report = load_timm_vit_state_dict(enc, tmp_path / "vit.safetensors")
    assert "pos_embed" in report.loaded and "patch_embed.proj.weight" in report.loaded
    # patch w/b, norm w/b, pos, 12 per block
    assert len(report.loaded) == 4 + 1 + LAYERS * 12
    assert {k for k, _ in report.skipped} == {"head.weight", "head.bias"}
    assert report.untouched == []
    torch.testing.assert_close(enc.blocks[1].mlp.fc1.weight, sd["blocks.1.mlp.fc1.weight"])
    img = torch.randn(1, 3, GRID * P, GRID * P)
    torch.testing.assert_close(_features(enc, img), _reference_vit(sd, img), atol=1e-4, rtol=1e-4)


def test_pth_checkpoint_with_class_token_and_wrappers(tmp_path):
    sd = _timm_state_dict(cls_token=True)
    torch.save(
        {"state_dict": {"module." + k: v for k, v in sd.items()}, "epoch": 3}, tmp_path / "vit.pth"
    )
    enc = _encoder()
    report = load_timm_vit_state_dict(enc, tmp_path / "vit.pth")
    reasons = dict(report.skipped)
    assert "prefix tokens" in reasons["cls_token"]
    grid = sd["pos_embed"][0, 1:].reshape(GRID, GRID, D)  # class token's position dropped
    rows, cols = torch.meshgrid(torch.arange(GRID), torch.arange(GRID), indexing="ij")
    table = enc.pos_embed.row[rows] + enc.pos_embed.col[cols]
    torch.testing.assert_close(table, grid, atol=1e-6, rtol=1e-5)
    # "copy"
    assert torch.equal(
        enc.pos_embed.row[GRID:], enc.pos_embed.row[GRID - 1 : GRID].expand(8 - GRID, -1)
    )


def test_naflex_layout_linear_patch_embed_and_factorised_pos(tmp_path):
    sd = _timm_state_dict(cls_token=False)
    conv = sd.pop("patch_embed.proj.weight")
    # naflex (ph, pw, C) flattening
    sd["embeds.proj.weight"] = conv.permute(0, 2, 3, 1).reshape(D, -1)
    sd["embeds.proj.bias"] = sd.pop("patch_embed.proj.bias")
    pos = sd.pop("pos_embed")[0].reshape(GRID, GRID, D)
    row, col, err = factorise_pos_embed(pos)
    sd["embeds.pos_embed_y"], sd["embeds.pos_embed_x"] = row[None], col[None]
    save_file(sd, str(tmp_path / "naflex.safetensors"))
    enc = _encoder()
    report = load_timm_vit_state_dict(enc, tmp_path / "naflex.safetensors")
    assert {"embeds.proj.weight", "embeds.pos_embed_y", "embeds.pos_embed_x"} <= set(report.loaded)
    ref_sd = dict(
        sd,
        **{
            "patch_embed.proj.weight": conv,
            "patch_embed.proj.bias": sd["embeds.proj.bias"],
            "pos_embed": (row[:, None] + col[None]).reshape(1, -1, D),
        },
    )
    img = torch.randn(1, 3, GRID * P, GRID * P)
    torch.testing.assert_close(
        _features(enc, img), _reference_vit(ref_sd, img), atol=1e-4, rtol=1e-4
    )


def test_factorisation_is_the_least_squares_fit():
    g = torch.randn(3, 5, 2, generator=torch.Generator().manual_seed(0))
    row, col, err = factorise_pos_embed(g)
    # Design matrix of grid[r, c] = a[r] + b[c]; lstsq gives the optimal residual to compare with.
    lhs = torch.zeros(15, 8)
    for r in range(3):
        for c in range(5):
            lhs[r * 5 + c, r] = lhs[r * 5 + c, 3 + c] = 1
    sol = torch.linalg.lstsq(lhs, g.reshape(15, 2), driver="gelsd").solution
    best = (lhs @ sol - g.reshape(15, 2)).norm() / g.norm()
    assert abs(err - float(best)) < 1e-5 and err > 0.1
    assert torch.equal(
        resample_table(torch.arange(3.0)[:, None], 5, "copy")[:, 0], torch.tensor([0, 1, 2, 2, 2.0])
    )
    assert torch.allclose(
        resample_table(torch.arange(3.0)[:, None], 5, "interpolate")[:, 0],
        torch.tensor([0, 0.5, 1, 1.5, 2]),
    )


def test_mismatches_are_skipped_with_reasons(tmp_path):
    sd = _timm_state_dict(cls_token=False)
    sd["blocks.0.ls1.gamma"] = torch.ones(D)
    save_file(sd, str(tmp_path / "vit.safetensors"))
    enc = NaViTEncoder(
        NaViTConfig(hidden_size=D, num_heads=HEADS, num_layers=1, pos="rope2d"),
        patch_size=P,
        merge=2,
    )
    reasons = dict(load_timm_vit_state_dict(enc, tmp_path / "vit.safetensors").skipped)
    assert "rope2d" in reasons["pos_embed"]
    assert "layer scale" in reasons["blocks.0.ls1.gamma"]
    assert "blocks.1.attn.qkv.weight" in reasons
    enc8 = NaViTEncoder(
        NaViTConfig(hidden_size=D, num_heads=HEADS, num_layers=1), patch_size=8, merge=2
    )
    assert (
        "patch"
        in dict(load_timm_vit_state_dict(enc8, tmp_path / "vit.safetensors").skipped)[
            "patch_embed.proj.weight"
        ]
    )
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        load_timm_vit_state_dict(enc, tmp_path / "nope.safetensors")


def test_vision_config_loads_checkpoint_into_navit(tmp_path):
    sd = _timm_state_dict(cls_token=False)
    save_file(sd, str(tmp_path / "vit.safetensors"))
    base = {
        "processor": {"patch_size": P, "max_patches": 16},
        "encoder": {"hidden_size": D, "num_heads": HEADS, "num_layers": LAYERS, "max_grid": 16},
    }
    tower = from_dict(
        VisionConfig, dict(base, timm_checkpoint=str(tmp_path / "vit.safetensors"))
    ).build(24)
    torch.testing.assert_close(
        tower.encoder.blocks[0].attn.qkv.weight, sd["blocks.0.attn.qkv.weight"]
    )
    wide = dict(
        base,
        encoder=dict(base["encoder"], hidden_size=64),
        timm_checkpoint=str(tmp_path / "vit.safetensors"),
    )
    with pytest.raises(ConfigError, match="no tensor matched"):
        from_dict(VisionConfig, wide).build(24)


_HAS_TIMM = importlib.util.find_spec("timm") is not None


@pytest.mark.skipif(_HAS_TIMM, reason="checks the error shown when timm is missing")
def test_timm_backbone_without_timm_says_how_to_install():
    cfg = from_dict(VisionConfig, {"backbone": "timm", "timm_model": "naflexvit_base_patch16_gap"})
    with pytest.raises(ImportError, match="timm` extra"):
        cfg.build(32)


@pytest.mark.skipif(not _HAS_TIMM, reason="timm is not installed (optional extra)")
def test_timm_naflex_backbone_packed_equals_alone():
    from vision.timm_backbone import TimmBackbone

    try:
        bb = TimmBackbone(
            "naflexvit_base_patch16_gap", merge=2, patch_size=16, depth=1, embed_dim=64, num_heads=2
        ).eval()
    except ImportError as e:  # timm present but torchvision broken on CPU torch
        pytest.skip(str(e))
    grids = [(2, 4), (4, 2)]
    xs = [torch.randn(r * c, 3 * 16 * 16) for r, c in grids]
    cs = [grid_coords(r, c) for r, c in grids]
    with torch.no_grad():
        packed = bb(torch.cat(xs), torch.cat(cs), torch.tensor(grids))
        alone = torch.cat([bb(x, c, torch.tensor([g])) for x, c, g in zip(xs, cs, grids)])
    assert packed.shape == (4, bb.out_dim)
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=1e-4)


class _FakeTimm:
    """Just enough of timm's API (create_model, NaFlex dict-free forward_features, prefix tokens) to
    check the wrapper's own work: patch layout conversion, unpadding, raster reordering and the
    merge. Each patch's feature is a linear map of its pixels plus its image's mean, so any
    cross-image mixing would show."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # acts on (c, ph, pw)-flattened patches

    def create_model(self, name, pretrained=False, num_classes=0, **kw):
        assert pretrained is False
        w, naflex = self.weight, name.startswith("naflexvit")

        class Model(torch.nn.Module):
            num_prefix_tokens, num_features = 1, w.shape[0]

            def __init__(self):
                super().__init__()
                holder = "embeds" if naflex else "patch_embed"
                setattr(self, holder, torch.nn.Module())
                getattr(self, holder).patch_size = (P, P)
                if naflex:
                    self.embeds.channels_last = True
                    self.w_naflex = w.view(-1, 3, P, P).permute(0, 2, 3, 1).reshape(w.shape[0], -1)

            def forward_features(self, img=None, patches=None, patch_coord=None, patch_valid=None):
                if naflex:
                    f = patches @ self.w_naflex.T  # [I, L, D]
                    m = (f * patch_valid[..., None]).sum(1, keepdim=True) / patch_valid.sum(1)[
                        :, None, None
                    ]
                    f = f + m
                    return {
                        "patches": torch.cat([torch.zeros_like(f[:, :1]), f], 1),
                        "patch_valid": patch_valid,
                    }
                f = F.conv2d(img, w.view(-1, 3, P, P), stride=P).flatten(2).transpose(1, 2)
                f = f + f.mean(1, keepdim=True)
                return torch.cat([torch.zeros_like(f[:, :1]), f], 1)

        return Model()


@pytest.mark.parametrize("name", ["naflexvit_base_patch16_gap", "vit_base_patch16_224"])
def test_timm_backbone_wrapper_logic_with_a_stand_in_timm(monkeypatch, name):
    import sys

    from vision.packing import build_layout, merge_patches
    from vision.timm_backbone import TimmBackbone

    w = torch.randn(8, 3 * P * P)
    monkeypatch.setitem(sys.modules, "timm", _FakeTimm(w))
    bb = TimmBackbone(name, merge=2, patch_size=P, merger="none")
    grids = [(2, 4), (4, 4), (2, 2)]
    xs = [torch.randn(r * c, 3 * P * P) for r, c in grids]
    cs = [grid_coords(r, c) for r, c in grids]
    expected = [x @ w.T + (x @ w.T).mean(0) for x in xs]
    # shuffle patches inside images: order must not matter
    perm = torch.randperm(sum(len(x) for x in xs))
    x, rc, g = torch.cat(xs), torch.cat(cs), torch.tensor(grids)
    layout = build_layout(rc, g, 2)
    ref = merge_patches(torch.cat(expected), layout)
    ids = layout.image_ids_P
    order = torch.cat([perm[ids[perm] == i] for i in range(len(grids))])  # keep images in order
    with torch.no_grad():
        out = bb(x[order], rc[order], g)
    assert out.shape == (sum((r // 2) * (c // 2) for r, c in grids), 8 * 4)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="patch size"):
        TimmBackbone(name, merge=2, patch_size=P + 1)
