"""The one sample schema of the shards (see SCHEMA.md), its encoder and its validating decoder.

A tar sample is the set of members sharing a key (webdataset convention, the key holds no dot):
`KEY.json` (metadata and text), `KEY.{i}.{ext}` (image i, in placeholder order). A foreign
webdataset with `KEY.jpg` + `KEY.txt` reads as an image-caption pair. Decoding checks everything
that does not need the image decoder and raises `BadSample(reason, message)`; reasons are the
loader's counter names.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from configs.config import ConfigError

# What a sample is (its `kind` field in the shards): an image-text pair, interleaved images and text,
# or text alone. Statistics count documents by another vocabulary, configs.batch.KINDS (a chat turn
# and a caption are both pairs): data_pipelines.encode.stats_kind maps one to the other.
SAMPLE_KINDS = ("pair", "interleaved", "text")
IMAGE_EXTS = ("png", "jpg", "jpeg", "webp", "bmp", "gif", "tif", "tiff", "ppm")
TEXT_EXTS = ("txt", "text", "caption")
IMAGE_TOKEN = "<image>"
ROLES = ("user", "assistant")

# Skip reasons (the loader's counters). Documented in SCHEMA.md.
UNREADABLE_SHARD = "unreadable_shard"
UNREADABLE_MEMBER = "unreadable_member"
TRUNCATED_SHARD = "truncated_shard"
MANIFEST_MISMATCH = "manifest_mismatch"
MISSING_SHARD = "missing_shard"
BAD_JSON = "bad_json"
NON_UTF8 = "non_utf8_text"
MISSING_FIELD = "missing_field"
INVALID_FIELD = "invalid_field"
EMPTY_TEXT = "empty_text"
IMAGE_COUNT = "image_count_mismatch"
CORRUPT_IMAGE = "corrupt_image"
IMAGE_TOO_LARGE = "image_too_large"
TOO_LONG = "too_long"
FILTERED_KIND = "filtered_kind"
REASONS = (
    UNREADABLE_SHARD,
    UNREADABLE_MEMBER,
    TRUNCATED_SHARD,
    MANIFEST_MISMATCH,
    MISSING_SHARD,
    BAD_JSON,
    NON_UTF8,
    MISSING_FIELD,
    INVALID_FIELD,
    EMPTY_TEXT,
    IMAGE_COUNT,
    CORRUPT_IMAGE,
    IMAGE_TOO_LARGE,
    TOO_LONG,
    FILTERED_KIND,
)

# a KEY.json holding one of these is the sample's schema
SCHEMA_FIELDS = ("text", "turns", "kind")
# img2dataset
METADATA_KEPT = ("key", "url", "status", "width", "height", "original_width", "original_height")
_IMAGE_MEMBER = re.compile(r"^(?:(\d+)\.)?(" + "|".join(IMAGE_EXTS) + r")$")


def image_member(name: str) -> re.Match | None:
    """A member suffix that is an image (`0.jpg`, `jpg`): (its number or None, its extension)."""
    return _IMAGE_MEMBER.match(name)


class ShardError(ConfigError):
    """A source pattern or shard that cannot be used (no match, missing file, a URL that cannot
    be fetched); names the path or URL. A config problem: the commands report it in one line,
    without a traceback."""


class BadSample(ValueError):
    """A sample (or `count` samples, for a shard-level loss) skipped for `reason`."""

    def __init__(self, reason: str, message: str, count: int = 1):
        super().__init__(message)
        self.reason, self.count = reason, count


def kind_for(n_images: int) -> str:
    """The kind of a sample that does not state one, by its images: the one rule (shards, importers,
    prompts)."""
    return "text" if not n_images else "pair" if n_images == 1 else "interleaved"


@dataclass
class Sample:
    """One training sample. `text` holds `<image>` placeholders (one per image, in order); chat
    samples keep the conversation in `turns` ([{role, content}], placeholders in the contents) and
    `text` is then unused."""

    key: str
    kind: str
    text: str = ""
    turns: list[dict] | None = None
    images: list[bytes] = field(default_factory=list)
    image_exts: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # shard path, for messages

    def placeholder_count(self) -> int:
        if self.turns is not None:
            return sum(t["content"].count(IMAGE_TOKEN) for t in self.turns)
        return self.text.count(IMAGE_TOKEN)

    def all_text(self) -> str:
        return "".join(t["content"] for t in self.turns) if self.turns is not None else self.text


def normalize_placeholders(sample: Sample) -> Sample:
    """An image-text pair without a placeholder gets one in front (caption datasets rarely write it)."""
    if sample.kind == "pair" and len(sample.images) == 1 and sample.placeholder_count() == 0:
        if sample.turns is not None:
            first = next((t for t in sample.turns if t["role"] == "user"), None)
            if first is not None:
                first["content"] = IMAGE_TOKEN + "\n" + first["content"]
        else:
            sample.text = IMAGE_TOKEN + sample.text
    return sample


def encode_sample(sample: Sample) -> dict[str, Any]:
    """Sample -> tar members for `webdataset.TarWriter` (bytes values, `__key__`)."""
    if "." in sample.key or "/" in sample.key or not sample.key:
        raise ValueError(f"sample key {sample.key!r}: must be non-empty and hold no '.' or '/'")
    if sample.kind not in SAMPLE_KINDS:
        raise ValueError(f"sample {sample.key}: kind {sample.kind!r} not one of {SAMPLE_KINDS}")
    meta: dict[str, Any] = {"kind": sample.kind}
    if sample.turns is not None:
        meta["turns"] = sample.turns
    else:
        meta["text"] = sample.text
    if sample.meta:
        meta["meta"] = sample.meta
    out: dict[str, Any] = {
        "__key__": sample.key,
        "json": json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8"),
    }
    for i, data in enumerate(sample.images):
        ext = (sample.image_exts[i] if i < len(sample.image_exts) else "png").lower().lstrip(".")
        if ext not in IMAGE_EXTS:
            raise ValueError(
                f"sample {sample.key}: image extension {ext!r} not one of {IMAGE_EXTS}"
            )
        out[f"{i}.{ext}"] = bytes(data)
    return out


def _utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadSample(NON_UTF8, f"{what}: not valid UTF-8 ({e})") from None


def _check_turns(turns: Any, where: str) -> list[dict]:
    if not isinstance(turns, list) or not turns:
        raise BadSample(
            INVALID_FIELD, f"{where}: 'turns' must be a non-empty list of {{role, content}}"
        )
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or "role" not in t or "content" not in t:
            raise BadSample(MISSING_FIELD, f"{where}: turns[{i}] needs 'role' and 'content'")
        if t["role"] not in ROLES or not isinstance(t["content"], str):
            raise BadSample(
                INVALID_FIELD,
                f"{where}: turns[{i}] role must be one of {ROLES} "
                f"and content a string, got {t['role']!r}",
            )
        out.append({"role": t["role"], "content": t["content"]})
    if not any(t["role"] == "assistant" and t["content"].strip() for t in out):
        raise BadSample(EMPTY_TEXT, f"{where}: no non-empty assistant turn")
    return out


def _parse_json(data: bytes, where: str) -> dict:
    try:
        meta = json.loads(_utf8(data, f"{where}.json"))
    except json.JSONDecodeError as e:
        raise BadSample(BAD_JSON, f"{where}.json: not valid JSON ({e})") from None
    except RecursionError:
        raise BadSample(BAD_JSON, f"{where}.json: nested too deeply to parse") from None
    if not isinstance(meta, dict):
        raise BadSample(BAD_JSON, f"{where}.json: top level must be an object")
    return meta


def is_metadata_json(meta: dict, raw: dict[str, Any]) -> bool:
    """A `KEY.json` that describes the sample instead of being it (img2dataset's url, caption,
    status, width, height, ...): it holds none of `text`, `turns`, `kind`, or the sample has a
    caption member (.txt), which this project's writer never writes next to its schema JSON."""
    return not any(k in meta for k in SCHEMA_FIELDS) or any(e in raw for e in TEXT_EXTS)


def decode_sample(
    raw: dict[str, Any], kind_filter: str = "auto", caption_field: str = "caption"
) -> Sample:
    """Raw tar members {"__key__", "__url__", ext: bytes} -> validated Sample
    (images still undecoded).

    A metadata JSON (see `is_metadata_json`) is not the schema: the caption comes from the `.txt`
    member, else from the metadata's `caption_field`, and the metadata's `METADATA_KEPT` fields go
    into `meta`."""
    key, url = raw.get("__key__", "?"), raw.get("__url__", "")
    where = f"sample {key} in {url}"
    images: dict[int, tuple[str, bytes]] = {}
    for name, value in raw.items():
        m = _IMAGE_MEMBER.match(name) if not name.startswith("__") else None
        if m:
            images[int(m.group(1) or 0)] = (m.group(2), value)
    ordered = [images[i] for i in sorted(images)]
    if sorted(images) != list(range(len(images))):
        raise BadSample(
            IMAGE_COUNT, f"{where}: image members are not numbered 0..n-1: {sorted(images)}"
        )
    meta = _parse_json(raw["json"], where) if "json" in raw else None
    if meta is not None and not is_metadata_json(meta, raw):
        kind = meta.get("kind") or kind_for(len(ordered))
        if kind not in SAMPLE_KINDS:
            raise BadSample(INVALID_FIELD, f"{where}: kind {kind!r} not one of {SAMPLE_KINDS}")
        turns = _check_turns(meta["turns"], where) if meta.get("turns") is not None else None
        text = meta.get("text")
        if turns is None:
            if text is None:
                raise BadSample(MISSING_FIELD, f"{where}: needs 'text' or 'turns'")
            if not isinstance(text, str):
                raise BadSample(INVALID_FIELD, f"{where}: 'text' must be a string")
        extra = meta.get("meta") or {}
        if not isinstance(extra, dict):
            raise BadSample(INVALID_FIELD, f"{where}: 'meta' must be an object")
        qa = extra.get("qa")
        if qa is not None and not (isinstance(qa, list) and all(isinstance(q, dict) for q in qa)):
            raise BadSample(INVALID_FIELD, f"{where}: meta.qa must be a list of objects")
    else:
        txt = next((raw[e] for e in TEXT_EXTS if e in raw), None)
        extra = {k: meta[k] for k in METADATA_KEPT if k in meta} if meta is not None else {}
        if txt is not None:
            text = _utf8(txt, f"{where}.txt")
        elif meta is not None and isinstance(meta.get(caption_field), str):
            text = meta[caption_field]
        elif meta is not None:
            raise BadSample(
                MISSING_FIELD,
                f"{where}: no .txt member, and its .json is metadata (no "
                f"{'/'.join(SCHEMA_FIELDS)}) without a string {caption_field!r}",
            )
        else:
            raise BadSample(
                MISSING_FIELD,
                f"{where}: no .json and no .txt member (members: "
                f"{sorted(k for k in raw if not k.startswith('__'))})",
            )
        turns = None
        kind = kind_for(len(ordered))
    sample = Sample(
        key=key,
        kind=kind,
        text=text or "",
        turns=turns,
        images=[d for _, d in ordered],
        image_exts=[e for e, _ in ordered],
        meta=extra,
        source=url,
    )
    if kind_filter != "auto" and kind != kind_filter:
        raise BadSample(
            FILTERED_KIND, f"{where}: kind {kind!r} filtered out (source kind {kind_filter!r})"
        )
    if kind == "text" and ordered:
        raise BadSample(INVALID_FIELD, f"{where}: kind 'text' but {len(ordered)} image members")
    if kind != "text" and not ordered:
        raise BadSample(MISSING_FIELD, f"{where}: kind {kind!r} but no image member")
    text_all = sample.all_text()
    if not text_all.replace(IMAGE_TOKEN, "").strip():
        raise BadSample(EMPTY_TEXT, f"{where}: empty text")
    try:  # JSON may escape a lone surrogate (\ud800), which no tokenizer can encode
        text_all.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadSample(
            NON_UTF8, f"{where}: text holds a lone surrogate at character {e.start}"
        ) from None
    normalize_placeholders(sample)
    if sample.placeholder_count() != len(sample.images):
        raise BadSample(
            IMAGE_COUNT,
            f"{where}: {sample.placeholder_count()} {IMAGE_TOKEN} "
            f"placeholders but {len(sample.images)} images",
        )
    return sample
