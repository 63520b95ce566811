"""The trainer's setup never rewrites the config it is handed (issue 30, item 4): what it learns
while setting up (the DeepSpeed settings a merged JSON runs, a converted or continued model's
sections, a source's tokenizer) goes into its own resolved copy, `Trainer.cfg`, which config.yaml
records; the caller's object stays as it was."""

from __future__ import annotations

import copy

import torch
import yaml


def _source(path):
    """A tiny transformers Qwen3-MoE next to its own BPE tokenizer and chat template (a CT source)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(
        ["hello there, how are you? a red circle left of a blue square"] * 20,
        trainer=trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=specials,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% "
        "endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    hf.save_pretrained(str(path))
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=len(hf) + 16,
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
            eos_token_id=hf.eos_token_id,
            pad_token_id=hf.pad_token_id,
            bos_token_id=None,
        )
    ).save_pretrained(str(path))


def _set_up(cfg_dict, run_dir, load_tiny):
    """Build a trainer from `cfg_dict`; the config object handed in, and a deep copy of it taken before."""
    from configs.config import to_dict
    from vlm.train.trainer import Trainer

    cfg = load_tiny(cfg_dict)
    before = copy.deepcopy(to_dict(cfg))
    tr = Trainer(cfg, run_dir, log=lambda *_: None)
    return tr, cfg, before


def test_a_vl_run_leaves_its_config_alone(
    tiny_data, tmp_path, torch_globals, tiny_config, load_tiny
):
    """deepspeed.extra sets ZeRO stage 1 over the section's stage 0: the run (and config.yaml) says stage 1."""
    from configs.config import to_dict

    cfg_dict = tiny_config(
        tiny_data,
        deepspeed={"zero_stage": 0, "extra": {"zero_optimization": {"stage": 1}}},
        train={"max_steps": 1},
        vision_warmup={"steps": 0},
        logging={"eval_every": 0},
        checkpoint={"save_every": 0},
    )
    tr, cfg, before = _set_up(cfg_dict, tmp_path / "run", load_tiny)
    assert to_dict(cfg) == before, "the trainer rewrote the config it was handed"
    assert cfg.deepspeed.zero_stage == 0
    assert tr.run.cfg.deepspeed.zero_stage == 1 and tr.run.engine.zero_optimization_stage() == 1
    assert tr.train() == 0
    assert to_dict(cfg) == before
    assert (
        yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["deepspeed"]["zero_stage"]
        == 1
    )


def test_a_ct_run_leaves_its_config_alone(
    tiny_data, tmp_path, torch_globals, tiny_config, load_tiny
):
    """Stage ct on a source with its own tokenizer: the model section (empty here), the vision
    section and data.tokenizer the run uses are the source's; they are the trainer's, not written
    into the caller's config."""
    from configs.config import to_dict

    _source(tmp_path / "src")
    cfg_dict = tiny_config(
        tiny_data,
        train={"stage": "ct", "max_steps": 1, "convert_from": str(tmp_path / "src")},
        convert={"encoder_layers": 1, "decoder_layers": 1},
        logging={"eval_every": 0},
        checkpoint={"save_every": 0},
    )
    cfg_dict["model"], cfg_dict["vision"] = {}, None
    cfg_dict["data"]["sources"] = [
        s for s in cfg_dict["data"]["sources"] if s["name"].endswith("/text")
    ]
    cfg_dict["logging"]["eval_sources"] = []
    tr, cfg, before = _set_up(cfg_dict, tmp_path / "ct", load_tiny)
    assert to_dict(cfg) == before, "the trainer rewrote the config it was handed"
    assert cfg.data.tokenizer == "byte" and tr.run.cfg.data.tokenizer == str(tmp_path / "src")
    assert (
        tr.run.cfg.model.hidden_size == 32 and tr.run.cfg.model.hidden_size != cfg.model.hidden_size
    )
    assert tr.run.cfg.model == tr.run.engine.module.model_cfg
    assert tr.train() == 0
    assert to_dict(cfg) == before
    saved = yaml.safe_load((tmp_path / "ct" / "config.yaml").read_text())
    assert saved["model"]["hidden_size"] == 32 and saved["data"]["tokenizer"] == str(
        tmp_path / "src"
    )
