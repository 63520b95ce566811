"""Planning: the run's one global sequence of micro-batches, without decoding an image.

Every source is read as one stream (data_pipelines.stream, split 0 of 1), the streams are mixed,
each sample is tokenized and its images planned from their headers (grid and orientation:
data_pipelines.encode with decode_images=False), the packer fills rows, and every
`rows_per_batch` rows make micro-batch g = 0, 1, 2, ... Nothing here depends on the number of
ranks or workers, so every rank runs the same planner and materialises only its own micro-batches
(data_pipelines.materialise: the expensive part, decoding and resizing).

What planning reads and skips is counted per micro-batch (`MicroBatchPlan.tally`): the rank that
trains on micro-batch g counts it, so the counts summed over ranks are exact. The planner's state
(`state_dict`) is the streams' positions, their shuffle buffers and the packer's waiting samples as
references, and the running totals: a shallow copy of a few lists, cheap enough to take after every
round of micro-batches.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from data_pipelines.config import DataConfig
from data_pipelines.encode import EncodedSample, encode_sample
from data_pipelines.packing import Packer
from data_pipelines.schema import BadSample, decode_sample
from data_pipelines.stream import Mixer, SourceStream
from data_pipelines.tokenizer import Tokenizer
from vision.image_processor import ImageProcessor

log = logging.getLogger("data_pipelines")


@dataclass
class ResolvedSource:
    label: str
    paths: list[Path | str]  # local shard files, or shard URLs (reader.Shard)
    counts: list[int]
    weight: float
    kind: str
    caption_field: str = "caption"


@dataclass
class Tally:
    """Samples read and skipped: skip counters by reason, statistics, and both per source label."""

    counters: Counter = field(default_factory=Counter)
    stats: Counter = field(default_factory=Counter)
    read_by_source: Counter = field(default_factory=Counter)
    skipped_by_source: dict[str, Counter] = field(default_factory=dict)

    def skip(self, label: str, reason: str, count: int = 1) -> None:
        self.counters[reason] += count
        self.skipped_by_source.setdefault(label, Counter())[reason] += count

    def add(self, other: "Tally") -> None:
        self.counters.update(other.counters)
        self.stats.update(other.stats)
        self.read_by_source.update(other.read_by_source)
        for label, c in other.skipped_by_source.items():
            self.skipped_by_source.setdefault(label, Counter()).update(c)

    def to_dict(self) -> dict:
        return {
            "counters": dict(self.counters),
            "stats": dict(self.stats),
            "read_by_source": dict(self.read_by_source),
            "skipped_by_source": {k: dict(c) for k, c in self.skipped_by_source.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Tally":
        return cls(
            Counter(d["counters"]),
            Counter(d["stats"]),
            Counter(d["read_by_source"]),
            {k: Counter(c) for k, c in d["skipped_by_source"].items()},
        )


@dataclass
class MicroBatchPlan:
    """Micro-batch `index` of the global sequence: its rows of encoded samples (images planned, not
    decoded) and what planning it read and skipped."""

    index: int
    rows: list[list[EncodedSample]]
    tally: Tally


class Planner:
    def __init__(
        self,
        cfg: DataConfig,
        sources: list[ResolvedSource],
        tok: Tokenizer,
        processor: ImageProcessor | None = None,
    ):
        self.cfg, self.sources, self.tok = cfg, sources, tok
        self.processor = processor or ImageProcessor(cfg.processor)
        self.streams = [
            SourceStream(i, s.paths, s.counts, 0, 1, cfg.seed, cfg.shuffle_buffer, cfg.epochs)
            for i, s in enumerate(sources)
        ]
        self.mixer = Mixer(self.streams, [s.weight for s in sources], cfg.seed, 0)
        self.packer = Packer(cfg.row_tokens, cfg.pack_buffer)
        self.next_index = 0
        self.ended = False
        self.totals = Tally()  # every micro-batch planned so far (all ranks')
        self.pending = Tally()  # read since the last micro-batch
        self.warn = True  # warn about the first skip of each reason (one rank does)

    def _encode(self, src: int, raw) -> list[EncodedSample]:
        sample = decode_sample(raw, self.sources[src].kind, self.sources[src].caption_field)
        pieces = encode_sample(
            sample,
            self.tok,
            self.processor,
            self.cfg.row_tokens,
            self.cfg.loss_on,
            self.cfg.long_text,
            decode_images=False,
        )
        for piece in pieces:
            piece.source = src
        return pieces

    def _skip(self, err: BadSample, src: int) -> None:
        first = err.reason not in self.totals.counters and err.reason not in self.pending.counters
        self.pending.skip(self.sources[src].label, err.reason, err.count)
        # every rank plans every sample: one warning per reason and process is enough
        (log.warning if first and self.warn else log.debug)(
            "skipping bad input (%s): %s", err.reason, err
        )

    def _fill_pool(self) -> None:
        while self.packer.need() > 0 and not self.ended:
            item = self.mixer.next()
            if item is None:
                self.ended = True
                return
            src, ref, raw = item
            self.pending.stats["samples_read"] += 1
            self.pending.read_by_source[self.sources[src].label] += 1
            try:
                if isinstance(raw, BadSample):
                    raise raw
                pieces = self._encode(src, raw)
            except BadSample as e:
                self._skip(e, src)
                continue
            self.pending.stats["truncated"] += pieces[0].truncated
            for k, enc in enumerate(pieces):
                self.packer.add((src, ref[0], ref[1], k), enc)

    def next_plan(self) -> MicroBatchPlan | None:
        """The next micro-batch of the global sequence; None once the data is exhausted (what was
        read after the last one stays in `pending`)."""
        rows = []
        while len(rows) < self.cfg.rows_per_batch:
            self._fill_pool()
            row = self.packer.next_row()
            if not row:
                break
            rows.append([enc for _, enc in row])
        if not rows:
            return None
        st = self.pending.stats
        st["batches"] += 1
        st["rows"] += len(rows)
        st["samples_packed"] += sum(len(r) for r in rows)
        st["tokens"] += sum(len(s) for r in rows for s in r)
        st["slots"] += len(rows) * self.cfg.row_tokens
        images = [im for r in rows for s in r for im in s.images]
        st["image_tokens"] += sum(im.num_tokens for im in images)
        st["images"] += len(images)
        plan = MicroBatchPlan(self.next_index, rows, self.pending)
        self.totals.add(self.pending)
        self.pending = Tally()
        self.next_index += 1
        return plan

    def take_pending(self) -> Tally:
        """What was read after the last micro-batch (at the end of the data: bad samples after the
        last good one); counted by the rank that would have trained on the next micro-batch."""
        out, self.pending = self.pending, Tally()
        self.totals.add(out)
        return out

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """The position after the last micro-batch planned: plain values, no sample bytes."""
        return {
            "next_index": self.next_index,
            "mixer": self.mixer.state_dict(),
            "pool": [ref for ref, _ in self.packer.pool],
            "ended": self.ended,
            "totals": self.totals.to_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.mixer.load_state_dict(state["mixer"])
        self.next_index, self.ended = state["next_index"], state["ended"]
        self.totals, self.pending = Tally.from_dict(state["totals"]), Tally()
        refs = [tuple(r) for r in state["pool"]]
        by_source: dict[int, list[tuple[int, int]]] = {}
        for src, shard, idx, _ in refs:
            by_source.setdefault(src, []).append((shard, idx))
        raws = {src: dict(zip(rs, self.streams[src].fetch(rs))) for src, rs in by_source.items()}
        self.packer.pool = []
        for src, shard, idx, piece in refs:
            # deterministic: the same pieces as before
            pieces = self._encode(src, raws[src][(shard, idx)])
            self.packer.pool.append(((src, shard, idx, piece), pieces[piece]))
