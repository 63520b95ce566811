"""The run's data: the training stream and the held-out batches its evaluations read."""
from __future__ import annotations

import itertools
from dataclasses import replace

from data_pipelines.loader import build_loader
from vlm.train.config import TrainConfig


def build_loaders(cfg: TrainConfig, tokenizer, rank: int, world_size: int):
    """(the training loader, the held-out batches): `logging.eval_batches` of `logging.eval_sources`, else of the
    default dataset's val split when that is the data, else none (the dashboards then read the training batch)."""
    lg, data = cfg.logging, cfg.data
    loader = build_loader(data, tokenizer, rank, world_size)
    val_cfg = None
    if lg.eval_every and lg.eval_sources:
        val_cfg = replace(data, sources=lg.eval_sources, num_workers=0, epochs=None)
    elif lg.eval_every and not data.sources:
        val_cfg = replace(data, split="val", num_workers=0, epochs=None)
    eval_batches = []
    if val_cfg is not None:
        eval_batches = list(itertools.islice(build_loader(val_cfg, tokenizer, rank, world_size), lg.eval_batches))
    return loader, eval_batches
