"""Where an import's rows come from: one file or a folder, in the format it was written
in, read streaming.

| input | read with |
|---|---|
| `.json` holding one array (LLaVA, ShareGPT4V; one line or pretty-printed) | ijson, one item at a time |
| `.json` / `.jsonl` / `.ndjson` with one object per line | line by line |
| `.csv` / `.tsv` | the csv module |
| `.parquet`, or a folder of them (`Dataset.to_parquet`, the hub's `data/train-*.parquet`) | pyarrow, in small batches |
| `.arrow`, or a `Dataset.save_to_disk` folder (`state.json`; `dataset_dict.json` + splits) | pyarrow IPC, mmap |

Nothing is read whole into memory. A row that cannot be parsed comes as `{"__error__": (reason,
detail)}` and is skipped and counted by the importer (a row in another text encoding also carries
`"__row__"`: its values with the undecodable bytes as surrogates, so that a captions table can say
which file it was for); a file that cannot be read at all raises `ImporterError` naming it. A JSON
object that writes a key twice, at any depth, is such a row (`duplicate_key`: a reader would keep
one of the two values), and a CSV header that names a column twice stops the import.
"""

from __future__ import annotations

import codecs
import csv
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

FORMATS = ("json", "jsonl", "csv", "tsv", "parquet", "arrow")
_SUFFIX_FORMAT = {
    ".json": "json",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
    ".tsv": "tsv",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
}
_SPLIT_NAMES = ("train", "validation", "val", "dev", "test")
_METADATA_FILES = ("dataset_info.json", "state.json", "dataset_dict.json", "manifest.json")
# rows per pyarrow batch turned into Python objects (rows may carry image bytes)
_BATCH_ROWS = 64


class ImporterError(ValueError):
    """A table or folder that cannot be imported at all; names the file and the problem (one line)."""


@dataclass
class RowSource:
    """The rows of one input (a file, or the files of a dataset folder), in order. `root` is the
    folder that relative image paths start from when no --image-root is given."""

    path: Path
    fmt: str
    files: list[Path]
    root: Path
    encoding: str = "utf-8"
    total: int | None = None  # rows, when the format says so without reading them
    notes: list[str] = field(default_factory=list)

    def rows(self) -> Iterator[dict[str, Any]]:
        reader = {
            "json": _json_rows,
            "jsonl": _jsonl_rows,
            "csv": _csv_rows,
            "tsv": _csv_rows,
            "parquet": _parquet_rows,
            "arrow": _arrow_rows,
        }[self.fmt]
        for f in self.files:
            yield from reader(f, self)

    def fingerprint(self) -> list:
        """What identifies this input for resuming: each file's name, size and modification time."""
        out = []
        for f in self.files:
            st = f.stat()
            out.append(
                [
                    f.relative_to(self.root).as_posix() if f.is_relative_to(self.root) else str(f),
                    st.st_size,
                    st.st_mtime_ns,
                ]
            )
        return out


def open_source(
    path: str | os.PathLike,
    fmt: str | None = None,
    split: str | None = None,
    encoding: str = "utf-8",
) -> RowSource:
    """The input at `path` (file or folder) as a RowSource; `fmt` overrides what the name says."""
    path = Path(path)
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise ImporterError(f"table {path}: unknown text encoding {encoding!r}") from None
    if fmt is not None and fmt not in FORMATS:
        raise ImporterError(f"table {path}: format {fmt!r} not one of {', '.join(FORMATS)}")
    if path.is_dir():
        return _folder_source(path, fmt, split, encoding)
    if not path.is_file():
        raise ImporterError(f"table {path} does not exist")
    fmt = fmt or _SUFFIX_FORMAT.get(path.suffix.lower())
    if fmt is None:
        raise ImporterError(
            f"table {path}: unknown format {path.suffix!r}; use .json, .jsonl, "
            ".csv, .tsv, .parquet or .arrow (or --format), or a dataset folder"
        )
    src = RowSource(path, fmt, [path], path.parent, encoding)
    if fmt == "json":
        src.fmt = _sniff_json(path)
    _count_rows(src)
    return src


def _folder_source(path: Path, fmt: str | None, split: str | None, encoding: str) -> RowSource:
    # DatasetDict.save_to_disk: one folder per split
    if (path / "dataset_dict.json").is_file():
        splits = _json_field(path / "dataset_dict.json", "splits")
        if split is None and len(splits) != 1:
            raise ImporterError(
                f"dataset folder {path} holds the splits {splits}: choose one with --split"
            )
        split = split or splits[0]
        if split not in splits:
            raise ImporterError(f"dataset folder {path}: split {split!r} not one of {splits}")
        path, split = path / split, None
    if (path / "state.json").is_file():  # Dataset.save_to_disk
        names = [
            d.get("filename")
            for d in _json_field(path / "state.json", "_data_files")
            if isinstance(d, dict)
        ]
        files = [path / n for n in names if isinstance(n, str) and "/" not in n and ".." not in n]
        missing = [f.name for f in files if not f.is_file()]
        if missing or not files:
            raise ImporterError(
                f"dataset folder {path}: state.json lists data "
                f"files that are not there: {missing or names}"
            )
        src = RowSource(path, "arrow", files, path, encoding)
        _count_rows(src)
        return src
    if any(path.glob("*.tar")):
        raise ImporterError(
            f"folder {path} holds webdataset shards (.tar; img2dataset writes its .parquet metadata "
            "beside them): give the folder as a data source as it is, or to `vlm data stats`"
        )
    files = sorted(
        f
        for f in path.rglob("*")
        if f.is_file()
        and not f.name.startswith(".")
        and f.suffix.lower() in _SUFFIX_FORMAT
        and f.name not in _METADATA_FILES
    )
    if fmt:
        files = [
            f
            for f in files
            if _SUFFIX_FORMAT[f.suffix.lower()] in (fmt, "json" if fmt == "jsonl" else fmt)
        ]
    elif any(_SUFFIX_FORMAT[f.suffix.lower()] in ("parquet", "arrow") for f in files):
        # JSON beside: metadata
        files = [f for f in files if _SUFFIX_FORMAT[f.suffix.lower()] in ("parquet", "arrow")]
    if split is not None:
        word = re.compile(rf"(^|[/_.-]){re.escape(split)}([/_.-]|$)")
        files = [f for f in files if word.search(f.relative_to(path).as_posix())]
    if not files:
        raise ImporterError(
            f"folder {path} holds no {'/'.join(sorted(set(_SUFFIX_FORMAT)))} files"
            + (f" of split {split!r}" if split else "")
        )
    fmts = sorted({_SUFFIX_FORMAT[f.suffix.lower()] for f in files})
    if len(fmts) > 1:
        raise ImporterError(
            f"folder {path} mixes formats {fmts}: import one kind (--format) or one file at a time"
        )
    if split is None:
        seen = sorted(
            {
                s
                for f in files
                for s in _SPLIT_NAMES
                if re.search(rf"(^|[/_.-]){s}([/_.-]|$)", f.relative_to(path).as_posix())
            }
        )
        if len(seen) > 1:
            raise ImporterError(
                f"folder {path} holds files of the splits {seen}: choose one with --split"
            )
    src = RowSource(path, fmts[0], files, path, encoding)
    if src.fmt == "json":
        kinds = {_sniff_json(f) for f in files}
        if len(kinds) > 1:
            raise ImporterError(f"folder {path} mixes JSON arrays and JSON lines files")
        src.fmt = kinds.pop()
    _count_rows(src)
    return src


def _json_field(path: Path, key: str) -> Any:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))[key]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ImporterError(f"{path}: cannot read {key!r} ({type(e).__name__}: {e})") from None
    if not isinstance(value, list):
        raise ImporterError(f"{path}: {key!r} is not a list")
    return value


def _sniff_json(path: Path) -> str:
    """`json` (one array, read with ijson) or `jsonl` (one object per line), from the first non-blank byte."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        while not head:
            chunk = f.read(1 << 16)
            if not chunk:
                return "jsonl"  # empty: no rows
            head = chunk.lstrip(b" \t\r\n")
    if head[:1] == b"{" and head.split(b"\n", 1)[0].strip() == b"{":
        raise ImporterError(
            f"table {path}: one pretty-printed JSON object, not an array of "
            f"rows ([{{...}}, ...]) nor JSON lines (one object per line)"
        )
    return "json" if head[:1] == b"[" else "jsonl"


def _count_rows(src: RowSource) -> None:
    try:
        if src.fmt == "parquet":
            import pyarrow.parquet as pq

            src.total = sum(pq.ParquetFile(f).metadata.num_rows for f in src.files)
        elif src.fmt == "arrow":
            src.total = sum(b.num_rows for f in src.files for b in _arrow_batches(f))
    except ImportError:
        raise ImporterError(
            f"table {src.path}: reading {src.fmt} needs pyarrow (pip "
            "install pyarrow); JSON, JSONL and CSV work without it"
        ) from None
    except ImporterError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
        raise ImporterError(
            f"table {src.path}: not a readable {src.fmt} file ({type(e).__name__}: {_one_line(e)})"
        ) from None


def _one_line(e: BaseException | str) -> str:
    return " ".join(str(e).split())[:300]


# ------------------------------------------------------------------------------------------------
# readers
class DuplicateKey(ValueError):
    """A JSON object that writes one key twice."""


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict:
    """json's object_pairs_hook: an object, unless a key comes twice."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKey(k)
        out[k] = v
    return out


class _SeenKeys(dict):
    """ijson's mapping type: a dict that remembers the keys written twice in it (ijson itself keeps
    the last value silently)."""

    twice: list[str] | None = None

    def __setitem__(self, key, value) -> None:
        if key in self:
            self.twice = [*(self.twice or []), key]
        super().__setitem__(key, value)


def _twice(value: Any) -> str | None:
    """The first key written twice in an object anywhere inside `value` (ijson items)."""
    if isinstance(value, _SeenKeys) and value.twice:
        return value.twice[0]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((k for v in items if (k := _twice(v)) is not None), None)


def _plain(value: Any) -> Any:
    """ijson's mappings as plain dicts (what the workers receive)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _duplicate(where: str, key: str) -> dict:
    return {
        "__error__": (
            "duplicate_key",
            (
                f"{where}: key {key!r} is written twice in one object (a reader keeps one of "
                "the two values: fix the row)"
            ),
        )
    }


def _json_rows(path: Path, src: RowSource) -> Iterator[dict]:
    import ijson

    n = 0
    with open(path, "rb") as f:
        try:
            for item in ijson.items(f, "item", use_float=True, map_type=_SeenKeys):
                if (key := _twice(item)) is not None:
                    yield _duplicate(f"{path.name} item {n}", key)
                elif isinstance(item, dict):
                    yield _plain(item)
                else:
                    yield {
                        "__error__": (
                            "bad_row",
                            f"item {n} is a {type(item).__name__}, not an object",
                        )
                    }
                n += 1
        except ijson.JSONError as e:
            raise ImporterError(
                f"table {path}: invalid JSON after item {n} ({_one_line(e)})"
            ) from None


def _jsonl_rows(path: Path, src: RowSource) -> Iterator[dict]:
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = line.decode(src.encoding)
            except UnicodeDecodeError as e:
                bad = {
                    "__error__": (
                        "non_utf8_text",
                        (
                            f"{path.name} line {n}: not valid {src.encoding} ({e.reason} "
                            f"at byte {e.start}; another encoding? see --encoding)"
                        ),
                    )
                }
                try:
                    row = json.loads(line.decode(src.encoding, "surrogateescape"))
                except (ValueError, RecursionError, LookupError):
                    row = None
                yield {**bad, "__row__": row} if isinstance(row, dict) else bad
                continue
            try:
                row = json.loads(text, object_pairs_hook=_unique_pairs)
            except DuplicateKey as e:
                yield _duplicate(f"{path.name} line {n}", str(e))
                continue
            except (ValueError, RecursionError) as e:
                yield {
                    "__error__": ("bad_row", f"{path.name} line {n}: invalid JSON ({_one_line(e)})")
                }
                continue
            yield (
                row
                if isinstance(row, dict)
                else {"__error__": ("bad_row", f"{path.name} line {n}: not a JSON object")}
            )


def _csv_rows(path: Path, src: RowSource) -> Iterator[dict]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    enc = (
        "utf-8-sig" if src.encoding.lower().replace("_", "-") in ("utf-8", "utf8") else src.encoding
    )
    with open(path, encoding=enc, errors="surrogateescape", newline="") as f:
        reader = csv.DictReader(f, delimiter="," if src.fmt == "csv" else "\t")
        try:
            header = reader.fieldnames or []
        except csv.Error as e:
            raise ImporterError(f"table {path}: line 1: {_one_line(e)}") from None
        twice = sorted({c for c in header if header.count(c) > 1})
        if twice:
            cols = [i + 1 for i, c in enumerate(header) if c == twice[0]]
            raise ImporterError(
                f"table {path}: column {twice[0]!r} is named twice in the header (columns "
                f"{' and '.join(map(str, cols))}); a reader keeps one of them: rename one"
            )
        try:
            for row in reader:
                try:
                    for v in row.values():
                        if isinstance(v, str):
                            v.encode("utf-8")
                except UnicodeEncodeError:
                    yield {
                        "__error__": (
                            "non_utf8_text",
                            (
                                f"{path.name} line {reader.line_num}: not valid "
                                f"{src.encoding} (another encoding? see --encoding)"
                            ),
                        ),
                        "__row__": row,
                    }
                    continue
                yield row
        except csv.Error as e:
            raise ImporterError(f"table {path}: line {reader.line_num}: {_one_line(e)}") from None


def _parquet_rows(path: Path, src: RowSource) -> Iterator[dict]:
    import pyarrow.parquet as pq

    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=_BATCH_ROWS):
            yield from batch.to_pylist()
    except Exception as e:  # noqa: BLE001 - a corrupt page or row group
        raise ImporterError(
            f"table {path}: cannot read on ({type(e).__name__}: {_one_line(e)})"
        ) from None


def _arrow_batches(path: Path):
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_stream(source)  # what datasets writes
        yield from reader
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(source)
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)


def _arrow_rows(path: Path, src: RowSource) -> Iterator[dict]:
    try:
        for batch in _arrow_batches(path):
            for start in range(0, batch.num_rows, _BATCH_ROWS):
                yield from batch.slice(start, _BATCH_ROWS).to_pylist()
    except Exception as e:  # noqa: BLE001
        raise ImporterError(
            f"table {path}: cannot read on ({type(e).__name__}: {_one_line(e)})"
        ) from None
