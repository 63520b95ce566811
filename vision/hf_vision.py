"""Hugging Face SigLIP / CLIP vision checkpoints in timm's key layout, so that one
loader serves both.

`SiglipVisionModel` / `CLIPVisionModel` (and the vision half of their full models) name the ViT's
parts `vision_model.embeddings.*`, `vision_model.encoder.layers.i.*` with separate q/k/v
projections; timm names them `patch_embed`, `pos_embed`, `blocks.i.attn.qkv` (q, k, v stacked). The
mapping is exact for the weights; what differs is only outside the weights: SigLIP's
tanh-approximated GELU and CLIP's quick-GELU against the encoder's exact GELU, and a full 2D
position table fitted into learned2d's row and column tables (see
timm_backbone.load_timm_vit_state_dict, which reports how well it fits).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

_PREFIX = re.compile(r"^(?:vision_model\.|model\.vision_model\.|siglip\.vision_model\.)")
_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(.+)$")
_LAYER_PARTS = {
    "layer_norm1": "norm1",
    "layer_norm2": "norm2",
    "self_attn.out_proj": "attn.proj",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}


def is_hf_vision_layout(sd: dict[str, torch.Tensor]) -> bool:
    return (
        any(_PREFIX.match(k) and ".embeddings.patch_embedding." in k for k in sd)
        or "embeddings.patch_embedding.weight" in sd
    )


def hf_vision_to_timm(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A SigLIP / CLIP vision state dict -> timm ViT names (text towers, heads and unknown keys dropped)."""
    vis = {}
    for k, v in sd.items():
        m = _PREFIX.match(k)
        if m:
            vis[k[m.end() :]] = v
        elif k.startswith(("embeddings.", "encoder.", "post_layernorm.", "pre_layrnorm.")):
            vis[k] = v  # a bare vision model saved without the vision_model prefix
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for k, v in vis.items():
        if k.startswith("embeddings.patch_embedding."):
            out["patch_embed.proj." + k.rsplit(".", 1)[1]] = v
        elif k == "embeddings.position_embedding.weight":
            out["pos_embed"] = v[None]
        elif k == "embeddings.class_embedding":  # CLIP: its position-table entry comes first
            out["cls_token"] = v.reshape(1, 1, -1)
        elif k.startswith("post_layernorm."):
            out["norm." + k.rsplit(".", 1)[1]] = v
        elif k.startswith("pre_layrnorm."):  # (sic: CLIP's name)
            out["norm_pre." + k.rsplit(".", 1)[1]] = v
        elif m := _LAYER.match(k):
            i, rest = int(m.group(1)), m.group(2)
            part, kind = rest.rsplit(".", 1)
            if part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                qkv.setdefault((i, kind), {})[part[-6]] = v
            elif part in _LAYER_PARTS:
                out[f"blocks.{i}.{_LAYER_PARTS[part]}.{kind}"] = v
            else:
                out[f"blocks.{i}.{rest}"] = v  # reported as unsupported by the loader
        else:
            # heads and the like: the loader reports them skipped
            out[k] = v
    if "patch_embed.proj.weight" in out and "patch_embed.proj.bias" not in out:  # CLIP's has none
        w = out["patch_embed.proj.weight"]
        out["patch_embed.proj.bias"] = w.new_zeros(w.shape[0])
    for (i, kind), parts in qkv.items():
        if set(parts) == {"q", "k", "v"}:
            out[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return out


def hf_vision_architecture(path: str | Path) -> tuple[dict, int] | None:
    """(NaViTConfig fields, patch size) of the ViT a Hugging Face SigLIP / CLIP folder holds, read
    from its config.json; None for anything else (a timm weights file states no architecture). A
    packed encoder built with them has a place for every tower tensor: linear patch embedding (a
    stride-p conv), no layer scale."""
    path = Path(path)
    if not (path.is_dir() and (path / "config.json").is_file()):
        return None
    import json

    info = json.loads((path / "config.json").read_text())
    v = info.get("vision_config") if isinstance(info.get("vision_config"), dict) else info
    kind = str(v.get("model_type") or info.get("model_type") or "")
    if not kind.startswith(("siglip", "clip")):
        return None
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(path))
    cfg = getattr(cfg, "vision_config", cfg)
    return {
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_hidden_layers,
        "num_heads": cfg.num_attention_heads,
        "mlp_ratio": cfg.intermediate_size / cfg.hidden_size,
        "mlp_hidden": cfg.intermediate_size,
        "stem": "linear",
        "layer_scale": None,
        "norm_pre": kind.startswith("clip"),
        "norm_eps": cfg.layer_norm_eps,
        "qkv_bias": True,
    }, cfg.patch_size
