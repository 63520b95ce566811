"""Shard writer (webdataset TarWriter underneath) with size/count rollover and a manifest of counts.

Tar headers get a fixed mtime/owner so the same samples always give the same bytes. On `close()` the
writer merges its shards' entries into `manifest.json` in the output folder; the loader takes
per-shard sample counts from there (to split ranks and workers without reading the data) and `vlm
data stats` prints the modality statistics.
"""

from __future__ import annotations

import io
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import webdataset as wds
from PIL import Image

from data_pipelines.schema import IMAGE_TOKEN, Sample, encode_sample

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the header only; None when Pillow cannot identify it."""
    # fast path: IHDR is the first chunk
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR":
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.size
    except Exception:  # noqa: BLE001 - statistics only; the loader reports bad images
        return None


class ShardStats:
    """Modality statistics of a set of samples (per shard, summed for totals)."""

    def __init__(self) -> None:
        self.count = 0
        self.bytes = 0
        self.kinds: Counter = Counter()
        self.chat = 0
        self.images = 0
        self.images_per_sample: Counter = Counter()
        self.image_pixels = 0
        self.min_side = None
        self.max_side = 0
        self.text_bytes = 0
        self.qa: Counter = Counter()

    def add(self, sample: Sample, nbytes: int = 0) -> None:
        self.count += 1
        self.bytes += nbytes
        self.kinds[sample.kind] += 1
        self.chat += sample.turns is not None
        self.images += len(sample.images)
        self.images_per_sample[str(len(sample.images))] += 1
        for data in sample.images:
            size = image_size(data)
            if size:
                self.image_pixels += size[0] * size[1]
                lo, hi = min(size), max(size)
                self.min_side = lo if self.min_side is None else min(self.min_side, lo)
                self.max_side = max(self.max_side, hi)
        self.text_bytes += len(sample.all_text().replace(IMAGE_TOKEN, "").encode("utf-8"))
        for qa in sample.meta.get("qa", []) if isinstance(sample.meta, dict) else []:
            self.qa[str(qa.get("type", "unknown"))] += 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "bytes": self.bytes,
            "kinds": dict(sorted(self.kinds.items())),
            "chat": self.chat,
            "images": self.images,
            "images_per_sample": dict(
                sorted(self.images_per_sample.items(), key=lambda kv: int(kv[0]))
            ),
            "image_pixels": self.image_pixels,
            "min_image_side": self.min_side,
            "max_image_side": self.max_side,
            "text_bytes": self.text_bytes,
            "qa_types": dict(sorted(self.qa.items())),
        }


def merge_stats(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum per-shard stat dicts into totals."""
    tot: dict[str, Any] = {
        "shards": len(entries),
        "count": 0,
        "bytes": 0,
        "kinds": Counter(),
        "chat": 0,
        "images": 0,
        "images_per_sample": Counter(),
        "image_pixels": 0,
        "min_image_side": None,
        "max_image_side": 0,
        "text_bytes": 0,
        "qa_types": Counter(),
    }
    for e in entries:
        for k in ("count", "bytes", "chat", "images", "image_pixels", "text_bytes"):
            tot[k] += e.get(k, 0)
        for k in ("kinds", "images_per_sample", "qa_types"):
            tot[k].update(e.get(k, {}))
        if e.get("min_image_side") is not None:
            lo = tot["min_image_side"]
            tot["min_image_side"] = (
                e["min_image_side"] if lo is None else min(lo, e["min_image_side"])
            )
        tot["max_image_side"] = max(tot["max_image_side"], e.get("max_image_side") or 0)
    for k in ("kinds", "images_per_sample", "qa_types"):
        tot[k] = dict(sorted(tot[k].items()))
    return tot


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"manifest {path} cannot be read: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("shards"), list):
        raise ValueError(f"manifest {path}: expected an object with a 'shards' list")
    return data


def write_atomic(path: Path, text: str) -> None:
    """`path` holds `text` or what it held before (a full disk leaves the old file and no `.tmp` beside it)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def update_manifest(
    directory: str | os.PathLike, entries: list[dict[str, Any]], drop: Any = ()
) -> Path:
    """Insert/replace `entries` (by shard name) in DIR/manifest.json, remove the entries
    named in `drop`, and recompute the totals; replaced in one step (a manifest left with no
    entry is removed)."""
    directory = Path(directory)
    old = read_manifest(directory) or {"shards": []}
    by_name = {e["name"]: e for e in old["shards"] if e.get("name") not in drop}
    by_name.update({e["name"]: e for e in entries})
    shards = [by_name[n] for n in sorted(by_name)]
    if not shards:
        (directory / MANIFEST).unlink(missing_ok=True)
        return directory / MANIFEST
    data = {"version": MANIFEST_VERSION, "shards": shards, "totals": merge_stats(shards)}
    write_atomic(directory / MANIFEST, json.dumps(data, indent=1))
    return directory / MANIFEST


class ShardWriter:
    """Write Samples into `DIR/{prefix}-{000000}.tar`, starting a new shard at `max_count` samples
    or `max_bytes` bytes, and record every shard in DIR/manifest.json on close."""

    def __init__(
        self,
        directory: str | os.PathLike,
        prefix: str = "shard",
        max_count: int = 10_000,
        max_bytes: int = 1 << 30,
        start_index: int = 0,
    ):
        if max_count < 1 or max_bytes < 1:
            raise ValueError(f"max_count and max_bytes must be >= 1, got {max_count}, {max_bytes}")
        if "." in prefix or "/" in prefix:
            raise ValueError(f"shard prefix {prefix!r} must hold no '.' or '/'")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.prefix, self.max_count, self.max_bytes = prefix, max_count, max_bytes
        self.index = start_index
        self.entries: list[dict[str, Any]] = []
        self._tar = None
        self._stats: ShardStats | None = None
        self._keys: set[str] = set()

    @property
    def shard_paths(self) -> list[Path]:
        return [self.dir / e["name"] for e in self.entries]

    def _open(self) -> None:
        name = f"{self.prefix}-{self.index:06d}.tar"
        self._name = name
        self._file = open(self.dir / name, "wb")
        self._tar = wds.TarWriter(
            self._file, encoder=False, mtime=0, user="vlm", group="vlm", mode=0o444
        )
        self._stats = ShardStats()
        self.index += 1

    def _finish(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        self._file.close()
        entry = {"name": self._name, **self._stats.to_dict()}
        entry["file_bytes"] = (self.dir / self._name).stat().st_size
        self.entries.append(entry)
        self._tar = None

    def write(self, sample: Sample) -> None:
        if sample.key in self._keys:
            raise ValueError(f"duplicate sample key {sample.key!r} in {self.dir}")
        self._keys.add(sample.key)
        members = encode_sample(sample)
        if self._tar is not None and (
            self._stats.count >= self.max_count or self._stats.bytes >= self.max_bytes
        ):
            self._finish()
        if self._tar is None:
            self._open()
        nbytes = self._tar.write(members)
        self._stats.add(sample, nbytes)

    def abort(self) -> None:
        """Drop the shard being written without writing anything more (after a failed write: a full
        disk) and delete its file; shards already finished are kept (not added to the manifest)."""
        if self._tar is None:
            return
        for stream in (self._tar.tarstream, getattr(self._tar.tarstream, "fileobj", None)):
            if stream is not None:
                # tarfile would otherwise write its end blocks (on close or when collected)
                stream.closed = True
        try:
            self._file.close()
        except OSError:
            pass
        (self.dir / self._name).unlink(missing_ok=True)
        self._tar = None

    def close(self) -> list[Path]:
        self._finish()
        if self.entries:
            update_manifest(self.dir, self.entries)
        return self.shard_paths

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
