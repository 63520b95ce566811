"""Reading shards: resolve source patterns, count samples, iterate a shard's samples by index.

Members come from Python's tarfile in stream mode and are grouped into samples here, not by webdataset's
`tar_file_iterator` + `group_by_keys`, because exact resume and exact loss counting need what they do not
give: a stable ordinal for every sample (bad ones included) so a position can be saved as (shard, index)
and resumed by skipping; knowing which sample a read error hit; and the stream offset where the members
stop, since tarfile ends silently at a truncated or corrupt header (we then read that block ourselves).
"""
from __future__ import annotations

import bz2
import fnmatch
import glob
import gzip
import logging
import lzma
import os
import re
import tarfile
import zlib
from pathlib import Path
from typing import Any, Iterator

import braceexpand
from webdataset.tariterators import base_plus_ext

from data_pipelines.schema import (
    MANIFEST_MISMATCH,
    MISSING_SHARD,
    TRUNCATED_SHARD,
    UNREADABLE_MEMBER,
    UNREADABLE_SHARD,
    BadSample,
)
from data_pipelines.writer import read_manifest

log = logging.getLogger("data_pipelines")
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
BLOCK = tarfile.BLOCKSIZE
_COMPRESSED = ((b"\x1f\x8b", gzip.open), (b"BZh", bz2.open), (b"\xfd7zXZ\x00", lzma.open))
_META = re.compile(r"__[^/]*__($|/)")   # webdataset's metadata members (`__key__` and the like)


class ShardError(ValueError):
    """A source pattern or shard that cannot be used (no match, missing file); names the path."""


def resolve_shards(pattern: str | os.PathLike) -> list[Path]:
    """A directory (its shards), a glob, a brace pattern (`a-{000..009}.tar`) or one file -> sorted shard paths."""
    pattern = str(pattern)
    p = Path(pattern)
    if p.is_dir():
        paths = sorted(q for q in p.iterdir() if q.name.endswith(SHARD_SUFFIXES))
        if not paths:
            raise ShardError(f"shard directory {p} holds no {'/'.join(SHARD_SUFFIXES)} files")
        return paths
    paths: list[Path] = []
    for pat in braceexpand.braceexpand(pattern):
        if glob.has_magic(pat):
            paths += [Path(q) for q in sorted(glob.glob(pat))]
        elif Path(pat).is_file():
            paths.append(Path(pat))
        else:
            raise ShardError(f"shard {pat} does not exist")
    if not paths:
        raise ShardError(f"shard pattern {pattern!r} matches no files")
    return sorted(dict.fromkeys(paths))


def _block_at(path: Path, offset: int) -> bytes:
    """Up to one tar block of the (decompressed) tar stream at `offset`."""
    with open(path, "rb") as f:
        magic = f.read(6)
    opener = next((o for m, o in _COMPRESSED if magic.startswith(m)), open)   # as tarfile's "r|*" detects
    try:
        with opener(path, "rb") as f:
            f.seek(offset)
            return f.read(BLOCK)
    except (OSError, EOFError, zlib.error, lzma.LZMAError):
        return b""


def _groups(path: Path, on_error: list, end: dict) -> Iterator[dict[str, Any]]:
    """Tar members -> raw samples {"__key__", "__url__", ext: bytes}; a failed member read ends the shard
    with one sample marked "__broken__" (the one the failing member belongs to).

    Python's tarfile ends silently at a truncated or corrupt header, so where the members stop we look at
    the next block ourselves: a zero block is the archive's end; anything else (a short or non-zero block)
    means the tar breaks there, and the header's name, when readable, tells whether the last sample is
    whole. `end["truncated"]` is set when the tar breaks.
    """
    sample: dict[str, Any] | None = None
    seen_member, failed_name = False, None
    with open(path, "rb") as f:
        tf = None
        try:
            tf = tarfile.open(fileobj=f, mode="r|*")
            for ti in tf:
                seen_member = True
                if not ti.isreg() or _META.match(ti.name):
                    continue
                failed_name = ti.name
                data = tf.extractfile(ti).read()
                failed_name = None
                prefix, suffix = base_plus_ext(ti.name)
                if prefix is None:
                    continue
                if sample is not None and prefix != sample["__key__"]:
                    yield sample
                    sample = None
                if sample is None:
                    sample = {"__key__": prefix, "__url__": str(path)}
                sample[suffix.lower()] = data
        except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
            if not seen_member:
                raise
            on_error.append((failed_name, e))   # the stream position is lost after a failed read
        if not on_error and tf is not None:
            block = _block_at(path, tf.offset)
            if len(block) < BLOCK or any(block):
                name = block[:100].split(b"\0")[0].decode("utf-8", "replace") or None
                on_error.append((name, "the tar breaks at byte %d (truncated, or a corrupt header)" % tf.offset))
    end["truncated"] = bool(on_error)
    if on_error:
        failed_key = base_plus_ext(on_error[0][0] or "")[0]
        if sample is not None and failed_key not in (None, sample["__key__"]):
            yield sample  # complete: the failing member opened the next sample
            sample = {"__key__": failed_key, "__url__": str(path)}
        if sample is None:
            sample = {"__key__": failed_key or "?", "__url__": str(path)}
        sample["__broken__"] = True
    if sample is not None:
        yield sample


def iter_shard(path: str | os.PathLike, start: int = 0, stop: int | None = None,
               expected: int | None = None) -> Iterator[tuple[int, Any]]:
    """Yield (index, raw sample or BadSample) for samples `start <= index < stop` of one shard.

    Samples before `start` are read but not yielded (resume skips this way). `expected` is the shard's
    count (from the manifest, or from reading it) and lets every lost sample be counted: after the tar
    breaks, each promised sample as truncated_shard (once, unnumbered, when the count was read from the
    broken tar itself); an intact tar holding fewer or more samples than promised, as manifest_mismatch;
    a missing file, each sample as missing_shard. Events without an index of their own come as index -1
    (also: unreadable_shard, the file cannot be opened as a tar) and only from the reader whose range ends
    the shard, so each is counted once per pass. Each shard warns once.
    """
    path = Path(path)
    at_end = stop is None or expected is None or stop >= expected
    if expected is not None:
        stop = expected if stop is None else min(stop, expected)
    if not path.exists():
        if expected is None:
            yield -1, BadSample(MISSING_SHARD, f"shard {path} is gone")
            return
        log.warning("shard %s is listed in its manifest (%d samples) but is gone", path, expected)
        for i in range(start, stop):
            yield i, BadSample(MISSING_SHARD, f"shard {path} is listed in its manifest but gone: sample {i} lost")
        return
    errors: list = []
    end: dict = {}
    n, held, extra = 0, None, 0

    def out(i: int, raw: Any):
        return (i, raw) if start <= i and (stop is None or i < stop) else None

    try:
        for raw in _groups(path, errors, end):
            if held is not None and (o := out(*held)):
                yield o
            held = None
            if stop is not None and n >= stop:
                if not (at_end and expected is not None):
                    return      # the sample at stop-1 was followed by another: it is whole
                extra += 1      # beyond the promised count: counted, not read
                continue
            held, n = (n, raw), n + 1
    except Exception as e:  # noqa: BLE001 - OSError, tarfile.ReadError on a file that is no tar, ...
        if n == 0:
            yield -1, BadSample(UNREADABLE_SHARD, f"shard {path} cannot be opened or read as a tar file: "
                                                  f"{type(e).__name__}: {e}")
            return
        errors.append((None, e))
        end["truncated"] = True
    truncated = end.get("truncated", False)
    if held is not None:
        i, raw = held
        if raw.get("__broken__"):
            name, exn = errors[0] if errors else (None, "the tar breaks after it")
            what = f"member {name}" if name else "a member"
            held = (i, BadSample(UNREADABLE_MEMBER, f"shard {path}: {what} of sample {raw['__key__']} cannot be "
                                                    f"read ({type(exn).__name__ + ': ' if errors else ''}{exn})"))
        else:
            raw.pop("__broken__", None)
        if o := out(*held):
            yield o
    if expected is not None and n < expected:
        reason = TRUNCATED_SHARD if truncated else MANIFEST_MISMATCH
        why = ("the tar breaks" if truncated else "the tar is intact but its manifest entry promises more: "
               "rewrite it with `vlm data stats --scan --write-manifest`")
        if at_end:
            log.warning("shard %s: read %d of %d samples (%s)", path, n, expected, why)
        for i in range(max(n, start), stop):
            yield i, BadSample(reason, f"shard {path}: sample {i} lost ({why} after {n} of {expected} samples)")
    elif at_end and truncated:
        log.warning("shard %s: the tar breaks after %d samples; an unknown number after them is lost "
                    "(a manifest entry would count them)", path, n)
        yield -1, BadSample(TRUNCATED_SHARD, f"shard {path}: the tar breaks after {n} samples; the samples after "
                                             "them are lost (their number is unknown without a manifest entry)")
    if extra:
        log.warning("shard %s holds %d samples more than its manifest entry (%d); they are not read: rewrite it "
                    "with `vlm data stats --scan --write-manifest`", path, extra, expected)
        yield -1, BadSample(MANIFEST_MISMATCH, f"shard {path}: {extra} samples beyond its manifest entry's "
                                               f"{expected} are not read", count=extra)


def count_samples(path: str | os.PathLike) -> int:
    """Samples in a shard by reading it (for shards without a manifest entry)."""
    return _count(Path(path))[0]


def _count(path: Path) -> tuple[int, bool]:
    """(samples, whether the tar breaks)."""
    end: dict = {}
    n = sum(1 for _ in _groups(path, [], end))
    return n, end["truncated"]


def listed_but_missing(pattern: str | os.PathLike) -> list[Path]:
    """Shards a folder's manifest lists under a directory or glob source that are no longer on disk: the
    loader keeps them (each of their samples is counted as missing_shard) instead of dropping them silently."""
    pattern = str(pattern)
    folders = [Path(pattern)] if Path(pattern).is_dir() else \
        sorted({Path(q).parent for q in braceexpand.braceexpand(pattern) if glob.has_magic(q)})
    out = []
    for d in folders:
        m = read_manifest(d) if d.is_dir() else None
        for e in (m or {"shards": []})["shards"]:
            q = d / str(e.get("name", ""))
            if q.name and not q.exists() and (d == Path(pattern) or any(
                    fnmatch.fnmatch(str(q), pat) for pat in braceexpand.braceexpand(pattern))):
                out.append(q)
    return out


class ManifestEntries:
    """A shard's entry in its folder's manifest.json (each folder's manifest read once), or None."""

    def __init__(self):
        self._by_dir: dict[Path, dict[str, dict]] = {}

    def __call__(self, shard: Path) -> dict | None:
        d = shard.parent
        if d not in self._by_dir:
            m = read_manifest(d)
            self._by_dir[d] = {e["name"]: e for e in m["shards"]} if m else {}
        return self._by_dir[d].get(shard.name)


def shard_counts(paths: list[Path]) -> list[int]:
    """Per-shard sample counts: from each folder's manifest.json, else (or when the entry's `file_bytes`
    disagrees with the file: the shard was rewritten) by reading the shard."""
    manifest_entry = ManifestEntries()
    counts = []
    for p in paths:
        entry = manifest_entry(p)
        if entry is not None and p.exists() and entry.get("file_bytes") not in (None, p.stat().st_size):
            # Rewritten since the manifest was made, or truncated: an intact tar is counted as it is now; a
            # broken one keeps the manifest's count, so that every promised sample it lost is counted.
            try:
                n, broken = _count(p)
            except Exception:  # noqa: BLE001 - no longer a tar: its reader counts it as unreadable_shard
                n, broken = 0, True
            log.warning("shard %s: its manifest entry says %s bytes and %s samples, the file has %d bytes%s",
                        p, entry["file_bytes"], entry["count"], p.stat().st_size,
                        " and breaks" if broken else f" and {n} samples; using {n}")
            counts.append(int(entry["count"]) if broken else n)
            continue
        if entry is not None:
            counts.append(int(entry["count"]))
            continue
        log.warning("shard %s has no manifest entry; counting its samples by reading it", p)
        try:
            counts.append(count_samples(p))
        except Exception as e:  # noqa: BLE001
            # One slot: the worker that owns it tries to read it and counts it once as an unreadable shard
            # (as for a manifest-listed shard that no longer reads), instead of stopping the run.
            log.warning("shard %s cannot be read (%s: %s); it is skipped and counted", p, type(e).__name__, e)
            counts.append(1)
    return counts


def fetch_samples(path: str | os.PathLike, indices: set[int], expected: int | None = None) -> dict[int, Any]:
    """Raw samples at `indices` of one shard (restoring buffered samples after a resume)."""
    if not indices:
        return {}
    out = {}
    for i, raw in iter_shard(path, start=min(indices), stop=max(indices) + 1, expected=expected):
        if i in indices:
            out[i] = raw
    return out


__all__ = ["resolve_shards", "listed_but_missing", "ManifestEntries", "iter_shard", "count_samples", "shard_counts", "fetch_samples", "ShardError"]
