"""Reading shards: resolve source patterns, count samples, iterate a shard's samples by index.

Members come from webdataset's `tar_file_iterator`; we group them into samples ourselves (a dozen lines)
rather than with `group_by_keys` because exact resume and exact bad-input counting need two things it
does not give: a stable ordinal for every sample (including bad ones) so a position can be saved as
(shard, index) and resumed by skipping, and knowing which sample a read error hit. Python's tarfile
in stream mode ends silently on a corrupt or truncated header, so a shard that yields fewer samples than
its manifest says is reported as unreadable members (the interrupted sample and all that follow).
"""
from __future__ import annotations

import glob
import logging
import os
from pathlib import Path
from typing import Any, Iterator

import braceexpand
from webdataset.tariterators import base_plus_ext, tar_file_iterator

from data_pipelines.schema import UNREADABLE_MEMBER, UNREADABLE_SHARD, BadSample
from data_pipelines.writer import read_manifest

log = logging.getLogger("data_pipelines")
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")


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


def _groups(path: Path, on_error: list) -> Iterator[dict[str, Any]]:
    """Tar members -> raw samples {"__key__", "__url__", ext: bytes}; a failed member read ends the shard
    with one sample marked "__broken__" (the one the failing member belongs to)."""
    current_name = [None]

    def select(fname: str) -> bool:  # called right before a member's data is read
        current_name[0] = fname
        return True

    def handler(exn: Exception) -> bool:
        on_error.append((current_name[0], exn))
        return False  # the stream position is lost after a failed read: stop this shard

    sample: dict[str, Any] | None = None
    seen_member = False
    with open(path, "rb") as f:
        try:
            for member in tar_file_iterator(f, handler=handler, select_files=select):
                seen_member = True
                prefix, suffix = base_plus_ext(member["fname"])
                if prefix is None:
                    continue
                if sample is not None and prefix != sample["__key__"]:
                    yield sample
                    sample = None
                if sample is None:
                    sample = {"__key__": prefix, "__url__": str(path)}
                sample[suffix.lower()] = member["data"]
        except Exception as e:  # noqa: BLE001 - a bad header mid-shard: the sample being read may be partial
            if not seen_member:
                raise
            on_error.append((None, e))
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

    Samples before `start` are read but not yielded (resume skips this way). `expected` (the manifest's
    count) lets a silently truncated shard be detected: the last sample read is then reported as
    unreadable (it may be partial) and so is every sample lost after it. An index of -1 with reason
    unreadable_shard means the shard could not be opened at all.
    """
    path = Path(path)
    if expected is not None:
        stop = expected if stop is None else min(stop, expected)
    errors: list = []
    n, held, complete = 0, None, False

    def out(i: int, raw: Any):
        return (i, raw) if start <= i and (stop is None or i < stop) else None

    try:
        for raw in _groups(path, errors):
            if held is not None and (o := out(*held)):
                yield o
            held = None
            if stop is not None and n >= stop:
                complete = True  # the sample at stop-1 was followed by another: it is whole
                break
            held, n = (n, raw), n + 1
    except Exception as e:  # noqa: BLE001 - OSError, tarfile.ReadError on a file that is no tar, ...
        if n == 0:
            yield -1, BadSample(UNREADABLE_SHARD, f"shard {path} cannot be opened or read as a tar file: "
                                                  f"{type(e).__name__}: {e}")
            return
        errors.append((None, e))
    if complete:
        return
    if held is not None:
        i, raw = held
        if raw.get("__broken__") or (expected is not None and n < expected):
            name, exn = errors[0] if errors else (None, "tar ends early (corrupt or truncated header)")
            what = f"member {name}" if name else "a member"
            held = (i, BadSample(UNREADABLE_MEMBER, f"shard {path}: {what} of sample {raw['__key__']} cannot be "
                                                    f"read ({type(exn).__name__ if errors else 'tar'}: {exn})"))
        else:
            raw.pop("__broken__", None)
        if o := out(*held):
            yield o
    if expected is not None and n < expected:
        log.warning("shard %s: read %d of %d samples (truncated or corrupt tar)", path, n, expected)
        for i in range(max(n, start), stop):
            yield i, BadSample(UNREADABLE_MEMBER, f"shard {path}: sample {i} lost (the tar ends after {n} "
                                                  f"of {expected} samples)")


def count_samples(path: str | os.PathLike) -> int:
    """Samples in a shard by reading it (for shards without a manifest entry)."""
    return sum(1 for _ in _groups(Path(path), []))


def shard_counts(paths: list[Path]) -> list[int]:
    """Per-shard sample counts: from each folder's manifest.json, else by reading the shard."""
    manifests: dict[Path, dict[str, int]] = {}
    counts = []
    for p in paths:
        d = p.parent
        if d not in manifests:
            m = read_manifest(d)
            manifests[d] = {e["name"]: int(e["count"]) for e in m["shards"]} if m else {}
        if p.name in manifests[d]:
            counts.append(manifests[d][p.name])
        else:
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


__all__ = ["resolve_shards", "iter_shard", "count_samples", "shard_counts", "fetch_samples", "ShardError"]
