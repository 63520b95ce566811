"""Checkpoints written before a parameter was renamed (vlm.model.legacy_names: the experts' hidden
width went from H to F, `w_gate_EDH` -> `w_gate_EDF`) still load and give the same logits: through
`load_state_dict` (DeepSpeed resume, `init_from`, `convert_from`), through transformers'
`from_pretrained` of a `final/` export and its weight check, and through `init_from`'s reader."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from configs.batch import PackedBatch
from vlm.model.config import ModelConfig, MoEConfig
from vlm.model.legacy_names import RENAMED, current_key
from vlm.model.multimodal import ConceptMoEVLM

OLD = {new: old for old, new in RENAMED.items()}


def _tiny() -> ConceptMoEVLM:
    torch.manual_seed(0)
    moe = MoEConfig(
        num_experts=4, top_k=2, expert_hidden=16, grove_groups=2, grove_hidden=8, grove_lambda=0.25
    )
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=16,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        moe=moe,
        init_std=0.2,
    )
    return ConceptMoEVLM(cfg, None).eval()


def _old_key(key: str) -> str:
    head, dot, last = key.rpartition(".")
    return head + dot + OLD.get(last, last)


def _as_stored_before(state: dict) -> dict:
    """`state` as a checkpoint from before the rename held it."""
    return {_old_key(k): v for k, v in state.items()}


def _logits(model: ConceptMoEVLM) -> torch.Tensor:
    batch = PackedBatch.from_documents([[1, 5, 9, 3, 7, 2], [4, 4, 8]], row_len=12)
    with torch.no_grad():
        return model(batch).logits


def test_every_renamed_key_maps_back():
    for old, new in RENAMED.items():
        assert current_key(f"lm.blocks.0.moe.{old}") == f"lm.blocks.0.moe.{new}"
        assert current_key(old) == new
    assert current_key("lm.blocks.0.moe.router.weight") == "lm.blocks.0.moe.router.weight"


def test_an_old_state_dict_loads_with_load_state_dict():
    src = _tiny()
    old = _as_stored_before(src.state_dict())
    assert any(k.endswith("moe.w_gate_EDH") for k in old)
    assert any(k.endswith("moe.adj_down_GHD") for k in old)
    dst = ConceptMoEVLM(src.model_cfg, None).eval()
    torch.nn.init.zeros_(dst.lm.embed.weight)  # not a copy of src by construction
    dst.load_state_dict(old, strict=True)
    torch.testing.assert_close(_logits(dst), _logits(src), rtol=0, atol=0)


def test_an_old_export_loads_with_from_pretrained_and_init_from(tmp_path):
    from vlm.model.hf import load_vlm, save_pretrained
    from vlm.model.weights_check import write_checksums
    from vlm.train.stages import read_model_state

    src = _tiny()
    out = save_pretrained(src, tmp_path / "final")
    f = out / "model.safetensors"
    tensors = load_file(str(f))
    assert any(k.endswith("moe.w_gate_EDF") for k in tensors)  # today's export: today's names
    save_file(_as_stored_before(tensors), str(f), metadata={"format": "pt"})
    write_checksums(out)  # as the old export recorded its own file
    assert any(k.endswith("w_down_EHD") for k in load_file(str(f)))
    loaded = load_vlm(out).eval()
    torch.testing.assert_close(_logits(loaded), _logits(src), rtol=0, atol=0)
    state = read_model_state(out)
    assert all(k == current_key(k) for k in state)
