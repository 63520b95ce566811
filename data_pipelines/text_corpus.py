"""A small generated text-only corpus for the text side of the default dataset.

Sentences from a few templates with learnable regularities (shape facts consistent with the
scenes, arithmetic, counting, a toy story grammar), so text loss falls measurably within minutes
of CPU training.
"""

from __future__ import annotations

import random

from data_pipelines.scenes import COLOURS, SHAPES

NUMBERS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
]
SIDES = {
    "circle": "no corners",
    "square": "four equal sides",
    "triangle": "three sides",
    "diamond": "four corners",
}
ANIMALS = ["cat", "dog", "fox", "owl", "horse", "rabbit", "mouse", "bear", "duck", "goat"]
ADJECTIVES = ["quick", "lazy", "small", "big", "happy", "quiet", "old", "young", "brave", "sleepy"]
VERBS = ["sees", "follows", "finds", "greets", "chases", "helps", "watches", "meets"]
PLACES = [
    "in the garden",
    "near the river",
    "under the tree",
    "on the hill",
    "by the house",
    "in the field",
]
THINGS = ["ball", "box", "kite", "hat", "cup", "book", "lamp", "stone"]


def _fact(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        s = rng.choice(SHAPES)
        return f"A {s} has {SIDES[s]}."
    if kind == 1:
        c, s = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
        return f"The {c} {s} is {rng.choice(['small', 'large'])}."
    a, b = rng.sample(sorted(COLOURS), 2)
    return f"{a.capitalize()} is a colour, and so is {b}."


def _arith(rng: random.Random) -> str:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    if rng.random() < 0.5:
        return f"{a} plus {b} is {a + b}."
    a, b = max(a, b), min(a, b)
    return f"{a} minus {b} is {a - b}."


def _count(rng: random.Random) -> str:
    start = rng.randint(0, 6)
    n = rng.randint(3, 6)
    return ", ".join(NUMBERS[start : start + n]).capitalize() + "."


def _story(rng: random.Random) -> str:
    a1, a2 = rng.sample(ANIMALS, 2)
    return (
        f"The {rng.choice(ADJECTIVES)} {a1} {rng.choice(VERBS)} the {rng.choice(ADJECTIVES)} {a2} "
        f"{rng.choice(PLACES)}. It has a {rng.choice(sorted(COLOURS))} {rng.choice(THINGS)}."
    )


GENERATORS = (_fact, _arith, _count, _story)


def document(rng: random.Random, min_sentences: int = 3, max_sentences: int = 12) -> str:
    return " ".join(
        rng.choice(GENERATORS)(rng) for _ in range(rng.randint(min_sentences, max_sentences))
    )
