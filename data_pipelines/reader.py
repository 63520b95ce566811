"""Reading shards: resolve source patterns, count samples, iterate a shard's samples by index.

A shard is a local file (a Path) or a URL webdataset understands (a str: `pipe:CMD`,
`http(s)://...`), opened with webdataset's gopen and read as a stream (urls.py); `file:` URLs are
local paths. Members come from Python's tarfile in stream mode and are grouped into samples here,
not by webdataset's `tar_file_iterator` + `group_by_keys` (nor its WebDataset pipeline, which
resumes at shard starts at best), because exact resume and exact loss counting need what they do not
give: a stable ordinal for every sample (bad ones included) so a position can be saved as (shard,
index) and resumed by skipping (on a URL shard, by streaming past the samples before it again);
knowing which sample a read error hit; and the stream offset where the members stop, since tarfile
ends silently at a truncated or corrupt header (we then read that block ourselves).
"""

from __future__ import annotations

import fnmatch
import glob
import io as io_module
import logging
import lzma
import os
import re
import tarfile
import zlib
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

import braceexpand
from webdataset.tariterators import base_plus_ext

from data_pipelines.manifest import read_manifest
from data_pipelines.schema import (
    MANIFEST_MISMATCH,
    MISSING_SHARD,
    TRUNCATED_SHARD,
    UNREADABLE_MEMBER,
    UNREADABLE_SHARD,
    BadSample,
    ShardError,
)
from data_pipelines.urls import (
    COMPRESSED,
    READ_ERRORS,
    UrlStream,
    expand_url_pattern,
    fetch_manifest,
    file_url_path,
    is_stream_url,
    shard_name,
    url_folder,
    url_scheme,
)

log = logging.getLogger("data_pipelines")
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
# metadata written next to shards (img2dataset, our manifest.json)
SIDECAR_SUFFIXES = (".parquet", ".json")
BLOCK = tarfile.BLOCKSIZE
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata members (`__key__` and the like)


Shard = Path | str  # a local file, or a URL read through gopen


def as_shard(name: str | os.PathLike) -> Shard:
    """A shard name as the reader takes it: a URL stays a str (a `file:` URL becomes its Path), a path a Path."""
    if is_stream_url(name):
        return name
    return Path(file_url_path(name) if url_scheme(name) == "file" else name)


def local_source(pattern: str | os.PathLike) -> str | None:
    """A source pattern as a local path pattern (a `file:` URL is one), or None for a URL read as a stream."""
    if is_stream_url(pattern):
        return None
    return file_url_path(pattern) if url_scheme(pattern) == "file" else str(pattern)


def resolve_shards(pattern: str | os.PathLike) -> list[Shard]:
    """A directory (its shards), a glob, a brace pattern (`a-{000..009}.tar`) or one file ->
    sorted shard paths (a `file:` URL names the same). Any other URL (`pipe:CMD`, `http(s)://...`)
    -> its shard URLs, expanded and ordered as webdataset does; they are not fetched here
    (counting them does)."""
    if (local := local_source(pattern)) is None:
        shards = [as_shard(u) for u in expand_url_pattern(pattern)]
        for q in shards:
            if isinstance(q, Path) and not q.is_file():
                raise ShardError(f"shard {q} does not exist")
        return shards
    pattern = local
    p = Path(pattern)
    if p.is_dir():
        paths = sorted(q for q in p.iterdir() if q.name.endswith(SHARD_SUFFIXES))
        if not paths:
            raise ShardError(f"shard directory {p} holds no {'/'.join(SHARD_SUFFIXES)} files")
        return paths
    paths: list[Path] = []
    for pat in braceexpand.braceexpand(pattern):
        # img2dataset's NNNNN.parquet / NNNNN_stats.json beside the tars are not shards
        if glob.has_magic(pat):
            paths += [Path(q) for q in sorted(glob.glob(pat)) if not q.endswith(SIDECAR_SUFFIXES)]
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
    # as tarfile's "r|*" detects
    opener = next((o for m, o in COMPRESSED if magic.startswith(m)), open)
    try:
        with opener(path, "rb") as f:
            f.seek(offset)
            return f.read(BLOCK)
    except (OSError, EOFError, zlib.error, lzma.LZMAError):
        return b""


class Counted:
    """A binary file whose reads are added to `io[what]` (the loader counts the bytes it reads)."""

    def __init__(self, f, io: Counter | None, what: str):
        self.f, self.io, self.what = f, io, what

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        if self.io is not None:
            self.io[self.what] += len(data)
        return data

    def seek(self, *args) -> int:
        return self.f.seek(*args)

    def tell(self) -> int:
        return self.f.tell()

    def close(self) -> None:
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def member_key(ti: tarfile.TarInfo) -> tuple[str, str] | None:
    """(sample key, member suffix) of a tar member that belongs to a sample, else None (directories,
    links, webdataset's `__key__`-style metadata, names without a suffix)."""
    if not ti.isreg() or _META.match(ti.name):
        return None
    prefix, suffix = base_plus_ext(ti.name)
    return None if prefix is None else (prefix, suffix.lower())


def _groups(
    path: Shard, on_error: list, end: dict, members: list | None = None, io: Counter | None = None
) -> Iterator[dict[str, Any]]:
    """Tar members -> raw samples {"__key__", "__url__", ext: bytes}; a failed member read ends the
    shard with one sample marked "__broken__" (the one the failing member belongs to).

    Python's tarfile ends silently at a truncated or corrupt header, so where the members stop we
    look at the next block ourselves: a zero block is the archive's end; anything else (a short or
    non-zero block) means the tar breaks there, and the header's name, when readable, tells whether
    the last sample is whole. `end["truncated"]` is set when the tar breaks. A URL shard is one
    gopen stream (urls.UrlStream, which keeps the bytes tarfile just read); a local file is reopened
    to read that block. With `members`, each member read is appended as (sample number, suffix,
    header offset, data offset, size) (data_pipelines.index); with `io`, the bytes read are counted
    under "shard_bytes" (a local file's).
    """
    sample: dict[str, Any] | None = None
    seen_member, failed_name = False, None
    url = isinstance(path, str)
    number = -1  # of the sample being read
    with UrlStream(path) if url else Counted(open(path, "rb"), io, "shard_bytes") as f:
        tf = None
        try:
            tf = tarfile.open(fileobj=f, mode="r|" if url else "r|*")
            for ti in tf:
                seen_member = True
                if member_key(ti) is None:
                    continue
                failed_name = ti.name
                data = tf.extractfile(ti).read()
                failed_name = None
                prefix, suffix = member_key(ti)
                if sample is not None and prefix != sample["__key__"]:
                    yield sample
                    sample = None
                if sample is None:
                    sample = {"__key__": prefix, "__url__": str(path)}
                    number += 1
                sample[suffix] = data
                if members is not None:
                    members.append((number, suffix, ti.offset, ti.offset_data, ti.size))
        except READ_ERRORS as e:
            if not seen_member:
                raise
            on_error.append((failed_name, e))  # the stream position is lost after a failed read
        if not on_error and tf is not None:
            block = f.block_at(tf.offset) if url else _block_at(path, tf.offset)
            if len(block) < BLOCK or any(block):
                name = block[:100].split(b"\0")[0].decode("utf-8", "replace") or None
                on_error.append(
                    (name, "the tar breaks at byte %d (truncated, or a corrupt header)" % tf.offset)
                )
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


def read_sample(path: Path, start: int, end: int, key: str, io: Counter | None = None) -> dict:
    """The raw sample {"__key__", "__url__", ext: bytes} whose members lie at bytes [start, end) of
    a local tar (from the loader's index). Raises ShardError when they are not the sample `key`'s
    members (the shard changed since it was indexed) or cannot be read."""
    try:
        # unbuffered: exactly the sample's bytes are read, not a buffer's worth more
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            parts, left = [], end - start
            while left > 0 and (part := f.read(left)):
                parts.append(part)
                left -= len(part)
            data = b"".join(parts)
    except OSError as e:
        raise ShardError(f"shard {path}: sample {key} cannot be read ({os_error(e)})") from None
    if io is not None:
        io["shard_bytes"] += len(data)
    raw: dict[str, Any] = {"__key__": key, "__url__": str(path)}
    try:
        # two zero blocks: the range holds members, not the archive's end
        tf = tarfile.open(fileobj=io_module.BytesIO(data + bytes(2 * BLOCK)), mode="r:")
        for ti in tf:
            mk = member_key(ti)
            if mk is None:
                continue
            if mk[0] != key:
                raise ShardError(f"holds a member of sample {mk[0]}")
            raw[mk[1]] = tf.extractfile(ti).read()
    except (tarfile.TarError, EOFError, OSError, ShardError) as e:
        raise ShardError(
            f"shard {path}: bytes {start}-{end} are not sample {key} any more ({e}); the shard "
            "changed since it was indexed"
        ) from None
    if len(raw) == 2 or len(data) != end - start:
        raise ShardError(
            f"shard {path}: bytes {start}-{end} are not sample {key} any more (cut short); the "
            "shard changed since it was indexed"
        )
    return raw


def os_error(e: OSError) -> str:
    return e.strerror or " ".join(str(e).split()) or type(e).__name__


def iter_shard(
    path: str | os.PathLike,
    start: int = 0,
    stop: int | None = None,
    expected: int | None = None,
    count_unreachable: bool = False,
    io: Counter | None = None,
) -> Iterator[tuple[int, Any]]:
    """Yield (index, raw sample or BadSample) for samples `start <= index < stop` of one shard
    (with `io`, the bytes of a local shard read are counted under "shard_bytes").

    Samples before `start` are read but not yielded (resume skips this way). `expected` is the
    shard's count (from the manifest, or from reading it) and lets every lost sample be counted:
    after the tar breaks, each promised sample as truncated_shard (once, unnumbered, when the count
    was read from the broken tar itself); an intact tar holding fewer or more samples than promised,
    as manifest_mismatch; a missing file, each sample as missing_shard (warned about by the loader,
    not here). Events without an index of their own come as index -1 (also: unreadable_shard, the
    file cannot be opened as a tar) and only from the reader whose range ends the shard, so each is
    counted once per pass. Each shard warns once.

    A URL shard is a stream: reaching `start` means streaming past the samples before it (the price
    of exact resume inside a URL shard). One that cannot be fetched at all (the command fails before
    its first byte) raises ShardError naming it, or with `count_unreachable` (the loader, mid-run)
    is counted as unreadable_shard; a stream that breaks later is a truncated shard, as a local file
    cut short.
    """
    path = as_shard(path)
    if isinstance(path, Path) and not path.exists():
        yield from _missing(path, start, stop, expected)
        return
    errors: list = []
    end: dict = {}
    yield from number_samples(
        _groups(path, errors, end, io=io),
        path,
        errors,
        end,
        start,
        stop,
        expected,
        count_unreachable,
    )


def _missing(path: Path, start: int, stop: int | None, expected: int | None):
    if expected is None:
        yield -1, BadSample(MISSING_SHARD, f"shard {path} is gone")
        return
    stop = expected if stop is None else min(stop, expected)
    # the loader names every such shard in one warning when it resolves the
    # source (loader.resolve_sources)
    log.debug("shard %s is listed in its manifest (%d samples) but is gone", path, expected)
    for i in range(start, stop):
        yield (
            i,
            BadSample(
                MISSING_SHARD,
                f"shard {path} is listed in its manifest but gone: sample {i} lost",
            ),
        )


class ReadFailure(Exception):
    """A read error recorded by the loader's index, raised again where the shard is read from the
    index: `text` is how the error read ("OSError: ...")."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


def _described(e: BaseException) -> str:
    return e.text if isinstance(e, ReadFailure) else f"{type(e).__name__}: {e}"


def number_samples(
    groups: Iterator[dict[str, Any]],
    path: Shard,
    errors: list,
    end: dict,
    start: int = 0,
    stop: int | None = None,
    expected: int | None = None,
    count_unreachable: bool = False,
) -> Iterator[tuple[int, Any]]:
    """iter_shard's numbering of a shard's samples (`groups`, as `_groups` yields them, filling
    `errors` and `end` as it goes); the loader's index replays a shard through it from what it
    recorded (data_pipelines.index), so that both count every sample alike."""
    at_end = stop is None or expected is None or stop >= expected
    if expected is not None:
        stop = expected if stop is None else min(stop, expected)
    n, held, extra = 0, None, 0

    def out(i: int, raw: Any):
        return (i, raw) if start <= i and (stop is None or i < stop) else None

    try:
        for raw in groups:
            if held is not None and (o := out(*held)):
                yield o
            held = None
            if stop is not None and n >= stop:
                if not (at_end and expected is not None):
                    return  # the sample at stop-1 was followed by another: it is whole
                extra += 1  # beyond the promised count: counted, not read
                continue
            held, n = (n, raw), n + 1
    except Exception as e:
        if n == 0:
            if isinstance(e, ShardError) and not count_unreachable:
                raise
            yield (
                -1,
                BadSample(
                    UNREADABLE_SHARD,
                    str(e)
                    if isinstance(e, ShardError)
                    else f"shard {path} cannot be opened or read as a tar file: {_described(e)}",
                ),
            )
            return
        errors.append((None, e))
        end["truncated"] = True
    truncated = end.get("truncated", False)
    if held is not None:
        i, raw = held
        if raw.get("__broken__"):
            name, exn = errors[0] if errors else (None, "the tar breaks after it")
            what = f"member {name}" if name else "a member"
            why = _described(exn) if errors else exn
            held = (
                i,
                BadSample(
                    UNREADABLE_MEMBER,
                    f"shard {path}: {what} of sample {raw['__key__']} cannot be read ({why})",
                ),
            )
        else:
            raw.pop("__broken__", None)
        if o := out(*held):
            yield o
    if expected is not None and n < expected:
        reason = TRUNCATED_SHARD if truncated else MANIFEST_MISMATCH
        why = (
            "the tar breaks"
            if truncated
            else "the tar is intact but its manifest entry promises more: "
            "rewrite it with `vlm data stats --scan --write-manifest`"
        )
        if at_end:
            log.warning("shard %s: read %d of %d samples (%s)", path, n, expected, why)
        for i in range(max(n, start), stop):
            yield (
                i,
                BadSample(
                    reason, f"shard {path}: sample {i} lost ({why} after {n} of {expected} samples)"
                ),
            )
    elif at_end and truncated:
        log.warning(
            "shard %s: the tar breaks after %d samples; an unknown number "
            "after them is lost (a manifest entry would count them)",
            path,
            n,
        )
        yield (
            -1,
            BadSample(
                TRUNCATED_SHARD,
                f"shard {path}: the tar breaks after {n} samples; the samples after "
                "them are lost (their number is unknown without a manifest entry)",
            ),
        )
    if extra:
        log.warning(
            "shard %s holds %d samples more than its manifest entry (%d); they are "
            "not read: rewrite it with `vlm data stats --scan --write-manifest`",
            path,
            extra,
            expected,
        )
        yield (
            -1,
            BadSample(
                MANIFEST_MISMATCH,
                f"shard {path}: {extra} samples beyond its manifest entry's {expected} are not read",
                count=extra,
            ),
        )


def count_samples(path: str | os.PathLike) -> int:
    """Samples in a shard by reading it (for shards without a manifest entry; a URL shard is streamed once)."""
    return _count(as_shard(path))[0]


def _count(path: Shard) -> tuple[int, bool]:
    """(samples, whether the tar breaks)."""
    end: dict = {}
    n = sum(1 for _ in _groups(path, [], end))
    return n, end["truncated"]


def listed_but_missing(pattern: str | os.PathLike) -> list[Path]:
    """Shards a folder's manifest lists under a directory or glob source that are no longer on disk:
    the loader keeps them (each of their samples is counted as missing_shard) instead of dropping
    them silently. A URL source has no folder to list: none."""
    if (pattern := local_source(pattern)) is None:
        return []
    folders = (
        [Path(pattern)]
        if Path(pattern).is_dir()
        else sorted({Path(q).parent for q in braceexpand.braceexpand(pattern) if glob.has_magic(q)})
    )
    out = []
    for d in folders:
        m = read_manifest(d) if d.is_dir() else None
        for e in (m or {"shards": []})["shards"]:
            q = d / str(e.get("name", ""))
            if (
                q.name
                and not q.exists()
                and (
                    d == Path(pattern)
                    or any(fnmatch.fnmatch(str(q), pat) for pat in braceexpand.braceexpand(pattern))
                )
            ):
                out.append(q)
    return out


class ManifestEntries:
    """A shard's entry in its folder's manifest.json (each folder's manifest read once), or None. A
    URL shard's folder manifest is fetched with gopen (`http://host/dir/manifest.json`); a `pipe:`
    shard has none."""

    def __init__(self):
        self._by_dir: dict[Path | str, dict[str, dict]] = {}

    def __call__(self, shard: Shard) -> dict | None:
        d = url_folder(shard) if isinstance(shard, str) else shard.parent
        if d is None:
            return None
        if d not in self._by_dir:
            m = fetch_manifest(d) if isinstance(d, str) else read_manifest(d)
            self._by_dir[d] = {e["name"]: e for e in m["shards"]} if m else {}
        return self._by_dir[d].get(shard_name(shard))


def shard_counts(
    paths: list[Shard], count: Callable[[Shard], tuple[int, bool]] | None = None
) -> list[int]:
    """Per-shard sample counts: from each folder's manifest.json, else (or when the entry's
    `file_bytes` disagrees with the file: the shard was rewritten) by reading the shard (a URL
    shard: streaming it once), or with `count` (the loader's index: (samples, whether the tar
    breaks), raising as reading would). A URL shard that cannot be fetched raises ShardError
    naming it."""
    count = count or _count
    manifest_entry = ManifestEntries()
    counts = []
    for p in paths:
        entry = manifest_entry(p)
        if (
            entry is not None
            and isinstance(p, Path)
            and p.exists()
            and entry.get("file_bytes") not in (None, p.stat().st_size)
        ):
            # Rewritten since the manifest was made, or truncated: an intact tar is counted as it
            # is now; a broken one keeps the manifest's count, so that every promised sample it
            # lost is counted.
            try:
                n, broken = count(p)
            except Exception:  # noqa: BLE001 - no longer a tar: its reader counts it as unreadable_shard
                n, broken = 0, True
            log.warning(
                "shard %s: its manifest entry says %s bytes and %s samples, the file has %d bytes%s",
                p,
                entry["file_bytes"],
                entry["count"],
                p.stat().st_size,
                " and breaks" if broken else f" and {n} samples; using {n}",
            )
            counts.append(int(entry["count"]) if broken else n)
            continue
        if entry is not None:
            counts.append(int(entry["count"]))
            continue
        log.warning(
            "shard %s has no manifest entry; counting its samples by %s",
            p,
            "streaming it" if isinstance(p, str) else "reading it (or its loader index)",
        )
        try:
            counts.append(count(p)[0])
        except ShardError:
            # a URL that cannot be fetched: a wrong source, as a local path that does not exist
            raise
        except Exception as e:  # noqa: BLE001
            # One slot: the worker that owns it tries to read it and counts it once as an
            # unreadable shard (as for a manifest-listed shard that no longer reads), instead of
            # stopping the run.
            log.warning("shard %s cannot be read (%s); it is skipped and counted", p, _described(e))
            counts.append(1)
    return counts


def fetch_samples(
    path: str | os.PathLike, indices: set[int], expected: int | None = None
) -> dict[int, Any]:
    """Raw samples at `indices` of one shard (restoring buffered samples after a resume)."""
    if not indices:
        return {}
    out = {}
    for i, raw in iter_shard(path, start=min(indices), stop=max(indices) + 1, expected=expected):
        if i in indices:
            out[i] = raw
    return out


__all__ = [
    "Shard",
    "as_shard",
    "local_source",
    "shard_name",
    "resolve_shards",
    "listed_but_missing",
    "ManifestEntries",
    "iter_shard",
    "number_samples",
    "read_sample",
    "member_key",
    "count_samples",
    "shard_counts",
    "fetch_samples",
    "ShardError",
]
