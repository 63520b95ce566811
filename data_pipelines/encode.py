"""Sample -> token ids with images expanded, per-token target flags, and processed images.

Each `<image>` placeholder becomes `<image_start>` + num_tokens x `<image_pad>` + `<image_end>`; the
document is framed by `<bos>` ... `<eos>`. `target[t]` says whether token t may be a training target
(whether the position before it gets a label); images, padding and document ends are masked later.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from data_pipelines.schema import (
    CORRUPT_IMAGE,
    EMPTY_TEXT,
    IMAGE_COUNT,
    IMAGE_TOO_LARGE,
    INVALID_FIELD,
    TOO_LONG,
    BadSample,
    Sample,
)
from data_pipelines.tokenizer import Tokenizer
from vision.image_processor import ImageError, ImageProcessor, ProcessedImage


@dataclass
class EncodedSample:
    ids: np.ndarray  # [L] int64
    target: np.ndarray  # [L] bool
    images: list[ProcessedImage] = field(default_factory=list)
    key: str = ""
    truncated: bool = False
    kind: str = "text"  # one of configs.batch.KINDS (statistics only)
    source: int = -1  # index of the data source it came from (statistics only)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def num_patches(self) -> int:
        return sum(int(im.patches_PD.shape[0]) for im in self.images)


def _header_size(data: bytes, max_pixels: int, where: str) -> None:
    """Classify oversized images from the header before anything is decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                w, h = im.size
    except Image.DecompressionBombError as e:
        raise BadSample(IMAGE_TOO_LARGE, f"{where}: {e}") from None
    except Exception:  # noqa: BLE001 - unidentifiable: the processor reports it as corrupt
        return
    if w * h > max_pixels:
        raise BadSample(
            IMAGE_TOO_LARGE, f"{where}: {w}x{h} = {w * h} pixels exceeds max_pixels={max_pixels}"
        )


def process_images(sample: Sample, processor: ImageProcessor) -> list[ProcessedImage]:
    out = []
    for i, data in enumerate(sample.images):
        where = f"image {i} of sample {sample.key} in {sample.source}"
        _header_size(data, processor.cfg.max_pixels, where)
        try:
            out.append(processor(data, source=where))
        except ImageError as e:
            raise BadSample(CORRUPT_IMAGE, str(e)) from None
    return out


def expand_images(
    ids: np.ndarray, target: np.ndarray, num_tokens: list[int], tok: Tokenizer
) -> tuple[np.ndarray, np.ndarray]:
    """Replace the k-th `<image>` id by start + num_tokens[k] pads + end (vectorised over tokens)."""
    pos = np.flatnonzero(ids == tok.image_id)
    if len(pos) != len(num_tokens):
        raise BadSample(
            IMAGE_COUNT,
            f"{len(pos)} <image> tokens after tokenization but {len(num_tokens)} images",
        )
    if not len(pos):
        return ids, target
    reps = np.ones(len(ids), dtype=np.int64)
    reps[pos] = np.asarray(num_tokens, dtype=np.int64) + 2
    out_ids = np.repeat(ids, reps)
    out_target = np.repeat(target, reps)
    starts = np.cumsum(reps)[pos] - reps[pos]  # where each expanded image begins
    out_ids[starts] = tok.image_start_id
    for s, n in zip(starts.tolist(), num_tokens):  # one slice assignment per image
        out_ids[s + 1 : s + 1 + n] = tok.image_pad_id
        out_ids[s + 1 + n] = tok.image_end_id
    return out_ids, out_target


def stats_kind(sample: Sample) -> str:
    """The kind a sample counts as in per-kind statistics: chat (it has turns), caption (an
    image-text pair), interleaved or text."""
    if sample.turns is not None:
        return "chat"
    return {"pair": "caption", "interleaved": "interleaved"}.get(sample.kind, "text")


def encode_sample(
    sample: Sample,
    tok: Tokenizer,
    processor: ImageProcessor,
    row_tokens: int,
    loss_on: str = "all",
    long_text: str = "truncate",
    allow_empty_text: bool = False,
) -> list[EncodedSample]:
    """Tokenize, expand and check one sample; returns one EncodedSample
    (several with long_text="split").

    `allow_empty_text` is for prompts: an image-only prompt ("<image>") is valid input to
    generation, while as training data it would teach nothing."""
    if sample.turns is not None:
        # the tokenizer's chat format: ours or a source's
        segments = tok.chat_segments(sample.turns)
        if loss_on == "all":
            segments = [(text, True) for text, _ in segments]
    else:
        segments = [(sample.text, True)]
    # a source without bos (Qwen) starts with its first token
    head = [] if tok.bos_id is None else [tok.bos_id]
    parts = [np.array(head, dtype=np.int64)]
    flags = [np.zeros(len(head), dtype=bool)]
    for text, is_target in segments:
        ids = tok.encode_np(text)
        if tok.is_reserved[ids].any():
            raise BadSample(
                INVALID_FIELD,
                f"sample {sample.key} in {sample.source}: text contains a reserved "
                "token (<pad>, <bos>, <eos>, <image_pad>, <image_start>, <image_end>)",
            )
        parts.append(ids)
        flags.append(np.full(len(ids), is_target, dtype=bool))
    # A source's chat template closes each answer with its own eos (Qwen's <|im_end|>): that ends
    # the document; our format closes turns with <|end|> and the document with <eos>.
    if not (sample.turns is not None and len(parts) > 1 and (parts[-1] == tok.eos_id).any()):
        parts.append(np.array([tok.eos_id], dtype=np.int64))
        flags.append(np.ones(1, dtype=bool))
    ids, target = np.concatenate(parts), np.concatenate(flags)
    if tok.is_special[ids].all() and not (allow_empty_text and sample.images):
        raise BadSample(EMPTY_TEXT, f"sample {sample.key} in {sample.source}: no text tokens")
    images = process_images(sample, processor) if sample.images else []
    try:
        ids, target = expand_images(ids, target, [im.num_tokens for im in images], tok)
    except BadSample as e:
        raise BadSample(e.reason, f"sample {sample.key} in {sample.source}: {e}") from None
    kind = stats_kind(sample)
    if len(ids) <= row_tokens:
        return [EncodedSample(ids, target, images, sample.key, kind=kind)]
    if images:
        last_end = int(np.flatnonzero(ids == tok.image_end_id)[-1])
        if last_end + 1 >= row_tokens:  # keep at least one text token after the last image
            raise BadSample(
                TOO_LONG,
                f"sample {sample.key} in {sample.source}: {len(ids)} tokens with "
                f"images ending at {last_end + 1} do not fit a row of {row_tokens}",
            )
        return [
            EncodedSample(
                ids[:row_tokens], target[:row_tokens], images, sample.key, truncated=True, kind=kind
            )
        ]
    if long_text == "split":
        return [
            EncodedSample(
                ids[s : s + row_tokens],
                target[s : s + row_tokens],
                [],
                sample.key,
                truncated=True,
                kind=kind,
            )
            for s in range(0, len(ids), row_tokens)
        ]
    return [
        EncodedSample(
            ids[:row_tokens], target[:row_tokens], [], sample.key, truncated=True, kind=kind
        )
    ]
