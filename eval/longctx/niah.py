"""Needle in a haystack: single, multi-key, multi-value and multi-query (after RULER's niah task).

Needles read "One of the special magic {kind} for {key} is: {value}." with adjective-noun keys and
7-digit or UUID values. The first needle whose value is asked for sits at the requested depth; every
other needle (more answers, distractor keys) at a seeded uniform depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from eval.longctx import words as W
from eval.longctx.haystack import Haystack, HaystackKind, sentence_starts, token_cost
from eval.longctx.sample import Sample, Tokenizer, answer_budget, sample_rng, token_length
from eval.longctx.sizing import fit_to_length

NEEDLE = "One of the special magic {kind} for {key} is: {value}."
TEMPLATE = (
    "Some special magic {kind} are hidden within the following text. Make sure to "
    "memorize them. I will quiz you about the {kind} afterwards.\n{context}\nWhat "
    "are all the special magic {kind} for {query} mentioned in the provided text?"
)
TEMPLATE_ONE = (
    "A special magic {kind} is hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the {kind} afterwards.\n{context}\nWhat "
    "is the special magic {kind} for {query} mentioned in the provided text?"
)
ANSWER_PREFIX = " The special magic {kind} for {query} mentioned in the provided text are"
ANSWER_PREFIX_ONE = " The special magic {kind} for {query} mentioned in the provided text is"
KIND_NAMES = {
    "numbers": ("number", "numbers"),
    "uuids": ("uuid", "uuids"),
    "words": ("word", "words"),
}
DISTRACTOR_POOL = 16


@dataclass(frozen=True)
class NiahSpec:
    haystack: HaystackKind = "essay"
    value_kind: Literal["numbers", "uuids", "words"] = "numbers"
    num_keys: int = 1  # needles with distinct keys (the non-queried ones are distractors)
    num_values: int = 1  # values per key
    num_queries: int = 1  # keys asked about
    max_new_tokens: int = 128

    def validate(self) -> None:
        if self.num_queries > self.num_keys:
            raise ValueError(f"num_queries ({self.num_queries}) > num_keys ({self.num_keys})")
        if min(self.num_keys, self.num_values, self.num_queries) < 1:
            raise ValueError("num_keys, num_values and num_queries must be >= 1")


def _query_text(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def generate_niah(
    name: str,
    spec: NiahSpec,
    tokenizer: Tokenizer,
    target_length: int,
    depth: float,
    seed: int,
    index: int,
) -> Sample:
    spec.validate()
    rng = sample_rng(seed, name, target_length, depth, index)
    keys = W.distinct(W.random_key, spec.num_keys, rng)
    draw = W.VALUE_KINDS[spec.value_kind]
    flat_values = W.distinct(draw, spec.num_keys * spec.num_values, rng)
    values = [
        flat_values[i * spec.num_values : (i + 1) * spec.num_values] for i in range(spec.num_keys)
    ]
    queried = sorted(rng.sample(range(spec.num_keys), spec.num_queries))
    answers = [v for i in queried for v in values[i]]
    one, many = KIND_NAMES[spec.value_kind]
    kind = one if len(answers) == 1 else many
    needles = [
        (i, v, NEEDLE.format(kind=many, key=keys[i], value=v))
        for i in range(spec.num_keys)
        for v in values[i]
    ]
    first_answer = NEEDLE.format(kind=many, key=keys[queried[0]], value=values[queried[0]][0])
    inserts = [
        (float(depth) if text == first_answer else rng.uniform(0.0, 100.0), text)
        for _, _, text in needles
    ]
    inserts.sort(key=lambda t: t[0])
    query = _query_text([keys[i] for i in queried])
    template, prefix = (
        (TEMPLATE_ONE, ANSWER_PREFIX_ONE) if len(answers) == 1 else (TEMPLATE, ANSWER_PREFIX)
    )
    head, tail = template.split("{context}")
    head, tail = (
        head.format(kind=kind),
        tail.format(kind=kind, query=query) + prefix.format(kind=kind, query=query),
    )
    starts = sentence_starts(spec.haystack)
    hay = Haystack(spec.haystack, starts[rng.randrange(len(starts))], token_cost(tokenizer))

    wrong = [v for i in range(spec.num_keys) if i not in queried for v in values[i]]
    distractors = wrong + W.distinct(
        draw, max(0, DISTRACTOR_POOL - len(wrong)), rng, exclude=set(flat_values)
    )

    def build(n: int) -> str:
        return head + hay.render(n, inserts) + tail

    fitted = fit_to_length(
        build, lambda p: token_length(tokenizer, p), target_length, what=f"{name}@{target_length}"
    )
    prompt = fitted.item
    start = prompt.index(first_answer)
    return Sample(
        task=name,
        prompt=prompt,
        answers=answers,
        distractors=distractors,
        target_length=target_length,
        length=fitted.length,
        depth=float(depth),
        max_new_tokens=answer_budget(tokenizer, spec.max_new_tokens, answers),
        context_span=(len(head), len(prompt) - len(tail)),
        needle_span=(start, start + len(first_answer)),
        meta={
            "keys": keys,
            "queried": [keys[i] for i in queried],
            "haystack_words": fitted.n,
            "inserted": [t for _, t in inserts],
        },
    )
