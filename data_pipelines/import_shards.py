"""The shards one import writes (data_pipelines.import_run): each written into
`OUT/.PREFIX.partial/` and moved into OUT when full, listed in the manifest, followed by a state
save; and removing an import's shards from a given one on (a resume drops what no state records).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Callable

from data_pipelines.import_out import writing
from data_pipelines.index_layers import drop_index, move_index
from data_pipelines.schema import Sample
from data_pipelines.writer import ShardWriter, read_manifest, update_manifest


def shard_index(name: str, prefix: str) -> int | None:
    stem = (
        name[len(prefix) + 1 : -len(".tar")]
        if name.startswith(prefix + "-") and name.endswith(".tar")
        else ""
    )
    return int(stem) if stem.isdigit() else None


def remove_shards(out: Path, prefix: str, first: int) -> None:
    """Delete PREFIX-NNNNNN.tar with NNNNNN >= first and their manifest entries."""
    gone = set()
    for p in out.glob(f"{prefix}-*.tar"):
        i = shard_index(p.name, prefix)
        if i is not None and i >= first:
            p.unlink()
            gone.add(p.name)
    drop_index(out, gone)
    m = read_manifest(out)
    if m is None:
        return
    drop = {
        e.get("name")
        for e in m["shards"]
        if e.get("name") in gone
        or ((i := shard_index(str(e.get("name")), prefix)) is not None and i >= first)
    }
    if drop:
        update_manifest(out, [], drop=drop)


class ImportShards:
    """Shards of one import: full ones moved from the partial folder into OUT, each followed by a state save."""

    def __init__(
        self, out: Path, prefix: str, max_count: int, max_bytes: int, start: int, save: Callable
    ):
        self.out, self.prefix, self.max_count, self.max_bytes = out, prefix, max_count, max_bytes
        self.tmp = out / f".{prefix}.partial"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.index, self.save = start, save
        self.writer: ShardWriter | None = None
        self.count = self.bytes = 0
        self.names: list[str] = []

    def _path(self) -> Path:
        return self.tmp / f"{self.prefix}-{self.index:06d}.tar"

    def write(self, sample: Sample, row: int) -> None:
        if self.writer is not None and (
            self.count >= self.max_count or self.bytes >= self.max_bytes
        ):
            self.finish(next_row=row)
        with writing(self._path()):
            if self.writer is None:
                self.tmp.mkdir(parents=True, exist_ok=True)
                self.writer = ShardWriter(
                    self.tmp,
                    self.prefix,
                    max_count=sys.maxsize,
                    max_bytes=sys.maxsize,
                    start_index=self.index,
                )
                self.count = self.bytes = 0
            self.writer.write(sample)
        self.count += 1
        self.bytes += sum(len(d) for d in sample.images) + len(
            sample.all_text().encode("utf-8", "replace")
        )

    def finish(self, next_row: int) -> None:
        if self.writer is not None:
            with writing(self._path()):
                self.writer.close()
            entry = self.writer.entries[0]
            with writing(self.out / entry["name"]):
                os.replace(self.tmp / entry["name"], self.out / entry["name"])
                move_index(self.tmp, self.out, entry["name"])
            with writing(self.out / "manifest.json"):
                update_manifest(self.out, [entry])
            self.names.append(entry["name"])
            self.writer = None
            self.index += 1
        self.save(next_row)

    def discard(self) -> None:
        """Drop the shard being written (after an interruption): the same command rewrites it."""
        if self.writer is not None:
            self.writer.abort()
            self.writer = None
        shutil.rmtree(self.tmp, ignore_errors=True)
