"""A generated LLaVA-style mix for the loader benchmark: multi-turn chat about photo-like JPEGs of
336-768 px per side, with a share of text-only conversations, written as shards in the schema.

The images are smooth colour fields with shapes and sensor-like grain, saved at JPEG quality 75-95:
they decode, resize and compress like photos (tens to hundreds of kB each), which flat colours or
white noise do not. `images` distinct pictures are generated and cycled over the samples, so that a
mix of thousands of samples is made in seconds while every sample still carries its own copy of the
bytes (the loader reads, decodes and resizes each one). The conversations are LLaVA 1.5's shapes:
one to five question-answer turns, short answers ("one word or phrase") and long descriptions mixed.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

WORDS = (
    "the a an of on in with at near behind above below left right two three small large red "
    "blue green white black wooden table person dog cat street car building tree window sign "
    "people standing sitting holding looking picture image shows scene background foreground "
    "light shadow water sky road grass plate food kitchen room field"
).split()
QUESTIONS = (
    "What is the color of the {w}?",
    "How many {w}s are in the picture?",
    "What is the person doing near the {w}?",
    "Describe the image in detail.",
    "Is there a {w} on the left side of the image?",
    "What is unusual about this {w}?",
    "Answer the question using a single word or phrase. Where is the {w}?",
)


def photo(rng: np.random.Generator, width: int, height: int) -> bytes:
    """A photo-like JPEG: a smooth colour field, a few shapes, fine grain."""
    from PIL import Image, ImageDraw, ImageFilter

    coarse = rng.integers(0, 256, (height // 64 + 2, width // 64 + 2, 3), dtype=np.uint8)
    img = Image.fromarray(coarse, "RGB").resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 9))):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1 = min(width, x0 + int(rng.integers(20, width // 2)))
        y1 = min(height, y0 + int(rng.integers(20, height // 2)))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape((x0, y0, x1, y1), fill=colour)
    img = img.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.5, 2.0))))
    grain = rng.normal(0.0, float(rng.uniform(3, 9)), (height, width, 1))
    arr = np.clip(np.asarray(img, dtype=np.float32) + grain, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, "JPEG", quality=int(rng.integers(75, 96)))
    return buf.getvalue()


def _sentence(rng: np.random.Generator, words: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), words)).capitalize() + "."


def conversation(rng: np.random.Generator, with_image: bool) -> list[dict]:
    turns = []
    for t in range(int(rng.integers(1, 6))):
        q = QUESTIONS[int(rng.integers(len(QUESTIONS)))].format(
            w=WORDS[int(rng.integers(len(WORDS)))]
        )
        if t == 0 and with_image:
            q = "<image>\n" + q
        long = rng.random() < 0.3
        a = " ".join(
            _sentence(rng, int(rng.integers(6, 18))) for _ in range(int(rng.integers(2, 6)))
        )
        turns += [
            {"role": "user", "content": q},
            {
                "role": "assistant",
                "content": a if long else _sentence(rng, int(rng.integers(1, 4))),
            },
        ]
    return turns


def write_llava_mix(
    out: str | Path,
    samples: int = 2000,
    images: int = 200,
    min_side: int = 336,
    max_side: int = 768,
    text_only_share: float = 0.06,
    per_shard: int = 500,
    seed: int = 0,
) -> Path:
    """Write the mix as shards (with a manifest) into `out`; returns the folder. Nothing is
    written again when its manifest already lists `samples` samples."""
    from data_pipelines.schema import Sample
    from data_pipelines.writer import ShardWriter, read_manifest

    out = Path(out)
    m = read_manifest(out) if out.is_dir() else None
    if m and sum(int(e["count"]) for e in m["shards"]) == samples:
        return out
    rng = np.random.default_rng(seed)
    sides = rng.integers(min_side, max_side + 1, (images, 2))
    pictures = [photo(rng, int(w), int(h)) for w, h in sides]
    with ShardWriter(out, "llava", max_count=per_shard) as w:
        for i in range(samples):
            text_only = rng.random() < text_only_share
            turns = conversation(rng, not text_only)
            imgs = [] if text_only else [pictures[i % images]]
            kind = "text" if text_only else "pair"
            w.write(
                Sample(f"s{i:07d}", kind, turns=turns, images=imgs, image_exts=["jpg"] * len(imgs))
            )
    return out
