"""Vision weights from the Hugging Face ecosystem: local SigLIP and CLIP vision checkpoints load into the
packed NaViT encoder (tiny random models built from configs and saved with save_pretrained)."""
import pytest
import torch

from configs.config import from_dict
from vision.config import VisionConfig

transformers = pytest.importorskip("transformers")

D, LAYERS, HEADS, PATCH = 32, 2, 2, 8


def _tower(path, norm_pre=False):
    cfg = from_dict(VisionConfig, {
        "processor": {"patch_size": PATCH, "min_patches": 4, "max_patches": 64, "merge": 2},
        "encoder": {"hidden_size": D, "num_layers": LAYERS, "num_heads": HEADS, "mlp_ratio": 4.0, "max_grid": 32,
                    "stem": "linear", "merger": "none", "norm_pre": norm_pre},
        "timm_checkpoint": str(path)})
    return cfg.build(16).encoder


def _sources(kind, tmp_path):
    torch.manual_seed(0)
    common = dict(hidden_size=D, intermediate_size=4 * D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  image_size=32, patch_size=PATCH)
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
    assert not [n for n in report.untouched if n.startswith(("blocks.", "patch_embed.", "norm"))], report
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
    if kind == "clip":   # no patch bias in CLIP: the encoder's is zeroed, not left at its random init
        assert not enc.patch_embed.proj.bias.any()
        assert torch.equal(enc.norm_pre.weight, src["pre_layrnorm.weight"])


def test_a_folder_without_weights_is_refused_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        _tower(tmp_path)
