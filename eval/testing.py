"""Test doubles that satisfy `eval.protocol.EvalModel` without a checkpoint.

Used by the eval tests and handy for smoke-testing the harnesses' plumbing: tokenizers with the
model tokenizer's interface, and a model that solves every long-context task by reading the prompt
with regular expressions (optionally only its last `window_chars` characters, to mimic a limited
context), answers image questions with the image's dominant colour name, and reports
compression statistics from the text it was given.
"""

from __future__ import annotations

import re
from collections import Counter

from data_pipelines.schema import IMAGE_TOKEN

_WORDISH = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")


class ByteTokenizer:
    """ids = UTF-8 bytes; specials above 255."""

    vocab_size, eos_id, image_id = 259, 256, 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class WordTokenizer:
    """Word-ish pieces (leading spaces kept, punctuation split) with a growing vocabulary."""

    eos_id, image_id = 0, 1

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._pieces: list[str] = ["</s>", IMAGE_TOKEN]

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    def encode(self, text: str) -> list[int]:
        out = []
        for piece in _WORDISH.findall(text):
            if piece not in self._ids:
                self._ids[piece] = len(self._pieces)
                self._pieces.append(piece)
            out.append(self._ids[piece])
        return out

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return "".join(self._pieces[i] for i in ids if not (skip_special and i < 2))


# ---- prompt solvers (one per long-context task family) ------------------------------------------


def _solve_niah(prompt: str) -> list[str] | None:
    m = re.search(
        r"The special magic \w+ for ([^?]+?) mentioned in the provided text (?:is|are)$", prompt
    )
    if not m:
        return None
    keys = [k.strip() for k in re.split(r",\s*(?:and\s+)?|\s+and\s+", m.group(1)) if k.strip()]
    found = re.findall(r"One of the special magic \w+ for (\S+) is: (\S+?)\.(?=\s|$)", prompt)
    return [v for k in keys for key, v in found if key == k]


def _solve_vt(prompt: str) -> list[str] | None:
    m = re.search(r"assigned the value (\d+), they are:$", prompt)
    if not m:
        return None
    task = prompt[prompt.rfind("Memorize and track") :]
    known = {}
    for name, src in re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)\.", task):
        known[name] = src
    names = [n for n, s in known.items() if s == m.group(1)]
    grew = True
    while grew:
        grew = False
        for n, s in known.items():
            if s.startswith("VAR ") and s[4:] in names and n not in names:
                names.append(n)
                grew = True
    return names


def _solve_cwe(prompt: str) -> list[str] | None:
    m = re.search(r"What are the (\d+) most common words in the above list\?", prompt[-400:])
    if not m:
        return None
    task = prompt[prompt.rfind("Below is a numbered list") :]
    body = task[: task.rfind("Question:")]
    counts = Counter(re.findall(r"\d+\. (\S+)", body))
    return [w for w, _ in counts.most_common(int(m.group(1)))]


def _solve_fwe(prompt: str) -> list[str] | None:
    if not prompt.endswith("the three most frequently appeared words are:"):
        return None
    start = prompt.find("coded words. ") + len("coded words. ")
    counts = Counter(w for w in prompt[start : prompt.rfind("\nQuestion:")].split() if w != "...")
    return [w for w, _ in counts.most_common(3)]


SOLVERS = (_solve_niah, _solve_vt, _solve_cwe, _solve_fwe)

COLOURS = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "white": (255, 255, 255),
    "black": (0, 0, 0),
}


def dominant_colour(image) -> str:
    r, g, b = image.convert("RGB").resize((1, 1)).getpixel((0, 0))
    return min(COLOURS, key=lambda c: sum((x - y) ** 2 for x, y in zip(COLOURS[c], (r, g, b))))


class OracleEvalModel:
    """Reads answers out of the prompt (and colours out of images); optionally near-sighted."""

    def __init__(
        self, tokenizer=None, window_chars: int | None = None, silent: bool = False
    ) -> None:
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.window_chars = window_chars
        self.silent = silent
        self.calls: list[dict] = []
        self._solved: dict[str, list[str]] = {}
        self._lengths: dict[str, int] = {}
        self.reset_stats()

    # -- helpers
    def _visible(self, prompt: str) -> str:
        return prompt if self.window_chars is None else prompt[-self.window_chars :]

    def answer(self, prompt: str, images: list | None = None) -> list[str]:
        if images:
            return [dominant_colour(images[-1])]
        if prompt not in self._solved:  # loglik asks about one prompt many times
            visible = self._visible(prompt)
            self._solved = {
                prompt: next((out for solve in SOLVERS if (out := solve(visible)) is not None), [])
            }
        return self._solved[prompt]

    def _account(self, prompts: list[str], images: list[list] | None) -> None:
        for i, p in enumerate(prompts):
            imgs = images[i] if images else []
            if p.count(IMAGE_TOKEN) != len(imgs):
                raise ValueError(
                    f"prompt {i} has {p.count(IMAGE_TOKEN)} "
                    f"{IMAGE_TOKEN} placeholders for {len(imgs)} images"
                )
            if p not in self._lengths:
                self._lengths = {p: len(self.tokenizer.encode(p))}
            n = self._lengths[p]
            self._tokens["text"] += n
            self._concepts["text"] += max(1, p.count("."))  # one "concept" per sentence
            if imgs:
                self._tokens["image"] += 16 * len(imgs)
                self._concepts["image"] += 4 * len(imgs)

    # -- EvalModel protocol
    def generate(
        self, prompts, images=None, *, max_new_tokens=32, temperature=0.0, top_p=1.0, stop=None
    ):
        self._account(prompts, images)
        self.calls.append(
            {
                "kind": "generate",
                "n": len(prompts),
                "max_new_tokens": max_new_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "stop": stop,
                "prompts": list(prompts),
                "images": [len(x) for x in images] if images else None,
            }
        )
        outs = []
        for i, p in enumerate(prompts):
            text = (
                ""
                if self.silent
                else " " + ", ".join(self.answer(p, images[i] if images else None))
            )
            for s in stop or []:
                if s and s in text:
                    text = text[: text.index(s)]
            outs.append(self.tokenizer.decode(self.tokenizer.encode(text)[:max_new_tokens]))
        return outs

    def loglikelihood(self, contexts, continuations, images=None):
        self._account(contexts, images)
        self.calls.append(
            {
                "kind": "loglikelihood",
                "n": len(contexts),
                "contexts": list(contexts),
                "continuations": list(continuations),
                "images": [len(x) for x in images] if images else None,
            }
        )
        out = []
        for i, (c, cont) in enumerate(zip(contexts, continuations)):
            hit = cont.strip() in self.answer(c, images[i] if images else None)
            out.append((0.0 if hit else -10.0 - 0.01 * len(cont), hit))
        return out

    def compression_stats(self) -> dict[str, float]:
        """Same keys as the real model's (`vlm.generate`): compression/{mod}, tokens/{mod}, compression/ratio."""
        out = {
            f"compression/{m}": self._tokens[m] / self._concepts[m]
            for m in self._tokens
            if self._concepts[m]
        }
        out.update({f"tokens/{m}": float(n) for m, n in self._tokens.items()})
        if self._concepts:
            out["compression/ratio"] = sum(self._tokens.values()) / sum(self._concepts.values())
        return out

    def reset_stats(self) -> None:
        self._tokens = Counter()
        self._concepts = Counter()
