"""Packing encoded samples into rows of a fixed token budget and assembling PackedBatch tensors.

Legend: D width, P patches.

Row filling: the oldest waiting sample opens a row (so nothing waits forever), then the subset of
the other waiting samples (a pool of `pack_buffer`) that fills the rest of the row best is added: an
exact 0/1 knapsack over lengths, which leaves much less padding than greedy best fit when samples
are long relative to the row. A sample is never split across rows. Labels are built for the whole
batch at once from the row layout.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from configs.batch import IGNORE_INDEX, IMAGE, KINDS, TEXT, PackedBatch
from data_pipelines.encode import EncodedSample, encode_sample
from data_pipelines.schema import Sample, kind_for
from data_pipelines.tokenizer import Tokenizer


class Packer:
    """A pool of (ref, sample) in arrival order, a sample being anything with a length (an
    EncodedSample, a planned lengths.Piece); `next_row` takes one row's worth out of it (samples
    keep their pool order within the row)."""

    def __init__(self, row_tokens: int, pack_buffer: int):
        self.row_tokens = row_tokens
        self.pack_buffer = pack_buffer
        self.pool: list[tuple[Any, Any]] = []
        self.lengths: list[int] = []  # of the pool's samples, in step

    def need(self) -> int:
        return max(self.pack_buffer - len(self.pool), 0)

    def add(self, ref: Any, sample: Any) -> None:
        n = len(sample)
        if n > self.row_tokens:
            raise ValueError(
                f"sample {getattr(sample, 'key', ref)}: {n} tokens exceed "
                f"row_tokens={self.row_tokens}"
            )
        self.pool.append((ref, sample))
        self.lengths.append(n)

    def next_row(self) -> list[tuple[Any, Any]]:
        if not self.pool:
            return []
        row = [self.pool.pop(0)]
        room = self.row_tokens - self.lengths.pop(0)
        chosen = best_subset(self.lengths, room) if room > 0 and self.pool else []
        for i in reversed(chosen):  # ascending indices: popped from the back, kept in pool order
            row.insert(1, self.pool.pop(i))
            del self.lengths[i]
        return row


def best_subset(lengths, room: int) -> list[int]:
    """Indices of a subset of `lengths` with the largest sum <= `room` (0/1 knapsack over reachable
    sums, each step's set of sums one integer's bits: a shift and an or per candidate sample, never
    a loop over tokens). Of the subsets with that sum, the one the walk back from the last sample
    finds (always the same: the order of the global plan depends on it)."""
    if not isinstance(lengths, list):  # the packer keeps a list of ints already
        lengths = [int(n) for n in lengths]
    mask, full = (1 << (room + 1)) - 1, 1 << room
    reach = [1]  # reach[i]: bit s set when s is a sum of some of the first i samples
    for n in lengths:
        r = reach[-1]
        reach.append(r | ((r << n) & mask) if n <= room else r)
        if reach[-1] & full:
            # a full row: the later samples cannot raise the sum, and the walk back passes over
            # them (each sum reachable without them), so they need not be looked at
            break
    total = reach[-1].bit_length() - 1
    chosen = []
    # walk back: sample i-1 was needed iff the sum was not reachable without it
    for i in range(len(reach) - 1, 0, -1):
        if not (reach[i - 1] >> total) & 1:
            chosen.append(i - 1)
            total -= lengths[i - 1]
    return chosen[::-1]


def assemble_batch(rows: list[list[EncodedSample]], row_tokens: int, tok: Tokenizer) -> PackedBatch:
    """Rows of encoded samples whose images are processed (prompts: normalised float patches) ->
    PackedBatch; images concatenated row by row, left to right. The training loader's batches,
    whose images are planned, are made by data_pipelines.materialise."""
    batch = token_batch(rows, row_tokens, tok.pad_id, tok.image_pad_id)
    images = [im for row in rows for s in row for im in s.images]
    if images:
        batch.pixel_patches = torch.cat([im.patches_PD for im in images], 0)
        batch.patch_coords = torch.cat([im.coords_P2 for im in images], 0)
        batch.image_grids = torch.tensor([list(im.grid) for im in images], dtype=torch.long)
    return batch


def token_batch(
    rows: list[list[EncodedSample]], row_tokens: int, pad_id: int, image_pad_id: int
) -> PackedBatch:
    """The token fields of a PackedBatch (labels shifted, masked at document ends, padding, images
    and non-target tokens); no images."""
    B, T = len(rows), row_tokens
    ids = np.full((B, T), pad_id, dtype=np.int64)
    doc = np.full((B, T), -1, dtype=np.int64)
    pos = np.zeros((B, T), dtype=np.int64)
    target = np.zeros((B, T), dtype=bool)
    kind = np.full((B, T), -1, dtype=np.int64)
    source = np.full((B, T), -1, dtype=np.int64)
    for r, row in enumerate(rows):
        o = 0
        for d, s in enumerate(row):
            n = len(s)
            if o + n > T:
                raise ValueError(f"row {r} overflows: {o + n} > {T} tokens")
            ids[r, o : o + n] = s.ids
            doc[r, o : o + n] = d
            pos[r, o : o + n] = np.arange(n)
            target[r, o : o + n] = s.target
            kind[r, o : o + n] = KINDS.index(s.kind)
            source[r, o : o + n] = s.source
            o += n
    is_image = (ids == image_pad_id) & (doc >= 0)
    labels = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
    keep = (
        (doc[:, 1:] == doc[:, :-1])
        & (doc[:, :-1] >= 0)
        & target[:, 1:]
        & ~is_image[:, 1:]
        & ~is_image[:, :-1]
    )
    labels[:, :-1] = np.where(keep, ids[:, 1:], IGNORE_INDEX)
    modality = np.where(is_image, IMAGE, TEXT)
    return PackedBatch(
        input_ids=torch.from_numpy(ids),
        labels=torch.from_numpy(labels),
        doc_ids=torch.from_numpy(doc),
        position_ids=torch.from_numpy(pos),
        modality=torch.from_numpy(modality),
        kind=torch.from_numpy(kind),
        source=torch.from_numpy(source),
    )


def select_rows(batch: PackedBatch, start: int, stop: int) -> PackedBatch:
    """Rows [start, stop) of a batch with exactly their images (images are stored row by row)."""
    is_img = batch.modality == IMAGE
    starts = is_img.clone()
    starts[:, 1:] &= ~is_img[:, :-1]  # an image is one run of IMAGE positions
    per_row = starts.sum(1).tolist()
    out = PackedBatch(
        batch.input_ids[start:stop],
        batch.labels[start:stop],
        batch.doc_ids[start:stop],
        batch.position_ids[start:stop],
        batch.modality[start:stop],
        kind=None if batch.kind is None else batch.kind[start:stop],
        source=None if batch.source is None else batch.source[start:stop],
    )
    i0, i1 = sum(per_row[:start]), sum(per_row[:stop])
    if batch.image_grids is not None and i1 > i0:
        sizes = batch.image_grids.prod(1).tolist()
        p0, p1 = sum(sizes[:i0]), sum(sizes[:i1])
        out.image_grids = batch.image_grids[i0:i1]
        out.pixel_patches, out.patch_coords = batch.pixel_patches[p0:p1], batch.patch_coords[p0:p1]
    return out


def make_prompt_batch(
    prompts: list[tuple[str, list[bytes]]], tok: Tokenizer, processor, add_eos: bool = False
) -> PackedBatch:
    """One row per prompt (for generation/eval): `<bos>` + text with images expanded, right-padded
    to the longest prompt. Labels are the usual shifted targets (useful for scoring answers)."""

    encoded = []
    for i, (text, imgs) in enumerate(prompts):
        s = Sample(
            key=f"prompt{i}",
            kind=kind_for(len(imgs)),
            text=text,
            images=list(imgs),
            source="<prompt>",
        )
        e = encode_sample(s, tok, processor, row_tokens=1 << 30, allow_empty_text=True)[0]
        if not add_eos:
            e = EncodedSample(e.ids[:-1], e.target[:-1], e.images, e.key)
        e.kind = "chat"  # a prompt to the model is a chat turn, whatever its text is
        encoded.append(e)
    T = max(len(e) for e in encoded)
    return assemble_batch([[e] for e in encoded], T, tok)
