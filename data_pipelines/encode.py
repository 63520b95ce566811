"""Sample -> token ids with images expanded, per-token target flags, and its images: planned (the
training loader: grid and orientation read from each header, decoded later, only by the rank that
trains on the sample) or processed at once (prompts: normalised float patches).

Each `<image>` placeholder becomes `<image_start>` + num_tokens x `<image_pad>` + `<image_end>`; the
document is framed by `<bos>` ... `<eos>`. `target[t]` says whether token t may be a training target
(whether the position before it gets a label); images, padding and document ends are masked later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

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
from vision.image_processor import (
    ImageError,
    ImagePlan,
    ImageProcessor,
    ImageTooLarge,
    ProcessedImage,
)


@dataclass
class EncodedSample:
    ids: np.ndarray  # [L] int64
    target: np.ndarray  # [L] bool
    # ImagePlan (the training loader: decoded when the batch is made) or ProcessedImage (prompts)
    images: list[ImagePlan | ProcessedImage] = field(default_factory=list)
    key: str = ""
    truncated: bool = False
    kind: str = "text"  # one of configs.batch.KINDS (statistics only)
    source: int = -1  # index of the data source it came from (statistics only)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def num_patches(self) -> int:
        return sum(im.grid[0] * im.grid[1] for im in self.images)


def image_where(sample: Sample, i: int) -> str:
    return f"{i} of sample {sample.key} in {sample.source}"


def plan_images(sample: Sample, processor: ImageProcessor) -> list[ImagePlan]:
    """Each image's grid and orientation from its header alone: an oversized one is
    image_too_large, one whose header cannot be read (or states no pixels) corrupt_image. Pixels
    that do not decode are found when the batch is made (data_pipelines.materialise)."""
    out = []
    for i, data in enumerate(sample.images):
        try:
            out.append(processor.plan(data, source=image_where(sample, i)))
        except ImageTooLarge as e:
            raise BadSample(IMAGE_TOO_LARGE, str(e)) from None
        except ImageError as e:
            raise BadSample(CORRUPT_IMAGE, str(e)) from None
    return out


def process_images(sample: Sample, processor: ImageProcessor) -> list[ProcessedImage]:
    """Every image decoded and normalised now (prompts; `vlm data stats --scan`)."""
    out = []
    for i, data in enumerate(sample.images):
        try:
            out.append(processor(data, source=image_where(sample, i)))
        except ImageTooLarge as e:
            raise BadSample(IMAGE_TOO_LARGE, str(e)) from None
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
    decode_images: bool = True,
) -> list[EncodedSample]:
    """Tokenize, expand and check one sample; returns one EncodedSample
    (several with long_text="split").

    `allow_empty_text` is for prompts: an image-only prompt ("<image>") is valid input to
    generation, while as training data it would teach nothing. `decode_images=False` (the
    training loader) plans the images from their headers instead of decoding them."""
    ids, target = tokenize_sample(sample, tok, loss_on, allow_empty_text)
    if not sample.images:
        images = []
    else:
        images = (process_images if decode_images else plan_images)(sample, processor)
    return fit_row(sample, ids, target, images, tok, row_tokens, long_text)


def tokenize_sample(
    sample: Sample, tok: Tokenizer, loss_on: str = "all", allow_empty_text: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, target) of a sample before its images are expanded (each `<image>` one id), framed by
    `<bos>` and `<eos>`; raises BadSample for reserved tokens in the text and for a sample without
    text. What the loader's index records of a sample's text (data_pipelines.lengths)."""
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
    return ids, target


def fit_row(
    sample: Sample,
    ids: np.ndarray,
    target: np.ndarray,
    images: list,
    tok: Tokenizer,
    row_tokens: int,
    long_text: str = "truncate",
) -> list[EncodedSample]:
    """The tokenized sample with its images expanded, cut to fit rows of `row_tokens`."""
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
