"""One worker's pipeline: mixed sample stream -> decode -> tokenize/patchify -> pack -> PackedBatch.

Everything here is deterministic given the state; `state_dict()` holds the streams' states, the
packer's waiting samples as references, and the counters, so `load_state_dict()` reproduces the
exact batches.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from configs.batch import IMAGE, PackedBatch
from data_pipelines.config import DataConfig
from data_pipelines.encode import encode_sample
from data_pipelines.packing import Packer, assemble_batch
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


class WorkerPipeline:
    def __init__(
        self,
        cfg: DataConfig,
        sources: list[ResolvedSource],
        tok: Tokenizer,
        split: int,
        num_splits: int,
        processor: ImageProcessor | None = None,
        rows_per_batch: int | None = None,
    ):
        self.cfg, self.sources, self.tok = cfg, sources, tok
        self.rows_per_batch = rows_per_batch or cfg.rows_per_batch
        self.processor = processor or ImageProcessor(cfg.processor)
        self.streams = [
            SourceStream(
                i, s.paths, s.counts, split, num_splits, cfg.seed, cfg.shuffle_buffer, cfg.epochs
            )
            for i, s in enumerate(sources)
        ]
        self.mixer = Mixer(self.streams, [s.weight for s in sources], cfg.seed, split)
        self.packer = Packer(cfg.row_tokens, cfg.pack_buffer)
        self.counters: Counter = Counter()
        self.stats: Counter = Counter()
        # per source label (a source is one kind of sample in the default data): samples read, and
        # skipped by reason
        self.read_by_source: Counter = Counter()
        self.skipped_by_source: dict[str, Counter] = {}
        self.ended = False

    def _encode(self, src: int, raw):
        sample = decode_sample(raw, self.sources[src].kind, self.sources[src].caption_field)
        pieces = encode_sample(
            sample,
            self.tok,
            self.processor,
            self.cfg.row_tokens,
            self.cfg.loss_on,
            self.cfg.long_text,
        )
        for piece in pieces:
            piece.source = src
        return pieces

    def _skip(self, err: BadSample, src: int) -> None:
        first = err.reason not in self.counters
        self.counters[err.reason] += err.count
        self.skipped_by_source.setdefault(self.sources[src].label, Counter())[err.reason] += (
            err.count
        )
        if first:
            log.warning("skipping bad input (%s): %s", err.reason, err)
        else:
            log.debug("skipping bad input (%s): %s", err.reason, err)

    def _fill_pool(self) -> None:
        while self.packer.need() > 0 and not self.ended:
            item = self.mixer.next()
            if item is None:
                self.ended = True
                return
            src, ref, raw = item
            self.stats["samples_read"] += 1
            self.read_by_source[self.sources[src].label] += 1
            try:
                if isinstance(raw, BadSample):
                    raise raw
                pieces = self._encode(src, raw)
            except BadSample as e:
                self._skip(e, src)
                continue
            self.stats["truncated"] += pieces[0].truncated
            for k, enc in enumerate(pieces):
                self.packer.add((src, ref[0], ref[1], k), enc)

    def next_batch(self) -> PackedBatch | None:
        rows = []
        while len(rows) < self.rows_per_batch:
            self._fill_pool()
            row = self.packer.next_row()
            if not row:
                break
            rows.append([enc for _, enc in row])
        if not rows:
            return None
        batch = assemble_batch(rows, self.cfg.row_tokens, self.tok)
        valid = int(batch.valid.sum())
        self.stats["batches"] += 1
        self.stats["rows"] += len(rows)
        self.stats["samples_packed"] += sum(len(r) for r in rows)
        self.stats["tokens"] += valid
        self.stats["slots"] += batch.input_ids.numel()
        self.stats["image_tokens"] += int((batch.modality == IMAGE).sum())
        self.stats["images"] += 0 if batch.image_grids is None else int(batch.image_grids.shape[0])
        return batch

    def state_dict(self) -> dict:
        return {
            "mixer": self.mixer.state_dict(),
            "pool": [list(ref) for ref, _ in self.packer.pool],
            "counters": dict(self.counters),
            "stats": dict(self.stats),
            "ended": self.ended,
            "read_by_source": dict(self.read_by_source),
            "skipped_by_source": {label: dict(c) for label, c in self.skipped_by_source.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.mixer.load_state_dict(state["mixer"])
        self.counters, self.stats = Counter(state["counters"]), Counter(state["stats"])
        # absent from the loader states of runs saved before they were kept: those resume counting
        # from 0
        self.read_by_source = Counter(state.get("read_by_source", {}))
        self.skipped_by_source = {
            label: Counter(c) for label, c in state.get("skipped_by_source", {}).items()
        }
        self.ended = state["ended"]
        refs = [tuple(r) for r in state["pool"]]
        by_source: dict[int, list[tuple[int, int]]] = {}
        for src, shard, idx, _ in refs:
            by_source.setdefault(src, []).append((shard, idx))
        raws = {src: dict(zip(rs, self.streams[src].fetch(rs))) for src, rs in by_source.items()}
        self.packer.pool = []
        for src, shard, idx, piece in refs:
            # deterministic: same pieces as before
            pieces = self._encode(src, raws[src][(shard, idx)])
            self.packer.pool.append(((src, shard, idx, piece), pieces[piece]))
