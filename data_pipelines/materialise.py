"""Materialising: a planned micro-batch -> PackedBatch, the expensive part of loading (decoding,
resizing, patchifying), done only by the rank that trains on it.

Legend: I images.

Pixels stay uint8 from the decoder to the device (a quarter of float32's bytes; the vision tower
normalises them there). Each image is resized once and copied once, straight into one buffer for
the whole micro-batch (in shared memory inside a DataLoader worker, so that handing it to the
trainer's process copies nothing). Patch coordinates are computed for all images at once.

An image whose header read but whose pixels do not decode drops its sample from the row (its
positions become padding) and is counted as corrupt_image here, by the rank that decoded it.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from configs.batch import PackedBatch
from data_pipelines.packing import token_batch
from data_pipelines.plan import MicroBatchPlan, Tally
from data_pipelines.schema import CORRUPT_IMAGE
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


def materialise(
    plan: MicroBatchPlan,
    row_tokens: int,
    pad_id: int,
    image_pad_id: int,
    processor: ImageProcessor,
    labels: list[str],
    shared: bool = False,
) -> tuple[PackedBatch, Tally]:
    """(the micro-batch, what decoding it lost). `labels`: the sources' names, for the counts."""
    patch_dim = 3 * processor.cfg.patch_size**2
    images = [im for row in plan.rows for s in row for im in s.images]
    total = sum(im.num_patches for im in images)
    pixels = _pixel_buffer(total, patch_dim, shared) if images else None
    out = pixels.numpy() if images else None
    lost = Tally()
    rows, grids, o = [], [], 0
    for row in plan.rows:
        kept = []
        for s in row:
            start = o
            try:
                for im in s.images:
                    processor.pixels_into(im, out[o : o + im.num_patches])
                    o += im.num_patches
            except ImageError as e:
                o = start  # the sample's images are overwritten by the next sample's
                label = labels[s.source] if 0 <= s.source < len(labels) else "?"
                first = not lost.counters
                lost.skip(label, CORRUPT_IMAGE)
                lost.stats["samples_packed"] -= 1
                lost.stats["tokens"] -= len(s)
                lost.stats["image_tokens"] -= sum(im.num_tokens for im in s.images)
                lost.stats["images"] -= len(s.images)
                (log.warning if first else log.debug)(
                    "skipping bad input (%s): sample %s: %s", CORRUPT_IMAGE, s.key, e
                )
                continue
            kept.append(s)
            grids += [im.grid for im in s.images]
        rows.append(kept)
    batch = token_batch(rows, row_tokens, pad_id, image_pad_id)
    if grids:
        grids_I2 = np.asarray(grids, dtype=np.int64)
        batch.pixel_patches = pixels if o == total else pixels[:o]
        batch.patch_coords = torch.from_numpy(patch_coords(grids_I2))
        batch.image_grids = torch.from_numpy(grids_I2)
    return batch, lost
