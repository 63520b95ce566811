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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from data_pipelines.index_file import (
    IndexFile,
    IndexFileError,
    pack_strings,
    unpack_strings,
    write_index,
)
from data_pipelines.lengths import HEADER_OK, Entry, ImageHeader, sample_entry, with_standins
from data_pipelines.reader import ReadFailure, Shard, _count, _described, _groups
from data_pipelines.tokenizer import Tokenizer
from data_pipelines.urls import COMPRESSED
from vision.image_processor import ImageProcessor

log = logging.getLogger("data_pipelines")

INDEX_VERSION = 1
INDEX_DIR = ".vlm-index"
# A shard changed this recently may change again within its timestamp's resolution unseen: an
# index the loader builds of it is used but not kept (the writer's own index of what it wrote is).
SETTLED_S = 2.0
COMPRESSED_SUFFIXES = (".gz", ".tgz", ".bz2", ".xz")
NOT_IMAGE = -1  # a member's header status: not an image member
# what a catalog counts (Catalog.io)
IO_KEYS = ("shard_bytes", "index_bytes", "samples_decoded", "index_entries")
# stands for the shard's path in the messages an index keeps (the folder may move)
SHARD = "\x00shard\x00"


def default_cache() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "vlm" / "loader-index"


def index_dirs(shard: Path, cache: str | os.PathLike = "") -> tuple[Path, Path]:
    """(beside the shard, in the cache folder) for a local shard."""
    folder = shard.parent
    digest = hashlib.sha256(str(folder.resolve()).encode("utf-8", "surrogateescape")).hexdigest()
    return folder / INDEX_DIR, Path(cache or default_cache()) / digest[:20]


def shard_stat(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def indexable(path: Shard) -> bool:
    """A local shard the index can serve: not compressed by its name (a `.tar` that holds a
    compressed stream is found when it is indexed)."""
    return isinstance(path, Path) and not path.name.endswith(COMPRESSED_SUFFIXES)


def tokens_key(tok: Tokenizer, kind: str, caption_field: str) -> str:
    spec = [INDEX_VERSION, tok.identity(), kind, caption_field]
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]


def _samples_name(path: Path) -> str:
    return f"{path.name}.samples.idx"


def _tokens_name(path: Path, key: str) -> str:
    return f"{path.name}.tokens-{key}.idx"


# ------------------------------------------------------------------------------------ samples layer
@dataclass
class SamplesIndex:
    """A shard's samples layer, loaded: its header, the per-sample arrays planning reads, and the
    shard's (size, mtime) it was checked against."""

    header: dict
    start: list[int]
    end: list[int]
    keys: list[str]
    stat: tuple[int, int]

    def count(self) -> tuple[int, bool]:
        """(samples, whether the tar breaks) as reader.shard_counts takes them; raises as reading
        the shard would."""
        h = self.header
        if h["unreadable"] is not None or h["raised"] is not None:
            raise ReadFailure(h["unreadable"] or h["raised"])
        return h["groups"], h["truncated"]

    def replay(self, errors: list, end: dict) -> Iterator[dict]:
        """The shard's samples as reader._groups yields them (payload: the sample's number),
        filling `errors` and `end` as it does, for reader.number_samples to number them as it
        numbers a read."""
        h = self.header
        if h["unreadable"] is not None:
            raise ReadFailure(h["unreadable"])
        if h["error"] is not None:
            errors.append((h["error"][0], ReadFailure(h["error"][1])))
        if h["raised"] is None:
            end["truncated"] = h["truncated"]
        n = h["groups"]
        for i in range(n):
            if i == n - 1 and h["broken"]:
                yield {"__key__": self.keys[i], "__broken__": True}
            else:
                yield {"__i__": i}
        if h["raised"] is not None:
            raise ReadFailure(h["raised"])


def _is_compressed(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
    except OSError:  # reading it fails again, and is recorded, when it is indexed
        return False
    return any(magic.startswith(m) for m, _ in COMPRESSED)


@dataclass
class ShardRead:
    """One read of a shard: its samples layer (header, arrays) and, when asked for, each sample's
    members (image members as stand-ins) and image headers, for the tokens layers."""

    header: dict
    arrays: dict
    raws: list[tuple[dict, dict]]
    stat: tuple[int, int] = (0, 0)  # the shard's (size, mtime) before it was read


def read_shard(
    path: Path, processor: ImageProcessor, io: Counter | None, keep_raw: bool
) -> ShardRead:
    """Read a local shard once, front to back, as the reader does."""
    header = {
        "layer": "samples",
        "version": INDEX_VERSION,
        "shard": path.name,
        "size": path.stat().st_size,
        "groups": 0,
        "truncated": False,
        "broken": False,
        "error": None,
        "raised": None,
        "unreadable": None,
        "compressed": False,
        "messages": {},
    }
    if _is_compressed(path):
        header["compressed"] = True
        return ShardRead(header, {}, [])
    members: list = []
    errors: list = []
    end: dict = {}
    keys, raws = [], []
    headers_of: dict[int, ImageHeader] = {}
    try:
        for raw in _groups(path, errors, end, members, io):
            keys.append(raw["__key__"])
            header["broken"] = bool(raw.get("__broken__"))
            raw["__url__"] = SHARD
            standins, headers = with_standins(raw, processor)
            for j in range(len(members) - 1, -1, -1):
                if members[j][0] != len(keys) - 1:
                    break
                if members[j][1] in headers:
                    headers_of[j] = headers[members[j][1]]
            if keep_raw:
                raws.append((standins, headers))
            if io is not None:
                io["samples_decoded"] += 1
    except Exception as e:  # noqa: BLE001 - recorded as it is: reading the shard again counts it alike
        header["unreadable" if not keys else "raised"] = _described(e)
    header["groups"] = len(keys)
    if header["raised"] is None and header["unreadable"] is None:
        header["truncated"] = bool(end.get("truncated"))
    if errors:
        name, exn = errors[0]
        header["error"] = [name, _described(exn)]
    spans: dict[int, list[int]] = {}
    for g, _, head_at, data_at, size in members:
        s = spans.setdefault(g, [head_at, data_at + size])
        s[0], s[1] = min(s[0], head_at), max(s[1], data_at + size)
    bounds = [spans.get(g, [0, 0]) for g in range(len(keys))]
    w, h = np.zeros(len(members), np.int32), np.zeros(len(members), np.int32)
    orient = np.ones(len(members), np.int8)
    status = np.full(len(members), NOT_IMAGE, np.int8)
    for j, hd in headers_of.items():
        w[j], h[j], orient[j], status[j] = hd.w, hd.h, hd.orientation, hd.status
        if hd.status != HEADER_OK:
            header["messages"][str(j)] = hd.message
    key_blob, key_ends = pack_strings(keys)
    suffix_blob, suffix_ends = pack_strings([m[1] for m in members])
    arrays = {
        "start": np.asarray([a for a, _ in bounds], np.int64),
        # a member's data is padded to whole blocks
        "end": np.asarray([-(-b // 512) * 512 for _, b in bounds], np.int64),
        "keys": key_blob,
        "key_ends": key_ends,
        "m_sample": np.asarray([m[0] for m in members], np.int32),
        "m_suffix": suffix_blob,
        "m_suffix_ends": suffix_ends,
        "m_offset": np.asarray([m[3] for m in members], np.int64),
        "m_size": np.asarray([m[4] for m in members], np.int64),
        "m_w": w,
        "m_h": h,
        "m_orient": orient,
        "m_status": status,
    }
    return ShardRead(header, arrays, raws)


def write_samples_index(path: Path, processor: ImageProcessor | None = None) -> Path | None:
    """Index a shard just written (ShardWriter): its samples layer beside it. None (and a
    warning) where the folder cannot hold it: the loader then builds it in its cache."""
    built = read_shard(path, processor or ImageProcessor(), None, keep_raw=False)
    target = path.parent / INDEX_DIR / _samples_name(path)
    try:
        target.parent.mkdir(exist_ok=True)
        write_index(target, built.header, built.arrays)
    except OSError as e:
        log.warning("cannot write the loader index of %s (%s)", path, e)
        return None
    return target


def move_index(src_dir: Path, dst_dir: Path, name: str) -> None:
    """Move a shard's samples layer along with the shard (an import's partial folder into its
    output; one that is not there is built by the loader), and forget which shards of the output
    were ready: a loader looks at each again."""
    src = src_dir / INDEX_DIR / _samples_name(Path(name))
    if src.is_file():
        (dst_dir / INDEX_DIR).mkdir(exist_ok=True)
        os.replace(src, dst_dir / INDEX_DIR / src.name)
    for ready in (dst_dir / INDEX_DIR).glob("ready.*.json"):
        ready.unlink(missing_ok=True)


def drop_index(folder: Path, names: set[str]) -> None:
    """Delete the index files of shards deleted from `folder` (an import starting again)."""
    d = folder / INDEX_DIR
    if not d.is_dir():
        return
    for f in d.iterdir():
        if f.name.startswith("ready.") or any(f.name.startswith(n + ".") for n in names):
            f.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------- tokens layer
def tokens_arrays(entries: list[Entry | None], header: dict) -> dict[str, np.ndarray]:
    """The tokens layer's arrays of a shard's entries (None: a broken sample, never planned); the
    reasons' names and the messages go into `header`."""
    names = header["reasons"]
    n = len(entries)
    reason, tokens = np.zeros(n, np.int8), np.zeros(n, np.int32)
    last, mismatch = np.full(n, -1, np.int32), np.zeros(n, np.int8)
    image_ends = np.zeros(n, np.int64)
    images: list[ImageHeader] = []
    for i, e in enumerate(entries):
        if e is not None:
            if e.reason is not None:
                if e.reason not in names:
                    names.append(e.reason)
                reason[i] = 1 + names.index(e.reason)
            tokens[i], last[i], mismatch[i] = e.tokens, e.last_image, e.mismatch
            if e.message:
                header["messages"][str(i)] = e.message
            for im in e.images:
                if im.message:
                    header["image_messages"][str(len(images))] = im.message
                images.append(im)
        image_ends[i] = len(images)
    return {
        "reason": reason,
        "tokens": tokens,
        "last_image": last,
        "mismatch": mismatch,
        "image_ends": image_ends,
        "img_w": np.asarray([im.w for im in images], np.int32),
        "img_h": np.asarray([im.h for im in images], np.int32),
        "img_orient": np.asarray([im.orientation for im in images], np.int8),
        "img_status": np.asarray([im.status for im in images], np.int8),
    }


TOKENS_ARRAYS = ("reason", "tokens", "last_image", "mismatch", "image_ends")
TOKENS_ARRAYS += ("img_w", "img_h", "img_orient", "img_status")


@dataclass(frozen=True)
class SourceSettings:
    """What a tokens layer depends on besides the shard and the tokenizer."""

    kind: str
    caption_field: str
    key: str


class ShardIndex:
    """A local shard's two layers, loaded for planning: `samples.replay` for the reader's
    numbering, `entry(i)` for sample i."""

    def __init__(self, path: Path, samples: SamplesIndex, tokens: dict, io: Counter):
        self.path, self.samples, self.io = path, samples, io
        h = tokens["header"]
        self.names, self.messages, self.image_messages = (
            h["reasons"],
            h["messages"],
            h["image_messages"],
        )
        self.reason, self.tokens = tokens["reason"], tokens["tokens"]
        self.last, self.mismatch = tokens["last_image"], tokens["mismatch"]
        self.image_ends = tokens["image_ends"]
        self.images = list(
            zip(tokens["img_w"], tokens["img_h"], tokens["img_orient"], tokens["img_status"])
        )

    def _message(self, table: dict, i: int) -> str:
        m = table.get(str(i))
        return m.replace(SHARD, str(self.path)) if m else ""

    def entry(self, i: int) -> Entry:
        self.io["index_entries"] += 1
        s = self.samples
        first, stop = self.image_ends[i - 1] if i else 0, self.image_ends[i]
        if self.image_messages:
            images = tuple(
                ImageHeader(*self.images[j], self._message(self.image_messages, j))
                for j in range(first, stop)
            )
        else:
            images = tuple(ImageHeader(*self.images[j]) for j in range(first, stop))
        code = self.reason[i]
        return Entry(
            s.keys[i],
            self.names[code - 1] if code else None,
            self._message(self.messages, i) if self.messages else "",
            self.tokens[i],
            self.last[i],
            bool(self.mismatch[i]),
            images,
            self.path,
            s.start[i],
            s.end[i],
        )


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
            got = self._open(path, _samples_name(path), stat, ("start", "end", "keys", "key_ends"))
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
            settled and self._write(path, _samples_name(path), built.header, built.arrays, stat)
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

    def samples(self, path: Path) -> SamplesIndex:
        """The shard's samples layer (checked against the shard; built when missing or stale)."""
        stat = shard_stat(path)
        return self._samples(path, stat) or self._build(path, [])

    def count(self, path: Shard) -> tuple[int, bool]:
        """reader.shard_counts' count of a shard, from its index where it has one."""
        if not indexable(path):
            return _count(path)
        s = self.samples(path)
        return _count(path) if s.header["compressed"] else s.count()

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
            self._write(path, _tokens_name(path, s.key), header, arrays, samples.stat)
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
                _samples_name(path),
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
        tokens = self._open(path, _tokens_name(path, s.key), stat, TOKENS_ARRAYS)
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
            done = self._find(path, _tokens_name(path, s.key))
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
        found = [f for p in paths if (f := self._find(p, _tokens_name(p, key))) is not None]
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
