"""Vision tower = encoder + projector: config round trip, gradients, a tiny training run, processor -> tower.

Legend: D width, N flat tokens or patches, P patches.
"""

import pytest
import torch
from PIL import Image

from configs.config import ConfigError, apply_overrides, from_dict, to_dict
from vision.config import VisionConfig
from vision.image_processor import ImageProcessor, grid_coords
from vision.projector import Projector, ProjectorConfig

TINY = {
    "processor": {"patch_size": 4, "max_patches": 64, "min_patches": 4},
    "encoder": {"hidden_size": 32, "num_heads": 4, "num_layers": 2, "max_grid": 64},
}


def _cfg(**overrides) -> VisionConfig:
    data = apply_overrides(
        to_dict(from_dict(VisionConfig, TINY)), [f"{k}={v}" for k, v in overrides.items()]
    )
    return from_dict(VisionConfig, data)


def _batch(grids, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.randn(r * c, 48, generator=g) for r, c in grids])
    return x, torch.cat([grid_coords(r, c) for r, c in grids]), torch.tensor(grids)


def test_config_round_trip_and_cross_checks():
    cfg = _cfg()
    assert from_dict(VisionConfig, to_dict(cfg)) == cfg
    # stated once, by the processor: the encoder has no copy to disagree
    for key in ("merge", "patch_size"):
        with pytest.raises(ConfigError, match=f"unknown key encoder.{key}"):
            _cfg(**{f"encoder.{key}": 1})
    tower = _cfg(**{"processor.patch_size": 2, "processor.merge": 1}).build(llm_hidden=8)
    assert (
        tower.merge,
        tower.encoder.merge,
        tower.encoder.patch_size,
        tower.encoder.patch_dim,
    ) == (1, 1, 2, 12)
    with pytest.raises(ConfigError, match="max_grid"):
        _cfg(**{"encoder.max_grid": 16})
    with pytest.raises(ConfigError, match="timm_model"):
        _cfg(backbone="timm")
    with pytest.raises(ConfigError, match="allowed values"):
        _cfg(**{"projector.kind": "conv"})


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_tower_shapes_and_tokens_per_image(kind):
    tower = _cfg(**{"projector.kind": kind}).build(llm_hidden=40)
    grids = [(4, 6), (2, 2), (8, 2)]
    out = tower(*_batch(grids))
    assert out.shape == (sum(tower.tokens_per_image(g) for g in grids), 40)
    assert [tower.tokens_per_image(g) for g in grids] == [6, 1, 4]
    assert tower.tokens_per_image(torch.tensor([4, 6])) == 6
    with pytest.raises(ValueError, match="multiples of merge"):
        tower.tokens_per_image((3, 4))


def test_projector_kinds():
    lin = Projector(ProjectorConfig("linear"), 8, 5)
    assert sum(p.numel() for p in lin.parameters()) == 8 * 5 + 5
    mlp = Projector(ProjectorConfig("mlp", hidden_mult=2.0), 8, 5)
    assert mlp.fc1.out_features == 10 and mlp(torch.randn(3, 8)).shape == (3, 5)
    with pytest.raises(ValueError, match="expects 8 features"):
        lin(torch.randn(2, 7))


def test_gradients_reach_every_parameter_and_never_the_padding():
    tower = _cfg(**{"encoder.pos": "rope2d"}).build(llm_hidden=16)
    x, rc, grids = _batch([(4, 4), (2, 6)])
    pad = torch.randn(5, 48)
    xp = torch.cat([x[:10], pad, x[10:]]).requires_grad_(True)
    rcp = torch.cat([rc[:10], torch.zeros(5, 2, dtype=torch.long), rc[10:]])
    valid = torch.ones(len(xp), dtype=torch.bool)
    valid[10:15] = False
    tower(xp, rcp, grids, valid_P=valid).square().sum().backward()
    for name, p in tower.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert xp.grad[valid].abs().sum() > 0 and xp.grad[~valid].abs().sum() == 0


def test_freeze_encoder_keeps_merger_and_projector_trainable():
    tower = _cfg(freeze_encoder=True).build(llm_hidden=16)
    trainable = {n for n, p in tower.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("projector.", "encoder.merger.")) for n in trainable)
    assert any(n.startswith("projector.") for n in trainable)


def test_tiny_training_lowers_loss():
    """The tower learns to read each token's mean colour: a loss that needs encoder, merge and projector."""
    torch.manual_seed(0)
    tower = _cfg(**{"projector.kind": "mlp"}).build(llm_hidden=3)
    grids = [(4, 4), (2, 6), (6, 2), (2, 2)]
    opt = torch.optim.AdamW(tower.parameters(), lr=3e-3)

    def batch(seed):
        x, rc, g = _batch(grids, seed)
        x = x + torch.randn(
            len(x), 3, generator=torch.Generator().manual_seed(seed)
        ).repeat_interleave(16, 1)
        # target per merged token: mean over its 4 patches of each channel's mean
        chans = x.view(len(x), 3, 16).mean(-1)
        lay = tower.encoder.layout(rc, g)
        target = torch.zeros(lay.num_tokens, 3)
        target.index_add_(0, lay.token_index_N, chans / 4)
        return (x, rc, g), target

    losses = []
    for step in range(60):
        inputs, target = batch(step % 8)
        loss = torch.nn.functional.mse_loss(tower(*inputs), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"tiny tower training: loss {first:.4f} -> {last:.4f}")
    assert last < 0.3 * first, (first, last)


def test_processor_output_feeds_the_tower():
    cfg = _cfg()
    proc, tower = ImageProcessor(cfg.processor), cfg.build(llm_hidden=8)
    imgs = [
        proc(Image.new("RGB", s, (i * 40, 100, 200)), f"k{i}")
        for i, s in enumerate([(1, 300), (50, 40), (1, 1)])
    ]
    out = tower(
        torch.cat([p.patches_PD for p in imgs]),
        torch.cat([p.coords_P2 for p in imgs]),
        torch.tensor([p.grid for p in imgs]),
    )
    assert out.shape == (sum(p.num_tokens for p in imgs), 8) and torch.isfinite(out).all()


def test_token_rows_cols_follow_each_images_raster_order():
    from vision.projector import token_rows_cols

    rows, cols = token_rows_cols(torch.tensor([[2, 3], [1, 2]]))
    assert rows.tolist() == [0, 0, 0, 1, 1, 1, 0, 0] and cols.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]


def test_grid_pos_tells_the_llm_where_each_token_is():
    """Equal features at different grid places come out different, by exactly row + col embeddings."""
    torch.manual_seed(0)
    proj = Projector(ProjectorConfig(grid_pos=4), 8, 16)
    x = torch.ones(6, 8)
    y = proj(x, torch.tensor([[2, 3]]))
    assert not torch.allclose(y[0], y[4])
    plain = proj.fc(x)
    # float32 tolerance
    torch.testing.assert_close(y[4] - plain[4], proj.row_pos[1] + proj.col_pos[1])
    with pytest.raises(ValueError, match="grid_pos=4"):
        proj(torch.ones(5, 8), torch.tensor([[1, 5]]))


def test_frac_pos_means_the_same_place_in_every_image_size():
    """frac_pos encodes a token's centre as a fraction of its image: the centre token of a 3x3 and
    of a 5x5 grid get the same added vector, its left and right neighbours different ones; tokens
    are told apart by place."""
    from vision.projector import fraction_features

    torch.manual_seed(0)
    proj = Projector(ProjectorConfig(frac_pos=3), 8, 16)
    grids = torch.tensor([[3, 3], [5, 5]])
    x = torch.ones(9 + 25, 8)
    added = proj(x, grids) - proj.fc(x)
    centre_small, centre_large = 4, 9 + 12
    torch.testing.assert_close(added[centre_small], added[centre_large])
    assert not torch.allclose(added[3], added[5])  # left vs right of the centre
    feats = fraction_features(grids, 1)
    # the lowest frequency's cos is monotone in x: further right, smaller cos x
    cos_x = feats[:9, 3].view(3, 3)
    assert (cos_x[:, :-1] > cos_x[:, 1:]).all()
    with pytest.raises(ValueError, match="frac_pos"):
        ProjectorConfig(frac_pos=-1)
