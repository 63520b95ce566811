"""One generated long-context sample and the seeding rule shared by all generators."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass
class Sample:
    task: str
    prompt: str  # everything the model reads, ending with the answer prefix
    answers: list[str]  # references (scored as substrings of the prediction)
    distractors: list[str]  # same-kind wrong answers, for the log-likelihood ranking mode
    target_length: int
    length: int  # prompt tokens with the model's tokenizer
    depth: float | None  # requested depth (%) of the first answer needle; None: no needle
    max_new_tokens: int
    context_span: tuple[int, int] = (0, 0)  # char span of the haystack region in `prompt`
    # char span of the first answer needle in `prompt`
    needle_span: tuple[int, int] | None = None
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            k: getattr(self, k)
            for k in (
                "task",
                "prompt",
                "answers",
                "distractors",
                "target_length",
                "length",
                "depth",
                "max_new_tokens",
                "context_span",
                "needle_span",
            )
        }


def sample_rng(
    seed: int, task: str, target_length: int, depth: float | None, index: int
) -> random.Random:
    """Independent, reproducible stream per sample (str seeds hash with SHA-512: stable across runs)."""
    return random.Random(f"{seed}/{task}/{target_length}/{depth}/{index}")


def token_length(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text))


def answer_budget(tokenizer: Tokenizer, default: int, answers: list[str]) -> int:
    """RULER's generation budgets are in BPE tokens; a byte-level tokenizer needs more room for the
    same answer, so the budget is at least 1.5x the reference answer list's own token count (+8)."""
    return max(default, (3 * token_length(tokenizer, " " + ", ".join(answers))) // 2 + 8)
