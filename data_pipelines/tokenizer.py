"""Tokenizers: byte-level (no files, Synergy-style) and BPE (the `tokenizers`
library), one protocol.

Both recognise the special tokens when they are written literally in the text, so the chat template
and the `<image>` placeholder are plain strings everywhere else in the code. Byte-level ids 0..255
are the UTF-8 bytes and the specials follow; a BPE tokenizer puts the specials first (ids 0..9) when
we train it, and wherever an imported `tokenizer.json` has them (missing ones are appended).

A pretrained model's own tokenizer folder (tokenizer.json with a chat template, as transformers
saves it) loads as a SourceTokenizer instead: its ids, special tokens and chat template stay the
source's, and only the image tokens are added; the project's role tokens never are.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

import numpy as np

from data_pipelines.tokenizer_base import (
    _SPECIAL_RE,
    META_FILE,
    SPECIAL_TOKENS,
    Tokenizer,
    TokenizerError,
)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are ids 0..255; SPECIAL_TOKENS follow at 256.. (no vocabulary file)."""

    kind = "byte"

    def __init__(self) -> None:
        self._special_ids = {s: 256 + i for i, s in enumerate(SPECIAL_TOKENS)}
        self._special_str = {i: s for s, i in self._special_ids.items()}
        self.vocab_size = 256 + len(SPECIAL_TOKENS)
        self._init_special_attrs()

    def _count_bytes(self) -> np.ndarray:
        # ids 0..255 are bytes; specials are zeroed
        return np.ones(self.vocab_size, dtype=np.int64)

    def encode_np(self, text: str) -> np.ndarray:
        parts = []
        for i, piece in enumerate(_SPECIAL_RE.split(text)):
            if i % 2:  # odd pieces are the captured special tokens
                parts.append(np.array([self._special_ids[piece]], dtype=np.int64))
            elif piece:
                parts.append(np.frombuffer(piece.encode("utf-8"), dtype=np.uint8).astype(np.int64))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def encode(self, text: str) -> list[int]:
        return self.encode_np(text).tolist()

    def decode(self, ids, skip_special: bool = True) -> str:
        out, buf = [], bytearray()
        for i in (int(x) for x in ids):
            if 0 <= i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if not skip_special and i in self._special_str:
                out.append(self._special_str[i])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def save(self, directory) -> None:
        """The marker our loader reads, and the same tokenizer as a `tokenizers` file for transformers."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        _save_for_transformers(self.as_tokenizers(), d)
        (d / META_FILE).write_text(
            json.dumps({"kind": "byte", "special_tokens": SPECIAL_TOKENS}, indent=1)
        )

    def as_tokenizers(self):
        """An equivalent `tokenizers.Tokenizer`: byte-level BPE without merges (one token per UTF-8
        byte, id = the byte's value), the special tokens at 256.., so that `AutoTokenizer` encodes
        and decodes as we do."""
        from tokenizers import (
            AddedToken,
            decoders,
            models,
            pre_tokenizers,
        )
        from tokenizers import (
            Tokenizer as HFTokenizer,
        )

        mapping = _bytes_to_unicode()
        vocab = {mapping[b]: b for b in range(256)}
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(
            [AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS]
        )
        return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the one `tokenizers`' ByteLevel uses."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _save_for_transformers(tok, d: Path) -> None:
    """tokenizer.json and the configs `transformers.AutoTokenizer.from_pretrained(d)` reads."""
    tok.save(str(d / "tokenizer.json"))
    extra = [s for s in SPECIAL_TOKENS if s not in ("<pad>", "<bos>", "<eos>")]
    specials = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "additional_special_tokens": extra,
        "extra_special_tokens": {},
        "model_max_length": 1_000_000_000,
        "clean_up_tokenization_spaces": False,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (d / "special_tokens_map.json").write_text(
        json.dumps(
            {**{k: v for k, v in specials.items() if v}, "additional_special_tokens": extra},
            indent=1,
        )
    )


class BPETokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (usually byte-level BPE) with our special tokens registered."""

    kind = "bpe"

    def __init__(self, tok) -> None:
        from tokenizers import AddedToken

        missing = [s for s in SPECIAL_TOKENS if tok.token_to_id(s) is None]
        if missing:  # an imported tokenizer.json: append what the VLM needs
            tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in missing])
        self.tok = tok
        self._special_ids = {s: tok.token_to_id(s) for s in SPECIAL_TOKENS}
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._init_special_attrs()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def _identity(self) -> str:
        return super()._identity() + self.tok.to_str()

    def _count_bytes(self) -> np.ndarray:
        """A byte-level BPE token's string has one character per byte (GPT-2's table); other
        vocabularies are measured by decoding each token alone."""
        byte_of = set(_bytes_to_unicode().values())
        out = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            piece = self.tok.id_to_token(i) or ""
            out[i] = (
                len(piece)
                if piece and all(c in byte_of for c in piece)
                else len(self.tok.decode([i], skip_special_tokens=False).encode("utf-8"))
            )
        return out

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids, skip_special: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def save(self, directory) -> None:
        """tokenizer.json + the files `transformers.AutoTokenizer.from_pretrained(directory)` reads."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        _save_for_transformers(self.tok, d)
        (d / META_FILE).write_text(
            json.dumps(
                {"kind": "bpe", "file": "tokenizer.json", "special_tokens": SPECIAL_TOKENS},
                indent=1,
            )
        )


def _json_object(path: Path) -> dict:
    """A tokenizer file that must hold a JSON object; TokenizerError naming it otherwise."""
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise TokenizerError(f"tokenizer file {path} cannot be read ({type(e).__name__})") from None
    if not isinstance(info, dict):
        raise TokenizerError(
            f"tokenizer file {path} holds a JSON {type(info).__name__}, not an object"
        )
    return info


def _load_tokenizer_json(path: Path) -> BPETokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        return BPETokenizer(HFTokenizer.from_file(str(path)))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception for malformed files
        raise TokenizerError(f"tokenizer file {path} cannot be loaded: {e}") from None


# What a pretrained model's chat format needs from the project: the image placeholder `encode`
# expands and the three tokens it expands into. Role tokens never: the source's chat template says
# how turns are written.
IMAGE_TOKENS = ["<image>", "<image_pad>", "<image_start>", "<image_end>"]


def is_source_tokenizer_dir(path: Path) -> bool:
    """A pretrained model's own tokenizer files (tokenizer.json with a chat template, as
    transformers saves them), or a final/ that carries one on: the chat format is the source's, not
    the project's."""
    path = Path(path)
    meta = path / META_FILE
    if meta.is_file():
        return _json_object(meta).get("kind") == "source"
    if not (path / "tokenizer.json").is_file() or not (path / "tokenizer_config.json").is_file():
        return False
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    return bool(_json_object(path / "tokenizer_config.json").get("chat_template"))


class SourceTokenizer(Tokenizer):
    """A pretrained model's tokenizer, loaded with transformers from its own files, in its
    own chat format.

    Its ids, special tokens, eos (which ends answers and documents), pad and chat template stay as
    they are; the only change is IMAGE_TOKENS appended with `add_tokens(..., special_tokens=True)`,
    the transformers way, at the first free ids (the model's embedding grows to fit them; see
    vlm.model.convert.fit_vocab). A source without a bos token (Qwen) starts documents with nothing,
    as its own tokenization does."""

    kind = "source"

    def __init__(self, directory: str | os.PathLike) -> None:
        from tokenizers import AddedToken
        from transformers import AutoTokenizer

        d = Path(directory)
        try:
            hf = AutoTokenizer.from_pretrained(str(d))
        except Exception as e:  # noqa: BLE001 - transformers raises many types for unreadable files
            raise TokenizerError(
                f"tokenizer directory {d} cannot be loaded with transformers: {e}"
            ) from None
        if not getattr(hf, "chat_template", None):
            raise TokenizerError(
                f"tokenizer directory {d} has no chat template "
                "(tokenizer_config.json chat_template or chat_template.jinja)"
            )
        if hf.eos_token_id is None:
            raise TokenizerError(
                f"tokenizer directory {d} names no eos_token: nothing would end an answer"
            )
        hf.add_tokens(
            [AddedToken(s, special=True, normalized=False) for s in IMAGE_TOKENS],
            special_tokens=True,
        )
        self.hf, self.chat_template = hf, hf.chat_template
        self.vocab_size = len(hf)
        vocab = hf.get_vocab()
        self._special_ids = {s: vocab[s] for s in IMAGE_TOKENS}
        s = self._special_ids
        self.eos_id = hf.eos_token_id
        # None: documents start with their first token
        self.bos_id = hf.bos_token_id
        self.pad_id = hf.pad_token_id if hf.pad_token_id is not None else self.eos_id
        self.image_id, self.image_pad_id = s["<image>"], s["<image_pad>"]
        self.image_start_id, self.image_end_id = s["<image_start>"], s["<image_end>"]
        self.user_id = self.assistant_id = self.end_id = None  # the roles are the template's text
        special = (
            {i for i, t in hf.added_tokens_decoder.items() if t.special}
            | set(s.values())
            | {i for i in (self.eos_id, self.bos_id, self.pad_id) if i is not None}
        )
        self.special_ids = frozenset(special)
        self.is_special = np.zeros(self.vocab_size, dtype=bool)
        self.is_special[list(self.special_ids)] = True
        # the eos may sit inside a rendered chat (Qwen closes every turn with it): only what the
        # data pipeline writes itself is reserved
        self.is_reserved = np.zeros(self.vocab_size, dtype=bool)
        self.is_reserved[[self.image_pad_id, self.image_start_id, self.image_end_id]] = True

    def encode(self, text: str) -> list[int]:
        return self.hf.backend_tokenizer.encode(text, add_special_tokens=False).ids

    def _identity(self) -> str:
        ids = [self.bos_id, self.eos_id, self.pad_id, sorted(self.special_ids)]
        return json.dumps([super()._identity(), ids, self.chat_template]) + (
            self.hf.backend_tokenizer.to_str()
        )

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [
            e.ids for e in self.hf.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        ]

    def decode(self, ids, skip_special: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def _count_bytes(self) -> np.ndarray:
        return np.array(
            [
                len(self.hf.decode([i], skip_special_tokens=False).encode("utf-8"))
                for i in range(self.vocab_size)
            ],
            dtype=np.int64,
        )

    def render(self, turns: list[dict], add_generation_prompt: bool = False) -> str:
        return self.hf.apply_chat_template(
            turns, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def chat_segments(
        self, turns: list[dict], add_generation_prompt: bool = False
    ) -> list[tuple[str, bool]]:
        """The source's template rendered turn by turn: (text, is_target), the targets being what
        the template writes after the generation prompt for each assistant turn (its content and
        closing eos)."""
        segs, done = [], ""
        for i, t in enumerate(turns):
            if t.get("role") == "assistant":
                prompt = self.render(turns[:i], add_generation_prompt=True)
                full = self.render(turns[: i + 1])
                if not (prompt.startswith(done) and full.startswith(prompt)):
                    raise TokenizerError(
                        "the source's chat template does not render a conversation as the "
                        "prefix of its continuation; it cannot be split into prompt and answer"
                    )
                segs += [(prompt[len(done) :], False), (full[len(prompt) :], True)]
            else:
                full = self.render(turns[: i + 1])
                if not full.startswith(done):
                    raise TokenizerError(
                        "the source's chat template does not render a conversation as "
                        "the prefix of its continuation; it cannot be split into turns"
                    )
                segs.append((full[len(done) :], False))
            done = full
        if add_generation_prompt:
            segs.append((self.render(turns, add_generation_prompt=True)[len(done) :], False))
        return [(text, target) for text, target in segs if text]

    def save(self, directory) -> None:
        """The source's files as transformers writes them (its template included,
        IMAGE_TOKENS added), and the marker that keeps the source's chat format when this
        directory is read back."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.hf.save_pretrained(str(d))
        (d / META_FILE).write_text(
            json.dumps({"kind": "source", "image_tokens": IMAGE_TOKENS}, indent=1)
        )


def load_tokenizer(path_or_kind: str | os.PathLike) -> Tokenizer:
    """`"byte"`, a directory written by `save()` (or holding any tokenizer.json), or a tokenizer.json file."""
    if str(path_or_kind) == "byte":
        return ByteTokenizer()
    p = Path(path_or_kind)
    if p.is_file():
        if p.name == META_FILE:
            return load_tokenizer(p.parent)
        return _load_tokenizer_json(p)
    if p.is_dir():
        meta = p / META_FILE
        if meta.is_file():
            info = _json_object(meta)
            if info.get("kind") == "byte":
                return ByteTokenizer()
            if info.get("kind") == "source":
                return SourceTokenizer(p)
            return _load_tokenizer_json(p / info.get("file", "tokenizer.json"))
        if is_source_tokenizer_dir(p):
            return SourceTokenizer(p)
        if (p / "tokenizer.json").is_file():
            return _load_tokenizer_json(p / "tokenizer.json")
        raise TokenizerError(
            f"tokenizer directory {p} holds neither {META_FILE} nor tokenizer.json"
        )
    raise TokenizerError(
        f"tokenizer {str(path_or_kind)!r}: expected 'byte', a "
        "directory or a tokenizer.json file (path does not exist)"
    )


def train_bpe(
    texts_iter: Iterable[str], vocab_size: int, min_frequency: int = 2, show_progress: bool = False
) -> BPETokenizer:
    """Train a byte-level BPE on `texts_iter`; the special tokens take ids 0..9 and every byte stays encodable."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    floor = len(SPECIAL_TOKENS) + 256
    if vocab_size < floor:
        raise TokenizerError(
            f"vocab_size={vocab_size} is too small for byte-level BPE: need "
            f">= {floor} ({len(SPECIAL_TOKENS)} special tokens + 256 bytes)"
        )
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    # special tokens written in the corpus must not be learnt as merges of their characters
    tok.train_from_iterator((_SPECIAL_RE.sub(" ", t) for t in texts_iter), trainer=trainer)
    return BPETokenizer(tok)
