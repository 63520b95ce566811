"""Materialising: a planned micro-batch -> PackedBatch, the expensive part of loading (reading the
samples' bytes, decoding, resizing, patchifying), done only by the rank that trains on it.

Legend: I images.

Each planned piece names its sample's byte range in its shard (the loader's index): the rank reads
those bytes alone (a URL or compressed shard's samples come with the plan, read as they streamed
by), decodes and encodes the sample as planning's entry said it would be, and checks that it did:
a sample whose bytes no longer match its entry (the shard changed after it was indexed, or cannot
be read now) leaves its row (its positions become padding) and is counted, under the reason its
decoding gives or as unreadable_member, by the rank that read it. The plan, and so every rank's
micro-batches, never depends on that read.

Pixels stay uint8 from the decoder to the device (a quarter of float32's bytes; the vision tower
normalises them there). Each image is resized once and copied once, straight into one buffer for
the whole micro-batch (in shared memory inside a DataLoader worker, so that handing it to the
trainer's process copies nothing). Patch coordinates are computed for all images at once. An image
whose header read but whose pixels do not decode drops its sample from the row likewise, counted as
corrupt_image.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from configs.batch import PackedBatch
from data_pipelines.encode import EncodedSample, encode_sample
from data_pipelines.lengths import Piece
from data_pipelines.packing import token_batch
from data_pipelines.plan import MicroBatchPlan, Tally
from data_pipelines.reader import read_sample
from data_pipelines.schema import (
    CORRUPT_IMAGE,
    UNREADABLE_MEMBER,
    BadSample,
    ShardError,
    decode_sample,
)
from data_pipelines.tokenizer import Tokenizer
from vision.image_processor import ImageError, ImageProcessor

log = logging.getLogger("data_pipelines")


def _pixel_buffer(patches: int, patch_dim: int, shared: bool) -> torch.Tensor:
    if not shared:
        return torch.empty((patches, patch_dim), dtype=torch.uint8)
    # allocated in shared memory: a DataLoader worker hands it over without copying it
    storage = torch.UntypedStorage._new_shared(patches * patch_dim)
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(patches, patch_dim)


def patch_coords(grids_I2: np.ndarray) -> np.ndarray:
    """[P, 2] (row, col) of every patch of every image, raster order within each image."""
    sizes = grids_I2[:, 0] * grids_I2[:, 1]
    starts = np.cumsum(sizes) - sizes
    local = np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(starts, sizes)
    cols = np.repeat(grids_I2[:, 1], sizes)
    return np.stack([local // cols, local % cols], axis=1)


@dataclass
class Materialiser:
    """What turns a plan into its micro-batch: the tokenizer and image processor, the row size and
    the loader's encoding settings, and per source (by number) its label, kind and caption field."""

    tok: Tokenizer
    processor: ImageProcessor
    row_tokens: int
    loss_on: str
    long_text: str
    sources: list[tuple[str, str, str]]  # (label, kind, caption_field)

    def _encode(self, piece: Piece, raw: dict) -> EncodedSample:
        """The piece as planned, from its sample's bytes; BadSample / ShardError when they do not
        make it."""
        _, kind, caption_field = self.sources[piece.source]
        sample = decode_sample(raw, kind, caption_field)
        pieces = encode_sample(
            sample,
            self.tok,
            self.processor,
            self.row_tokens,
            self.loss_on,
            self.long_text,
            decode_images=False,
        )
        enc = pieces[piece.piece] if piece.piece < len(pieces) else None
        if enc is None or (len(enc), tuple(im.num_tokens for im in enc.images)) != (
            piece.length,
            piece.image_tokens,
        ):
            raise ShardError(
                f"sample {piece.entry.key} in {piece.entry.path} is not what its index says "
                "(the shard changed since it was indexed)"
            )
        enc.source = piece.source
        return enc

    def _read(self, pieces: list[Piece], io: Counter) -> dict:
        """The raw samples of `pieces` (a ShardError for one that cannot be read), by (path,
        start): each shard's in byte order."""
        wanted = {
            (str(p.entry.path), p.entry.start): p.entry for p in pieces if p.entry.raw is None
        }
        out: dict = {}
        for at in sorted(wanted):
            e = wanted[at]
            try:
                out[at] = read_sample(e.path, e.start, e.end, e.key, io)
            except ShardError as err:
                out[at] = err
            io["samples_decoded"] += 1
        return out

    def __call__(
        self, plan: MicroBatchPlan, shared: bool = False
    ) -> tuple[PackedBatch, Tally, Counter]:
        """(the micro-batch, what reading and decoding it lost, the bytes and samples read)."""
        io: Counter = Counter()
        lost = Tally()
        raws = self._read([p for row in plan.rows for p in row], io)
        encoded: list[list[EncodedSample]] = []
        for row in plan.rows:
            kept = []
            for piece in row:
                e = piece.entry
                raw = e.raw if e.raw is not None else raws[(str(e.path), e.start)]
                try:
                    if isinstance(raw, ShardError):
                        raise raw
                    kept.append(self._encode(piece, raw))
                except (BadSample, ShardError) as err:
                    reason = err.reason if isinstance(err, BadSample) else UNREADABLE_MEMBER
                    self._drop(
                        e.key, piece.source, piece.length, piece.image_tokens, reason, err, lost
                    )
            encoded.append(kept)
        batch = self._pixels(encoded, lost, shared)
        return batch, lost, io

    def _drop(self, key: str, source: int, length: int, image_tokens, reason, err, lost) -> None:
        """A planned sample leaves its row: counted under `reason`, and taken out of the stats."""
        label = self.sources[source][0] if 0 <= source < len(self.sources) else "?"
        first = not lost.counters
        lost.skip(label, reason)
        lost.stats["samples_packed"] -= 1
        lost.stats["tokens"] -= length
        lost.stats["image_tokens"] -= sum(image_tokens)
        lost.stats["images"] -= len(image_tokens)
        (log.warning if first else log.debug)(
            "skipping bad input (%s): sample %s: %s", reason, key, err
        )

    def _pixels(self, rows: list[list[EncodedSample]], lost: Tally, shared: bool) -> PackedBatch:
        patch_dim = 3 * self.processor.cfg.patch_size**2
        images = [im for row in rows for s in row for im in s.images]
        total = sum(im.num_patches for im in images)
        pixels = _pixel_buffer(total, patch_dim, shared) if images else None
        out = pixels.numpy() if images else None
        kept_rows, grids, o = [], [], 0
        for row in rows:
            kept = []
            for s in row:
                start = o
                try:
                    for im in s.images:
                        self.processor.pixels_into(im, out[o : o + im.num_patches])
                        o += im.num_patches
                except ImageError as e:
                    o = start  # the sample's images are overwritten by the next sample's
                    tokens = [im.num_tokens for im in s.images]
                    self._drop(s.key, s.source, len(s), tokens, CORRUPT_IMAGE, e, lost)
                    continue
                kept.append(s)
                grids += [im.grid for im in s.images]
            kept_rows.append(kept)
        batch = token_batch(kept_rows, self.row_tokens, self.tok.pad_id, self.tok.image_pad_id)
        if grids:
            grids_I2 = np.asarray(grids, dtype=np.int64)
            batch.pixel_patches = pixels if o == total else pixels[:o]
            batch.patch_coords = torch.from_numpy(patch_coords(grids_I2))
            batch.image_grids = torch.from_numpy(grids_I2)
        return batch
