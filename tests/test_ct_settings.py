"""A checkpoint's settings come with it (issue 27, item 2): `train.init_from` and
`train.convert_from` take the model section from the checkpoint's config.json; a differing value is
refused in one line naming the key, the stored value and the config's, unless the key may change in
CT (the ratio target, concept top-k, loops, ...)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

from configs.config import ConfigError, from_dict
from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig
from vlm.model.hf import save_pretrained
from vlm.model.multimodal import ConceptMoEVLM
from vlm.train.config import TrainConfig, load_train_config
from vlm.train.stages import build_stage_model as build_model
from vlm.train.stages import load_pretrained_weights

DEFAULT_YAML = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
STORED = ModelConfig(
    vocab_size=300,
    hidden_size=32,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    rope_theta=1e6,
    encoder_layers=1,
    concept_layers=1,
    decoder_layers=1,
    moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16),
    chunk=ChunkConfig(residual="delta", target_ratio=2.0),
)


@pytest.fixture
def stored(tmp_path) -> Path:
    torch.manual_seed(0)
    model = ConceptMoEVLM(STORED)
    save_pretrained(model, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _cfg(ckpt: Path, stage: str = "text", **model) -> TrainConfig:
    """What `vlm train` makes of a config whose model section is `model` (load_train_config records the keys)."""
    run = {"stage": stage, ("convert_from" if stage == "ct" else "init_from"): str(ckpt)}
    cfg = from_dict(
        TrainConfig,
        {"model": model, "vision": None, "train": run, "data": {"default_parts": ["text"]}},
    )
    cfg.model_stated = {
        f"{k}.{kk}" for k, v in model.items() if isinstance(v, dict) for kk in v
    } | {k for k, v in model.items() if not isinstance(v, dict)}
    return cfg


@pytest.mark.parametrize("stage", ["text", "ct"])
@pytest.mark.parametrize(
    "key,value,stored_value",
    [
        ("rope_theta", 10000.0, 1e6),  # moves every logit, no tensor says so
        ("chunk.residual", "identity", "delta"),
        ("qk_norm", False, True),  # would also drop the stored q/k norms
    ],
)
def test_a_differing_setting_is_refused_in_one_line(stored, stage, key, value, stored_value):
    section = {key.split(".")[0]: {key.split(".")[1]: value}} if "." in key else {key: value}
    with pytest.raises(ConfigError) as err:
        build_model(_cfg(stored, stage, **section))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(
        f"model.{key}: the checkpoint {stored} has {stored_value!r}, this config {value!r}"
    )


@pytest.mark.parametrize("stage", ["text", "ct"])
def test_the_ratio_target_may_change_and_everything_else_is_the_checkpoints(stored, stage):
    cfg = _cfg(
        stored,
        stage,
        chunk={"target_ratio": 3.0},
        concept_moe={"top_k": 3},
        moe={"loss_free_balancing": False},
    )
    before = copy.deepcopy(cfg)
    model, fresh = build_model(cfg)
    assert model.model_cfg.chunk.target_ratio == 3.0 and model.model_cfg.c_moe.top_k == 3
    assert model.model_cfg.moe.top_k == 2  # the token-level experts keep theirs
    assert not model.model_cfg.moe.loss_free_balancing
    assert model.model_cfg.rope_theta == 1e6 and model.model_cfg.chunk.residual == "delta"
    # the config handed in stays as it was
    assert model.model_cfg.hidden_size == 32 and cfg == before
    torch.manual_seed(0)
    ref = ConceptMoEVLM(STORED).state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k
    assert "lm" not in fresh


def test_a_minimal_config_on_the_default_yaml_takes_the_stored_model(stored, tmp_path):
    f = tmp_path / "ct.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "base": str(DEFAULT_YAML),
                "model": {"chunk": {"target_ratio": 2.5}},
                "train": {"stage": "text", "init_from": str(stored)},
                "vision": None,
                "vision_warmup": {"steps": 0},
                "data": {"default_parts": ["text"]},
                "params": {"vision_lr_mult": 1.0, "projector_lr_mult": 1.0},
            }
        )
    )
    cfg = load_train_config(f, ["model.loop_times=0"])
    assert cfg.model_stated == {"chunk.target_ratio", "loop_times"}
    model, _ = build_model(cfg)
    assert model.model_cfg == ModelConfig(
        **{**STORED.__dict__, "chunk": ChunkConfig(residual="delta", target_ratio=2.5)}
    )
    # a value the project's default file sets is not this config's: stated here, it is refused
    with pytest.raises(
        ConfigError,
        match=r"^model\.hidden_size: the checkpoint .* has 32, this config 96;",
    ):
        build_model(load_train_config(f, ["model.hidden_size=96"]))


def test_stored_tensors_the_model_would_drop_are_an_error(stored):
    from dataclasses import replace

    model = ConceptMoEVLM(replace(STORED, qk_norm=False))
    with pytest.raises(
        ConfigError,
        match=r"tensor lm\.\S+\.attn\.k_norm\.weight is stored but has no place",
    ):
        load_pretrained_weights(model, stored)
