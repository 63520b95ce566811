"""Tokenizers: byte-level ids, BPE training/saving/loading (ours and transformers'), any tokenizer.json."""

from __future__ import annotations

import pytest

from data_pipelines.chat import format_chat, normalize_answer, strip_answer, vqa_prompt
from data_pipelines.tokenizer import (
    SPECIAL_TOKENS,
    ByteTokenizer,
    TokenizerError,
    load_tokenizer,
    train_bpe,
)

TEXT = "<|user|><image>\nWhat colour is the circle? ünï ✓<|end|><|assistant|>red<|end|>"


def test_byte_tokenizer_ids_and_round_trip(tmp_path):
    tok = ByteTokenizer()
    assert tok.vocab_size == 256 + len(SPECIAL_TOKENS)
    assert [tok.pad_id, tok.bos_id, tok.eos_id, tok.image_id] == [256, 257, 258, 259]
    ids = tok.encode(TEXT)
    assert ids[:2] == [tok.user_id, tok.image_id] and ids[-1] == tok.end_id
    assert ids[2:7] == list(b"\nWhat")
    assert tok.decode(ids, skip_special=False) == TEXT
    assert tok.decode(ids) == "\nWhat colour is the circle? ünï ✓red"
    assert tok.encode("") == []
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, ByteTokenizer) and again.encode(TEXT) == ids
    assert load_tokenizer("byte").encode("ab") == [97, 98]


def _corpus():
    return [
        f"the {c} {s} is {w} of the {c2} square. <image> {i} plus {i} is {2 * i}."
        for i in range(60)
        for c, s, w, c2 in [("red", "circle", "left", "blue"), ("green", "diamond", "above", "red")]
    ]


def test_bpe_train_save_load_and_transformers(tmp_path):
    tok = train_bpe(_corpus(), vocab_size=400)
    assert [tok.token_id(s) for s in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.vocab_size <= 400
    ids = tok.encode(TEXT)
    assert ids[0] == tok.user_id and ids[1] == tok.image_id and ids[-1] == tok.end_id
    # merges learnt
    assert len(tok.encode("the red circle is left of the blue square")) < len(
        "the red circle is left"
    )
    assert tok.decode(ids, skip_special=False) == TEXT
    assert tok.decode(tok.encode("\x00\x7f 漢字")) == "\x00\x7f 漢字"  # any byte stays encodable
    tok.save(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).is_file()
    ours = load_tokenizer(tmp_path)
    assert ours.encode(TEXT) == ids and ours.image_pad_id == tok.image_pad_id
    assert load_tokenizer(tmp_path / "tokenizer.json").encode(TEXT) == ids
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf(TEXT, add_special_tokens=False)["input_ids"] == ids
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (
        tok.pad_id,
        tok.bos_id,
        tok.eos_id,
    )
    assert hf.convert_tokens_to_ids("<image>") == tok.image_id


def test_foreign_tokenizer_json_gets_our_special_tokens(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == 3 + len(SPECIAL_TOKENS)
    assert tok.encode("hello <image> world") == [0, tok.image_id, 1]


def test_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(TokenizerError, match="neither"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(TokenizerError, match="cannot be loaded"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="too small"):
        train_bpe(["abc"], vocab_size=100)


def test_chat_template():
    turns = [
        {"role": "user", "content": "<image>\nQ1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "a2"},
    ]
    assert format_chat(turns) == (
        "<|user|><image>\nQ1<|end|><|assistant|>a1<|end|><|user|>Q2<|end|><|assistant|>a2<|end|>"
    )
    assert vqa_prompt("What shape?") == "<|user|><image>\nWhat shape?<|end|><|assistant|>"
    # the first turn of a training conversation is exactly the evaluation prompt
    assert format_chat(turns).startswith(vqa_prompt("Q1").replace("What shape?", ""))
    assert strip_answer(" Red <|end|><|user|>more") == "Red"
    assert normalize_answer("The Red.") == "red"
    with pytest.raises(ValueError, match="role"):
        format_chat([{"role": "system", "content": "x"}])


@pytest.mark.parametrize("text", ["héllo wörld <image> 日本 <|end|>x", "  two  spaces\n\ttab", ""])
def test_the_byte_tokenizer_saves_a_file_transformers_reads_the_same(tmp_path, text):
    from transformers import AutoTokenizer

    from data_pipelines.tokenizer import ByteTokenizer

    ours = ByteTokenizer()
    ours.save(tmp_path)
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    ids = theirs(text, add_special_tokens=False).input_ids
    assert ids == ours.encode(text)
    assert theirs.decode(ids) == text and theirs.decode(
        ids, skip_special_tokens=True
    ) == ours.decode(ids)
    assert type(load_tokenizer(tmp_path)).__name__ == "ByteTokenizer"


def test_bytes_per_id_counts_the_utf8_bytes_each_token_stands_for(tmp_path):
    """The denominator of bits per byte: summed over a text's tokens it is the text's UTF-8 length."""
    byte = ByteTokenizer()
    assert byte.bytes_per_id[:256].tolist() == [1] * 256 and not byte.bytes_per_id[256:].any()
    texts = [
        "a red circle at the top left",
        "zwölf Boxkämpfer jagen Viktor",
        "日本語のテキスト",
    ] * 20
    bpe = train_bpe(texts, 300)
    for text in texts[:3] + ["<|user|>hi<|end|>"]:
        ids = bpe.encode(text)
        plain = text.replace("<|user|>", "").replace("<|end|>", "")
        assert int(bpe.bytes_per_id[ids].sum()) == len(plain.encode("utf-8"))
