"""Continual training keeps the source's chat format (issue 27, item 1): a tiny transformers
Qwen3-MoE saved next to its own BPE tokenizer and a Qwen-style chat template is converted, trained a
few steps and exported; final/ speaks the source's template, ids and eos. The same for a source
whose vocab equals its tokenizer's size."""

from __future__ import annotations

import json

import pytest
import torch

# Qwen's layout, and not the project's (<|user|> ... <|end|>): the test's proof that final/ kept
# the source's
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% "
    "endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SOURCE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT = [
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "hi, how are you"},
]


def _source_tokenizer(path, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SOURCE_SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(
        ["hello there, how are you? a red circle left of a blue square"] * 20, trainer=trainer
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf.chat_template = TEMPLATE
    hf.save_pretrained(str(path))
    return hf


def _source(path, pad_vocab: bool):
    """Qwen3-MoE + tokenizer; vocab_size above the tokenizer's size (Qwen pads it) or equal to it (Mixtral)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf_tok = _source_tokenizer(path, 300)
    n = len(hf_tok)
    vocab = n + 16 if pad_vocab else n
    torch.manual_seed(0)
    eos = hf_tok.eos_token_id
    model = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=vocab,
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
            eos_token_id=eos,
            pad_token_id=hf_tok.pad_token_id,
            bos_token_id=None,
        )
    ).eval()
    model.save_pretrained(str(path))
    return model, hf_tok


class _EosAt:
    """A logits processor that makes the k-th new token the eos: generation must stop right there."""

    def __init__(self, prompt_len: int, k: int, eos: int):
        self.at, self.eos = prompt_len + k - 1, eos

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] == self.at:
            scores = torch.full_like(scores, -float("inf"))
            scores[:, self.eos] = 0.0
        return scores


@pytest.mark.parametrize("how", ["convert_from", "init_from"])
@pytest.mark.parametrize(
    "pad_vocab", [True, False], ids=["vocab_above_tokenizer", "vocab_equals_tokenizer"]
)
def test_ct_keeps_the_source_chat_format(
    pad_vocab, how, tiny_data, tmp_path, torch_globals, tiny_config, make_trainer
):
    """`train.stage: ct` on the converted folder, or `train.init_from` on it (a text stage)."""
    from transformers import AutoTokenizer, LogitsProcessorList

    import vlm.model.hf  # noqa: F401  (registers the Auto classes)
    from data_pipelines.tokenizer import IMAGE_TOKENS
    from vlm.cli import main

    src_dir, conv, run_dir = tmp_path / "src", tmp_path / "conv", tmp_path / "ct"
    src, src_tok = _source(src_dir, pad_vocab)
    n_src = len(src_tok)
    rendered = src_tok.apply_chat_template(CHAT, tokenize=False)

    assert (
        main(
            [
                "convert",
                str(src_dir),
                "--out",
                str(conv),
                "--encoder-layers",
                "1",
                "--decoder-layers",
                "1",
            ]
        )
        == 0
    )
    # the source's files and template, next to the weights
    conv_tok = AutoTokenizer.from_pretrained(str(conv))
    assert conv_tok.apply_chat_template(CHAT, tokenize=False) == rendered
    assert json.loads((conv / "config.json").read_text())["eos_token_id"] == src_tok.eos_token_id

    cfg = tiny_config(
        tiny_data,
        train={"stage": "ct" if how == "convert_from" else "text", "max_steps": 2, how: str(conv)},
        logging={"eval_every": 0},
    )
    cfg["model"], cfg["vision"] = {}, None  # the model section is the checkpoint's
    cfg["data"]["sources"] = [s for s in cfg["data"]["sources"] if s["name"].endswith("/text")]
    cfg["logging"]["eval_sources"] = []
    tr = make_trainer(cfg, run_dir)
    tok = tr.run.tokenizer
    assert tok.kind == "source" and tok.eos_id == src_tok.eos_token_id and tok.bos_id is None
    assert tok.pad_id == src_tok.pad_token_id
    # the image tokens (never role tokens) at the first free ids; the model grows to hold them only
    # when needed
    assert [tok.hf.convert_tokens_to_ids(t) for t in IMAGE_TOKENS] == list(range(n_src, n_src + 4))
    assert tok.vocab_size == n_src + 4
    emb = tr.run.engine.module.lm.embed.weight.detach()
    assert emb.shape[0] == (src.config.vocab_size if pad_vocab else n_src + 4)
    assert torch.equal(emb[: src.config.vocab_size], src.model.embed_tokens.weight)
    if not pad_vocab:  # the stated initialisation: the mean of the source's rows
        torch.testing.assert_close(emb[n_src:], src.model.embed_tokens.weight.mean(0).expand(4, -1))
    # a chat sample trains in the source's template: its answer and closing <|im_end|> are
    # the targets
    segs = tok.chat_segments(CHAT)
    assert "".join(t for t, _ in segs) == rendered
    assert [t for t, target in segs if target] == ["hi, how are you<|im_end|>\n"]
    from data_pipelines.encode import encode_sample
    from data_pipelines.schema import Sample
    from vision.image_processor import ImageProcessor, ImageProcessorConfig

    enc = encode_sample(
        Sample("k", "chat", turns=CHAT),
        tok,
        ImageProcessor(ImageProcessorConfig()),
        256,
        loss_on="assistant",
    )[0]
    # exactly the rendered conversation: no bos (Qwen has none), and the template's own <|im_end|>
    # ends the document (no second eos after it)
    assert enc.ids.tolist() == src_tok(rendered, add_special_tokens=False)["input_ids"]
    answer = src_tok("hi, how are you<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert enc.ids[enc.target].tolist() == answer
    assert tr.train() == 0

    final = run_dir / "final"
    ftok = AutoTokenizer.from_pretrained(str(final))
    assert ftok.apply_chat_template(CHAT, tokenize=False) == rendered
    assert ftok.apply_chat_template(
        CHAT[:1], tokenize=False, add_generation_prompt=True
    ) == src_tok.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True)
    text = "hello there, a red circle"
    assert (
        ftok(text, add_special_tokens=False)["input_ids"]
        == src_tok(text, add_special_tokens=False)["input_ids"]
    )
    assert ftok.eos_token_id == src_tok.eos_token_id and ftok.pad_token_id == src_tok.pad_token_id
    assert not {"<|user|>", "<|assistant|>", "<|end|>", "<eos>"} & set(ftok.get_vocab())

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(final)).eval()
    assert model.generation_config.eos_token_id in (src_tok.eos_token_id, [src_tok.eos_token_id])
    prompt = ftok.apply_chat_template(
        CHAT[:1], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    L = prompt["input_ids"].shape[1]
    out = model.generate(
        **prompt,
        max_new_tokens=8,
        do_sample=False,
        logits_processor=LogitsProcessorList([_EosAt(L, 3, src_tok.eos_token_id)]),
    )
    # ended on the source's eos
    assert out.shape[1] == L + 3 and out[0, -1].item() == src_tok.eos_token_id

    # vlm chat, the demo and lmms-eval prompt the model in that same format (the model's tokenizer
    # renders it)
    from vlm.chat_cli import Conversation
    from vlm.generate import load_eval_model

    session = Conversation(load_eval_model(final))
    assert session.prompt(CHAT[:1]) == src_tok.apply_chat_template(
        CHAT[:1], tokenize=False, add_generation_prompt=True
    )


def test_own_format_stays_for_our_tokenizer(tmp_path):
    """A model trained from scratch keeps the project's template and tokens."""
    from data_pipelines.chat import chat_segments
    from data_pipelines.tokenizer import is_source_tokenizer_dir, load_tokenizer

    tok = load_tokenizer("byte")
    assert tok.chat_segments(CHAT) == chat_segments(CHAT) and tok.chat_template is None
    tok.save(tmp_path)
    assert not is_source_tokenizer_dir(tmp_path)


def test_a_vl_stage_after_ct_keeps_the_source_format(
    tiny_data, tmp_path, torch_globals, tiny_config, make_trainer
):
    """Chained: CT (text) -> VL from its final/: the tokenizer, template and ids carry over through
    init_from, the images use the added placeholder tokens, and final/'s AutoProcessor renders the
    source's template."""
    from PIL import Image
    from transformers import AutoProcessor

    import vlm.model.hf  # noqa: F401  (registers the Auto classes)

    src_dir = tmp_path / "src"
    _, src_tok = _source(src_dir, pad_vocab=True)
    ct = tiny_config(
        tiny_data,
        train={"stage": "ct", "max_steps": 1, "convert_from": str(src_dir)},
        convert={"encoder_layers": 1, "decoder_layers": 1},
        logging={"eval_every": 0},
    )
    ct["model"], ct["vision"] = {}, None
    ct["data"]["sources"] = [s for s in ct["data"]["sources"] if s["name"].endswith("/text")]
    ct["logging"]["eval_sources"] = []
    assert make_trainer(ct, tmp_path / "ct").train() == 0
    vl = tiny_config(
        tiny_data,
        train={"stage": "vl", "max_steps": 1, "init_from": str(tmp_path / "ct" / "final")},
        logging={"eval_every": 0},
    )
    vl["model"] = {}
    tr = make_trainer(vl, tmp_path / "vl")
    assert tr.run.tokenizer.kind == "source" and tr.run.tokenizer.eos_id == src_tok.eos_token_id
    # the CT model's settings
    assert tr.run.cfg.model.chunk.enabled and tr.run.cfg.model.hidden_size == 32
    assert tr.train() == 0
    proc = AutoProcessor.from_pretrained(str(tmp_path / "vl" / "final"))
    msgs = [{"role": "user", "content": "<image>\nwhat is it?"}]
    text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == src_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    enc = proc(images=[Image.new("RGB", (28, 28))], text=[text], return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    # no bos the source never had
    assert ids[0] == src_tok.convert_tokens_to_ids("<|im_start|>")
    assert proc.tokenizer.convert_tokens_to_ids("<image_pad>") in ids


def test_a_ct_run_with_the_source_tokenizer_resumes(
    tiny_data, tmp_path, torch_globals, tiny_config, make_trainer
):
    """The run config records the source's tokenizer and the grown vocabulary: --resume accepts its own run."""
    src_dir = tmp_path / "src"
    _source(src_dir, pad_vocab=False)
    cfg = tiny_config(
        tiny_data,
        train={"stage": "ct", "max_steps": 1, "convert_from": str(src_dir)},
        convert={"encoder_layers": 1, "decoder_layers": 1},
        logging={"eval_every": 0},
        checkpoint={"save_every": 1},
    )
    cfg["model"], cfg["vision"] = {}, None
    cfg["data"]["sources"] = [s for s in cfg["data"]["sources"] if s["name"].endswith("/text")]
    cfg["logging"]["eval_sources"] = []
    assert make_trainer(cfg, tmp_path / "ct").train() == 0
    cfg["train"]["max_steps"] = 2
    tr = make_trainer(cfg, tmp_path / "ct", resume=True)
    assert tr.run.cfg.data.tokenizer == str(src_dir) and tr.run.tokenizer.kind == "source"
    assert tr.train() == 0 and tr.step == 2


def test_a_project_tokenizer_for_a_source_model_is_refused(tmp_path):
    from configs.config import ConfigError, from_dict
    from data_pipelines.tokenizer import load_tokenizer
    from vlm.train.config import TrainConfig
    from vlm.train.stages import load_run_tokenizer, resolve_tokenizer

    _source_tokenizer(tmp_path / "src", 300)
    load_tokenizer("byte").save(tmp_path / "ours")
    base = {
        "vision": None,
        "data": {"default_parts": ["text"]},
        "train": {"stage": "ct", "convert_from": str(tmp_path / "src")},
    }
    for name in ("byte", "default"):  # the project's defaults give way to the source's
        cfg = from_dict(
            TrainConfig, dict(base, data={"default_parts": ["text"], "tokenizer": name})
        )
        resolved = resolve_tokenizer(cfg)
        assert load_run_tokenizer(resolved).kind == "source" and resolved.data.tokenizer == str(
            tmp_path / "src"
        )
        assert cfg.data.tokenizer == name  # the config handed in stays as it was
    cfg = from_dict(
        TrainConfig,
        dict(base, data={"default_parts": ["text"], "tokenizer": str(tmp_path / "ours")}),
    )
    with pytest.raises(
        ConfigError,
        match=r"keeps its own tokenizer and chat format; drop data.tokenizer",
    ):
        resolve_tokenizer(cfg)


def test_a_template_that_cannot_be_split_is_refused_at_start(tmp_path):
    """A template whose rendering of a conversation is not the prefix of its continuation (it
    rewrites earlier turns) cannot say which tokens are the answer: one line at start, not a crash
    in the data loader."""
    from transformers import AutoTokenizer

    from configs.config import ConfigError, from_dict
    from vlm.train.config import TrainConfig
    from vlm.train.stages import load_run_tokenizer, resolve_tokenizer

    _source_tokenizer(tmp_path / "src", 300)
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "src"))
    hf.chat_template = (
        "{{ messages | length }}{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    hf.save_pretrained(str(tmp_path / "src"))
    cfg = from_dict(
        TrainConfig,
        {
            "vision": None,
            "data": {"default_parts": ["text"]},
            "train": {"stage": "ct", "convert_from": str(tmp_path / "src")},
        },
    )
    with pytest.raises(ConfigError, match="does not render a conversation as the prefix"):
        load_run_tokenizer(resolve_tokenizer(cfg))
