"""Saved checkpoint keys never change for style: every model variant's `state_dict()` keys (parameter
and buffer names, `w_gate_EDF`, `adj_gate_GDF`, `expert_bias`, ...) are the ones in
tests/data/state_dict_keys.json, generated before the shape-suffix renames of issue 42. A rename of a
local or an argument leaves them alone; a rename of a parameter breaks every checkpoint out there and
needs an entry in vlm.model.legacy_names instead (and a regenerated list:
`python tests/test_state_dict_keys.py`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from vision.config import VisionConfig
from vision.image_processor import ImageProcessorConfig
from vision.navit import NaViTConfig
from vision.projector import ProjectorConfig
from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig
from vlm.model.multimodal import ConceptMoEVLM

DATA = Path(__file__).resolve().parent / "data" / "state_dict_keys.json"


def _lm(**kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8)
    base.update(kw)
    base.setdefault("moe", MoEConfig(num_experts=4, top_k=2, expert_hidden=16))
    return ModelConfig(**base)


def _vision(**kw) -> VisionConfig:
    return VisionConfig(
        processor=ImageProcessorConfig(patch_size=4, min_patches=4, max_patches=16, merge=2),
        encoder=NaViTConfig(hidden_size=16, num_layers=1, num_heads=2, max_grid=16),
        **kw,
    )


def variants() -> dict[str, tuple[ModelConfig, VisionConfig | None]]:
    grove = MoEConfig(
        num_experts=4, top_k=2, expert_hidden=16, router="grove", grove_groups=2, grove_hidden=8
    )
    shared = MoEConfig(
        num_experts=4, top_k=2, expert_hidden=16, num_shared_experts=1, shared_hidden=8
    )
    return {
        "default": (_lm(), None),
        "grove": (_lm(moe=grove), None),
        "shared_experts": (_lm(moe=shared), None),
        "no_chunking": (_lm(chunk=ChunkConfig(enabled=False)), None),
        "linear_router_linear_residual": (
            _lm(chunk=ChunkConfig(router="linear", residual="linear")),
            None,
        ),
        "cross_attention_decoder": (_lm(decoder_mode="cross_attention"), None),
        "concept_width": (
            _lm(concept_hidden_size=24, concept_num_heads=3, concept_num_kv_heads=1),
            None,
        ),
        "tied_embeddings": (_lm(tie_embeddings=True), None),
        "vision": (_lm(), _vision()),
        "vision_mlp_grid_pos": (_lm(), _vision(projector=ProjectorConfig(kind="mlp", grid_pos=8))),
    }


def keys_now() -> dict[str, list[str]]:
    torch.manual_seed(0)
    return {name: sorted(ConceptMoEVLM(m, v).state_dict()) for name, (m, v) in variants().items()}


def test_no_variant_s_state_dict_keys_changed():
    saved = json.loads(DATA.read_text())
    now = keys_now()
    assert sorted(now) == sorted(saved)
    for name in saved:
        gone = sorted(set(saved[name]) - set(now[name]))
        new = sorted(set(now[name]) - set(saved[name]))
        assert not gone and not new, f"{name}: keys gone {gone[:5]}, keys new {new[:5]}"


if __name__ == "__main__":
    DATA.write_text(json.dumps(keys_now(), indent=1) + "\n")
    sys.exit(0)
