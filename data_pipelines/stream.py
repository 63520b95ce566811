"""Sample streams: loop epochs, shuffle, mix sources.

The loader reads every source as one stream (split 0 of 1: one global order, whatever the number
of ranks and workers). Splitting remains for other readers: the source's samples, numbered over
its shards in sorted order, are cut into `num_splits` contiguous ranges (sizes differ by at most
one), read as (shard, start, stop) segments. Shuffling: segment order is permuted per epoch, then a
shuffle buffer (webdataset-style) draws samples at random. All randomness is numpy PCG64 seeded
from (seed, source, split[, epoch]); the state is the reading position, the buffered samples as
(shard, index) references and the generator state, all plain Python values, so a restored stream
re-reads its buffered samples and continues bit for bit (a URL shard has no random access:
re-reading sample k of one streams through the k before it). The buffer keeps its references apart
from its samples, so that a state is a shallow copy of one list, not a walk over the buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from data_pipelines.reader import fetch_samples, iter_shard
from data_pipelines.schema import BadSample


@dataclass(frozen=True)
class Segment:
    shard: int
    start: int
    stop: int


def split_range(counts: list[int], split: int, num_splits: int) -> list[Segment]:
    """Segments of the `split`-th of `num_splits` contiguous ranges over the concatenated shards."""
    total = sum(counts)
    lo, hi = total * split // num_splits, total * (split + 1) // num_splits
    segs, base = [], 0
    for shard, n in enumerate(counts):
        a, b = max(lo, base), min(hi, base + n)
        if a < b:
            segs.append(Segment(shard, a - base, b - base))
        base += n
    return segs


def _rng(*seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([int(s) for s in seed]))


class RawShards:
    """How a stream reads its shards by default: raw samples (reader.iter_shard). The loader reads
    index entries instead (data_pipelines.plan.IndexedShards): the same numbering, the same bad
    samples, no sample bytes."""

    def read(self, path, start: int, stop: int, expected: int) -> Iterator[tuple[int, Any]]:
        # mid-run, a URL that no longer answers is counted (unreadable_shard), not fatal
        return iter_shard(path, start=start, stop=stop, expected=expected, count_unreachable=True)

    def fetch(self, path, indices: set[int], expected: int) -> dict[int, Any]:
        return fetch_samples(path, indices, expected)


class SourceStream:
    """The samples of one source for one split: (ref, raw sample | BadSample), epoch after epoch
    (with `shards`, what it reads instead of raw samples)."""

    def __init__(
        self,
        index: int,
        paths: list[Path | str],
        counts: list[int],
        split: int,
        num_splits: int,
        seed: int,
        shuffle_buffer: int,
        epochs: int | None,
        shards: RawShards | None = None,
    ):
        self.shards = shards or RawShards()
        self.index, self.paths, self.counts = index, paths, counts
        self.split, self.seed = split, seed
        self.segments = split_range(counts, split, num_splits)
        self.buffer_size = max(shuffle_buffer, 1)
        self.shuffle = shuffle_buffer > 0
        self.epochs = epochs
        self.epoch, self.seg_pos, self.offset, self.epoch_read = 0, 0, 0, False
        self.exhausted = not self.segments
        # the shuffle buffer: (shard, index) references and their raw samples, in step
        self.refs: list[tuple[int, int]] = []
        self.raws: list[Any] = []
        self.rng = _rng(seed, index, split, 1)
        self._order = self._epoch_order()
        self._reader = None

    def _epoch_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.segments)))
        return (
            _rng(self.seed, self.index, self.split, 2, self.epoch)
            .permutation(len(self.segments))
            .tolist()
        )

    def _read_one(self):
        """Next (ref, raw | BadSample) in reading order, or None at the end of the epoch's segments."""
        while self.seg_pos < len(self.segments):
            seg = self.segments[self._order[self.seg_pos]]
            if self._reader is None:
                self._reader = self.shards.read(
                    self.paths[seg.shard],
                    seg.start + self.offset,
                    seg.stop,
                    self.counts[seg.shard],
                )
            item = next(self._reader, None)
            if item is None or item[0] < 0:  # segment done, or the shard cannot be opened at all
                self.seg_pos, self.offset, self._reader = self.seg_pos + 1, 0, None
                if item is None:
                    continue
            else:
                self.offset = item[0] - seg.start + 1
            return (seg.shard, item[0]), item[1]
        return None

    def next(self):
        """Next (ref, raw | BadSample) in shuffled order; None once the configured epochs are done."""
        while not self.exhausted:
            while len(self.refs) < self.buffer_size and not self.epoch_read:
                item = self._read_one()
                if item is None:
                    self.epoch_read = True
                elif isinstance(item[1], BadSample):
                    return item  # bad samples bypass the buffer (nothing to shuffle)
                else:
                    self.refs.append(item[0])
                    self.raws.append(item[1])
            if self.refs:
                j = int(self.rng.integers(len(self.refs))) if self.shuffle else 0
                return self.refs.pop(j), self.raws.pop(j)
            self.epoch += 1
            self.seg_pos, self.offset, self.epoch_read, self._reader = 0, 0, False, None
            self._order = self._epoch_order()
            if self.epochs is not None and self.epoch >= self.epochs:
                self.exhausted = True
        return None

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "seg_pos": self.seg_pos,
            "offset": self.offset,
            "epoch_read": self.epoch_read,
            "exhausted": self.exhausted,
            "buffer": list(self.refs),  # (shard, index) tuples: immutable, so a shallow copy
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.seg_pos, self.offset = state["epoch"], state["seg_pos"], state["offset"]
        self.epoch_read, self.exhausted = state["epoch_read"], state["exhausted"]
        self.rng.bit_generator.state = state["rng"]
        self._order, self._reader = self._epoch_order(), None
        self.refs = [tuple(r) for r in state["buffer"]]
        self.raws = self.fetch(self.refs)

    def fetch(self, refs: list[tuple[int, int]]) -> list[Any]:
        """Samples for (shard, index) references (re-reading each shard once, or from its index)."""
        wanted: dict[int, set[int]] = {}
        for shard, idx in refs:
            wanted.setdefault(shard, set()).add(idx)
        got = {
            s: self.shards.fetch(self.paths[s], idx, self.counts[s]) for s, idx in wanted.items()
        }
        missing = [(s, i) for s, i in refs if i not in got[s]]
        if missing:
            s, i = missing[0]
            raise RuntimeError(
                f"cannot restore the data position: sample {i} of shard "
                f"{self.paths[s]} is gone (shards changed since the checkpoint?)"
            )
        return [got[s][i] for s, i in refs]


class Mixer:
    """Picks the source of each next sample with probabilities proportional to the weights."""

    def __init__(self, streams: list[SourceStream], weights: list[float], seed: int, split: int):
        self.streams = streams
        self.weights = np.asarray(weights, dtype=np.float64)
        self.rng = _rng(seed, split, 3)

    def next(self):
        """(source index, ref, raw | BadSample), or None when every source is exhausted."""
        while True:
            active = [i for i, s in enumerate(self.streams) if not s.exhausted]
            if not active:
                return None
            if len(self.streams) == 1:
                i = 0
            else:
                w = self.weights[active]
                i = active[
                    int(
                        np.searchsorted(
                            np.cumsum(w / w.sum()), self.rng.random(), side="right"
                        ).clip(max=len(active) - 1)
                    )
                ]
            item = self.streams[i].next()
            if item is not None:
                return (i, *item)

    def state_dict(self) -> dict:
        return {
            "rng": self.rng.bit_generator.state,
            "streams": [s.state_dict() for s in self.streams],
        }

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        for s, st in zip(self.streams, state["streams"]):
            s.load_state_dict(st)
