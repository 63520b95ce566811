"""What planning knows of a sample without its bytes: an `Entry` (its token count before the images
are expanded, where its last image placeholder is, each image's header, or why it cannot be used),
and the pieces it makes in rows of a given size (`Sizer.pieces`).

An entry is made once per sample and tokenizer (data_pipelines.index keeps it on disk), from the
same functions the sample is encoded with when it is trained on (data_pipelines.encode), so that the
lengths planning packs are exactly those of the encoded sample: a sample is planned from its entry
by every rank, and read, decoded and encoded by the one rank that trains on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from data_pipelines.encode import tokenize_sample
from data_pipelines.schema import (
    CORRUPT_IMAGE,
    IMAGE_COUNT,
    IMAGE_TOO_LARGE,
    TOO_LONG,
    BadSample,
    decode_sample,
    image_member,
)
from data_pipelines.tokenizer import Tokenizer
from vision.image_processor import ImageError, ImageProcessor, ImageTooLarge

# an image header's status in an entry
HEADER_OK, HEADER_UNREADABLE, HEADER_REFUSED = 0, 1, 2


class ImageHeader(NamedTuple):
    """An image as its header states it: (width, height, EXIF orientation), or why the header
    cannot be read (`status`: HEADER_UNREADABLE -> corrupt_image, HEADER_REFUSED -> Pillow's
    decompression-bomb guard, image_too_large) and the message."""

    w: int
    h: int
    orientation: int
    status: int = HEADER_OK
    message: str = ""


class Entry(NamedTuple):
    """One sample as planning sees it. `reason`/`message`: why it cannot be used, as far as that is
    known without the row size and the image settings (None: usable so far). `tokens`: its ids
    before the images are expanded (each `<image>` one id), `last_image`: the position of the last
    `<image>` id (-1: none), `mismatch`: the `<image>` ids after tokenization are not one per
    image. Where its bytes are: `path` and the byte range [`start`, `end`) of its members in the
    tar, or `raw` (a URL or compressed shard: the bytes read as it streamed by)."""

    key: str
    reason: str | None
    message: str
    tokens: int
    last_image: int
    mismatch: bool
    images: tuple[ImageHeader, ...]
    path: Path | str
    start: int = -1
    end: int = -1
    raw: Any = None


def image_header(data: bytes, where: str, processor: ImageProcessor) -> ImageHeader:
    """An image member's header (never raises)."""
    try:
        return ImageHeader(*processor.read_header(data, where))
    except ImageTooLarge as e:
        return ImageHeader(0, 0, 1, HEADER_REFUSED, str(e))
    except ImageError as e:
        return ImageHeader(0, 0, 1, HEADER_UNREADABLE, str(e))


def sample_entry(
    raw: dict[str, Any],
    headers: dict[str, ImageHeader],
    tok: Tokenizer,
    kind: str,
    caption_field: str,
    path: Path | str,
    start: int = -1,
    end: int = -1,
) -> Entry:
    """The entry of a raw sample whose image members hold their own member names (`0.jpg`) in place
    of their bytes, with each image member's header in `headers` by that name: the image bytes need
    not be at hand. The decoder orders the images, so the headers come in its order."""
    key = raw.get("__key__", "?")
    try:
        sample = decode_sample(raw, kind, caption_field)
        ids, _ = tokenize_sample(sample, tok)
    except BadSample as e:
        return Entry(key, e.reason, str(e), 0, -1, False, (), path, start, end)
    images = tuple(headers[name] for name in sample.images)
    pos = (ids == tok.image_id).nonzero()[0]
    mismatch = len(pos) != len(images)
    message = (
        f"sample {sample.key} in {sample.source}: {len(pos)} <image> tokens after tokenization "
        f"but {len(images)} images"
        if mismatch
        else ""
    )
    last = int(pos[-1]) if len(pos) else -1
    return Entry(key, None, message, len(ids), last, mismatch, images, path, start, end)


def with_standins(raw: dict[str, Any], processor: ImageProcessor) -> tuple[dict, dict]:
    """(the raw sample with each image member's bytes replaced by its name, the members' headers):
    what `sample_entry` takes, from a sample read whole."""
    out, headers = dict(raw), {}
    for name, value in raw.items():
        if not name.startswith("__") and (m := image_member(name)):
            where = f"{int(m.group(1) or 0)} of sample {raw.get('__key__', '?')} in "
            headers[name] = image_header(value, where + str(raw.get("__url__", "")), processor)
            out[name] = name
    return out, headers


@dataclass(frozen=True, slots=True)
class Piece:
    """Piece `piece` of a planned sample (of source number `source`): its length in a row and its
    images' LLM tokens."""

    entry: Entry
    piece: int
    length: int
    image_tokens: tuple[int, ...]
    truncated: bool
    source: int = -1

    def __len__(self) -> int:
        return self.length


class Sizer:
    """An entry's pieces in rows of `row_tokens` with the given image processor: the lengths and the
    checks of data_pipelines.encode.encode_sample, in its order, from the entry alone."""

    def __init__(self, processor: ImageProcessor, row_tokens: int, long_text: str):
        self.processor, self.row_tokens, self.long_text = processor, row_tokens, long_text
        self.max_pixels = processor.cfg.max_pixels
        self._tokens: dict[tuple[int, int, int], int] = {}  # LLM tokens by header: few sizes

    def _image_tokens(self, e: Entry, i: int, im: ImageHeader, where: str) -> int:
        n = self._tokens.get(im[:3])
        if n is not None:
            return n
        name = f"{i} of sample {e.key} in {where}"
        if im.status == HEADER_REFUSED:
            raise BadSample(IMAGE_TOO_LARGE, im.message)
        if im.status != HEADER_OK:
            raise BadSample(CORRUPT_IMAGE, im.message)
        try:
            self.processor.check_size(im.w, im.h, name)
        except ImageTooLarge as err:
            raise BadSample(IMAGE_TOO_LARGE, str(err)) from None
        except ImageError as err:
            raise BadSample(CORRUPT_IMAGE, str(err)) from None
        n = self.processor.plan_size(b"", im.w, im.h, im.orientation).num_tokens
        if im.status == HEADER_OK:  # a size that passed the checks: the same answer next time
            self._tokens[im[:3]] = n
        return n

    def pieces(self, e: Entry, source: int = -1) -> list[Piece]:
        """The entry's pieces (of source number `source`); BadSample when it cannot be used."""
        if e.reason is not None:
            raise BadSample(e.reason, e.message)
        where = e.raw["__url__"] if e.raw is not None else str(e.path)
        num_tokens = tuple(self._image_tokens(e, i, im, where) for i, im in enumerate(e.images))
        if e.mismatch:
            raise BadSample(IMAGE_COUNT, e.message)
        added = sum(num_tokens) + len(num_tokens)  # each <image> id: start, pads, end
        expanded = e.tokens + added
        row = self.row_tokens
        if expanded <= row:
            return [Piece(e, 0, expanded, num_tokens, False, source)]
        if num_tokens:
            last_end = e.last_image + added
            if last_end + 1 >= row:  # keep at least one text token after the last image
                raise BadSample(
                    TOO_LONG,
                    f"sample {e.key} in {where}: {expanded} tokens with images ending at "
                    f"{last_end + 1} do not fit a row of {row}",
                )
            return [Piece(e, 0, row, num_tokens, True, source)]
        if self.long_text == "split":
            return [
                Piece(e, k, min(row, expanded - s), (), True, source)
                for k, s in enumerate(range(0, expanded, row))
            ]
        return [Piece(e, 0, row, (), True, source)]


__all__ = [
    "Entry",
    "ImageHeader",
    "Piece",
    "Sizer",
    "image_header",
    "sample_entry",
    "with_standins",
]
