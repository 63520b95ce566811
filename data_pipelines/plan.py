"""Planning: the run's one global sequence of micro-batches, from the loader's index.

Every source is read as one stream (data_pipelines.stream, split 0 of 1), the streams are mixed,
and each sample is planned from its index entry (data_pipelines.index, .lengths): its length in a
row and its images' sizes, known without its bytes. The packer fills rows, and every
`rows_per_batch` rows make micro-batch g = 0, 1, 2, ... Nothing here depends on the number of
ranks or workers, so every rank runs the same planner and materialises only its own micro-batches
(data_pipelines.materialise: reading the samples' bytes, decoding, resizing). URL shards and
compressed tars, which cannot be read in parts, are planned from entries made as they stream by.

What planning reads and skips is counted per micro-batch (`MicroBatchPlan.tally`): the rank that
trains on micro-batch g counts it, so the counts summed over ranks are exact. The planner's state
(`state_dict`) is the streams' positions, their shuffle buffers and the packer's waiting samples as
references, and the running totals: a shallow copy of a few lists, cheap enough to take after every
round of micro-batches.

A source whose every sample was skipped over a whole pass, which would be read again and again
without ever filling a row, stops the loader with a ShardError naming it and why.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from data_pipelines.config import DataConfig
from data_pipelines.index import Catalog
from data_pipelines.index_layers import SourceSettings, indexable
from data_pipelines.lengths import Piece, Sizer
from data_pipelines.packing import Packer
from data_pipelines.reader import iter_shard, number_samples
from data_pipelines.schema import BadSample, ShardError
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
    """Micro-batch `index` of the global sequence: its rows of planned pieces (each an index entry:
    where the sample's bytes are, its length, its images' tokens) and what planning it read and
    skipped."""

    index: int
    rows: list[list[Piece]]
    tally: Tally


class IndexedShards:
    """A source's shards as its stream reads them for planning: entries from the index (local
    tars), or made as they stream by (URLs, compressed tars); the reader's numbering and bad
    samples either way (reader.number_samples)."""

    def __init__(self, catalog: Catalog, settings: SourceSettings):
        self.catalog, self.settings = catalog, settings

    def read(self, path, start: int, stop: int, expected: int):
        index = None
        if indexable(path) and path.exists():
            index = self.catalog.shard(path, self.settings)
        if index is not None:
            errors: list = []
            end: dict = {}
            groups = index.samples.replay(errors, end)
            for i, item in number_samples(groups, path, errors, end, start, stop, expected, True):
                yield i, item if isinstance(item, BadSample) else index.entry(item["__i__"])
            return
        io = self.catalog.io
        for i, raw in iter_shard(path, start, stop, expected, count_unreachable=True, io=io):
            if not isinstance(raw, BadSample):
                raw = self.catalog.entry_from_raw(raw, self.settings)
            yield i, raw

    def fetch(self, path, indices: set[int], expected: int) -> dict:
        if not indices:
            return {}
        got = self.read(path, min(indices), max(indices) + 1, expected)
        return {i: item for i, item in got if i in indices}


class Planner:
    def __init__(
        self,
        cfg: DataConfig,
        sources: list[ResolvedSource],
        tok: Tokenizer,
        processor: ImageProcessor | None = None,
        catalog: Catalog | None = None,
    ):
        self.cfg, self.sources, self.tok = cfg, sources, tok
        self.processor = processor or ImageProcessor(cfg.processor)
        self.catalog = catalog or Catalog(tok, self.processor, cfg.index_cache)
        self.streams = [
            SourceStream(
                i,
                s.paths,
                s.counts,
                0,
                1,
                cfg.seed,
                cfg.shuffle_buffer,
                cfg.epochs,
                IndexedShards(self.catalog, self.catalog.settings(s.kind, s.caption_field)),
            )
            for i, s in enumerate(sources)
        ]
        self.mixer = Mixer(self.streams, [s.weight for s in sources], cfg.seed, 0)
        self.packer = Packer(cfg.row_tokens, cfg.pack_buffer)
        self.sizer = Sizer(self.processor, cfg.row_tokens, cfg.long_text)
        self.next_index = 0
        self.ended = False
        self.totals = Tally()  # every micro-batch planned so far (all ranks')
        self.pending = Tally()  # read since the last micro-batch
        self.warn = True  # warn about the first skip of each reason (one rank does)
        # per source, the pass being read: its epoch, whether a sample of it was packed, what it
        # skipped (a pass that packs nothing is read again for ever: an error)
        self.pass_epoch = [0] * len(sources)
        self.pass_usable = [False] * len(sources)
        self.pass_skipped: list[Counter] = [Counter() for _ in sources]
        self.pass_first: list[str] = [""] * len(sources)

    def _skip(self, err: BadSample, src: int) -> None:
        first = err.reason not in self.totals.counters and err.reason not in self.pending.counters
        self.pending.skip(self.sources[src].label, err.reason, err.count)
        self.pass_skipped[src][err.reason] += err.count
        self.pass_first[src] = self.pass_first[src] or str(err)
        # every rank plans every sample: one warning per reason and process is enough
        (log.warning if first and self.warn else log.debug)(
            "skipping bad input (%s): %s", err.reason, err
        )

    def _check_pass(self, src: int) -> None:
        """Source `src`'s stream has begun another pass: the one before must have packed a
        sample."""
        epoch = self.streams[src].epoch
        if not self.pass_usable[src]:
            s, skipped = self.sources[src], self.pass_skipped[src]
            raise ShardError(
                f"source {s.label}: no sample of its {len(s.paths)} shard(s) can be used: a whole "
                f"pass skipped every one it read ("
                + ", ".join(f"{r}={n}" for r, n in sorted(skipped.items()))
                + f"); the first: {self.pass_first[src]}"
            )
        self.pass_epoch[src], self.pass_usable[src] = epoch, False
        self.pass_skipped[src], self.pass_first[src] = Counter(), ""

    def _fill_pool(self) -> None:
        read = [0] * len(self.sources)  # counted once at the end: this runs per sample
        try:
            while self.packer.need() > 0 and not self.ended:
                item = self.mixer.next()
                if item is None:
                    self.ended = True
                    return
                src, ref, entry = item
                if self.streams[src].epoch != self.pass_epoch[src]:
                    self._check_pass(src)
                read[src] += 1
                try:
                    if isinstance(entry, BadSample):
                        raise entry
                    pieces = self.sizer.pieces(entry, src)
                except BadSample as e:
                    self._skip(e, src)
                    continue
                self.pass_usable[src] = True
                self.pending.stats["truncated"] += pieces[0].truncated
                for piece in pieces:
                    self.packer.add((src, ref[0], ref[1], piece.piece), piece)
        finally:
            self.pending.stats["samples_read"] += sum(read)
            for src, n in enumerate(read):
                if n:
                    self.pending.read_by_source[self.sources[src].label] += n

    def next_plan(self) -> MicroBatchPlan | None:
        """The next micro-batch of the global sequence; None once the data is exhausted (what was
        read after the last one stays in `pending`)."""
        rows = []
        while len(rows) < self.cfg.rows_per_batch:
            self._fill_pool()
            row = self.packer.next_row()
            if not row:
                break
            rows.append([piece for _, piece in row])
        if not rows:
            return None
        st = self.pending.stats
        st["batches"] += 1
        st["rows"] += len(rows)
        st["samples_packed"] += sum(len(r) for r in rows)
        st["tokens"] += sum(p.length for r in rows for p in r)
        st["slots"] += len(rows) * self.cfg.row_tokens
        st["image_tokens"] += sum(sum(p.image_tokens) for r in rows for p in r)
        st["images"] += sum(len(p.image_tokens) for r in rows for p in r)
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
        entries = {src: dict(zip(rs, self.streams[src].fetch(rs))) for src, rs in by_source.items()}
        self.packer.pool, self.packer.lengths = [], []
        for src, shard, idx, piece in refs:
            # deterministic: the same pieces as before
            got = self.sizer.pieces(entries[src][(shard, idx)], src)[piece]
            self.packer.add((src, shard, idx, piece), got)
        self.pass_usable = [True] * len(self.sources)  # not known of the passes begun before
        self.pass_epoch = [s.epoch for s in self.streams]
