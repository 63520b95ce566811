"""Pictures of what the chunk module did: an image with its merged patches outlined by concept, and
a text sample with its concept boundaries marked. Used by the TensorBoard dashboard at eval steps.

Legend: B rows, T tokens, H height, W width.
"""

from __future__ import annotations

import colorsys

import numpy as np
import torch
from PIL import Image, ImageDraw

from configs.batch import IMAGE, PackedBatch
from vision.image_processor import unpatchify


def _palette(n: int) -> list[tuple[int, int, int]]:
    """n well-separated colours (golden-ratio hue steps)."""
    out = []
    for i in range(max(n, 1)):
        r, g, b = colorsys.hsv_to_rgb((i * 0.618034) % 1.0, 0.75, 1.0)
        out.append((int(r * 255), int(g * 255), int(b * 255)))
    return out


def concept_ids(boundary_BT: torch.Tensor) -> torch.Tensor:
    """Concept index of every position in its row: a boundary closes a concept, so the concept of
    token n is the number of boundaries strictly before n (the token at a boundary belongs to the
    concept it closes)."""
    b = boundary_BT.long()
    return b.cumsum(1) - b


def first_image(
    batch: PackedBatch, patch_size: int, merge: int, denormalize
) -> tuple[np.ndarray, int, int, tuple[int, int]] | None:
    """(pixels HxWx3 uint8, row, first token position, merged grid) of the batch's first image, or None."""
    if batch.image_grids is None or batch.image_grids.numel() == 0:
        return None
    rows, cols = (int(v) for v in batch.image_grids[0])
    patches = batch.pixel_patches[: rows * cols].cpu()  # denormalize reads uint8 or float
    x = denormalize(patches).clamp(0, 1)
    img_3HW = unpatchify(x, (rows, cols), patch_size)
    pixels = (img_3HW.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    img_pos = (batch.modality == IMAGE).nonzero(as_tuple=False)
    if img_pos.numel() == 0:
        return None
    row, start = int(img_pos[0, 0]), int(img_pos[0, 1])
    return pixels, row, start, (rows // merge, cols // merge)


def render_image_concepts(
    pixels: np.ndarray, concept_of_token: np.ndarray, grid: tuple[int, int], scale: int = 4
) -> np.ndarray:
    """Overlay each merged patch with its concept's colour and outline the borders between concepts.

    `concept_of_token` holds the concept id of each image token in raster order of the merged grid.
    Returns an HxWx3 uint8 array.
    """
    gr, gc = grid
    H, W = pixels.shape[:2]
    img = Image.fromarray(pixels).resize((W * scale, H * scale), Image.Resampling.NEAREST)
    ch, cw = img.height / gr, img.width / gc
    ids = concept_of_token.reshape(gr, gc)
    uniq = {c: i for i, c in enumerate(np.unique(ids))}
    colours = _palette(len(uniq))
    overlay = Image.new("RGBA", img.size, (0, 0, 0, 0))
    draw = ImageDraw.Draw(overlay)
    for r in range(gr):
        for c in range(gc):
            col = colours[uniq[ids[r, c]]]
            draw.rectangle([c * cw, r * ch, (c + 1) * cw - 1, (r + 1) * ch - 1], fill=col + (70,))
    # Outline: a line wherever two neighbouring cells read different concepts.
    for r in range(gr):
        for c in range(gc):
            x0, y0, x1, y1 = c * cw, r * ch, (c + 1) * cw, (r + 1) * ch
            if c + 1 < gc and ids[r, c] != ids[r, c + 1]:
                draw.line([x1, y0, x1, y1], fill=(255, 255, 255, 255), width=2)
            if r + 1 < gr and ids[r, c] != ids[r + 1, c]:
                draw.line([x0, y1, x1, y1], fill=(255, 255, 255, 255), width=2)
    draw.rectangle([0, 0, img.width - 1, img.height - 1], outline=(255, 255, 255, 255), width=2)
    return np.asarray(Image.alpha_composite(img.convert("RGBA"), overlay).convert("RGB"))


def image_concept_picture(
    batch: PackedBatch, boundary_BT: torch.Tensor, patch_size: int, merge: int, denormalize
) -> np.ndarray | None:
    found = first_image(batch, patch_size, merge, denormalize)
    if found is None:
        return None
    pixels, row, start, grid = found
    n = grid[0] * grid[1]
    cid = concept_ids(boundary_BT.cpu())[row, start : start + n].numpy()
    if cid.shape[0] != n:
        return None
    return render_image_concepts(pixels, cid, grid)


def text_with_boundaries(
    batch: PackedBatch, boundary_BT: torch.Tensor, decode, max_tokens: int = 400, sep: str = "|"
) -> str:
    """The first document of the batch with `sep` after every concept (runs of image tokens collapsed)."""
    row = 0
    doc = batch.doc_ids[row].cpu()
    ids = batch.input_ids[row].cpu()
    mod = batch.modality[row].cpu()
    b = boundary_BT[row].cpu()
    pos = (doc == doc[0]).nonzero().flatten()[:max_tokens].tolist() if doc[0] >= 0 else []
    pieces, cur, img_run = [], [], 0
    for t in pos:  # display only (a few hundred tokens at eval steps), not a hot path
        if mod[t] == IMAGE:
            if cur:
                pieces.append(decode(cur))
                cur = []
            img_run += 1
        else:
            if img_run:
                pieces.append(f"[{img_run} image tokens]")
                img_run = 0
            cur.append(int(ids[t]))
        if b[t]:
            if cur:
                pieces.append(decode(cur))
                cur = []
            if img_run:
                pieces.append(f"[{img_run} image tokens]")
                img_run = 0
            pieces.append(sep)
    if cur:
        pieces.append(decode(cur))
    if img_run:
        pieces.append(f"[{img_run} image tokens]")
    return "".join(pieces)
