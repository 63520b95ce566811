"""Packed NaViT encoder: block-diagonal isolation, padding invariance, merge order, both position schemes.

Legend: P patches.
"""

import pytest
import torch

from configs.config import ConfigError, from_dict
from vision.config import VisionConfig
from vision.image_processor import grid_coords
from vision.navit import NaViTConfig, NaViTEncoder

GRIDS = [(4, 6), (2, 2), (8, 4), (6, 2)]
PD = 3 * 4 * 4  # patch_size 4 keeps the tests tiny


def _encoder(pos="learned2d", merge=2, **kw):
    torch.manual_seed(0)
    return NaViTEncoder(
        NaViTConfig(hidden_size=32, num_heads=4, num_layers=2, pos=pos, max_grid=16, **kw),
        patch_size=4,
        merge=merge,
    ).eval()


def _images(grids=GRIDS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(r * c, PD, generator=g) for r, c in grids], [
        grid_coords(r, c) for r, c in grids
    ]


def _packed(patches, coords, grids):
    return torch.cat(patches), torch.cat(coords), torch.tensor(grids)


@pytest.mark.parametrize("stem", ["linear", "conv"])
@pytest.mark.parametrize("merge", [1, 2])
@pytest.mark.parametrize("pos", ["learned2d", "rope2d"])
def test_packed_equals_alone(pos, merge, stem):
    enc = _encoder(pos, merge, stem=stem)
    patches, coords = _images()
    with torch.no_grad():
        packed = enc(*_packed(patches, coords, GRIDS))
        alone = torch.cat([enc(p, c, torch.tensor([g])) for p, c, g in zip(patches, coords, GRIDS)])
    n_tokens = sum((r // merge) * (c // merge) for r, c in GRIDS)
    assert packed.shape == (n_tokens, enc.out_dim) and enc.out_dim == 32 * merge**2
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stem", ["linear", "conv"])
@pytest.mark.parametrize("pos", ["learned2d", "rope2d"])
def test_images_never_see_each_other(pos, stem):
    enc = _encoder(pos, stem=stem)
    patches, coords = _images()
    changed = [p.clone() for p in patches]
    changed[1] = torch.randn_like(changed[1]) * 3
    with torch.no_grad():
        a, b = enc(*_packed(patches, coords, GRIDS)), enc(*_packed(changed, coords, GRIDS))
    t = [(r // 2) * (c // 2) for r, c in GRIDS]
    img1 = slice(t[0], t[0] + t[1])
    assert not torch.allclose(a[img1], b[img1])  # image 1 did change ...
    keep = torch.ones(len(a), dtype=torch.bool)
    keep[img1] = False
    torch.testing.assert_close(a[keep], b[keep], atol=1e-6, rtol=0)  # ... and nobody else noticed


@pytest.mark.parametrize("stem", ["linear", "conv"])
@pytest.mark.parametrize("merge", [1, 2])
@pytest.mark.parametrize("pos", ["learned2d", "rope2d"])
def test_padding_never_changes_outputs(pos, merge, stem):
    enc = _encoder(pos, merge, stem=stem)
    patches, coords = _images()
    x, rc, grids = _packed(patches, coords, GRIDS)
    with torch.no_grad():
        ref = enc(x, rc, grids)
    g = torch.Generator().manual_seed(5)
    P = len(x) + 37
    valid = torch.ones(P, dtype=torch.bool)
    valid[torch.randperm(P, generator=g)[:37]] = False  # padding scattered anywhere
    # huge, nan and inf garbage in the pads
    xp = torch.randn(P, PD, generator=g) * 1e4
    xp[~valid][:3] = float("nan")
    xp[torch.nonzero(~valid)[:3, 0]] = float("nan")
    xp[torch.nonzero(~valid)[3:6, 0]] = float("inf")
    # out-of-range coords in pads are ignored
    rcp = torch.randint(0, 99, (P, 2), generator=g)
    xp[valid], rcp[valid] = x, rc
    with torch.no_grad():
        out = enc(xp, rcp, grids, valid_P=valid)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stem", ["linear", "conv"])
@pytest.mark.parametrize("pos", ["learned2d", "rope2d"])
def test_patch_order_inside_an_image_does_not_matter(pos, stem):
    enc = _encoder(pos, stem=stem)
    patches, coords = _images()
    x, rc, grids = _packed(patches, coords, GRIDS)
    perm = torch.cat(
        [
            torch.randperm(r * c) + off
            for (r, c), off in zip(
                GRIDS, torch.tensor([0] + [r * c for r, c in GRIDS]).cumsum(0).tolist()
            )
        ]
    )
    with torch.no_grad():
        torch.testing.assert_close(
            enc(x[perm], rc[perm], grids), enc(x, rc, grids), atol=1e-5, rtol=1e-5
        )


def test_merge_concatenates_2x2_blocks_in_raster_order():
    enc = _encoder(merger="none")
    patches, coords = _images()
    x, rc, grids = _packed(patches, coords, GRIDS)
    layout = enc.layout(rc, grids)
    with torch.no_grad():
        feats = enc.encode_patches(x, layout)
        tokens = enc(x, rc, grids)
    # image 0 has a 4x6 patch grid -> 2x3 tokens; token (1, 2) = patches (2,4) (2,5) (3,4) (3,5)
    rows, cols = GRIDS[0]
    idx = [r * cols + c for r, c in [(2, 4), (2, 5), (3, 4), (3, 5)]]
    torch.testing.assert_close(tokens[1 * 3 + 2], torch.cat([feats[i] for i in idx]))
    # image 2 (8x4) starts after 6 + 1 tokens; its token (3, 0) = patches (6,0) (6,1) (7,0) (7,1)
    off_patches, off_tokens = 24 + 4, 6 + 1
    idx = [off_patches + r * 4 + c for r, c in [(6, 0), (6, 1), (7, 0), (7, 1)]]
    torch.testing.assert_close(tokens[off_tokens + 3 * 2 + 0], torch.cat([feats[i] for i in idx]))


def test_position_information_is_used():
    # Without positions attention is permutation-equivariant: swapping two patches' contents would
    # just swap their outputs. With either scheme, the outputs must depend on where each patch sits.
    x = torch.randn(4, PD, generator=torch.Generator().manual_seed(3))
    swapped = x[[3, 1, 2, 0]]
    for pos in ["learned2d", "rope2d"]:
        enc = _encoder(pos, merge=1)
        with torch.no_grad():
            # sharpen attention: at init scores are ~0 and RoPE has nothing to rotate
            for blk in enc.blocks:
                blk.attn.qkv.weight.mul_(20)
            out = enc(x, grid_coords(2, 2), torch.tensor([[2, 2]]))
            out_swapped = enc(swapped, grid_coords(2, 2), torch.tensor([[2, 2]]))
        assert (out_swapped[0] - out[3]).abs().max() > 1e-3, pos


def test_out_dim_and_mergers():
    patches, coords = _images()
    for merger, out_dim, expect in [
        ("mlp", None, 128),
        ("linear", 48, 48),
        ("mlp", 24, 24),
        ("none", None, 128),
    ]:
        enc = _encoder(merger=merger, out_dim=out_dim)
        assert enc.out_dim == expect
        assert enc(*_packed(patches, coords, GRIDS)).shape[1] == expect


def test_bad_inputs_raise_clear_errors():
    enc = _encoder()
    patches, coords = _images()
    x, rc, grids = _packed(patches, coords, GRIDS)
    with pytest.raises(ValueError, match="multiples of merge"):
        enc(x[:15], rc[:15], torch.tensor([[3, 5]]))
    with pytest.raises(ValueError, match="valid patches but the image grids"):
        enc(x[:-1], rc[:-1], grids)
    bad = rc.clone()
    bad[0] = torch.tensor([9, 9])
    with pytest.raises(ValueError, match="outside its image's grid"):
        enc(x, bad, grids)
    bad = rc.clone()
    bad[1] = bad[0]
    with pytest.raises(ValueError, match="repeat"):
        enc(x, bad, grids)
    with pytest.raises(ValueError, match="max_grid"):
        enc(torch.randn(40 * 2, PD), grid_coords(40, 2), torch.tensor([[40, 2]]))
    with pytest.raises(ValueError, match="3\\*patch\\*patch"):
        enc(x[:, :10], rc, grids)


def test_config_validation():
    with pytest.raises(ConfigError, match="divisible by num_heads"):
        from_dict(NaViTConfig, {"hidden_size": 30, "num_heads": 4})
    with pytest.raises(ConfigError, match="divisible by 4"):
        from_dict(NaViTConfig, {"hidden_size": 24, "num_heads": 4, "pos": "rope2d"})
    with pytest.raises(ConfigError, match="allowed values"):
        from_dict(NaViTConfig, {"pos": "sincos"})
    with pytest.raises(ConfigError, match="encoder.merger='none'"):  # needs the processor's merge
        from_dict(VisionConfig, {"encoder": {"merger": "none", "out_dim": 10}}, "vision")
    # the patch geometry is the processor's: no second copy here
    for key in ("patch_size", "merge"):
        with pytest.raises(ConfigError, match=f"unknown key {key}"):
            from_dict(NaViTConfig, {key: 2})
    # checked however the config is made
    with pytest.raises(ConfigError, match="divisible by num_heads"):
        NaViTConfig(hidden_size=30, num_heads=4)


def test_grad_checkpointing_gives_same_gradients():
    patches, coords = _images()
    grads = []
    for ckpt in [False, True]:
        enc = _encoder(pos="rope2d", grad_checkpointing=ckpt).train()
        enc(*_packed(patches, coords, GRIDS)).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in enc.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("pos", ["learned2d", "rope2d"])
def test_attention_backends_agree(pos):
    enc = _encoder(pos)
    patches, coords = _images()
    x, rc, grids = _packed(patches, coords, GRIDS)
    valid = torch.ones(len(x) + 6, dtype=torch.bool)
    valid[[0, 9, 30, 31, 50, -1]] = False
    xp = torch.zeros(len(valid), PD)
    rcp = torch.zeros(len(valid), 2, dtype=torch.long)
    xp[valid], rcp[valid] = x, rc
    outs = {}
    with torch.no_grad():
        for backend in ["auto", "dense", "per_image"]:
            enc.cfg.attn_backend = backend
            outs[backend] = enc(x, rc, grids)
            torch.testing.assert_close(
                enc(xp, rcp, grids, valid_P=valid), outs[backend], atol=1e-5, rtol=1e-5
            )
    torch.testing.assert_close(outs["dense"], outs["per_image"], atol=1e-5, rtol=1e-5)
    enc.cfg.attn_backend = "flash"
    # CPU tensors in fp32: never flash, GPU or not
    with pytest.raises(RuntimeError, match="flash-attn"):
        enc(x, rc, grids)


def test_no_images_gives_no_tokens():
    enc = _encoder()
    out = enc(
        torch.zeros(0, PD), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2, dtype=torch.long)
    )
    assert out.shape == (0, enc.out_dim)
    pads = torch.randn(3, PD)
    out = enc(
        pads,
        torch.zeros(3, 2, dtype=torch.long),
        torch.zeros(0, 2, dtype=torch.long),
        valid_P=torch.zeros(3, dtype=torch.bool),
    )
    assert out.shape == (0, enc.out_dim)


@pytest.mark.parametrize(
    "patch,strides", [(4, [2, 2]), (8, [2, 2, 2]), (14, [2, 7]), (6, [2, 3]), (1, [])]
)
def test_conv_stem_strides_multiply_to_the_patch_size(patch, strides):
    from vision.navit import stem_strides

    assert stem_strides(patch) == strides


def test_conv_stem_is_a_convolution_over_each_whole_image():
    """Each patch's vector is the stem's conv stack applied to its image's pixels with a one-patch
    zero margin (kernels cross patch borders), read at the patch's grid cell: the same as running
    the convs on that image alone, whatever else is packed with it."""
    from vision.image_processor import unpatchify
    from vision.packing import build_layout

    enc = _encoder(stem="conv")
    patches, coords = _images()
    packed, where, grids = _packed(patches, coords, GRIDS)
    with torch.no_grad():
        got = enc.patch_embed(packed, build_layout(where, grids, 2))
        want = []
        for p, (r, c) in zip(patches, GRIDS):
            # [1, 3, r*4+8, c*4+8]
            img = torch.nn.functional.pad(unpatchify(p, (r, c), 4)[None], (4, 4, 4, 4))
            stem = enc.patch_embed
            grid = stem.grid_conv(torch.nn.functional.gelu(stem.convs(img)))[0, :, 1:-1, 1:-1]
            want.append(grid.permute(1, 2, 0).reshape(r * c, -1))
    torch.testing.assert_close(got, torch.cat(want), atol=1e-5, rtol=1e-5)
    # a border-crossing kernel: changing one patch's pixels moves its neighbour's vector too
    changed = packed.clone()
    changed[0] += 1.0
    with torch.no_grad():
        moved = enc.patch_embed(changed, build_layout(where, grids, 2))
    assert not torch.allclose(moved[1], got[1])
