"""One imported row (or image file) -> one Sample, or a `Skip(reason, detail)`.

Runs in the import's worker processes, so it imports only the schema and Pillow. Columns are found
by common names unless given. What a row may hold:

- images: a path (relative to --image-root or the table's folder; never outside them unless
  allowed), bytes, a `{"bytes", "path"}` struct (datasets' `Image` feature), a `data:` URI, or a
  list of those (multi-image);
- text: a caption or document (`text`, `caption`, ...), a question/answer pair, or a
  conversation: LLaVA/ShareGPT `[{"from": "human"|"gpt", "value"}]`, OpenAI-style `[{"role",
  "content"}]` (content a string or a list of `{"type": "text"|"image"}` parts), the Cauldron's
  `texts: [{"user", "assistant"}]`;
- interleaved documents as OBELICS writes them: `texts` and `images` lists of the same length, each
  position holding either a text or an image (`None` in the other list).

Every image is decoded once here (a truncated file fails only when decoded), so a corrupt image is
skipped and counted instead of reaching training. Rows rarely write `<image>` placeholders: missing
ones go in front.
"""

from __future__ import annotations

import base64
import io
import os
import re
import signal
import stat
import sys
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from PIL import Image

from data_pipelines.schema import IMAGE_EXTS, IMAGE_TOKEN, Sample, kind_for

COLUMN_GUESSES = {
    "image": (
        "image",
        "images",
        "image_path",
        "image_paths",
        "img",
        "file_name",
        "filename",
        "file",
        "path",
        "jpg",
        "png",
    ),
    "text": ("text", "caption", "captions", "txt", "content", "sentence"),
    "question": ("question", "query", "prompt", "instruction"),
    "answer": ("answer", "answers", "response", "output", "label"),
    "type": ("question_type", "type", "category"),
    "conversations": ("conversations", "messages", "turns", "conversation", "texts"),
}
ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "bot": "assistant",
    "model": "assistant",
}
_ID_FIELDS = ("id", "sample_id", "uid", "key")
# as the loader's default processor.max_pixels: larger images would be skipped there
MAX_PIXELS = 50_000_000


class Skip(Exception):
    """A row that cannot become a sample: `reason` (a counter name) and a one-line `detail`."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


@dataclass
class RowSettings:
    """What every worker needs to convert rows: the given column names and where images may be read."""

    columns: dict[str, str | None] = field(default_factory=dict)
    roots: list[Path] = field(default_factory=list)
    confine: bool = True


@dataclass
class FileSettings:
    """Image-folder import: the folder, the caption sidecar extensions."""

    root: Path
    caption_exts: tuple[str, ...] = ("txt", "caption")
    confine: bool = True
    encoding: str = "utf-8"


def guess_column(row: dict, what: str) -> str | None:
    return next((c for c in COLUMN_GUESSES[what] if c in row), None)


def row_id(row: Any) -> str | None:
    if isinstance(row, dict):
        for k in _ID_FIELDS:
            if isinstance(row.get(k), (str, int)) and not isinstance(row.get(k), bool):
                return str(row[k])[:100]
    return None


# ------------------------------------------------------------------------------------------------
# images
def check_image(data: bytes) -> str:
    """Decode the image (all of it: a truncated file fails only here); its file extension."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                fmt = (im.format or "").lower()
                # from the header, before anything is decoded
                if im.width * im.height > MAX_PIXELS:
                    raise Skip(
                        "image_too_large", f"{im.width}x{im.height} pixels exceeds {MAX_PIXELS}"
                    )
                # decode at 1/8 scale: every coefficient is still read (a cut file fails)
                if fmt == "jpeg":
                    im.draft(im.mode, (max(1, im.width // 8), max(1, im.height // 8)))
                im.load()
    except Skip:
        raise
    except Image.DecompressionBombError as e:
        raise Skip("image_too_large", str(e)) from None
    except Exception as e:  # noqa: BLE001 - Pillow raises many kinds for bad bytes
        raise Skip(
            "corrupt_image", f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        ) from None
    ext = {"jpeg": "jpg", "tiff": "tif"}.get(fmt, fmt)
    return ext if ext in IMAGE_EXTS else "png"


_FILE_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
)


def _not_regular(mode: int, what: str) -> Skip:
    kind = next((k for test, k in _FILE_KINDS if test(mode)), "a special file")
    return Skip("not_regular_file", f"{what} is {kind}, not a regular file")


def check_regular(path: Path, what: str) -> None:
    """Skip (`not_regular_file`) a FIFO, device or socket, from its stat alone: it is never opened
    (opening a FIFO blocks until a writer comes); a link to nothing is `missing_image_file`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise Skip("missing_image_file", f"{what} leads to nothing (a broken link?)") from None
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(st.st_mode, what)


def read_file(path: Path, what: str) -> bytes:
    """The bytes of a regular file (others are skipped as by `check_regular`)."""
    check_regular(path, what)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    # replaced by a FIFO since the stat: O_NONBLOCK kept the open from blocking
    with open(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(mode, what)
        return f.read()


@lru_cache(maxsize=64)
def _real_root(root: str) -> str:
    return os.path.realpath(root)


def inside(path: Path, roots: list[Path]) -> bool:
    """`path`, symlinks followed, lies under one of `roots` (a table's `../x` or `/etc/x` does not)."""
    real = os.path.realpath(path)
    for r in roots:
        rr = _real_root(str(r))
        if real == rr or real.startswith(rr.rstrip(os.sep) + os.sep):
            return True
    return False


def _image_file(value: Any, roots: list[Path]) -> Path | None:
    """The file an image value names (a path, or a struct's path without bytes) as `load_image`
    reads it: the first existing candidate; None for bytes, `data:` URIs and names found nowhere."""
    if isinstance(value, dict):
        return None if value.get("bytes") else _image_file(value.get("path"), roots)
    if not isinstance(value, str) or not value.strip() or value.startswith("data:"):
        return None
    p = Path(value)
    for cand in [p] if p.is_absolute() else [r / p for r in roots]:
        if cand.exists() and not cand.is_dir():
            return cand
    return None


def file_stat(path: Path) -> list:
    """What an import's input fingerprint records of a file it reads: [path, size, mtime_ns]
    (a file that is gone: [path, None, None])."""
    try:
        st = os.stat(path)
    except OSError:
        return [os.fspath(path), None, None]
    return [os.fspath(path), st.st_size, st.st_mtime_ns]


def row_inputs(item: Any, settings: RowSettings) -> list:
    """The files a table row makes the import read (its images given as paths), as `file_stat`s:
    what the input fingerprint of an import-table holds beyond the table itself, so that an image
    replaced since the import is seen."""
    if not isinstance(item, dict) or "__error__" in item:
        return []
    col = settings.columns.get("image") or guess_column(item, "image")
    try:
        values = _as_list(item.get(col), "images") if col else []
    except Skip:
        return []
    out = []
    for v in values:
        name = v.get("path") if isinstance(v, dict) and not v.get("bytes") else v
        if isinstance(name, str) and name.strip() and not name.startswith("data:"):
            # one found nowhere counts too: the file added since is a change
            found = _image_file(name, settings.roots)
            out.append(file_stat(found) if found is not None else [name, None, None])
    return out


def file_inputs(item: tuple[str, Any], settings: FileSettings) -> list:
    """The files an image-folder item makes the import read: the image and its sidecar caption."""
    rel, caption = item
    path = settings.root / rel
    out = [file_stat(path)]
    if caption is None:
        sides = [path.with_suffix("." + e) for e in settings.caption_exts]
        out += [file_stat(side) for side in sides if side.is_file()][:1]
    return out


def load_image(value: Any, roots: list[Path], confine: bool = True) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, dict):  # datasets' Image feature: {"bytes": ..., "path": ...}
        if value.get("bytes"):
            return load_image(value["bytes"], roots, confine)
        return load_image(value.get("path"), roots, confine)
    if isinstance(value, str) and value.startswith("data:"):
        try:
            return base64.b64decode(value.split(",", 1)[1], validate=True)
        except Exception:  # noqa: BLE001
            raise Skip("bad_image_data", "a data: URI that is not base64") from None
    if isinstance(value, str) and value.strip():
        cand = _image_file(value, roots)
        if cand is not None:
            if confine and not inside(cand, roots):
                raise Skip(
                    "outside_root",
                    f"image {value!r} leads outside {', '.join(map(str, roots))} "
                    "(--image-root FOLDER reads images under FOLDER, "
                    "--allow-outside-root reads them anywhere)",
                )
            return read_file(cand, f"image {value!r}")
        raise Skip(
            "missing_image_file", f"image {value!r} not found under {', '.join(map(str, roots))}"
        )
    raise Skip("missing_image", f"image value {str(value)[:60]!r}")


def _as_list(value: Any, what: str) -> list:
    if value is None or value == "":
        return []
    if isinstance(value, str) and value.startswith("["):
        import json

        try:
            value = json.loads(value)
        except ValueError:
            raise Skip("bad_row", f"{what}: a '[...]' string that is not JSON") from None
    return list(value) if isinstance(value, (list, tuple)) else [value]


# ------------------------------------------------------------------------------------------------
# text
def _content(value: Any, images_in_parts: list[int]) -> str:
    """A turn's content: a string, or a list of parts ({"type": "text", "text"} / {"type": "image"})."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        out = []
        for p in value:
            if p.get("type") in ("image", "image_url"):
                out.append(IMAGE_TOKEN)
                images_in_parts.append(1)
            elif isinstance(p.get("text"), str):
                out.append(p["text"])
        return "".join(out)
    raise Skip("bad_conversations", f"turn content is a {type(value).__name__}")


def conversation_turns(conv: Any) -> list[dict]:
    """LLaVA / OpenAI / Cauldron conversations -> [{role, content}] (system prompts and unknown roles dropped)."""
    conv = _as_list(conv, "conversations")
    turns: list[dict] = []
    for t in conv:
        if not isinstance(t, dict):
            raise Skip("bad_conversations", f"a turn is a {type(t).__name__}, not an object")
        if "user" in t or "assistant" in t:  # the Cauldron: {"user", "assistant", "source"}
            for role in ("user", "assistant"):
                if isinstance(t.get(role), str):
                    turns.append({"role": role, "content": t[role]})
            continue
        role = ROLE_MAP.get(str(t.get("role", t.get("from", ""))).lower())
        content = t.get("content", t.get("value"))
        if role is None or content is None:
            continue
        turns.append({"role": role, "content": _content(content, [])})
    if not any(t["role"] == "assistant" and t["content"].strip() for t in turns):
        raise Skip("bad_conversations", "no assistant turn with text")
    return turns


def _interleaved(texts: list, images: list) -> tuple[str, list]:
    """OBELICS-style aligned lists: position i holds a text or an image."""
    parts, kept = [], []
    for t, im in zip(texts, images):
        if im is not None:
            parts.append(IMAGE_TOKEN)
            kept.append(im)
        elif isinstance(t, str):
            parts.append(t)
    return "\n".join(parts), kept


def place_images(sample: Sample, missing: int) -> None:
    if missing <= 0:
        return
    if sample.turns is not None:
        first = next((t for t in sample.turns if t["role"] == "user"), sample.turns[0])
        first["content"] = IMAGE_TOKEN * missing + "\n" + first["content"]
    else:
        sample.text = IMAGE_TOKEN * missing + sample.text


# ------------------------------------------------------------------------------------------------
# rows
def convert_row(index: int, row: dict, settings: RowSettings) -> Sample:
    if "__error__" in row:
        raise Skip(*row["__error__"])
    cols = {k: v or guess_column(row, k) for k, v in settings.columns.items()}
    for k in ("image", "text", "question", "answer", "type", "conversations"):
        cols.setdefault(k, guess_column(row, k))
    image_values = _as_list(row.get(cols["image"]), "images") if cols["image"] else []
    meta: dict[str, Any] = {}
    if (rid := row_id(row)) is not None:
        meta["id"] = rid
    turns, text = None, ""
    conv = row.get(cols["conversations"]) if cols["conversations"] else None
    if isinstance(conv, list) and conv and all(t is None or isinstance(t, str) for t in conv):
        if len(conv) != len(image_values):  # OBELICS: texts and images aligned
            raise Skip(
                "image_count_mismatch", f"{len(conv)} texts but {len(image_values)} image slots"
            )
        text, image_values = _interleaved(conv, image_values)
    elif conv not in (None, "", []):
        turns = conversation_turns(conv)
    elif cols["question"] and cols["answer"] and row.get(cols["question"]) not in (None, ""):
        q, a = str(row[cols["question"]]), row.get(cols["answer"])
        if isinstance(a, list):  # VQA-style answer lists: train on the first
            a = a[0] if a else ""
        if a is None or not str(a).strip():
            raise Skip("empty_text", f"column {cols['answer']!r} is empty")
        turns = [{"role": "user", "content": q}, {"role": "assistant", "content": str(a)}]
        qtype = (
            str(row.get(cols["type"]))
            if cols["type"] and row.get(cols["type"]) is not None
            else "unknown"
        )
        meta["qa"] = [
            {"question": q.replace(IMAGE_TOKEN, "").strip(), "answer": str(a), "type": qtype}
        ]
    elif cols["text"] and row.get(cols["text"]) not in (None, ""):
        value = row[cols["text"]]
        if isinstance(value, list):  # several captions: the first
            value = next((v for v in value if isinstance(v, str) and v.strip()), "")
        text = str(value)
    else:
        raise Skip(
            "missing_text",
            f"no text, caption, question/answer or conversation in {sorted(row)[:8]}",
        )
    if not (text.replace(IMAGE_TOKEN, "").strip() or turns):
        raise Skip("empty_text", "the text is empty")
    images = [load_image(v, settings.roots, settings.confine) for v in image_values]
    exts = [check_image(d) for d in images]
    sample = Sample(
        key=f"row{index:09d}",
        kind=kind_for(len(images)),
        text=text,
        turns=turns,
        images=images,
        image_exts=exts,
        meta=meta,
    )
    place_images(sample, len(images) - sample.placeholder_count())
    if sample.placeholder_count() != len(images):
        raise Skip(
            "image_count_mismatch",
            f"{sample.placeholder_count()} {IMAGE_TOKEN} placeholders but {len(images)} images",
        )
    return sample


def file_key(name: str, index: int) -> str:
    return f"{index:08d}_" + re.sub(r"[^A-Za-z0-9_-]+", "_", name)[:80]


def convert_file(index: int, item: tuple[str, Any], settings: FileSettings) -> Sample:
    """(path relative to the folder, caption; None: read the sidecar file; False: not
    in the captions table; (reason, detail): its row in the table cannot be used) ->
    an image-caption pair."""
    rel, caption = item
    root = settings.root
    path = root / rel
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raise Skip(
            "non_utf8_file_name",
            f"{shown_name(rel)}: the file name is not UTF-8 (rename the file to import it)",
        ) from None
    if caption is False:
        raise Skip("missing_caption", f"{rel} is not in the captions table")
    # (reason, detail): its row in the captions table cannot be used
    if isinstance(caption, tuple):
        raise Skip(*caption)
    if settings.confine and not inside(path, [root]):
        raise Skip(
            "outside_root",
            f"{rel} leads outside {root} (a link out; --allow-outside-root follows it)",
        )
    check_regular(path, rel)
    if caption is None:
        side = next(
            (
                path.with_suffix("." + e)
                for e in settings.caption_exts
                if path.with_suffix("." + e).is_file()
            ),
            None,
        )
        if side is None:
            raise Skip(
                "missing_caption",
                f"no {' or '.join('.' + e for e in settings.caption_exts)} beside {rel}",
            )
        if settings.confine and not inside(side, [root]):
            raise Skip(
                "outside_root",
                f"{side.name} leads outside {root} (--allow-outside-root follows it)",
            )
        try:
            caption = read_file(side, side.name).decode(settings.encoding)
        except UnicodeDecodeError as e:
            raise Skip(
                "non_utf8_text",
                f"{side.name}: not valid {settings.encoding} (byte "
                f"{e.start}; another encoding? see --encoding)",
            ) from None
    if not str(caption).strip():
        raise Skip("empty_text", f"the caption of {rel} is empty")
    data = read_file(path, rel)
    ext = check_image(data)
    return Sample(
        key=file_key(rel, index),
        kind="pair",
        text=IMAGE_TOKEN + str(caption).strip(),
        images=[data],
        image_exts=[ext],
        meta={"file": rel},
    )


# ------------------------------------------------------------------------------------------------
# workers
_WORKER: tuple | None = None


def shown_name(name: str) -> str:
    """A file name as text that can be printed and written as UTF-8: the bytes of a name that is
    not UTF-8 (held as surrogates) shown as \\xNN."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


# prctl(2): deliver a signal to this process when its parent dies
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """End this worker when the import's process ends, however it ends (kill -9 included): on
    Linux the kernel sends SIGKILL (prctl PR_SET_PDEATHSIG); elsewhere a thread polls the parent.
    Without it a worker blocked writing a result to a parent that is gone lives on."""
    import ctypes
    import threading
    import time

    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)
    if armed:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def init_worker(convert, settings, parent: int | None = None) -> None:
    """A worker's set-up: what to convert with. Ctrl-C, SIGTERM and SIGHUP reach the whole process
    group (a terminal, a job scheduler); the main process handles them (keeps the complete shards,
    says how to resume) and stops the workers, which ignore them, and which end with it whatever
    ends it (`_die_with_parent`)."""
    global _WORKER
    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, signal.SIG_IGN)
    if parent is not None:
        _die_with_parent(parent)
    _WORKER = (convert, settings)


def convert_chunk(
    chunk: list[tuple[int, Any]], convert=None, settings=None
) -> list[tuple[int, Any]]:
    """[(index, row)] -> [(index, Sample or (reason, detail, id))]. Any failure of a row skips that row only."""
    if convert is None:
        convert, settings = _WORKER
    out = []
    for i, item in chunk:
        try:
            out.append((i, convert(i, item, settings)))
        except Skip as s:
            rid = row_id(item) or (item[0] if isinstance(item, tuple) else None)
            out.append((i, (s.reason, s.detail, shown_name(rid) if rid is not None else None)))
        except (
            OSError,
            ValueError,
            TypeError,
            AttributeError,
            KeyError,
            IndexError,
            RecursionError,
        ) as e:
            out.append(
                (
                    i,
                    (
                        "bad_row",
                        f"{type(e).__name__}: {' '.join(str(e).split())[:200]}",
                        row_id(item),
                    ),
                )
            )
    return out
