"""The loader's index: what planning needs of every sample of a local tar shard, so that planning
reads no shard and a rank reads only the bytes of the samples it trains on.

Two files per shard, in `.vlm-index/` beside the shards (or, where that folder cannot be written,
in a cache folder: `data.index_cache`, default `~/.cache/vlm/loader-index/<folder hash>/`):

- `NAME.samples.idx`, what the tar holds, whatever the tokenizer: how reading it ends (whole,
  breaking, an error), per sample its key and the byte range of its members, per member its suffix
  and byte range and, for an image, its header (size, EXIF orientation, or why it cannot be read).
  `ShardWriter` writes it with every shard (the importers and the default dataset); for shards made
  elsewhere the loader builds it by reading the shard once.
- `NAME.tokens-KEY.idx`, per tokenizer and source settings (KEY hashes the tokenizer's identity,
  the source's `kind` and `caption_field`): per sample its `lengths.Entry` (token count before the
  images are expanded, the last placeholder's position, why it cannot be used). Built from the
  samples file by reading only the text members.

The format is data_pipelines.index_file (a JSON header and numeric arrays, no pickle). An index file
is used for a shard when it has this INDEX_VERSION, records the shard's size and is not older than
the shard (a shard written, copied or changed after its index is indexed again; what holds no
modification time is the same bytes for the same shard, so a dataset builds byte for byte).
`ready.KEY.json` in the index folder lists the shards whose files for KEY are built, so that a
loader's start-up reads one file per folder instead of looking at every shard's; the ranks share
the first build (each starts at its own place in the list and skips what another has written).

URL shards and compressed tars have no random access: they are planned as they stream by
(`Catalog.entry_from_raw`, the same entries), and every rank reads them whole.

The layers themselves (what a read of a shard finds, the arrays, the file names and places) are
data_pipelines.index_layers; this module's Catalog finds, checks and builds them for a loader.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

from data_pipelines.index_file import IndexFile, IndexFileError, unpack_strings, write_index
from data_pipelines.index_layers import (
    INDEX_VERSION,
    IO_KEYS,
    NOT_IMAGE,
    SETTLED_S,
    SHARD,
    TOKENS_ARRAYS,
    SamplesIndex,
    ShardIndex,
    ShardRead,
    SourceSettings,
    index_dirs,
    indexable,
    read_shard,
    samples_name,
    shard_stat,
    tokens_arrays,
    tokens_key,
    tokens_name,
)
from data_pipelines.lengths import Entry, ImageHeader, sample_entry, with_standins
from data_pipelines.reader import Shard, _count
from data_pipelines.tokenizer import Tokenizer
from vision.image_processor import ImageProcessor

log = logging.getLogger("data_pipelines")


class Catalog:
    """The indexes of a loader's local shards: found, checked against the shards, built where
    missing or stale (and written where a folder takes them), a few kept in memory. `io` counts
    what indexing and planning read: `shard_bytes`, `index_bytes`, `samples_decoded` (samples read
    and decoded to index them) and `index_entries` (entries planning took from an index)."""

    KEEP = 64  # shards whose indexes are kept in memory

    def __init__(
        self, tok: Tokenizer, processor: ImageProcessor, cache: str = "", io: Counter | None = None
    ):
        self.tok, self.processor, self.cache = tok, processor, cache
        self.io = io if io is not None else Counter()
        for k in IO_KEYS:  # every key there from the start: another thread may read it meanwhile
            self.io.setdefault(k, 0)
        self._loaded: OrderedDict[tuple[Path, str], ShardIndex] = OrderedDict()
        # built here and not written (the shard had just changed, or no folder takes it)
        self._unwritten: dict[Path, ShardRead] = {}
        self._warned = False

    def settings(self, kind: str, caption_field: str) -> SourceSettings:
        return SourceSettings(kind, caption_field, tokens_key(self.tok, kind, caption_field))

    # ------------------------------------------------------------------ files
    def _find(self, path: Path, name: str) -> Path | None:
        for d in index_dirs(path, self.cache):
            if (d / name).is_file():
                return d / name
        return None

    def _write(self, path: Path, name: str, header: dict, arrays: dict, stat) -> bool:
        """Beside the shard, else in the cache folder; False (one warning per loader) where neither
        takes it, or where the shard changed while it was read."""
        problems = []
        for d in index_dirs(path, self.cache):
            try:
                d.mkdir(parents=True, exist_ok=True)
                write_index(d / name, header, arrays)
            except OSError as e:
                problems.append(f"{d}: {e.strerror or e}")
                continue
            if shard_stat(path) != stat:
                (d / name).unlink(missing_ok=True)
                return False
            return True
        if not self._warned:
            self._warned = True
            log.warning(
                "the loader index cannot be written (%s); every process builds it in memory "
                "(data.index_cache names a folder that can be written)",
                "; ".join(problems),
            )
        return False

    def _open(self, path: Path, name: str, stat: tuple[int, int], arrays: tuple) -> dict | None:
        """The header and `arrays` of an index file that holds for the shard as it is now (this
        version, its size, not older than it); None when there is none."""
        found = self._find(path, name)
        if found is None:
            return None
        try:
            with IndexFile(found, self.io) as f:
                h = f.header
                if (h.get("version"), h.get("size")) != (INDEX_VERSION, stat[0]) or (
                    os.fstat(f.f.fileno()).st_mtime_ns < stat[1]
                ):
                    return None
                out = {a: f.array(a) for a in arrays if not h.get("compressed")}
            out["header"] = h
            return out
        except (IndexFileError, OSError, KeyError, TypeError, ValueError) as e:
            log.debug("loader index %s is not usable (%s); it is built again", found, e)
            return None

    # ------------------------------------------------------------------ samples layer
    def _samples(self, path: Path, stat: tuple[int, int]) -> SamplesIndex | None:
        kept = self._unwritten.get(path)
        if kept is not None and kept.stat == stat:
            got = {**kept.arrays, "header": kept.header}
        else:
            got = self._open(path, samples_name(path), stat, ("start", "end", "keys", "key_ends"))
        if got is None:
            return None
        h = got["header"]
        if h["compressed"]:
            return SamplesIndex(h, [], [], [], stat)
        keys = unpack_strings(got["keys"], got["key_ends"])
        return SamplesIndex(h, got["start"].tolist(), got["end"].tolist(), keys, stat)

    def _build(self, path: Path, settings: list[SourceSettings]) -> SamplesIndex:
        """Read the shard once: its samples layer and the tokens layers of `settings`, written
        where they can be and when the shard is settled (kept in memory otherwise)."""
        stat = shard_stat(path)
        built = read_shard(path, self.processor, self.io, keep_raw=bool(settings))
        built.stat = stat
        settled = time.time_ns() - stat[1] > SETTLED_S * 1e9
        if not (
            settled and self._write(path, samples_name(path), built.header, built.arrays, stat)
        ):
            self._unwritten[path] = built
        h, a = built.header, built.arrays
        samples = SamplesIndex(h, [], [], [], stat)
        if not h["compressed"]:
            keys = unpack_strings(a["keys"], a["key_ends"])
            samples = SamplesIndex(h, a["start"].tolist(), a["end"].tolist(), keys, stat)
        if samples.header["compressed"]:
            return samples
        n, broken = samples.header["groups"], samples.header["broken"]
        raws, built.raws = built.raws, []  # not kept (a shard kept in memory keeps its arrays)
        for s in settings:
            entries = [
                None
                if i == n - 1 and broken
                else sample_entry(
                    *raws[i],
                    self.tok,
                    s.kind,
                    s.caption_field,
                    path,
                    samples.start[i],
                    samples.end[i],
                )
                for i in range(n)
            ]
            self._keep_tokens(path, samples, s, entries, write=settled)
        return samples

    def count(self, path: Shard) -> tuple[int, bool]:
        """reader.shard_counts' count of a shard, from its index where it has one."""
        if not indexable(path):
            return _count(path)
        stat = shard_stat(path)
        kept = self._unwritten.get(path)
        if kept is not None and kept.stat == stat:
            header = kept.header
        else:  # the header says it: no array is read
            got = self._open(path, samples_name(path), stat, ())
            header = got["header"] if got is not None else self._build(path, []).header
        if header["compressed"]:
            return _count(path)
        return SamplesIndex(header, [], [], [], stat).count()

    # ------------------------------------------------------------------ tokens layer
    def _tokens_header(self, samples: SamplesIndex, s: SourceSettings) -> dict:
        return {
            "layer": "tokens",
            "version": INDEX_VERSION,
            "shard": samples.header["shard"],
            "size": samples.stat[0],
            "tokenizer": self.tok.identity(),
            "kind": s.kind,
            "caption_field": s.caption_field,
            "reasons": [],
            "messages": {},
            "image_messages": {},
        }

    def _keep_tokens(
        self, path: Path, samples: SamplesIndex, s: SourceSettings, entries: list, write: bool
    ) -> ShardIndex:
        header = self._tokens_header(samples, s)
        arrays = tokens_arrays(entries, header)
        if write:
            self._write(path, tokens_name(path, s.key), header, arrays, samples.stat)
        tokens = {k: v.tolist() for k, v in arrays.items()}
        tokens["header"] = header
        return self._remember(path, s, ShardIndex(path, samples, tokens, self.io))

    def _remember(self, path: Path, s: SourceSettings, index: ShardIndex) -> ShardIndex:
        self._loaded[(path, s.key)] = index
        self._loaded.move_to_end((path, s.key))
        while len(self._loaded) > self.KEEP:
            self._loaded.popitem(last=False)
        return index

    def _tokens_from_samples(self, path: Path, samples: SamplesIndex, s: SourceSettings):
        """The tokens layer built from the samples layer, reading only the text members."""
        kept = self._unwritten.get(path)
        if kept is not None:
            m, h = kept.arrays, kept.header
        else:
            m = self._open(
                path,
                samples_name(path),
                samples.stat,
                ("m_sample", "m_suffix", "m_suffix_ends", "m_offset", "m_size")
                + ("m_w", "m_h", "m_orient", "m_status"),
            )
            if m is None:  # gone or changed since it was opened: read the shard
                self._unwritten.pop(path, None)
                self._build(path, [s])
                return self._loaded[(path, s.key)]
            h = m["header"]
        suffixes = unpack_strings(m["m_suffix"], m["m_suffix_ends"])
        cols = {k: m[k].tolist() for k in ("m_sample", "m_offset", "m_size", "m_w", "m_h")}
        cols["m_orient"], cols["m_status"] = m["m_orient"].tolist(), m["m_status"].tolist()
        raws = [({"__key__": k, "__url__": SHARD}, {}) for k in samples.keys]
        with open(path, "rb") as f:
            for j, g in enumerate(cols["m_sample"]):
                raw, headers = raws[g]
                name = suffixes[j]
                if cols["m_status"][j] != NOT_IMAGE:
                    raw[name] = name
                    headers[name] = ImageHeader(
                        cols["m_w"][j],
                        cols["m_h"][j],
                        cols["m_orient"][j],
                        cols["m_status"][j],
                        h["messages"].get(str(j), ""),
                    )
                else:
                    f.seek(cols["m_offset"][j])
                    raw[name] = f.read(cols["m_size"][j])
                    self.io["shard_bytes"] += len(raw[name])
        n, broken = h["groups"], h["broken"]
        entries = []
        for i, (raw, headers) in enumerate(raws):
            if i == n - 1 and broken:
                entries.append(None)
                continue
            self.io["samples_decoded"] += 1
            entries.append(
                sample_entry(
                    raw,
                    headers,
                    self.tok,
                    s.kind,
                    s.caption_field,
                    path,
                    samples.start[i],
                    samples.end[i],
                )
            )
        return self._keep_tokens(path, samples, s, entries, write=kept is None)

    def shard(self, path: Path, s: SourceSettings) -> ShardIndex | None:
        """The index of a local shard for a source's settings, checked against the shard as it is
        now (built where missing or stale); None for a compressed tar (planned as it streams)."""
        stat = shard_stat(path)
        hit = self._loaded.get((path, s.key))
        if hit is not None and hit.samples.stat == stat:
            self._loaded.move_to_end((path, s.key))
            return hit
        samples = self._samples(path, stat)
        if samples is None:
            samples = self._build(path, [s])
            return None if samples.header["compressed"] else self._loaded[(path, s.key)]
        if samples.header["compressed"]:
            return None
        tokens = self._open(path, tokens_name(path, s.key), stat, TOKENS_ARRAYS)
        if tokens is None or tokens["header"].get("tokenizer") != self.tok.identity():
            return self._tokens_from_samples(path, samples, s)
        tokens = {k: (v.tolist() if k != "header" else v) for k, v in tokens.items()}
        return self._remember(path, s, ShardIndex(path, samples, tokens, self.io))

    # ------------------------------------------------------------------ streamed shards
    def entry_from_raw(self, raw: dict[str, Any], s: SourceSettings) -> Entry:
        """The entry of a sample read whole (a URL or compressed shard): what its index would hold,
        with the bytes kept for the rank that trains on it."""
        self.io["samples_decoded"] += 1
        standins, headers = with_standins(raw, self.processor)
        e = sample_entry(standins, headers, self.tok, s.kind, s.caption_field, raw["__url__"])
        return e._replace(raw=raw)

    # ------------------------------------------------------------------ the first build
    def prepare(
        self, shards: list[tuple[Path, SourceSettings]], rank: int = 0, world_size: int = 1
    ) -> int:
        """Make sure every local shard has its index for its source's settings, the ranks sharing
        the work: each starts at its own place in the list of shards not yet listed as ready and
        goes round, skipping what another has written meanwhile. Returns the shards it read."""
        by_folder: dict[tuple[Path, str], list[tuple[Path, SourceSettings]]] = {}
        for path, s in shards:
            if indexable(path):
                by_folder.setdefault((path.parent, s.key), []).append((path, s))
        todo = []
        for (_, key), group in by_folder.items():
            ready = self._ready(group[0][0], key)
            todo += [(p, s) for p, s in group if p.name not in ready and p.is_file()]
        if not todo:
            return 0
        if rank == 0:
            log.warning(
                "indexing %d shard(s) for the loader: once per dataset and tokenizer, shared by "
                "the %d rank(s)",
                len(todo),
                world_size,
            )
        read = 0
        first = rank * len(todo) // world_size
        for j in range(len(todo)):
            path, s = todo[(first + j) % len(todo)]
            done = self._find(path, tokens_name(path, s.key))
            try:
                if done is not None and done.stat().st_mtime_ns >= path.stat().st_mtime_ns:
                    continue  # built (by another rank meanwhile): checked when it is planned
            except OSError:
                pass
            before = self.io["shard_bytes"]
            try:
                self.shard(path, s)
            except OSError as e:  # counted when planning reaches it
                log.debug("shard %s cannot be indexed (%s)", path, e)
            read += self.io["shard_bytes"] > before
        for (_, key), group in by_folder.items():
            self._mark_ready([p for p, _ in group], key)
        return read

    def _ready(self, path: Path, key: str) -> set[str]:
        """The shards of `path`'s folder whose tokens layer for `key` was built (either place)."""
        names: set[str] = set()
        for d in index_dirs(path, self.cache):
            try:
                text = (d / f"ready.{key}.json").read_text()
            except OSError:
                continue
            self.io["index_bytes"] += len(text)
            try:
                data = json.loads(text)
                if data.get("version") == INDEX_VERSION:
                    names |= {str(n) for n in data.get("shards", [])}
            except (ValueError, AttributeError, TypeError):
                continue
        return names

    def _mark_ready(self, paths: list[Path], key: str) -> None:
        found = [f for p in paths if (f := self._find(p, tokens_name(p, key))) is not None]
        if not found:
            return
        names = self._ready(paths[0], key) | {f.name.rsplit(".tokens-", 1)[0] for f in found}
        record = json.dumps({"version": INDEX_VERSION, "shards": sorted(names)})
        d = found[0].parent
        tmp = d / f".ready.{key}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            tmp.write_text(record)
            os.replace(tmp, d / f"ready.{key}.json")
        except OSError:
            tmp.unlink(missing_ok=True)
