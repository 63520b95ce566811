"""Shard writer (webdataset TarWriter underneath) with size/count rollover and a manifest of counts.

Tar headers get a fixed mtime/owner so the same samples always give the same bytes. On `close()` the
writer merges its shards' entries into `manifest.json` in the output folder (data_pipelines.manifest);
the loader takes per-shard sample counts from there and `vlm data stats` prints the modality
statistics. Each finished shard gets its loader index (`.vlm-index/NAME.samples.idx`,
data_pipelines.index), so that the loader plans without reading it.
"""

from __future__ import annotations

import io
import os
from collections import Counter
from pathlib import Path
from typing import Any

import webdataset as wds
from PIL import Image

from data_pipelines.index_layers import write_samples_index
from data_pipelines.manifest import (  # noqa: F401 - where the importers and tools found them
    MANIFEST,
    MANIFEST_VERSION,
    merge_stats,
    read_manifest,
    update_manifest,
    write_atomic,
)
from data_pipelines.schema import IMAGE_TOKEN, Sample, encode_sample


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
        # the loader plans from it without reading the shard (data_pipelines.index)
        write_samples_index(self.dir / self._name)

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
