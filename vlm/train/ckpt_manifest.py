"""Which rank checks which bytes of a checkpoint: each rank hashes the files it writes, as it writes
them, and a resume on any number of ranks verifies them in parallel.

A save records, for every file, its SHA-256 and the rank that wrote it (meta.json's `files` and
`writers`); no rank reads back another rank's bytes, so the cost per rank of hashing is its own
share, not the checkpoint. A resume on M ranks gives writer w's files to rank w mod M
(`share_of`), and a checkpoint written before writers were recorded is dealt out file by file;
each rank reads and hashes only its share, and the ranks compare their verdicts
(vlm.train.ckpt_resume).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import torch

from vlm.train.ckpt_layout import DamagedMeta, read_meta


class HashingFile:
    """A binary file that hashes what is written to it, in order. `digest()` is None where the
    writer seeked (the hash of the bytes in order is then not the file's: read it back)."""

    def __init__(self, fh):
        self.fh, self.sha = fh, hashlib.sha256()
        self.pos, self.sequential, self.hash_s = 0, True, 0.0

    def write(self, data) -> int:
        n = self.fh.write(data)
        t = time.perf_counter()
        self.sha.update(memoryview(data)[:n] if n is not None else data)
        self.hash_s += time.perf_counter() - t
        self.pos += n if n is not None else len(data)
        return n

    def seek(self, *args):
        self.sequential = False
        return self.fh.seek(*args)

    def digest(self) -> str | None:
        return self.sha.hexdigest() if self.sequential and self.fh.tell() == self.pos else None

    def __getattr__(self, name):  # tell, flush, fileno, ...: the real file's
        return getattr(self.fh, name)


def sha256_of(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def write_hashed(save, obj, path: Path) -> tuple[str, float]:
    """`save(obj, file)` into `path`, fsynced; (its SHA-256, seconds spent hashing), hashed as it
    was written (read back only where the writer seeked)."""
    with open(path, "wb") as raw:
        fh = HashingFile(raw)
        save(obj, fh)
        fh.flush()
        os.fsync(raw.fileno())
        digest = fh.digest()
    if digest is None:
        t = time.perf_counter()
        digest = sha256_of(path)
        return digest, fh.hash_s + time.perf_counter() - t
    return digest, fh.hash_s


def host_copy(obj, memo: dict | None = None):
    """`obj` (a state dict: tensors in plain containers) with every tensor copied to host memory:
    what a background writer may write while the next steps change the originals. A tensor that
    appears twice is copied once (a tied weight stays tied)."""
    memo = {} if memo is None else memo
    if torch.is_tensor(obj):
        if id(obj) not in memo:
            memo[id(obj)] = obj.detach().to("cpu", copy=True)
        return memo[id(obj)]
    if isinstance(obj, dict):
        return type(obj)((k, host_copy(v, memo)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(host_copy(v, memo) for v in obj)
    return obj  # numbers, strings, and the engine's settings: not changed by a step


def share_of(files: dict[str, str], writers: dict[str, int], rank: int, world: int) -> list[str]:
    """The files rank `rank` of `world` verifies: those its writer-rank maps to (w mod world); a
    file with no recorded writer goes by its place in the sorted list."""
    names = sorted(files)
    return [rel for i, rel in enumerate(names) if writers.get(rel, i) % world == rank]


def damaged_share(
    ckpt: Path, rank: int = 0, world: int = 1, need: tuple[str, ...] = ()
) -> str | None:
    """The first file of rank `rank`'s share (of `world`) of `ckpt` that is missing or differs from
    its checksum, or a meta.json that no save wrote (every rank reads it: it is small); None:
    intact, or written before checksums were recorded. With the defaults: the whole checkpoint."""
    try:
        meta = read_meta(ckpt, need)
    except DamagedMeta as e:
        return f"meta.json ({e})"
    files = meta.get("files")
    if files is None:
        return None
    for rel in share_of(files, meta.get("writers") or {}, rank, world):
        path = ckpt / rel
        if not path.is_file():
            return f"{rel} (missing)"
        if sha256_of(path) != files[rel]:
            return f"{rel} (checksum mismatch)"
    return None


def damaged_file(ckpt: Path, need: tuple[str, ...] = ()) -> str | None:
    """The first damaged file of the whole of `ckpt` (`damaged_share` of one rank)."""
    return damaged_share(ckpt, 0, 1, need)
