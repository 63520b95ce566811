"""Importers into shards: a table or dataset as researchers hold it, and a folder of
images with captions.

- `import_table`: LLaVA/ShareGPT JSON arrays (streamed), JSONL, CSV/TSV, Parquet and Arrow files or
  folders (`datasets` `save_to_disk` / `to_parquet` output, the hub's parquet layout) with `Image`
  features; where rows come from is `import_sources`, how a row becomes a sample is `import_rows`.
- `import_folder`: images with sidecar captions (`name.txt`) or a captions table.

Both run through `import_run.run_import`: images decoded and checked in worker processes, a progress
bar, resumable and idempotent output, rows that cannot be used skipped and counted by reason, and a
summary (`ImportFailed` when nothing could be imported).
"""

from __future__ import annotations

import codecs
import hashlib
import os
from pathlib import Path
from typing import Any, Iterator

from data_pipelines.import_out import check_out
from data_pipelines.import_rows import (
    COLUMN_GUESSES,
    FileSettings,
    RowSettings,
    convert_file,
    convert_row,
    file_inputs,
    guess_column,
    row_inputs,
    shown_name,
)
from data_pipelines.import_run import run_import
from data_pipelines.import_sources import ImporterError, RowSource, open_source
from data_pipelines.import_summary import (
    DEFAULT_MAX_SKIP_SHARE,
    ImportFailed,
    ImportInterrupted,
    ImportWriteFailed,
    summary_lines,
)
from data_pipelines.schema import IMAGE_EXTS

__all__ = [
    "import_table",
    "import_folder",
    "read_table",
    "open_source",
    "ImporterError",
    "ImportFailed",
    "ImportInterrupted",
    "ImportWriteFailed",
    "summary_lines",
    "DEFAULT_MAX_SKIP_SHARE",
]


def read_table(
    path: str | os.PathLike, fmt: str | None = None, encoding: str = "utf-8"
) -> Iterator[dict[str, Any]]:
    """Rows of a table file or dataset folder as dicts (streamed; unparsable rows as {"__error__": ...})."""
    return open_source(path, fmt, encoding=encoding).rows()


def _check_columns(src: RowSource, given: dict[str, str | None]) -> dict[str, str | None]:
    """Named columns must exist and some text column must be found: checked on the first good row."""
    for row in src.rows():
        if "__error__" in row:
            continue
        for k, v in given.items():
            if v and v not in row:
                raise ImporterError(
                    f"table {src.path}: column {v!r} not found; columns: {sorted(map(str, row))}"
                )
        cols = {k: v or guess_column(row, k) for k, v in given.items()}
        if not (cols["text"] or cols["conversations"] or (cols["question"] and cols["answer"])):
            raise ImporterError(
                f"table {src.path}: no text column found among {sorted(map(str, row))}; name "
                "one with --text-col, --question-col/--answer-col or --conversations-col"
            )
        return cols
    return {k: v for k, v in given.items()}


def import_table(
    table: str | os.PathLike,
    out: str | os.PathLike,
    image_col: str | None = None,
    text_col: str | None = None,
    question_col: str | None = None,
    answer_col: str | None = None,
    type_col: str | None = None,
    conversations_col: str | None = None,
    image_root: str | os.PathLike | None = None,
    fmt: str | None = None,
    split: str | None = None,
    encoding: str = "utf-8",
    prefix: str = "shard",
    max_count: int = 10_000,
    max_bytes: int = 1 << 30,
    allow_outside_root: bool = False,
    workers: int = 0,
    progress: bool = False,
    max_skip_share: float = DEFAULT_MAX_SKIP_SHARE,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Rows -> shards; returns the summary (`written`, `skipped` by reason, `examples`, `shards`,
    `status`, ...).

    Image paths must lead (symlinks followed) into `image_root` or the table's folder (a dataset
    folder: the folder); others are skipped and counted (`outside_root`) unless
    `allow_outside_root`. Columns not named are guessed per row from common names
    (`import_rows.COLUMN_GUESSES`). Raises `ImportFailed` when nothing could be imported,
    `ImporterError` (one line) when the input cannot be read at all or `out` cannot be written
    (checked first), `ImportWriteFailed` when a write fails part way (a full disk)."""
    check_out(out)
    src = open_source(table, fmt, split=split, encoding=encoding)
    roots = ([Path(image_root)] if image_root else []) + [src.root]
    if image_root and not Path(image_root).is_dir():
        raise ImporterError(f"--image-root {image_root} does not exist or is not a folder")
    given = {
        "image": image_col,
        "text": text_col,
        "question": question_col,
        "answer": answer_col,
        "type": type_col,
        "conversations": conversations_col,
    }
    cols = _check_columns(src, given)
    settings = RowSettings(columns=given, roots=roots, confine=not allow_outside_root)
    summary = run_import(
        src.rows(),
        convert_row,
        settings,
        out=out,
        source=str(src.path),
        fmt=src.fmt,
        fingerprint=src.fingerprint(),
        prefix=prefix,
        max_count=max_count,
        max_bytes=max_bytes,
        workers=workers,
        progress=progress,
        total=src.total,
        unit="row",
        desc="import-table",
        max_skip_share=max_skip_share,
        overwrite=overwrite,
        inputs=lambda row: row_inputs(row, settings),
        extra={
            "columns": given,
            "roots": [str(r.resolve()) for r in roots],
            "split": split,
            "encoding": encoding,
            "confine": not allow_outside_root,
        },
    )
    summary["columns"] = cols
    return summary


def _caption_mapping(
    captions: str | os.PathLike, encoding: str
) -> tuple[dict[str, list[Any]], int]:
    """file name -> its captions in table order (a file listed several times, as COCO lists 5
    captions per image, gets one sample per caption), each a caption or (reason, detail) for a row
    that names its file but cannot be used (a caption not in `encoding`); and the number of rows
    that could not be read at all."""
    src = open_source(captions, encoding=encoding)
    mapping: dict[str, list[Any]] = {}
    fcol = tcol = None
    unread = 0
    for row in src.rows():
        data = row.get("__row__") if "__error__" in row else row
        if not isinstance(data, dict):
            unread += 1
            continue
        if fcol is None:
            fcol, tcol = guess_column(data, "image"), guess_column(data, "text")
            if fcol is None or tcol is None:
                need = (
                    [f"a file column ({', '.join(COLUMN_GUESSES['image'])})"]
                    if fcol is None
                    else []
                )
                need += (
                    [f"a caption column ({', '.join(COLUMN_GUESSES['text'])})"]
                    if tcol is None
                    else []
                )
                raise ImporterError(
                    f"captions {captions}: needs {' and '.join(need)}; "
                    f"its columns: {sorted(map(str, data))}"
                )
        if data.get(fcol) is not None and data.get(tcol) is not None:
            mapping.setdefault(str(data[fcol]), []).append(
                tuple(row["__error__"]) if "__error__" in row else str(data[tcol])
            )
    return mapping, unread


def _image_entries(root: Path, recursive: bool) -> list[str]:
    """Names with an image extension, relative to `root`, that are not folders: regular files, and
    also FIFOs, devices, sockets and broken links, which the import skips and counts instead of
    leaving out unseen."""
    return sorted(
        p.relative_to(root).as_posix()
        for p in (root.rglob("*") if recursive else root.iterdir())
        if p.suffix.lower().lstrip(".") in IMAGE_EXTS and not p.is_dir()
    )


def import_folder(
    images_dir: str | os.PathLike,
    out: str | os.PathLike,
    captions: str | os.PathLike | None = None,
    caption_exts: tuple[str, ...] = ("txt", "caption"),
    prefix: str = "shard",
    max_count: int = 10_000,
    max_bytes: int = 1 << 30,
    recursive: bool = True,
    allow_outside_root: bool = False,
    workers: int = 0,
    progress: bool = False,
    max_skip_share: float = DEFAULT_MAX_SKIP_SHARE,
    overwrite: bool = False,
    encoding: str = "utf-8",
) -> dict[str, Any]:
    """Images with captions (sidecar `name.txt`, or a JSONL/CSV/... `captions` table mapping file ->
    caption) -> image-caption pairs. A symlink that leads out of the folder is skipped and counted
    (`outside_root`) unless allow_outside_root; a FIFO, device or socket with an image's name is
    skipped and counted (`not_regular_file`) without being opened. `encoding`: of the sidecar files
    and the captions table. `progress`: a bar on a terminal, periodic lines in a redirected log."""
    check_out(out)
    root = Path(images_dir)
    if not root.is_dir():
        raise ImporterError(f"image folder {root} does not exist or is not a folder")
    try:
        utf8 = codecs.lookup(encoding).name == "utf-8"
    except LookupError:
        raise ImporterError(f"unknown text encoding {encoding!r} (--encoding)") from None
    mapping, unread = _caption_mapping(captions, encoding) if captions is not None else (None, 0)
    files = _image_entries(root, recursive)

    # each image with each of its captions (by the file's path in the folder, else its name)
    used: set[str] = set()
    pairs: list[tuple[str, Any]] = []
    for rel in files:
        if mapping is None:
            pairs.append((rel, None))
            continue
        name = rel if rel in mapping else rel.rsplit("/", 1)[-1]
        found = mapping.get(name)
        if found:
            used.add(name)
            pairs += [(rel, caption) for caption in found]
        elif unread:
            why = (
                f"{shown_name(rel)} is not in the captions table, {unread} of whose rows could "
                "not be read (another encoding? see --encoding)"
            )
            pairs.append((rel, ("missing_caption", why)))
        else:
            pairs.append((rel, False))  # not listed
    if mapping is not None:  # rows naming a file the folder does not hold are counted too
        pairs += [
            (
                name,
                (
                    "missing_image_file",
                    f"{shown_name(name)} is in the captions table, not in {root}",
                ),
            )
            for name, found in mapping.items()
            if name not in used
            for _ in found
        ]

    def items():
        yield from pairs

    fp = hashlib.sha256("\n".join(files).encode("utf-8", "surrogateescape")).hexdigest()
    if mapping is not None and len(pairs) != len(files):
        # the rows, not the files: an import made before each caption of a file became a sample
        # does not resume into this one
        fp = hashlib.sha256(f"{fp}\n{len(pairs)}".encode()).hexdigest()
    cap_fp = None
    if captions is not None:
        st = Path(captions).stat()
        cap_fp = [str(Path(captions).resolve()), st.st_size, st.st_mtime_ns]
    settings = FileSettings(
        root=root,
        caption_exts=tuple(caption_exts),
        confine=not allow_outside_root,
        encoding=encoding,
    )
    extra = {"caption_exts": list(caption_exts), "confine": not allow_outside_root}
    if not utf8:
        # only when given: imports made before --encoding existed still resume
        extra["encoding"] = encoding
    return run_import(
        items(),
        convert_file,
        settings,
        out=out,
        source=str(root),
        fmt="image folder",
        fingerprint=[fp, len(files), cap_fp],
        inputs=lambda item: file_inputs(item, settings),
        prefix=prefix,
        max_count=max_count,
        max_bytes=max_bytes,
        workers=workers,
        progress=progress,
        total=len(pairs),
        unit="image",
        desc="import-folder",
        max_skip_share=max_skip_share,
        overwrite=overwrite,
        extra=extra,
    )
