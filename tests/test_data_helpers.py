"""Shared fixtures-as-functions for the data tests (this module holds no tests)."""
from __future__ import annotations

import io
from dataclasses import fields
from pathlib import Path

import torch
from PIL import Image

from data_pipelines.default_dataset import DefaultDatasetConfig, build_default
from data_pipelines.schema import Sample
from data_pipelines.writer import ShardWriter

TINY_DEFAULT = DefaultDatasetConfig(train_scenes=120, val_scenes=20, test_scenes=20, interleaved_docs=16,
                                    text_docs=60, shard_max_count=50)


def png(w: int = 40, h: int = 30, colour=(255, 0, 0), fmt: str = "PNG", mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h), colour if mode == "RGB" else 0).save(buf, fmt)
    return buf.getvalue()


def tiny_default(tmp_path_factory) -> Path:
    return build_default(tmp_path_factory.mktemp("data") / "default", TINY_DEFAULT, progress=False)


def write_text_shards(directory: Path, n: int, per_shard: int, prefix: str = "t") -> list[str]:
    """Text-only samples whose text names them ("doc 17 ..."), so a packed batch can be decoded back."""
    texts = [f"doc {i} " + "x" * (i % 23) for i in range(n)]
    with ShardWriter(directory, prefix, max_count=per_shard) as w:
        for i, t in enumerate(texts):
            w.write(Sample(key=f"{prefix}{i:05d}", kind="text", text=t))
    return texts


def batches_equal(a, b) -> bool:
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
            return False
    return True


def decode_docs(batch, tok) -> list[str]:
    """Text of every document in a packed batch (specials dropped)."""
    out = []
    for r in range(batch.input_ids.shape[0]):
        ids, doc = batch.input_ids[r], batch.doc_ids[r]
        for d in doc.unique().tolist():
            if d >= 0:
                out.append(tok.decode(ids[doc == d].tolist()))
    return out
