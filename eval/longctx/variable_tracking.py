"""Variable tracking (after RULER): follow `VAR B = VAR A` chains back to a numeric assignment.

Chain 0's first statement (`VAR X = 12345`) sits at the requested depth and its later hops at seeded
depths after it, in order; other chains (distractors) anywhere. The answer is every variable of
chain 0. A one-shot worked example on a short haystack precedes the task, as in RULER.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from eval.longctx import words as W
from eval.longctx.haystack import Haystack, token_cost
from eval.longctx.sample import Sample, Tokenizer, answer_budget, sample_rng, token_length
from eval.longctx.sizing import fit_to_length

TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in "
    "the following text.\n\n{context}\nQuestion: Find all variables "
    "that are assigned the value {query} in the text above."
)
ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text "
    "above, {num_v} variables are assigned the value {query}, they are:"
)
EXAMPLE_HAYSTACK_WORDS = 40
DISTRACTOR_POOL = 16


@dataclass(frozen=True)
class VTSpec:
    num_chains: int = 1
    num_hops: int = 4
    max_new_tokens: int = 30

    def validate(self) -> None:
        if self.num_chains < 1 or self.num_hops < 1:
            raise ValueError(
                f"num_chains and num_hops must be >= 1, got {self.num_chains}, {self.num_hops}"
            )


def _chains(rng: random.Random, spec: VTSpec) -> tuple[list[list[str]], list[list[str]], list[str]]:
    names = W.distinct(W.random_var_name, spec.num_chains * (spec.num_hops + 1), rng)
    values = W.distinct(lambda r: str(r.randint(10000, 99999)), spec.num_chains, rng)
    var_lists, chains = [], []
    for c in range(spec.num_chains):
        v = names[c * (spec.num_hops + 1) : (c + 1) * (spec.num_hops + 1)]
        var_lists.append(v)
        chains.append(
            [f"VAR {v[0]} = {values[c]}."]
            + [f"VAR {v[j + 1]} = VAR {v[j]}." for j in range(spec.num_hops)]
        )
    return var_lists, chains, values


def _place(rng: random.Random, chains: list[list[str]], depth: float) -> list[tuple[float, str]]:
    first = chains[0]
    later = sorted(rng.uniform(depth, 100.0) for _ in first[1:])
    inserts = [(float(depth), first[0])] + list(zip(later, first[1:]))
    for chain in chains[1:]:
        inserts += list(zip(sorted(rng.uniform(0.0, 100.0) for _ in chain), chain))
    return sorted(inserts, key=lambda t: t[0])  # stable: equal depths keep chain order


def _texts(spec: VTSpec, values: list[str]) -> tuple[str, str]:
    head, tail = TEMPLATE.split("{context}")
    return head, tail.format(query=values[0]) + ANSWER_PREFIX.format(
        num_v=spec.num_hops + 1, query=values[0]
    )


def _example(rng: random.Random, spec: VTSpec) -> tuple[str, list[str]]:
    var_lists, chains, values = _chains(rng, spec)
    head, tail = _texts(spec, values)
    context = Haystack("repeat").render(
        EXAMPLE_HAYSTACK_WORDS, _place(rng, chains, rng.uniform(0, 50))
    )
    return head + context + tail + " " + " ".join(var_lists[0]) + "\n\n", [
        v for vs in var_lists for v in vs
    ]


def generate_vt(
    name: str,
    spec: VTSpec,
    tokenizer: Tokenizer,
    target_length: int,
    depth: float,
    seed: int,
    index: int,
) -> Sample:
    spec.validate()
    rng = sample_rng(seed, name, target_length, depth, index)
    example, example_vars = _example(rng, spec)
    var_lists, chains, values = _chains(rng, spec)
    inserts = _place(rng, chains, depth)
    head, tail = _texts(spec, values)
    head = example + head
    # wrong names that also occur in the prompt come first: other chains, then the worked example's
    taken = {v for vs in var_lists for v in vs}
    distractors = [v for vs in var_lists[1:] for v in vs] + [
        v for v in example_vars if v not in taken
    ]
    distractors += W.distinct(
        W.random_var_name,
        max(0, DISTRACTOR_POOL - len(distractors)),
        rng,
        exclude=taken | set(distractors),
    )

    hay = Haystack("repeat", 0, token_cost(tokenizer))

    def build(n: int) -> str:
        return head + hay.render(n, inserts) + tail

    fitted = fit_to_length(
        build, lambda p: token_length(tokenizer, p), target_length, what=f"{name}@{target_length}"
    )
    prompt = fitted.item
    start = prompt.index(chains[0][0], len(head))
    return Sample(
        task=name,
        prompt=prompt,
        answers=list(var_lists[0]),
        distractors=distractors,
        target_length=target_length,
        length=fitted.length,
        depth=float(depth),
        max_new_tokens=answer_budget(tokenizer, spec.max_new_tokens, var_lists[0]),
        context_span=(len(head), len(prompt) - len(tail)),
        needle_span=(start, start + len(chains[0][0])),
        meta={"chains": chains, "haystack_words": fitted.n, "inserted": [t for _, t in inserts]},
    )
