"""The tokenizer protocol every tokenizer keeps (data_pipelines/tokenizer.py has the byte-level, BPE
and source tokenizers): the project's special tokens, their ids as attributes, lookup tables, the
chat format and bits-per-byte counts."""

from __future__ import annotations

import hashlib
import json
import os
import re

import numpy as np

SPECIAL_TOKENS = [
    "<pad>",
    "<bos>",
    "<eos>",
    "<image>",
    "<image_pad>",
    "<image_start>",
    "<image_end>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
]
META_FILE = "vlm_tokenizer.json"  # written next to tokenizer.json; says which kind to load
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or built; the message names the path or the problem."""


class Tokenizer:
    """Common protocol. Subclasses set `vocab_size` and `_special_ids` (token string -> id)."""

    kind = "abstract"
    vocab_size: int
    _special_ids: dict[str, int]

    def _init_special_attrs(self) -> None:
        s = self._special_ids
        self.pad_id, self.bos_id, self.eos_id = s["<pad>"], s["<bos>"], s["<eos>"]
        self.image_id, self.image_pad_id = s["<image>"], s["<image_pad>"]
        self.image_start_id, self.image_end_id = s["<image_start>"], s["<image_end>"]
        self.user_id, self.assistant_id, self.end_id = (
            s["<|user|>"],
            s["<|assistant|>"],
            s["<|end|>"],
        )
        self.special_ids = frozenset(s.values())
        # lookup tables: checking token arrays with them costs one gather, not a set search
        self.is_special = np.zeros(self.vocab_size, dtype=bool)
        self.is_special[list(self.special_ids)] = True
        self.is_reserved = np.zeros(self.vocab_size, dtype=bool)  # never legal inside sample text
        self.is_reserved[
            [
                self.pad_id,
                self.bos_id,
                self.eos_id,
                self.image_pad_id,
                self.image_start_id,
                self.image_end_id,
            ]
        ] = True

    def identity(self) -> str:
        """A digest of what decides how text becomes ids (the vocabulary, the merges, the special
        tokens, the chat format): the loader's index keeps token counts per identity."""
        if getattr(self, "_identity_digest", None) is None:
            self._identity_digest = _digest(self._identity())
        return self._identity_digest

    def _identity(self) -> str:
        return json.dumps([type(self).__name__, self.vocab_size, sorted(self._special_ids.items())])

    def token_id(self, special: str) -> int:
        return self._special_ids[special]

    # the project's own format (data_pipelines/chat.py); a source's tokenizer has its own
    chat_template = None

    def chat_segments(
        self, turns: list[dict], add_generation_prompt: bool = False
    ) -> list[tuple[str, bool]]:
        """A conversation as (text, is_target) pieces in this tokenizer's chat format."""
        from data_pipelines.chat import chat_segments

        return chat_segments(turns, add_generation_prompt)

    def format_chat(self, turns: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as one string in this tokenizer's chat format (what chat, the demo and
        lmms-eval prompt the model with)."""
        return "".join(text for text, _ in self.chat_segments(turns, add_generation_prompt))

    @property
    def bytes_per_id(self) -> np.ndarray:
        """UTF-8 bytes each id stands for (0 for special tokens): the denominator of bits per byte."""
        if getattr(self, "_bytes_per_id", None) is None:
            self._bytes_per_id = self._count_bytes()
            self._bytes_per_id[list(self.special_ids)] = 0
        return self._bytes_per_id

    def _count_bytes(self) -> np.ndarray:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_np(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        raise NotImplementedError

    def save(self, directory: str | os.PathLike) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]
