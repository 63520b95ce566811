"""The loader index's file format: a small binary file of named one-dimensional arrays under a JSON
header, read array by array (a reader seeks to the arrays it needs and reads nothing else).

    b"VLMINDEX"                  8 bytes, the magic
    header length                4 bytes, little-endian unsigned
    header                       UTF-8 JSON object: what the writer put in it, plus
                                 "arrays": {name: [numpy dtype string, length, offset]}
    arrays                       each at its offset from the end of the header, little-endian

Nothing is unpickled: numbers are read with numpy.frombuffer from the dtypes the header names,
and only fixed-size numeric dtypes are accepted. Writes go to a temporary file in the same folder,
then replace the target in one step: a reader sees the old file or the new one, never a part.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from collections import Counter
from pathlib import Path

import numpy as np

MAGIC = b"VLMINDEX"
_LEN = struct.Struct("<I")
_DTYPES = {"<i1", "<i2", "<i4", "<i8", "|i1", "|u1", "<u1", "<u4", "<u8"}
_FIRST_READ = 4096  # the header usually fits: one read


class IndexFileError(ValueError):
    """An index file that cannot be used (not one, cut short, another version): it is rebuilt."""


def write_index(path: Path, header: dict, arrays: dict[str, np.ndarray]) -> None:
    """Write `path` atomically; raises OSError when it cannot be written."""
    layout, offset, blobs = {}, 0, []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        a = a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a
        layout[name] = [a.dtype.str, int(a.shape[0]), offset]
        blobs.append(a.tobytes())
        offset += len(blobs[-1])
    head = json.dumps({**header, "arrays": layout}, separators=(",", ":")).encode()
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + _LEN.pack(len(head)) + head)
            for b in blobs:
                f.write(b)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class IndexFile:
    """An index file opened for reading: `header`, then `array(name)` one by one; the bytes read are
    added to `io["index_bytes"]`. Raises IndexFileError for a file that is not a whole index
    file, OSError when it cannot be read."""

    def __init__(self, path: Path, io: Counter | None = None):
        self.path, self.io = path, io
        self.f = open(path, "rb")
        try:
            head = self._read(_FIRST_READ)
            if head[:8] != MAGIC or len(head) < 12:
                raise IndexFileError(f"{path} is not a loader index file")
            (n,) = _LEN.unpack(head[8:12])
            if len(head) < 12 + n:
                head += self._read(12 + n - len(head))
            try:
                self.header = json.loads(head[12 : 12 + n])
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise IndexFileError(f"{path}: its header cannot be read ({e})") from None
            if not isinstance(self.header, dict) or not isinstance(self.header.get("arrays"), dict):
                raise IndexFileError(f"{path}: its header is not an index header")
            self.data_start = 12 + n
        except BaseException:
            self.f.close()
            raise

    def _read(self, n: int) -> bytes:
        data = self.f.read(n)
        if self.io is not None:
            self.io["index_bytes"] += len(data)
        return data

    def array(self, name: str) -> np.ndarray:
        try:
            dtype, length, offset = self.header["arrays"][name]
            if dtype not in _DTYPES:
                raise IndexFileError(f"{self.path}: array {name} has dtype {dtype!r}")
            size = np.dtype(dtype).itemsize * int(length)
        except (KeyError, TypeError, ValueError) as e:
            raise IndexFileError(f"{self.path}: no usable array {name} ({e})") from None
        self.f.seek(self.data_start + int(offset))
        data = self._read(size)
        if len(data) != size:
            raise IndexFileError(f"{self.path}: cut short in array {name}")
        return np.frombuffer(data, dtype=dtype)

    def close(self) -> None:
        self.f.close()

    def __enter__(self) -> "IndexFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pack_strings(values: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Strings as (their UTF-8 bytes joined, the end offset of each)."""
    data = [v.encode("utf-8", "surrogateescape") for v in values]
    ends = np.cumsum([len(d) for d in data], dtype=np.int64)
    return np.frombuffer(b"".join(data), dtype=np.uint8), ends


def unpack_strings(blob: np.ndarray, ends: np.ndarray) -> list[str]:
    raw, out, a = blob.tobytes(), [], 0
    for b in ends.tolist():
        out.append(raw[a:b].decode("utf-8", "surrogateescape"))
        a = b
    return out
