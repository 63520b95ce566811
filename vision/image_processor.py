"""Image processor: decode any image safely, resize to a patch budget keeping the
aspect ratio, patchify.

Pillow only (torchvision does not import on a CPU-only torch). The output is what the packed NaViT
encoder consumes: one row per patch, channel-major inside a patch (c, ph, pw), so that a timm ViT's
conv patch embedding flattens onto it directly, plus each patch's (row, col) in its image's grid.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from configs.config import ValidatedOnInit, check

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ImageError(ValueError):
    """An image the system cannot use (corrupt, truncated, empty, too large); the message names its source."""


@dataclass
class ImageProcessorConfig(ValidatedOnInit):
    """How images become patches. The patch geometry (`patch_size`, `merge`) is stated here only:
    the vision encoder gets it from the processor config next to it (VisionConfig), and a training
    run's loader patchifies with that same processor config."""

    patch_size: int = 14
    min_patches: int = 4  # per image, before merge
    max_patches: int = 256  # per image, before merge
    merge: Literal[1, 2] = 2  # 2: 2x2 patches are merged into one LLM token, so grids are even
    # decompression-bomb guard, checked on the header's size before decoding
    max_pixels: int = 50_000_000
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    def validate(self) -> None:
        check(self.patch_size >= 1, f"patch_size must be >= 1, got {self.patch_size}")
        check(self.merge in (1, 2), f"merge must be 1 or 2, got {self.merge}")
        m2 = self.merge**2
        check(self.min_patches >= 1, f"min_patches must be >= 1, got {self.min_patches}")
        check(
            self.max_patches >= m2,
            f"max_patches must be >= merge**2 = {m2} (one merged token), got {self.max_patches}",
        )
        check(
            self.min_patches <= self.max_patches,
            f"min_patches={self.min_patches} must be <= max_patches={self.max_patches}",
        )
        check(
            math.ceil(self.min_patches / m2) <= self.max_patches // m2,
            f"no grid of {self.merge}x{self.merge} blocks has between "
            f"min_patches={self.min_patches} and "
            f"max_patches={self.max_patches} patches; widen the range",
        )
        check(self.max_pixels >= 1, f"max_pixels must be >= 1, got {self.max_pixels}")
        check(
            len(self.mean) == 3 and len(self.std) == 3,
            f"mean and std need 3 values (R, G, B), got {list(self.mean)} and {list(self.std)}",
        )
        check(all(s > 0 for s in self.std), f"std values must be > 0, got {list(self.std)}")


@dataclass
class ProcessedImage:
    # [P, 3*patch*patch] float32, normalised, raster order, (c, ph, pw) inside a patch
    patches_PD: torch.Tensor
    coords_P2: torch.Tensor  # [P, 2] long, (row, col) in the patch grid
    grid: tuple[int, int]  # (rows, cols) in patches, both multiples of `merge`
    merge: int = 1

    @property
    def num_tokens(self) -> int:
        """Tokens the LLM sees for this image (after the merge)."""
        return (self.grid[0] // self.merge) * (self.grid[1] // self.merge)


def choose_grid(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """(rows, cols) in patches for an image of `height` x `width` pixels.

    Works in merge-units (merge x merge patch blocks). The target is the image's natural size in
    units, each side raised to at least one unit (so a 1x1000 strip aims for 1 x 36 units, not for
    an aspect ratio no grid can show), with the area clamped into the budget. Every feasible row
    count (and column count) is scored at once by the squared log errors in aspect ratio and in
    area, and the best one wins.
    """
    unit = cfg.patch_size * cfg.merge
    m2 = cfg.merge**2
    min_u, max_u = math.ceil(cfg.min_patches / m2), cfg.max_patches // m2
    r0, c0 = max(height / unit, 1.0), max(width / unit, 1.0)
    area = min(max(r0 * c0, min_u), max_u)
    aspect = r0 / c0
    u = np.arange(1, max_u + 1, dtype=np.float64)  # side lengths, in units

    def fit(other: np.ndarray, ideal: np.ndarray) -> np.ndarray:
        """Clamp a side length into what the budget allows next to `other` (nan where nothing fits)."""
        lo, hi = np.maximum(np.ceil(min_u / other), 1.0), np.floor(max_u / other)
        out = np.minimum(np.maximum(ideal, lo), hi)
        return np.where(lo <= hi, out, np.nan)

    # Candidates driven by each side in turn (floor and ceil of the ideal other side), so that the
    # choice is the same for an image and its transpose.
    rows = np.concatenate([u, u, fit(u, np.floor(u * aspect)), fit(u, np.ceil(u * aspect))])
    cols = np.concatenate([fit(u, np.floor(u / aspect)), fit(u, np.ceil(u / aspect)), u, u])
    # Squared log errors: with absolute values whole runs of grids tie exactly, and then which one
    # wins depends on the scan order (an image and its transpose would get different grids).
    score = np.log(rows / cols / aspect) ** 2 + np.log(rows * cols / area) ** 2
    score = np.round(np.where(np.isnan(score), np.inf, score), 12)
    best = int(np.lexsort((-rows * cols, score))[0])  # ties: the larger grid
    return int(rows[best]) * cfg.merge, int(cols[best]) * cfg.merge


def to_rgb(img: Image.Image) -> Image.Image:
    """Any Pillow mode -> RGB. Transparency is composited over white; 16/32-bit and float scale to 8 bits."""
    if img.mode == "RGB":
        return img
    if img.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        arr = np.asarray(img, dtype=np.float64)
        # 16-bit data spans 0..65535; 32-bit int/float data has no fixed range, so stretch it if it
        # leaves 0..255.
        if img.mode.startswith("I;16"):
            arr = arr / 257.0
        elif arr.size and (arr.max() > 255 or arr.min() < 0):
            lo, hi = float(arr.min()), float(arr.max())
            arr = (arr - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(arr)
        gray = Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), mode="L")
        return gray.convert("RGB")
    has_alpha = img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info
    if has_alpha:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def patchify(x_3HW: torch.Tensor, patch: int) -> torch.Tensor:
    """[3, H, W] -> [P, 3*patch*patch], raster order over the grid, (c, ph, pw) inside a patch."""
    c, h, w = x_3HW.shape
    rows, cols = h // patch, w // patch
    x = x_3HW.reshape(c, rows, patch, cols, patch).permute(1, 3, 0, 2, 4)
    return x.reshape(rows * cols, c * patch * patch)


def unpatchify(patches_PD: torch.Tensor, grid: tuple[int, int], patch: int) -> torch.Tensor:
    """Inverse of `patchify`: [P, 3*patch*patch] -> [3, rows*patch, cols*patch]."""
    rows, cols = grid
    c = patches_PD.shape[1] // (patch * patch)
    x = patches_PD.reshape(rows, cols, c, patch, patch).permute(2, 0, 3, 1, 4)
    return x.reshape(c, rows * patch, cols * patch)


def grid_coords(rows: int, cols: int) -> torch.Tensor:
    """[rows*cols, 2] (row, col) in raster order."""
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack([r.reshape(-1), c.reshape(-1)], dim=1)


class ImageProcessor:
    def __init__(self, cfg: ImageProcessorConfig | None = None):
        self.cfg = cfg or ImageProcessorConfig()  # validated when it was made
        self._mean_3 = np.asarray(self.cfg.mean, dtype=np.float32)
        self._std_3 = np.asarray(self.cfg.std, dtype=np.float32)

    def __call__(
        self, image: "Image.Image | bytes | str | os.PathLike", source: str = ""
    ) -> ProcessedImage:
        img = self.load(image, source, for_patches=True)
        rows, cols = choose_grid(img.height, img.width, self.cfg)
        p = self.cfg.patch_size
        img = img.resize((cols * p, rows * p), Image.Resampling.BICUBIC)
        # numpy, not torch: single-threaded and cheap in data-loader workers (torch's OpenMP pool
        # stalls on busy machines for arrays this small).
        x_HW3 = np.asarray(img, dtype=np.float32) * np.float32(1 / 255.0)
        x_HW3 = (x_HW3 - self._mean_3) / self._std_3
        patches = (
            x_HW3.reshape(rows, p, cols, p, 3)
            .transpose(0, 2, 4, 1, 3)
            .reshape(rows * cols, 3 * p * p)
        )
        return ProcessedImage(
            torch.from_numpy(np.ascontiguousarray(patches)),
            grid_coords(rows, cols),
            (rows, cols),
            self.cfg.merge,
        )

    def tokens_for_size(self, height: int, width: int) -> int:
        """LLM tokens an image of this pixel size will take (without decoding it)."""
        rows, cols = choose_grid(height, width, self.cfg)
        return (rows // self.cfg.merge) * (cols // self.cfg.merge)

    def denormalize(self, patches_PD: torch.Tensor) -> torch.Tensor:
        """Undo the mean/std normalisation of patches (values back in 0..1)."""
        p2 = self.cfg.patch_size**2
        mean = torch.from_numpy(self._mean_3).repeat_interleave(p2).to(patches_PD)
        std = torch.from_numpy(self._std_3).repeat_interleave(p2).to(patches_PD)
        return patches_PD * std + mean

    def load(
        self,
        image: "Image.Image | bytes | str | os.PathLike",
        source: str = "",
        for_patches: bool = False,
    ) -> Image.Image:
        """Decode to an RGB Pillow image; every failure becomes an ImageError naming the source.

        for_patches: the image will be resized to its patch grid, so a JPEG may be decoded at a
        reduced DCT scale (libjpeg's draft mode) that is still at least the grid's pixel size.
        """
        if isinstance(image, (str, os.PathLike)):
            name = source or os.fspath(image)
            if not os.path.isfile(image):
                raise ImageError(f"image {name}: file not found")
            with open(image, "rb") as f:
                data = f.read()
            return self._decode(data, name, for_patches)
        if isinstance(image, (bytes, bytearray, memoryview)):
            return self._decode(bytes(image), source or "<bytes>", for_patches)
        if isinstance(image, Image.Image):
            return self._finish(image, source or "<PIL image>")
        raise ImageError(
            f"image {source or '<unknown>'}: expected a PIL "
            f"image, bytes or a path, got {type(image).__name__}"
        )

    def _decode(self, data: bytes, name: str, for_patches: bool = False) -> Image.Image:
        if not data:
            raise ImageError(f"image {name}: empty data (0 bytes)")
        try:
            img = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as e:
            # Pillow's own guard fires in open() for absurd headers
            raise ImageError(
                f"image {name}: exceeds the pixel limit, "
                f"max_pixels={self.cfg.max_pixels} (decompression-bomb guard: {e})"
            ) from None
        except UnidentifiedImageError:
            raise ImageError(
                f"image {name}: not a recognised image format ({len(data)} bytes)"
            ) from None
        except Exception as e:  # noqa: BLE001 - Pillow raises many types (SyntaxError, struct.error, ...) on broken headers
            raise ImageError(f"image {name}: cannot be read ({type(e).__name__}: {e})") from None
        return self._finish(img, name, for_patches)

    def _finish(self, img: Image.Image, name: str, for_patches: bool = False) -> Image.Image:
        w, h = img.size
        if w < 1 or h < 1:
            raise ImageError(f"image {name}: has no pixels ({w}x{h})")
        if w * h > self.cfg.max_pixels:  # read from the header: nothing has been decoded yet
            raise ImageError(
                f"image {name}: {w}x{h} = {w * h} pixels exceeds "
                f"max_pixels={self.cfg.max_pixels} (decompression-bomb guard)"
            )
        try:
            with warnings.catch_warnings():
                # our own guard is above
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                if for_patches and img.format == "JPEG" and img.mode in ("RGB", "L", "YCbCr"):
                    rows, cols = choose_grid(h, w, self.cfg)
                    img.draft(img.mode, (cols * self.cfg.patch_size, rows * self.cfg.patch_size))
                img.load()
                # a copy would double the decoded bytes
                ImageOps.exif_transpose(img, in_place=True)
                return to_rgb(img)
        except Exception as e:  # noqa: BLE001 - truncated streams, bad chunks, decoder errors, Pillow's own bomb error
            raise ImageError(f"image {name}: cannot be decoded ({type(e).__name__}: {e})") from None
