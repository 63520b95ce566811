"""The chat template (training on VQA, evaluation, the chat demo) and VQA helpers for evaluation.

Template, with no extra whitespace so that byte-level tokens are not spent on it:

    <|user|>{user content}<|end|><|assistant|>{assistant content}<|end|>...

Images are `<image>` placeholders inside user contents. In training the assistant contents plus
their closing `<|end|>` are the targets (with `loss_on="assistant"`); a generation prompt ends with
`<|assistant|>` and the model answers until it writes `<|end|>`.

This is the format of models trained from scratch. A model continued from a pretrained source keeps
the source's own template (data_pipelines.tokenizer.SourceTokenizer.chat_segments); the data
pipeline asks the tokenizer.
"""

from __future__ import annotations

import os
import re
import string
from dataclasses import dataclass
from typing import Iterator

from data_pipelines.samples import iter_samples
from data_pipelines.schema import IMAGE_TOKEN, ROLES

USER, ASSISTANT, END = "<|user|>", "<|assistant|>", "<|end|>"
_ROLE_TOKEN = {"user": USER, "assistant": ASSISTANT}


def chat_segments(turns: list[dict], add_generation_prompt: bool = False) -> list[tuple[str, bool]]:
    """Turns -> [(text, is_target)]; targets are assistant contents and their closing <|end|>."""
    segs: list[tuple[str, bool]] = []
    for i, t in enumerate(turns):
        role = t.get("role")
        if role not in ROLES:
            raise ValueError(f"turn {i}: role {role!r} not one of {ROLES}")
        if role == "assistant":
            segs += [(ASSISTANT, False), (t["content"] + END, True)]
        else:
            segs.append((USER + t["content"] + END, False))
    if add_generation_prompt:
        segs.append((ASSISTANT, False))
    return segs


def format_chat(turns: list[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as one string (what the tokenizer sees)."""
    return "".join(text for text, _ in chat_segments(turns, add_generation_prompt))


def vqa_prompt(question: str, num_images: int = 1) -> str:
    """The generation prompt for a question about image(s): user turn with placeholders, then <|assistant|>."""
    return format_chat(
        [{"role": "user", "content": IMAGE_TOKEN * num_images + "\n" + question}],
        add_generation_prompt=True,
    )


def strip_answer(generated: str) -> str:
    """Cut a generated continuation at the first <|end|> (or other special token)."""
    return re.split(r"<\|end\|>|<eos>|<\|user\|>|<\|assistant\|>", generated, maxsplit=1)[0].strip()


_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(answer: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (VQA-style exact match)."""
    words = answer.lower().translate(_PUNCT).split()
    return " ".join(w for w in words if w not in ("a", "an", "the"))


@dataclass
class VQASample:
    image: bytes
    question: str
    answer: str
    question_type: str
    key: str
    heldout: bool = False
    images: list[bytes] | None = None  # all images of the sample (image == images[0])

    @property
    def prompt(self) -> str:
        return vqa_prompt(self.question, len(self.images or [self.image]))


def iter_vqa_samples(
    shard_paths: str | os.PathLike | list, limit: int | None = None
) -> Iterator[VQASample]:
    """One VQASample per question in the shards' `meta.qa` lists (default dataset and imported
    tables), in shard order. Samples without `qa` or that fail to decode are skipped."""
    n = 0
    for sample in iter_samples(shard_paths):
        if not sample.images:
            continue
        for qa in sample.meta.get("qa", []):
            yield VQASample(
                image=sample.images[0],
                question=qa["question"],
                answer=str(qa["answer"]),
                question_type=str(qa.get("type", "unknown")),
                key=sample.key,
                heldout=bool(qa.get("heldout", False)),
                images=sample.images,
            )
            n += 1
            if limit is not None and n >= limit:
                return
