"""Haystacks (filler text) and depth-exact insertion of needle sentences.

A haystack is a word stream: RULER's repeated noise sentences, or an essay-like text shipped with
this package (`essay.txt`, written for it), repeated cyclically from a sentence start. Sizing works
in words, so one step of the length search adds a handful of tokens, which is what makes a ±2 %
length tolerance reachable at short lengths.

Depth is measured like RULER, over the filler alone (other needles do not count), but in the
model's tokens: each word is weighted by its token count, and a needle goes to the sentence
boundary whose token offset is nearest to `depth/100 x filler tokens`.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Callable, Literal

import numpy as np

HaystackKind = Literal["repeat", "essay"]

REPEAT_NOISE = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
ESSAY_PATH = Path(__file__).with_name("essay.txt")
_SENTENCE_END = (".", "!", "?")


@lru_cache(maxsize=None)
def _essay_words() -> tuple[str, ...]:
    if not ESSAY_PATH.is_file():
        raise FileNotFoundError(f"essay haystack text missing: {ESSAY_PATH}")
    # titles (lines without sentence punctuation) would glue onto the next sentence: drop them
    lines = [ln.strip() for ln in ESSAY_PATH.read_text(encoding="utf-8").splitlines()]
    return tuple(" ".join(ln for ln in lines if ln.endswith(_SENTENCE_END)).split())


@lru_cache(maxsize=None)
def source_words(kind: str) -> tuple[str, ...]:
    if kind == "repeat":
        return tuple(REPEAT_NOISE.split())
    if kind == "essay":
        return _essay_words()
    raise ValueError(f"unknown haystack kind {kind!r}; allowed: repeat, essay")


def sentence_starts(kind: HaystackKind) -> list[int]:
    src = source_words(kind)
    return [0] + [i for i in range(1, len(src)) if src[i - 1].endswith(_SENTENCE_END)]


def token_cost(tokenizer) -> Callable[[str], int]:
    """Tokens of a word as it appears mid-text (with its leading space), memoized."""
    cache: dict[str, int] = {}

    def cost(word: str) -> int:
        if word not in cache:
            cache[word] = len(tokenizer.encode(" " + word))
        return cache[word]

    return cost


class Haystack:
    """The first n words of a cyclic source text from `offset`, with needles placed by token depth."""

    def __init__(
        self, kind: HaystackKind, offset: int = 0, cost: Callable[[str], int] | None = None
    ) -> None:
        src = source_words(kind)
        self.kind = kind
        self.offset = offset % len(src)
        self._src = src[self.offset :] + src[: self.offset]
        self._cost = np.array([cost(w) if cost else 1 for w in self._src], dtype=np.int64)
        self._ends = np.array([w.endswith(_SENTENCE_END) for w in self._src], dtype=bool)

    def words(self, n: int) -> list[str]:
        reps = n // len(self._src) + 1
        return list((self._src * reps)[:n])

    def boundaries(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Sentence-start word indices (with 0 and n) and the filler token offset of each."""
        ends = np.resize(self._ends, n)
        bounds = (
            np.unique(np.concatenate([[0], np.nonzero(ends[:-1])[0] + 1, [n]]))
            if n
            else np.zeros(1, np.int64)
        )
        cum = np.concatenate([[0], np.cumsum(np.resize(self._cost, n))])
        return bounds, cum[bounds]

    def render(self, n: int, inserts: list[tuple[float, str]], sep: str = " ") -> str:
        """The n-word filler with each (depth %, sentence) at the boundary nearest that token depth.

        Inserts landing on the same boundary keep their order in `inserts` (chains stay in order).
        """
        words = self.words(n)
        bounds, offsets = self.boundaries(n)
        placed: dict[int, list[str]] = {}
        for depth, sentence in inserts:
            if not 0.0 <= depth <= 100.0:
                raise ValueError(f"needle depth {depth} outside [0, 100]")
            target = depth / 100.0 * offsets[-1]
            j = int(np.searchsorted(offsets, target))
            cands = [k for k in (j - 1, j) if 0 <= k < len(bounds)]
            best = min(cands, key=lambda k: (abs(offsets[k] - target), k))
            placed.setdefault(int(bounds[best]), []).append(sentence)
        pieces: list[str] = []
        start = 0
        for b in sorted(placed):
            pieces += words[start:b] + placed[b]
            start = b
        pieces += words[start:]
        return sep.join(pieces)
