"""Decoded samples of shards, for the tools that read shards outside the loader (VQA and caption
export, tokenizer training, `vlm data stats --scan`): resolve the source patterns, read each shard,
count the bad samples by reason and skip them, decode the rest."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator

from data_pipelines.reader import iter_shard, resolve_shards, shard_counts
from data_pipelines.schema import BadSample, Sample, decode_sample


def iter_decoded(
    path: str | os.PathLike, expected: int | None = None, counters: Counter | None = None
) -> Iterator[tuple[dict[str, Any], Sample]]:
    """(raw sample, decoded Sample) for every good sample of one shard, in order. A sample that
    cannot be read or decoded is skipped and, with `counters`, counted under its reason (`expected`
    as in `iter_shard`)."""
    for _, raw in iter_shard(path, expected=expected):
        if isinstance(raw, BadSample):
            if counters is not None:
                counters[raw.reason] += raw.count
            continue
        try:
            sample = decode_sample(raw)
        except BadSample as e:
            if counters is not None:
                counters[e.reason] += e.count
            continue
        yield raw, sample


def iter_samples(
    patterns: str | os.PathLike | Iterable[str | os.PathLike],
    *,
    manifest_counts: bool = True,
    counters: Counter | None = None,
) -> Iterator[Sample]:
    """Decoded samples of the shards that `patterns` (one or a list of directories, globs,
    brace patterns or files) resolve to, in shard order; bad samples are skipped and counted
    as in `iter_decoded`.

    With `manifest_counts` (as the loader) each shard is read up to its manifest count (or the count
    found by reading it first) and every sample it lost is counted; without, each shard is read once
    to its end."""
    paths: list[Path] = []
    for p in [patterns] if isinstance(patterns, (str, os.PathLike)) else patterns:
        paths += resolve_shards(p)
    counts = shard_counts(paths) if manifest_counts else [None] * len(paths)
    for path, count in zip(paths, counts):
        for _, sample in iter_decoded(path, expected=count, counters=counters):
            yield sample


__all__ = ["iter_decoded", "iter_samples"]
