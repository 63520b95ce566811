"""Aggregation tasks (after RULER): common-words extraction (CWE) and
frequent-words extraction (FWE).

Neither has a needle, so they have no depth; the haystack size is the number of list entries (CWE)
or the Zipf sample size (FWE).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import lru_cache

from eval.longctx import words as W
from eval.longctx.sample import Sample, Tokenizer, answer_budget, sample_rng, token_length
from eval.longctx.sizing import SizingError, fit_to_length

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often "
    "than others. Memorize the ones that appear most often.\n{context}\nQuestion: "
    "What are the {k} most common words in the above list?"
)
CWE_PREFIX = " Answer: The top {k} words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. {context}\nQuestion: "
    "Do not provide any explanation. Please ignore the dots '....'. What are "
    "the three most frequently appeared words in the above coded text?"
)
FWE_PREFIX = (
    " Answer: According to the coded text above, the three most frequently appeared words are:"
)
DISTRACTOR_POOL = 16


@dataclass(frozen=True)
class CWESpec:
    num_common: int = 10
    freq_common: int = 30
    freq_uncommon: int = 3
    # RULER uses sparser lists below 4k tokens so that short prompts still hold enough
    # distinct words
    short_below: int = 4096
    short_freq_common: int = 6
    short_freq_uncommon: int = 1
    max_new_tokens: int = 120


@dataclass(frozen=True)
class FWESpec:
    alpha: float = 2.0
    word_len: int = 6
    vocab_per_tokens: int = 50  # vocabulary size = target_length // this (RULER's rule)
    max_new_tokens: int = 50


def _word_pool(rng: random.Random) -> list[str]:
    singles = sorted(set(W.ADJECTIVES) | set(W.NOUNS))
    rng.shuffle(singles)
    return singles


@lru_cache(maxsize=1)
def _all_pairs() -> tuple[str, ...]:
    return tuple(sorted({f"{a}-{b}" for a in W.ADJECTIVES for b in W.NOUNS}))


def _numbered(entries: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries))


def _cwe_list(
    common: list[str], uncommon: list[str], fc: int, fu: int, n: int, rng_seed: str
) -> list[str]:
    """All common words `fc` times, then `n` uncommon entries (each uncommon word at most `fu` times)."""
    extra = [uncommon[j // fu] for j in range(n)]
    entries = common * fc + extra
    random.Random(rng_seed).shuffle(entries)
    return entries


def generate_cwe(
    name: str,
    spec: CWESpec,
    tokenizer: Tokenizer,
    target_length: int,
    depth: float | None,
    seed: int,
    index: int,
) -> Sample:
    rng = sample_rng(seed, name, target_length, None, index)
    for fc, fu in (
        (spec.freq_common, spec.freq_uncommon),
        (spec.short_freq_common, spec.short_freq_uncommon),
    ):
        if fu >= fc:
            raise ValueError(
                f"{name}: uncommon frequency {fu} must be below the common frequency {fc}"
            )
    pool = _word_pool(rng)
    k = spec.num_common
    # answers must not be substrings of other list words, or naming those would score as a hit
    clean = [w for w in pool if not any(w != o and w in o for o in pool)]
    common, ex_pool = clean[:k], clean[k : 3 * k]
    rest = [w for w in pool if w not in set(common) | set(ex_pool)]
    # beyond the single words, adjective-noun pairs that share no part with a common word
    pairs = [p for p in _all_pairs() if not set(p.split("-")) & set(common)]
    rng.shuffle(pairs)
    uncommon = rest + pairs
    head, tail = CWE_TEMPLATE.split("{context}")
    tail = tail.format(k=k) + CWE_PREFIX.format(k=k)
    # one-shot worked example on words the task list does not use: k common x3, k uncommon x1
    ex_entries = _cwe_list(
        ex_pool[:k], ex_pool[k:], 3, 1, len(ex_pool) - k, f"{seed}/{index}/example"
    )
    example = head + _numbered(ex_entries) + tail + " " + _numbered(ex_pool[:k]) + "\n"
    base = f"{seed}/{name}/{target_length}/{index}/n="

    def builder(fc: int, fu: int):
        return lambda n: (
            example + head + _numbered(_cwe_list(common, uncommon, fc, fu, n, base + str(n))) + tail
        )

    # dense lists (many repeats) only where the repeated common words leave room for the rest
    fc, fu = spec.freq_common, spec.freq_uncommon
    if (
        target_length < spec.short_below
        or token_length(tokenizer, builder(fc, fu)(0)) > target_length // 2
    ):
        fc, fu = spec.short_freq_common, spec.short_freq_uncommon
    build = builder(fc, fu)
    n_max = len(uncommon) * fu
    fitted = fit_to_length(
        build,
        lambda p: token_length(tokenizer, p),
        target_length,
        what=f"{name}@{target_length}",
        n_max=n_max,
    )
    prompt = fitted.item
    start = len(example) + len(head)
    used_uncommon = uncommon[: math.ceil(fitted.n / fu)] if fitted.n else []
    distractors = (used_uncommon + uncommon[len(used_uncommon) :])[:DISTRACTOR_POOL]
    return Sample(
        task=name,
        prompt=prompt,
        answers=list(common),
        distractors=distractors,
        target_length=target_length,
        length=fitted.length,
        depth=None,
        max_new_tokens=answer_budget(tokenizer, spec.max_new_tokens, common),
        context_span=(start, len(prompt) - len(tail)),
        meta={"freq_common": fc, "freq_uncommon": fu, "entries": fitted.n + fc * k},
    )


def _zeta(alpha: float, terms: int = 10000) -> float:
    """Riemann zeta by partial sum plus the integral tail (alpha > 1); exact enough for Zipf weights."""
    if alpha <= 1.0:
        raise ValueError(f"FWE alpha must be > 1, got {alpha}")
    partial = sum(k**-alpha for k in range(1, terms + 1))
    return partial + terms ** (1.0 - alpha) / (alpha - 1.0) - 0.5 * terms**-alpha


def zipf_counts(n: int, vocab_size: int, alpha: float) -> list[int]:
    z = _zeta(alpha)
    return [int(n * k**-alpha / z) for k in range(1, vocab_size + 1)]


def generate_fwe(
    name: str,
    spec: FWESpec,
    tokenizer: Tokenizer,
    target_length: int,
    depth: float | None,
    seed: int,
    index: int,
) -> Sample:
    rng = sample_rng(seed, name, target_length, None, index)
    vocab_size = max(8, target_length // spec.vocab_per_tokens)
    vocab = W.distinct(lambda r: W.random_coded_word(r, spec.word_len), vocab_size, rng)
    vocab[0] = "..."  # the top-ranked "word" is noise, as in RULER
    head, tail = FWE_TEMPLATE.split("{context}")
    base = f"{seed}/{name}/{target_length}/{index}/n="

    def build(n: int) -> str:
        text = [w for w, c in zip(vocab, zipf_counts(n, vocab_size, spec.alpha)) for _ in range(c)]
        random.Random(base + str(n)).shuffle(text)
        return head + " ".join(text) + tail + FWE_PREFIX

    fitted = fit_to_length(
        build, lambda p: token_length(tokenizer, p), target_length, what=f"{name}@{target_length}"
    )
    counts = zipf_counts(fitted.n, vocab_size, spec.alpha)
    if not counts[1] > counts[2] > counts[3] > counts[4]:
        raise SizingError(
            f"{name}@{target_length}: too short for distinct top-3 word counts {counts[:5]}"
        )
    prompt = fitted.item
    return Sample(
        task=name,
        prompt=prompt,
        answers=vocab[1:4],
        distractors=vocab[4 : 4 + DISTRACTOR_POOL],
        target_length=target_length,
        length=fitted.length,
        depth=None,
        max_new_tokens=answer_budget(tokenizer, spec.max_new_tokens, vocab[1:4]),
        context_span=(len(head), len(prompt) - len(tail) - len(FWE_PREFIX)),
        meta={"counts": counts[:8], "sample_words": fitted.n},
    )
