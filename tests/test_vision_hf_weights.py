"""Vision weights from the Hugging Face ecosystem: local SigLIP and CLIP vision checkpoints load
into the packed NaViT encoder (tiny random models built from configs and saved with
save_pretrained)."""

import pytest
import torch

from configs.config import from_dict
from vision.config import VisionConfig

transformers = pytest.importorskip("transformers")

D, LAYERS, HEADS, PATCH = 32, 2, 2, 8


def _tower(path, norm_pre=False):
    cfg = from_dict(
        VisionConfig,
        {
            "processor": {"patch_size": PATCH, "min_patches": 4, "max_patches": 64, "merge": 2},
            "encoder": {
                "hidden_size": D,
                "num_layers": LAYERS,
                "num_heads": HEADS,
                "mlp_ratio": 4.0,
                "max_grid": 32,
                "stem": "linear",
                "merger": "none",
                "norm_pre": norm_pre,
            },
            "timm_checkpoint": str(path),
        },
    )
    return cfg.build(16).encoder


def _sources(kind, tmp_path):
    torch.manual_seed(0)
    common = dict(
        hidden_size=D,
        intermediate_size=4 * D,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        image_size=32,
        patch_size=PATCH,
    )
    if kind == "siglip":
        model = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**common))
    else:
        model = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**common))
    model.save_pretrained(tmp_path)
    # saved with or without the `vision_model.` prefix depending on the transformers version
    return {k.removeprefix("vision_model."): v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", ["siglip", "clip"])
def test_every_vit_weight_of_a_local_checkpoint_lands_in_the_encoder(kind, tmp_path):
    src = _sources(kind, tmp_path)
    enc = _tower(tmp_path, norm_pre=kind == "clip")
    report = enc.load_report
    assert not [n for n in report.untouched if n.startswith(("blocks.", "patch_embed.", "norm"))], (
        report
    )
    for i in range(LAYERS):
        p = f"encoder.layers.{i}."
        q, k, v = (src[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
        assert torch.equal(enc.blocks[i].attn.qkv.weight, torch.cat([q, k, v]))
        assert torch.equal(enc.blocks[i].attn.proj.weight, src[p + "self_attn.out_proj.weight"])
        assert torch.equal(enc.blocks[i].mlp.fc2.weight, src[p + "mlp.fc2.weight"])
        assert torch.equal(enc.blocks[i].norm1.weight, src[p + "layer_norm1.weight"])
    conv = src["embeddings.patch_embedding.weight"]
    assert torch.equal(enc.patch_embed.proj.weight, conv.reshape(D, -1))
    assert torch.equal(enc.norm.weight, src["post_layernorm.weight"])
    # no patch bias in CLIP: the encoder's is zeroed, not left at its random init
    if kind == "clip":
        assert not enc.patch_embed.proj.bias.any()
        assert torch.equal(enc.norm_pre.weight, src["pre_layrnorm.weight"])


def test_a_folder_without_weights_is_refused_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        _tower(tmp_path)


def test_the_architecture_comes_from_the_folder_and_a_mismatch_is_an_error(tmp_path):
    """A config that says otherwise (the conv stem, layer scale, other widths and patch size, as
    configs/default.yaml does for a fresh encoder) still gets the SigLIP tower whole; a tower that
    cannot hold it is refused."""
    from configs.config import ConfigError

    src = _sources("siglip", tmp_path)
    cfg = from_dict(
        VisionConfig,
        {
            "processor": {"patch_size": 14, "min_patches": 4, "max_patches": 64, "merge": 2},
            "encoder": {
                "hidden_size": 48,
                "num_layers": 3,
                "num_heads": 4,
                "stem": "conv",
                "layer_scale": 0.1,
                "max_grid": 32,
                "merger": "none",
            },
            "timm_checkpoint": str(tmp_path),
        },
    )
    assert (cfg.processor.patch_size, cfg.encoder.stem, cfg.encoder.layer_scale) == (
        PATCH,
        "linear",
        None,
    )
    enc = cfg.build(16).encoder
    assert enc.load_report.untouched == [] and not enc.load_report.mismatches()
    assert torch.equal(
        enc.patch_embed.proj.weight, src["embeddings.patch_embedding.weight"].reshape(D, -1)
    )
    assert "architecture read from the checkpoint" in str(enc.load_report)
    rope = from_dict(
        VisionConfig,
        {
            "processor": {"patch_size": PATCH, "min_patches": 4, "max_patches": 64, "merge": 2},
            "encoder": {"pos": "rope2d", "merger": "none"},
            "timm_checkpoint": str(tmp_path),
        },
    )
    with pytest.raises(
        ConfigError,
        match=r"the tower does not match the checkpoint: pos_embed: encoder uses rope2d",
    ):
        rope.build(16)


def test_a_pretrained_tower_skips_the_warm_up_stays_trainable_and_reports(
    tiny_data, tmp_path, torch_globals, tiny_config, load_tiny
):
    from vlm.train.trainer import Trainer

    src = _sources("siglip", tmp_path / "siglip")
    cfg = tiny_config(
        tiny_data,
        train={"stage": "vl", "max_steps": 1},
        logging={"eval_every": 0},
        vision_warmup={
            "steps": 5,
            "freeze_after": True,
            "images_per_step": 4,
            "max_captions": 8,
            "min_word_count": 1,
            "held_out": 0,
        },
    )
    cfg["vision"].update(
        timm_checkpoint=str(tmp_path / "siglip"), encoder={"stem": "conv", "max_grid": 16}
    )
    lines = []
    tr = Trainer(load_tiny(cfg), tmp_path / "run", log=lines.append)
    enc = tr.run.engine.module.vision.encoder
    assert not (tmp_path / "run" / "vision_warmup.json").exists()  # no warm-up ran
    # and nothing froze the tower
    assert all(p.requires_grad for p in enc.parameters())
    # the pretrained weights, untouched
    for i in range(LAYERS):
        assert torch.equal(enc.blocks[i].mlp.fc1.weight, src[f"encoder.layers.{i}.mlp.fc1.weight"])
    assert torch.equal(
        enc.patch_embed.proj.weight, src["embeddings.patch_embedding.weight"].reshape(D, -1)
    )
    report = (tmp_path / "run" / "vision_load_report.txt").read_text()
    assert "0 encoder params kept at init" in report and any(
        report.strip() in line for line in lines
    )
