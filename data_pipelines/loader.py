"""The packed loader: `build_loader(cfg, tokenizer, rank, world_size) -> PackedLoader`
(iterable of PackedBatch).

With `num_workers = W > 0` each rank runs W logical workers in torch DataLoader processes; each
worker packs whole batches from its own split of every source. torch hands out batches strictly
round-robin (a finished worker keeps answering with an end marker so the rotation never changes),
and every batch travels with its worker's state after producing it. The loader keeps the last state
per worker and which worker is next; restoring starts the DataLoader rotated so that worker comes
first, which reproduces the uninterrupted sequence exactly. `iter(loader)` always continues from the
current state.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import threading
from collections import Counter
from typing import Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from configs.batch import PackedBatch
from configs.config import to_dict
from data_pipelines.config import DataConfig, SourceConfig
from data_pipelines.default_dataset import default_sources, ensure_default_dataset
from data_pipelines.packing import select_rows
from data_pipelines.pipeline import ResolvedSource, WorkerPipeline
from data_pipelines.reader import (
    ShardError,
    listed_but_missing,
    resolve_shards,
    shard_counts,
    shard_name,
)
from data_pipelines.tokenizer import Tokenizer

log = logging.getLogger("data_pipelines")
MISSING_NAMED = 10  # a warning about deleted shards names this many, then says how many more

STATE_VERSION = 1


def resolve_sources(cfg: DataConfig) -> list[ResolvedSource]:
    """Source configs -> shard paths with per-shard counts (default dataset when `sources` is empty)."""
    sources = cfg.sources
    if not sources:
        ensure_default_dataset(cfg.default_dir)
        sources = [
            SourceConfig(**s)
            for s in default_sources(cfg.default_dir, cfg.split)
            if not cfg.default_parts or s["name"].split("/")[-1] in cfg.default_parts
        ]
        if not sources:
            raise ShardError(
                f"the default dataset's {cfg.split} split has "
                f"none of data.default_parts={cfg.default_parts}"
            )
    out = []
    for s in sources:
        paths = resolve_shards(s.path)  # local: sorted; URLs: in webdataset's expansion order
        if missing := listed_but_missing(s.path):
            paths = sorted(paths + missing)
        counts = shard_counts(paths)
        if missing:
            gone = set(missing)
            lost = sum(n for p, n in zip(paths, counts) if p in gone)
            log.warning("source %s: %s", s.label, missing_shards_line(missing, lost))
        out.append(ResolvedSource(s.label, paths, counts, s.weight, s.kind, s.caption_field))
    return out


def missing_shards_line(missing: list, samples: int) -> str:
    """One line naming the shards a manifest lists that are gone (the first MISSING_NAMED, then how
    many more); the reader counts each of their samples as missing_shard."""
    folders = {p.parent for p in missing}
    names = sorted(p.name for p in missing) if len(folders) == 1 else sorted(map(str, missing))
    where = (
        f"{folders.pop() / 'manifest.json'}"
        if len(folders) == 1
        else "their folders' manifest.json"
    )
    more = f" and {len(names) - MISSING_NAMED} more" if len(names) > MISSING_NAMED else ""
    return (
        f"{len(names)} shard(s) listed in {where} are gone ({samples} samples, "
        f"counted as missing_shard): {', '.join(names[:MISSING_NAMED])}{more}"
    )


def _single_threaded(fn):
    """Run data work on one torch thread: per-image tensors are tiny and a multi-threaded pool only
    adds overhead (DataLoader workers get one thread anyway)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(n)


def _leave_stop_signals_to_the_trainer(worker_id: int) -> None:
    """A scheduler's SIGTERM (SLURM, Kubernetes) and a terminal's Ctrl-C reach every process of the
    job, workers included. torch's worker dies on SIGTERM, and the trainer would then crash on the
    dead worker instead of saving a checkpoint (vlm.train.signals). So a worker ignores SIGINT and
    takes SIGTERM only from its parent: the DataLoader shutting it down (`Process.terminate`). A
    thread waits for SIGTERM (blocked in every thread, so no handler runs) and reads who sent it."""
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait_for_the_parent() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != parent:
            pass
        os._exit(0)

    threading.Thread(target=wait_for_the_parent, name="sigterm-from-parent", daemon=True).start()


def _identity(x):
    return x


class _WorkerDataset(IterableDataset):
    def __init__(self, loader: "PackedLoader", rotation: int):
        self.loader, self.rotation = loader, rotation

    def __iter__(self):
        info = get_worker_info()
        w = (info.id + self.rotation) % info.num_workers
        pipe = self.loader._pipeline(w)
        while True:
            batch = pipe.next_batch()
            # batch None: this worker is done (sent on every later request)
            yield w, batch, pipe.state_dict()


class PackedLoader:
    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Tokenizer,
        sources: list[ResolvedSource],
        rank: int = 0,
        world_size: int = 1,
    ):
        self.cfg, self.tok, self.sources = cfg, tokenizer, sources
        self.rank, self.world_size = rank, world_size
        self.num_logical = max(cfg.num_workers, 1)
        self.by_rows = cfg.rank_split == "rows" and world_size > 1
        self.num_splits = (1 if self.by_rows else world_size) * self.num_logical
        for s in sources:
            total = sum(s.counts)
            if total < self.num_splits:
                raise ShardError(
                    f"source {s.label} has {total} samples, fewer than world_size "
                    f"x workers = {self.num_splits}: some workers would get none"
                )
        self.worker_states: list[dict | None] = [None] * self.num_logical
        self.next_worker = 0
        self.batches = 0

    # ---------------------------------------------------------------- state
    def fingerprint(self) -> dict:
        c = self.cfg
        # shard file names, not paths: a dataset folder may move (or be served over http) between
        # the checkpoint and the resume
        return {
            "sources": [
                [[shard_name(p) for p in s.paths], s.counts, s.weight, s.kind] for s in self.sources
            ],
            "seed": c.seed,
            "row_tokens": c.row_tokens,
            "rows_per_batch": c.rows_per_batch,
            "shuffle_buffer": c.shuffle_buffer,
            "pack_buffer": c.pack_buffer,
            "workers": self.num_logical,
            "rank": self.rank,
            "world_size": self.world_size,
            "epochs": c.epochs,
            "loss_on": c.loss_on,
            "long_text": c.long_text,
            "rank_split": c.rank_split,
            "vocab_size": self.tok.vocab_size,
            "processor": to_dict(c.processor),
        }

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint(),
            "batches": self.batches,
            "next_worker": self.next_worker,
            "workers": copy.deepcopy(self.worker_states),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')} != {STATE_VERSION}")
        mine, theirs = self.fingerprint(), state["fingerprint"]
        diff = [k for k in mine if to_dict(mine[k]) != to_dict(theirs.get(k))]
        if diff:
            k = diff[0]
            raise ValueError(
                f"loader state does not match this data config: {k} was {theirs.get(k)!r}, now "
                f"{mine[k]!r} (resume needs the same sources, seed, sizes, workers and ranks)"
            )
        self.batches, self.next_worker = state["batches"], state["next_worker"]
        self.worker_states = copy.deepcopy(state["workers"])

    # ---------------------------------------------------------------- iteration
    def _pipeline(self, w: int) -> WorkerPipeline:
        if self.by_rows:  # every rank runs the same global pipeline and keeps its rows
            pipe = WorkerPipeline(
                self.cfg,
                self.sources,
                self.tok,
                w,
                self.num_splits,
                rows_per_batch=self.cfg.rows_per_batch * self.world_size,
            )
        else:
            pipe = WorkerPipeline(
                self.cfg, self.sources, self.tok, self.rank * self.num_logical + w, self.num_splits
            )
        if self.worker_states[w] is not None:
            pipe.load_state_dict(self.worker_states[w])
        return pipe

    def _mine(self, batch: PackedBatch | None) -> PackedBatch | None:
        """This rank's rows of a global batch (rank_split="rows"); None when a last, short batch has none."""
        if batch is None or not self.by_rows:
            return batch
        b = self.cfg.rows_per_batch
        if batch.input_ids.shape[0] <= self.rank * b:
            return None
        return select_rows(batch, self.rank * b, (self.rank + 1) * b)

    def _record(self, w: int, state: dict) -> None:
        self.worker_states[w] = state
        self.next_worker = (w + 1) % self.num_logical

    def __iter__(self) -> Iterator[PackedBatch]:
        if self.cfg.num_workers == 0:
            pipe = self._pipeline(0)
            while (batch := self._mine(_single_threaded(pipe.next_batch))) is not None:
                self._record(0, pipe.state_dict())
                self.batches += 1
                yield batch
            self._record(0, pipe.state_dict())
            return
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        done = {
            w
            for w, s in enumerate(self.worker_states)
            if s is not None and s["ended"] and not s["pool"]
        }
        if len(done) == self.num_logical:
            return
        dl = DataLoader(
            _WorkerDataset(self, self.next_worker),
            batch_size=None,
            num_workers=self.cfg.num_workers,
            collate_fn=_identity,
            prefetch_factor=self.cfg.prefetch_factor,
            persistent_workers=False,
            worker_init_fn=_leave_stop_signals_to_the_trainer,
        )
        for w, batch, state in dl:
            self._record(w, state)
            batch = self._mine(batch)
            if batch is None:
                done.add(w)
                if len(done) == self.num_logical:
                    return
                continue
            self.batches += 1
            yield batch

    # ---------------------------------------------------------------- reporting
    def _sum(self, key: str) -> Counter:
        total: Counter = Counter()
        for s in self.worker_states:
            if s is not None:
                total.update(s[key])
        return total

    @property
    def counters(self) -> dict[str, int]:
        """Skipped samples by reason, over all workers of this rank (for batches delivered so far)."""
        return dict(sorted(self._sum("counters").items()))

    @property
    def stats(self) -> dict[str, int]:
        return dict(sorted(self._sum("stats").items()))

    def by_source(self) -> dict[str, tuple[int, dict[str, int]]]:
        """Per source label: (samples read, skipped by reason), over all workers of this rank."""
        read: Counter = Counter()
        skipped: dict[str, Counter] = {}
        for s in self.worker_states:
            if s is not None:
                read.update(s.get("read_by_source", {}))
                for label, c in s.get("skipped_by_source", {}).items():
                    skipped.setdefault(label, Counter()).update(c)
        return {
            label: (read[label], dict(skipped.get(label, {})))
            for label in sorted(set(read) | set(skipped))
        }

    def packing_efficiency(self) -> float:
        st = self.stats
        return st.get("tokens", 0) / max(st.get("slots", 0), 1)

    def report(self) -> str:
        st, bad = self.stats, self.counters
        line = (
            f"data: {st.get('batches', 0)} batches, {st.get('samples_packed', 0)} "
            f"samples packed, packing efficiency {100 * self.packing_efficiency():.1f}%"
        )
        if bad:
            line += "; skipped " + ", ".join(f"{k}={v}" for k, v in bad.items())
        return line


def build_loader(
    cfg: DataConfig, tokenizer: Tokenizer, rank: int = 0, world_size: int = 1
) -> PackedLoader:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    cfg.validate()
    if tokenizer.vocab_size <= max(tokenizer.special_ids):
        raise ValueError(
            f"tokenizer vocab_size={tokenizer.vocab_size} does not cover its special ids"
        )
    return PackedLoader(cfg, tokenizer, resolve_sources(cfg), rank, world_size)
