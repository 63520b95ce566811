"""The loader index's two layers per shard, as files and in memory (data_pipelines.index has the
whole picture, and the Catalog that finds, checks and builds them).

- the samples layer (`NAME.samples.idx`): what one front-to-back read of a tar finds (`read_shard`),
  written by ShardWriter with every shard (`write_samples_index`) or by the loader; in memory a
  `SamplesIndex`, which replays the read for reader.number_samples;
- the tokens layer (`NAME.tokens-KEY.idx`): a shard's lengths.Entry values as arrays
  (`tokens_arrays`); in memory, with its samples layer, a `ShardIndex` that gives entry i.

File names, where the files go (`index_dirs`), and what marks a shard as changed (`shard_stat`) are
here too. Messages kept in a layer name the shard as SHARD (its folder may move).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from data_pipelines.index_file import pack_strings, write_index
from data_pipelines.lengths import HEADER_OK, Entry, ImageHeader, with_standins
from data_pipelines.reader import ReadFailure, Shard, _described, _groups
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


def samples_name(path: Path) -> str:
    return f"{path.name}.samples.idx"


def tokens_name(path: Path, key: str) -> str:
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
    target = path.parent / INDEX_DIR / samples_name(path)
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
    src = src_dir / INDEX_DIR / samples_name(Path(name))
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
