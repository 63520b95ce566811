"""Importers into shards: a folder of images with captions, and a JSONL/CSV/Parquet table.

Tables are read row by row with the standard library (CSV, JSONL); Parquet needs pyarrow. Columns are
found by common names unless given: images (paths relative to --image-root or the table's folder, bytes,
{"bytes", "path"} dicts as written by HF datasets, data: URIs, or a list of those), text/caption,
question/answer (+ question type), or LLaVA-style conversations ([{from|role, value|content}]).
Rows that cannot be used are skipped and counted by reason; the counts are returned and printed.
"""
from __future__ import annotations

import base64
import csv
import io
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from PIL import Image

from data_pipelines.schema import IMAGE_EXTS, IMAGE_TOKEN, Sample
from data_pipelines.progress import Progress
from data_pipelines.writer import ShardWriter

COLUMN_GUESSES = {
    "image": ("image", "images", "image_path", "image_paths", "img", "file_name", "filename", "file", "path", "jpg",
              "png"),
    "text": ("text", "caption", "captions", "txt", "content", "sentence"),
    "question": ("question", "query", "prompt", "instruction"),
    "answer": ("answer", "answers", "response", "output", "label"),
    "type": ("question_type", "type", "category"),
    "conversations": ("conversations", "messages", "turns", "conversation"),
}
_ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
             "model": "assistant"}


class ImporterError(ValueError):
    """A table or folder that cannot be imported at all; names the file and the problem."""


class _Skip(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _image_ext(data: bytes) -> str:
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt = (im.format or "").lower()
    except Exception:  # noqa: BLE001
        raise _Skip("unreadable_image") from None
    ext = {"jpeg": "jpg", "tiff": "tif"}.get(fmt, fmt)
    return ext if ext in IMAGE_EXTS else "png"


# ------------------------------------------------------------------------------------------------ folder
def import_folder(images_dir: str | os.PathLike, out: str | os.PathLike, captions: str | os.PathLike | None = None,
                  caption_exts: tuple[str, ...] = ("txt", "caption"), prefix: str = "shard", max_count: int = 10_000,
                  max_bytes: int = 1 << 30, recursive: bool = True, allow_outside_root: bool = False,
                  progress: bool = False) -> dict[str, Any]:
    """Images with captions (sidecar `name.txt`, or a JSONL/CSV `captions` file mapping file -> caption).
    A symlink that leads out of the folder is skipped and counted (`outside_root`) unless allow_outside_root.
    `progress`: a bar on a terminal, periodic lines in a redirected log."""
    root = Path(images_dir)
    if not root.is_dir():
        raise ImporterError(f"image folder {root} does not exist or is not a folder")
    mapping: dict[str, str] = {}
    if captions is not None:
        for row in read_table(captions):
            fcol = _guess(row, "image", None, captions)
            tcol = _guess(row, "text", None, captions)
            mapping[str(row[fcol])] = row[tcol]
    files = sorted(p for p in (root.rglob("*") if recursive else root.iterdir())
                   if p.is_file() and p.suffix.lower().lstrip(".") in IMAGE_EXTS)
    skipped: Counter = Counter()
    written = 0
    with ShardWriter(out, prefix, max_count=max_count, max_bytes=max_bytes) as w, \
            Progress(len(files), "import-folder", progress, unit="image") as bar:
        for i, path in enumerate(files):
            bar.update()
            rel = path.relative_to(root).as_posix()
            try:
                if not allow_outside_root and not _inside(path, [root]):
                    raise _Skip("outside_root")
                if captions is not None:
                    caption = mapping.get(rel, mapping.get(path.name))
                    if caption is None:
                        raise _Skip("missing_caption")
                else:
                    side = next((path.with_suffix("." + e) for e in caption_exts if path.with_suffix("." + e).is_file()),
                                None)
                    if side is None:
                        raise _Skip("missing_caption")
                    if not allow_outside_root and not _inside(side, [root]):
                        raise _Skip("outside_root")
                    try:
                        caption = side.read_bytes().decode("utf-8")
                    except UnicodeDecodeError:
                        raise _Skip("non_utf8_text") from None
                if not str(caption).strip():
                    raise _Skip("empty_text")
                data = path.read_bytes()
                ext = _image_ext(data)
                w.write(Sample(key=_key(rel, i), kind="pair", text=IMAGE_TOKEN + str(caption).strip(), images=[data],
                               image_exts=[ext], meta={"file": rel}))
                written += 1
            except _Skip as s:
                skipped[s.reason] += 1
    return {"written": written, "skipped": dict(skipped), "shards": [str(p) for p in w.shard_paths]}


def _key(name: str, index: int) -> str:
    return f"{index:08d}_" + re.sub(r"[^A-Za-z0-9_-]+", "_", name)[:80]


# ------------------------------------------------------------------------------------------------ tables
def read_table(path: str | os.PathLike, fmt: str | None = None) -> Iterator[dict[str, Any]]:
    """Rows of a .jsonl/.json (one object per line), .csv/.tsv or .parquet file as dicts."""
    path = Path(path)
    if not path.is_file():
        raise ImporterError(f"table {path} does not exist")
    fmt = fmt or {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv",
                  ".parquet": "parquet", ".pq": "parquet"}.get(path.suffix.lower())
    if fmt is None:
        raise ImporterError(f"table {path}: unknown format {path.suffix!r}; use .jsonl, .csv, .tsv or .parquet "
                           "(or --format)")
    if fmt == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImporterError(f"table {path}: reading Parquet needs pyarrow (pip install pyarrow); "
                               "CSV and JSONL work without it") from None
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
        return
    with open(path, encoding="utf-8", newline="") as f:
        if fmt in ("csv", "tsv"):
            csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
            yield from csv.DictReader(f, delimiter="," if fmt == "csv" else "\t")
            return
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    yield {"__error__": f"line {n}: invalid JSON ({e})"}
                    continue
                yield row if isinstance(row, dict) else {"__error__": f"line {n}: not a JSON object"}


def _guess(row: dict, what: str, given: str | None, table) -> str | None:
    if given:
        if given not in row:
            raise ImporterError(f"table {table}: column {given!r} not found; columns: {sorted(row)}")
        return given
    return next((c for c in COLUMN_GUESSES[what] if c in row), None)


def _inside(path: Path, roots: list[Path]) -> bool:
    """`path`, symlinks followed, lies under one of `roots` (a table's `../x` or `/etc/x` does not)."""
    real = path.resolve()
    return any(real.is_relative_to(r.resolve()) for r in roots)


def _load_image(value: Any, roots: list[Path], confine: bool = True) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, dict):  # HF datasets Image feature: {"bytes": ..., "path": ...}
        if value.get("bytes"):
            return _load_image(value["bytes"], roots, confine)
        return _load_image(value.get("path"), roots, confine)
    if isinstance(value, str) and value.startswith("data:"):
        try:
            return base64.b64decode(value.split(",", 1)[1], validate=True)
        except Exception:  # noqa: BLE001
            raise _Skip("bad_image_data") from None
    if isinstance(value, str) and value.strip():
        p = Path(value)
        for cand in ([p] if p.is_absolute() else [r / p for r in roots]):
            if cand.is_file():
                if confine and not _inside(cand, roots):
                    raise _Skip("outside_root")
                return cand.read_bytes()
        raise _Skip("missing_image_file")
    raise _Skip("missing_image")


def _image_list(value: Any) -> list:
    if value is None or value == "":
        return []
    if isinstance(value, str) and value.startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise _Skip("bad_image_list") from None
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _turns(conv: Any) -> list[dict]:
    if isinstance(conv, str):
        try:
            conv = json.loads(conv)
        except json.JSONDecodeError:
            raise _Skip("bad_conversations") from None
    if not isinstance(conv, list):
        raise _Skip("bad_conversations")
    turns = []
    for t in conv:
        if not isinstance(t, dict):
            raise _Skip("bad_conversations")
        role = _ROLE_MAP.get(str(t.get("role", t.get("from", ""))).lower())
        content = t.get("content", t.get("value"))
        if role is None or not isinstance(content, str):
            continue  # system prompts and unknown roles are dropped
        turns.append({"role": role, "content": content})
    if not any(t["role"] == "assistant" for t in turns):
        raise _Skip("bad_conversations")
    return turns


def _place_images(sample: Sample) -> None:
    """Rows rarely write placeholders: put missing ones in front of the (first user) text."""
    missing = len(sample.images) - sample.placeholder_count()
    if missing <= 0:
        return
    if sample.turns is not None:
        first = next(t for t in sample.turns if t["role"] == "user") if any(
            t["role"] == "user" for t in sample.turns) else sample.turns[0]
        first["content"] = IMAGE_TOKEN * missing + "\n" + first["content"]
    else:
        sample.text = IMAGE_TOKEN * missing + sample.text


def row_to_sample(row: dict, index: int, cols: dict[str, str | None], roots: list[Path], confine: bool = True
                  ) -> Sample:
    if "__error__" in row:
        raise _Skip("bad_row")
    images = [_load_image(v, roots, confine) for v in _image_list(row.get(cols["image"])) if cols["image"]]
    exts = [_image_ext(d) for d in images]
    meta: dict[str, Any] = {}
    turns, text = None, ""
    if cols["conversations"] and row.get(cols["conversations"]):
        turns = _turns(row[cols["conversations"]])
    elif cols["question"] and cols["answer"] and row.get(cols["question"]) not in (None, ""):
        q, a = str(row[cols["question"]]), row.get(cols["answer"])
        if isinstance(a, list):  # VQA-style answer lists: train on the first
            a = a[0] if a else ""
        if a is None or not str(a).strip():
            raise _Skip("empty_text")
        turns = [{"role": "user", "content": q}, {"role": "assistant", "content": str(a)}]
        qtype = str(row.get(cols["type"])) if cols["type"] and row.get(cols["type"]) is not None else "unknown"
        meta["qa"] = [{"question": q.replace(IMAGE_TOKEN, "").strip(), "answer": str(a), "type": qtype}]
    elif cols["text"] and row.get(cols["text"]) not in (None, ""):
        text = str(row[cols["text"]])
    else:
        raise _Skip("missing_text")
    if not (text.strip() or turns):
        raise _Skip("empty_text")
    kind = "text" if not images else "pair" if len(images) == 1 else "interleaved"
    sample = Sample(key=f"row{index:09d}", kind=kind, text=text, turns=turns, images=images, image_exts=exts,
                    meta=meta)
    _place_images(sample)
    if sample.placeholder_count() != len(images):
        raise _Skip("image_count_mismatch")
    return sample


def import_table(table: str | os.PathLike, out: str | os.PathLike, image_col: str | None = None,
                 text_col: str | None = None, question_col: str | None = None, answer_col: str | None = None,
                 type_col: str | None = None, conversations_col: str | None = None,
                 image_root: str | os.PathLike | None = None, fmt: str | None = None, prefix: str = "shard",
                 max_count: int = 10_000, max_bytes: int = 1 << 30, allow_outside_root: bool = False,
                 progress: bool = False) -> dict[str, Any]:
    """Rows -> shards. Image paths must lead (symlinks followed) into --image-root or the table's folder; others
    are skipped and counted (`outside_root`) unless allow_outside_root. `progress` as in import_folder (the
    number of rows is not known in advance)."""
    table = Path(table)
    roots = [Path(image_root)] if image_root else []
    roots.append(table.parent)
    given = {"image": image_col, "text": text_col, "question": question_col, "answer": answer_col,
             "type": type_col, "conversations": conversations_col}
    cols: dict[str, str | None] | None = None
    skipped: Counter = Counter()
    written = 0
    with ShardWriter(out, prefix, max_count=max_count, max_bytes=max_bytes) as w, \
            Progress(None, "import-table", progress, unit="row") as bar:
        for i, row in enumerate(read_table(table, fmt)):
            bar.update()
            if cols is None and "__error__" not in row:  # named columns must exist; check names on the first row
                cols = {k: _guess(row, k, v, table) for k, v in given.items()}
                if not (cols["text"] or cols["conversations"] or (cols["question"] and cols["answer"])):
                    raise ImporterError(f"table {table}: no text column found among {sorted(row)}; name one with "
                                        "--text-col, --question-col/--answer-col or --conversations-col")
            # JSONL rows may differ in their fields: unnamed columns are guessed row by row
            row_cols = {k: v or _guess(row, k, None, table) for k, v in given.items()}
            try:
                w.write(row_to_sample(row, i, row_cols, roots, confine=not allow_outside_root))
                written += 1
            except _Skip as s:
                skipped[s.reason] += 1
    return {"written": written, "skipped": dict(skipped), "columns": cols,
            "shards": [str(p) for p in w.shard_paths]}
