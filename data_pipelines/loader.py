"""The packed loader: `build_loader(cfg, tokenizer, rank, world_size) -> PackedLoader`
(iterable of PackedBatch).

The data is one global sequence of micro-batches g = 0, 1, 2, ... (data_pipelines.plan), whose
content depends on the data config, the tokenizer and g only. Rank r of M yields g = r, r + M,
r + 2M, ...: every rank plans every micro-batch from the loader's index (data_pipelines.index: no
shard is read to plan) and materialises only its own (data_pipelines.materialise: reading those
samples' bytes, decoding, resizing). Building the loader makes sure every local shard is indexed
(the ranks share a first build) and counts the shards from their manifest or index. With
`num_workers = W > 0` a thread plans
ahead and the rank's plans go to a map-style DataLoader whose W worker processes materialise them;
the DataLoader hands the results back in order, so the sequence does not depend on W either.

M consecutive micro-batches (one per rank) are a round. The state after a round is the planner's
(the same on every rank, whatever M and W); `state_dict()` is that of the last round this rank has
received its micro-batch of, and `load_state_dict` on a loader of any (rank, world_size,
num_workers) continues with the next micro-batch. `iter(loader)` always continues from the current
state.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
from collections import Counter, deque
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from configs.batch import PackedBatch
from configs.config import to_dict
from data_pipelines.config import DataConfig, SourceConfig
from data_pipelines.default_dataset import default_sources, ensure_default_dataset
from data_pipelines.index import Catalog
from data_pipelines.index_layers import IO_KEYS
from data_pipelines.materialise import Materialiser
from data_pipelines.plan import MicroBatchPlan, Planner, ResolvedSource, Tally
from data_pipelines.reader import (
    ShardError,
    listed_but_missing,
    resolve_shards,
    shard_counts,
    shard_name,
)
from data_pipelines.tokenizer import Tokenizer
from vision.image_processor import ImageProcessor

log = logging.getLogger("data_pipelines")
MISSING_NAMED = 10  # a warning about deleted shards names this many, then says how many more

# 2: one global order of micro-batches (version 1 split the data by rank and worker)
STATE_VERSION = 2


def resolve_sources(
    cfg: DataConfig, catalog: Catalog | None = None, rank: int = 0, world_size: int = 1
) -> list[ResolvedSource]:
    """Source configs -> shard paths with per-shard counts (default dataset when `sources` is empty).
    With `catalog` (the loader's), the local shards are indexed first (rank `rank` of `world_size`
    taking its share of a first build), and a shard without a manifest entry is counted from its
    index instead of by reading it."""
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
        if catalog is not None:
            settings = catalog.settings(s.kind, s.caption_field)
            catalog.prepare([(p, settings) for p in paths], rank, world_size)
        counts = shard_counts(paths, catalog.count if catalog is not None else None)
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


class _Materialise(Dataset):
    """Map-style: a plan in, (its index, the micro-batch, what reading and decoding lost, what was
    read) out, in a worker."""

    def __init__(self, materialiser: Materialiser):
        self.materialiser = materialiser

    def __getitem__(self, plan: MicroBatchPlan):
        batch, lost, io = self.materialiser(plan, shared=True)
        return plan.index, batch, lost, io


class _Plans:
    """The DataLoader's sampler: this rank's plans, from the planning thread's queue."""

    def __init__(self, items: Iterator):
        self.items = items

    def __iter__(self):
        return self.items


_END = object()


class _PlanAhead:
    """Runs `rounds` (the planner) in a thread, `depth` rounds ahead of the DataLoader."""

    def __init__(self, rounds: Iterator, depth: int):
        self.rounds, self.queue = rounds, queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def _run(self) -> None:
        try:
            for item in self.rounds:
                while not self.stop.is_set():
                    try:
                        self.queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self.stop.is_set():
                    return
            self.queue.put(_END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self.queue.put(e)

    def __iter__(self):
        # started on the first request, which the DataLoader makes after forking its workers:
        # no thread runs while they are forked
        self.thread = threading.Thread(target=self._run, name="data-planner", daemon=True)
        self.thread.start()
        while True:
            try:
                item = self.queue.get(timeout=0.1)
            except queue.Empty:
                if self.stop.is_set() and not self.thread.is_alive():
                    raise RuntimeError("the loader's planning thread was stopped") from None
                continue
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            while self.thread.is_alive():
                try:
                    self.queue.get(timeout=0.1)
                except queue.Empty:
                    pass
            self.thread.join()
        try:
            self.rounds.close()
        except ValueError:  # at interpreter exit: the thread stopped inside the generator
            pass


class PackedLoader:
    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Tokenizer,
        sources: list[ResolvedSource],
        rank: int = 0,
        world_size: int = 1,
        catalog: Catalog | None = None,
    ):
        self.cfg, self.tok, self.sources = cfg, tokenizer, sources
        self.rank, self.world_size = rank, world_size
        self.processor = ImageProcessor(cfg.processor)
        # what planning reads (the index; shards it indexes) and what this rank's micro-batches
        # read, apart: the planner may run in a thread of its own
        self.catalog = catalog or Catalog(tokenizer, self.processor, cfg.index_cache)
        self.read_io: Counter = Counter()
        self.materialiser = Materialiser(
            tokenizer,
            self.processor,
            cfg.row_tokens,
            cfg.loss_on,
            cfg.long_text,
            [(s.label, s.kind, s.caption_field) for s in sources],
        )
        for s in sources:
            if sum(s.counts) < 1:
                raise ShardError(f"source {s.label} has no samples")
        # the planner's state after the last round delivered (None: the start)
        self.position: dict | None = None
        # counts: restored with a state (on rank 0 only, so that the sum over ranks counts them
        # once), and this rank's micro-batches since
        self.base, self.own = Tally(), Tally()
        self._ahead: _PlanAhead | None = None

    # ---------------------------------------------------------------- state
    def fingerprint(self) -> dict:
        c = self.cfg
        # shard file names, not paths: a dataset folder may move (or be served over http) between
        # the checkpoint and the resume. Ranks and workers are not in it: they do not change the
        # data; nor is rows_per_batch: the planner packs row after row whatever a micro-batch
        # holds, so a position after a whole global batch is the same row for any micro-batch
        # size that divides it (vlm.train.run_config: a resume keeps the global batch)
        return {
            "sources": [
                [[shard_name(p) for p in s.paths], s.counts, s.weight, s.kind] for s in self.sources
            ],
            "seed": c.seed,
            "row_tokens": c.row_tokens,
            "shuffle_buffer": c.shuffle_buffer,
            "pack_buffer": c.pack_buffer,
            "epochs": c.epochs,
            "loss_on": c.loss_on,
            "long_text": c.long_text,
            "vocab_size": self.tok.vocab_size,
            "processor": to_dict(c.processor),
        }

    def state_dict(self) -> dict:
        """The position after the last round this rank received its micro-batch of: the same dict
        on every rank, whatever the number of ranks and workers."""
        return {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint(),
            "planner": self.position,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"the checkpoint's data position (loader state version {state.get('version')}) "
                f"cannot be carried over to this loader (version {STATE_VERSION}: one global "
                "order of micro-batches); start a new run, e.g. with train.init_from"
            )
        mine, theirs = self.fingerprint(), state["fingerprint"]
        diff = [k for k in mine if to_dict(mine[k]) != to_dict(theirs.get(k))]
        if diff:
            k = diff[0]
            raise ValueError(
                f"loader state does not match this data config: {k} was {theirs.get(k)!r}, now "
                f"{mine[k]!r} (resume needs the same sources, seed, sizes and tokenizer)"
            )
        self._close()
        self.position = state["planner"]
        totals = Tally() if self.position is None else Tally.from_dict(self.position["totals"])
        self.base, self.own = (totals if self.rank == 0 else Tally()), Tally()

    # ---------------------------------------------------------------- iteration
    def _rounds(self) -> Iterator[tuple[MicroBatchPlan | None, dict, Tally | None]]:
        """(this rank's plan, the planner's state after its round, None) round after round, then
        (None, the final state, what this rank counts of the samples read after the last
        micro-batch) once the data is exhausted."""
        planner = Planner(self.cfg, self.sources, self.tok, self.processor, self.catalog)
        planner.warn = self.rank == 0
        if self.position is not None:
            planner.load_state_dict(self.position)
        M = self.world_size
        while True:
            # a round is M consecutive micro-batches, the m-th of them rank m's (counted from the
            # position the loader started at: after a resume on other ranks the rounds start there)
            mine, m = None, 0
            for m in range(M):
                plan = planner.next_plan()
                if plan is None:
                    break
                if m == self.rank:
                    mine = plan
            else:
                yield mine, planner.state_dict(), None
                continue
            # the data is exhausted: what was read after the last micro-batch is counted by the
            # rank the next micro-batch would have gone to
            rest = planner.take_pending()
            if mine is not None:
                yield mine, planner.state_dict(), None
            yield None, planner.state_dict(), rest if m == self.rank else None
            return

    def _received(
        self, tally: Tally | None, lost: Tally | None, position: dict, io: Counter | None = None
    ) -> None:
        for t in (tally, lost):
            if t is not None:
                self.own.add(t)
        if io:
            self.read_io.update(io)
        self.position = position

    @property
    def io(self) -> dict[str, int]:
        """What this loader has read so far: `shard_bytes` and `index_bytes` (bytes of shard and
        index files), `samples_decoded` (samples read and decoded: this rank's own, and those it
        indexed), `index_entries` (index entries planning took). Planning's and this rank's
        micro-batches' (in its workers too) together."""
        return {k: self.catalog.io.get(k, 0) + self.read_io.get(k, 0) for k in IO_KEYS}

    def __iter__(self) -> Iterator[PackedBatch]:
        self._close()
        if self.cfg.num_workers == 0:
            rounds = self._rounds()
            try:
                for plan, position, rest in rounds:
                    if plan is None:
                        self._received(rest, None, position)
                        return
                    batch, lost, io = _single_threaded(lambda: self.materialiser(plan))
                    self._received(plan.tally, lost, position, io)
                    yield batch
            finally:
                rounds.close()
            return
        yield from self._with_workers()

    def _with_workers(self) -> Iterator[PackedBatch]:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        W = self.cfg.num_workers
        # (index, tally, position) of the plans handed to the DataLoader, in order; the end of the
        # data comes last as (None, what this rank counts of it, the final position)
        inflight: deque = deque()

        def plans():
            for plan, position, rest in ahead:
                if plan is None:
                    inflight.append((None, rest, position))
                    return
                inflight.append((plan.index, plan.tally, position))
                yield plan

        ahead = self._ahead = _PlanAhead(self._rounds(), depth=max(2, W))
        dl = DataLoader(
            _Materialise(self.materialiser),
            batch_size=None,
            sampler=_Plans(plans()),
            num_workers=W,
            collate_fn=_identity,
            prefetch_factor=self.cfg.prefetch_factor,
            persistent_workers=False,
            worker_init_fn=_leave_stop_signals_to_the_trainer,
        )
        it = iter(dl)
        try:
            for index, batch, lost, io in it:
                expected, tally, position = inflight.popleft()
                if index != expected:  # the DataLoader returns in order; a change there would show
                    raise RuntimeError(f"micro-batch {index} arrived where {expected} was due")
                self._received(tally, lost, position, io)
                yield batch
            if inflight:  # the end of the data
                _, rest, position = inflight.popleft()
                self._received(rest, None, position)
        finally:
            del it
            ahead.close()  # this iteration's: a later `iter(loader)` may have started its own
            if self._ahead is ahead:
                self._ahead = None

    def _close(self) -> None:
        """Stop the planning thread of an earlier iteration (its DataLoader is gone with it)."""
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None

    # ---------------------------------------------------------------- reporting
    def _tally(self) -> Tally:
        t = Tally()
        t.add(self.base)
        t.add(self.own)
        return t

    @property
    def counters(self) -> dict[str, int]:
        """Skipped samples by reason, for this rank's micro-batches delivered so far (summed over
        ranks: the whole run's)."""
        return dict(sorted((k, v) for k, v in self._tally().counters.items() if v))

    @property
    def stats(self) -> dict[str, int]:
        return dict(sorted(self._tally().stats.items()))

    def by_source(self) -> dict[str, tuple[int, dict[str, int]]]:
        """Per source label: (samples read, skipped by reason), for this rank's micro-batches."""
        t = self._tally()
        return {
            label: (t.read_by_source[label], dict(t.skipped_by_source.get(label, {})))
            for label in sorted(set(t.read_by_source) | set(t.skipped_by_source))
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
    catalog = Catalog(tokenizer, ImageProcessor(cfg.processor), cfg.index_cache)
    sources = resolve_sources(cfg, catalog, rank, world_size)
    return PackedLoader(cfg, tokenizer, sources, rank, world_size, catalog)
