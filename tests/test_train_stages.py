"""Training stages: text pretraining -> VL continual training from its LLM; CT from a converted pretrained MoE."""

from __future__ import annotations

import json

import pytest
import torch
import yaml


def _text_only(cfg: dict) -> dict:
    cfg["vision"] = None
    cfg["data"]["sources"] = [s for s in cfg["data"]["sources"] if s["name"].endswith("/text")]
    cfg["logging"]["eval_sources"] = [
        s for s in cfg["logging"]["eval_sources"] if s["name"].endswith("/text")
    ]
    return cfg


def test_text_then_vl_from_its_llm(tiny_data, tmp_path, torch_globals, tiny_config, make_trainer):
    from vlm.model.hf import load_vlm

    text_cfg = _text_only(
        tiny_config(tiny_data, train={"stage": "text", "max_steps": 2}, logging={"eval_every": 0})
    )
    text_dir = tmp_path / "text"
    assert make_trainer(text_cfg, text_dir).train() == 0
    pretrained = load_vlm(text_dir / "final")
    assert pretrained.vision is None

    vl_cfg = tiny_config(
        tiny_data,
        train={"stage": "vl", "max_steps": 2, "init_from": str(text_dir)},
        params={"freeze": ["lm.embed"], "projector_lr_mult": 10.0},
        logging={"eval_every": 0},
    )
    tr = make_trainer(vl_cfg, tmp_path / "vl")
    module = tr.run.engine.module
    # every LLM tensor comes from the text run
    for name, t in pretrained.lm.state_dict().items():
        assert torch.equal(module.lm.state_dict()[name], t), name
    assert module.vision is not None and module.vision.projector is not None
    groups = {g["name"]: g["lr"] for g in tr.run.optimizer.param_groups}
    assert groups["projector/matrix"] == pytest.approx(10 * groups["token/matrix"])
    assert "embed/matrix" not in groups  # frozen
    embed_before = module.lm.embed.weight.detach().clone()
    assert tr.train() == 0
    assert torch.equal(module.lm.embed.weight, embed_before)
    rec = json.loads((tmp_path / "vl" / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["tokens/image"] > 0 and rec["compression/image"] is not None


def test_ct_stage_converts_a_transformers_moe(
    tiny_data, tmp_path, torch_globals, make_trainer, tiny_config
):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    src = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=272,
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            tie_word_embeddings=False,
        )
    ).eval()
    src.save_pretrained(tmp_path / "src")
    cfg = _text_only(
        tiny_config(
            tiny_data,
            train={"stage": "ct", "max_steps": 2, "convert_from": str(tmp_path / "src")},
            convert={"encoder_layers": 1, "decoder_layers": 1, "target_ratio": 3.0},
            logging={"eval_every": 0},
        )
    )
    cfg["model"] = {}  # the model section is the checkpoint's (a differing value would be refused)
    run_dir = tmp_path / "ct"
    tr = make_trainer(cfg, run_dir)
    m = tr.run.engine.module
    assert (
        tr.run.cfg.model.hidden_size == 32
        and tr.run.cfg.model.concept_layers == 2
        and tr.run.cfg.model.chunk.enabled
    )
    assert tr.run.cfg.model.chunk.target_ratio == 3.0
    # pretrained weights kept
    assert torch.equal(m.lm.embed.weight, src.model.embed_tokens.weight)
    assert torch.equal(m.lm.lm_head.weight, src.lm_head.weight)
    # conversion: own state + update
    assert m.lm.cfg.chunk.residual == "delta" and m.lm.dechunk.residual is None
    assert tr.train() == 0
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["concept_layers"] == 2 and saved["train"]["stage"] == "ct"
    rec = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["compression/text"] is not None and rec["loss/lm"] > 0


def test_mup_continuation_keeps_the_pretrained_function(
    tiny_data, tmp_path, torch_globals, tiny_config, make_trainer
):
    """muP scales logits by 1/s_token in a hook; exports fold it into lm_head, checkpoints do not. A
    VL run with its own muP width starting from either source must compute the pretrained logits
    before any update."""
    from configs.batch import PackedBatch
    from vlm.model.hf import load_vlm

    text_cfg = _text_only(
        tiny_config(
            tiny_data,
            train={"stage": "text", "max_steps": 2},
            logging={"eval_every": 0},
            params={"mup": True, "mup_base_width": 16},
            checkpoint={"save_every": 2},
        )
    )
    text_dir = tmp_path / "text"
    assert make_trainer(text_cfg, text_dir).train() == 0
    ref_model = load_vlm(text_dir / "final").eval()
    batch = PackedBatch.from_documents([[1, 2, 3, 4, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        ref = ref_model(batch).logits
    for src in (text_dir / "final", text_dir / "checkpoints" / "step_00000002"):
        cfg = tiny_config(
            tiny_data,
            train={"stage": "vl", "max_steps": 1, "init_from": str(src)},
            params={"mup": True, "mup_base_width": 8},
            logging={"eval_every": 0},
        )
        tr = make_trainer(cfg, tmp_path / f"vl_{src.name}")
        assert tr.run.logit_scale == pytest.approx(0.25)
        m = tr.run.engine.module.eval()
        with torch.no_grad():
            got = m(batch).logits
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=lambda e: f"{src.name}: {e}")


def test_vl_init_from_carries_the_whole_vlm(
    tiny_data, tmp_path, torch_globals, tiny_config, make_trainer
):
    """Stages chain: a VL run started from an earlier VL run (export or checkpoint) begins with its
    vision encoder, projector and LLM exactly."""
    from vlm.model.hf import load_vlm

    first = tmp_path / "align"
    cfg = tiny_config(
        tiny_data,
        train={"stage": "vl", "max_steps": 2},
        logging={"eval_every": 0},
        checkpoint={"save_every": 2},
    )
    assert make_trainer(cfg, first).train() == 0
    trained = load_vlm(first / "final").state_dict()
    for src in (first / "final", first / "checkpoints" / "step_00000002"):
        nxt = tiny_config(
            tiny_data,
            train={"stage": "vl", "max_steps": 1, "init_from": str(src), "seed": 7},
            logging={"eval_every": 0},
        )
        module = make_trainer(nxt, tmp_path / f"full_{src.name}").run.engine.module
        state = module.state_dict()
        vision_keys = [k for k in trained if k.startswith("vision.")]
        assert any(k.startswith("vision.encoder.") for k in vision_keys)
        assert any(k.startswith("vision.projector.") for k in vision_keys)
        for k in vision_keys + [k for k in trained if k.startswith("lm.")]:
            assert torch.equal(state[k], trained[k]), f"{src.name}: {k}"


def test_init_from_names_a_mismatched_vision_tensor(
    tiny_data, tmp_path, torch_globals, tiny_config, make_trainer
):
    from configs.config import ConfigError

    first = tmp_path / "a"
    assert (
        make_trainer(
            tiny_config(
                tiny_data, train={"stage": "vl", "max_steps": 1}, logging={"eval_every": 0}
            ),
            first,
        ).train()
        == 0
    )
    cfg = tiny_config(
        tiny_data,
        train={"stage": "vl", "max_steps": 1, "init_from": str(first)},
        logging={"eval_every": 0},
    )
    cfg["vision"]["projector"] = {"kind": "mlp"}
    with pytest.raises(
        ConfigError,
        match=r"vision\.projector\.\S+ is missing; the vision section must match",
    ):
        make_trainer(cfg, tmp_path / "b")
