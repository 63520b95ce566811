"""Image processor: decode any image safely, resize to a patch budget keeping the
aspect ratio, patchify.

Legend: D width, P patches, H height, W width.

Pillow only (torchvision does not import on a CPU-only torch). The output is what the packed NaViT
encoder consumes: one row per patch, channel-major inside a patch (c, ph, pw), so that a timm ViT's
conv patch embedding flattens onto it directly, plus each patch's (row, col) in its image's grid.
"""

from __future__ import annotations

import functools
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

try:  # optional: views of Pillow's pixels without a copy (rgb_view)
    import pyarrow as _pa
except ImportError:  # pragma: no cover - the copying path gives the same pixels
    _pa = None

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
    """(rows, cols) in patches for an image of `height` x `width` pixels (cached: a data set holds
    few distinct sizes, and scoring every candidate costs a quarter of a millisecond).

    Works in merge-units (merge x merge patch blocks). The target is the image's natural size in
    units, each side raised to at least one unit (so a 1x1000 strip aims for 1 x 36 units, not for
    an aspect ratio no grid can show), with the area clamped into the budget. Every feasible row
    count (and column count) is scored at once by the squared log errors in aspect ratio and in
    area, and the best one wins.
    """
    return _choose_grid(
        int(height), int(width), cfg.patch_size, cfg.merge, cfg.min_patches, cfg.max_patches
    )


@functools.lru_cache(maxsize=65536)
def _choose_grid(
    height: int, width: int, patch_size: int, merge: int, min_patches: int, max_patches: int
) -> tuple[int, int]:
    unit = patch_size * merge
    m2 = merge**2
    min_u, max_u = math.ceil(min_patches / m2), max_patches // m2
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
    return int(rows[best]) * merge, int(cols[best]) * merge


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


def rgb_view(img: Image.Image) -> np.ndarray:
    """[H, W, 3] uint8 pixels of an RGB image. Where Pillow exports its memory through the Arrow C
    data interface (Pillow >= 11.2, with pyarrow installed) this is a view of it (RGB is held as
    RGBX); else `np.asarray` copies it out, at about a tenth of a resize's time per image."""
    if _pa is not None and img.mode == "RGB":
        try:
            arr = _pa.array(img)
            if isinstance(arr.type, _pa.FixedSizeListType) and arr.type.list_size == 4:
                flat = arr.flatten().to_numpy(zero_copy_only=True)
                return flat.reshape(img.height, img.width, 4)[..., :3]
        except Exception:  # noqa: BLE001 - not exportable (an older Pillow, a chunked image): copy
            pass
    return np.asarray(img)


def grid_coords(rows: int, cols: int) -> torch.Tensor:
    """[rows*cols, 2] (row, col) in raster order."""
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack([r.reshape(-1), c.reshape(-1)], dim=1)


# EXIF orientation tag -> the transpose that shows the image upright (ImageOps.exif_transpose's table)
ORIENTATION_TAG = 0x0112
UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


class ImageTooLarge(ImageError):
    """An image whose header states more pixels than max_pixels (nothing was decoded)."""


@dataclass(frozen=True)
class ImagePlan:
    """An image placed in a batch before it is decoded: its bytes, its patch grid and EXIF
    orientation (both read from the header: `ImageProcessor.plan`), and where it came from, for
    messages. `ImageProcessor.pixels_into` decodes it to exactly that grid."""

    data: bytes
    grid: tuple[int, int]  # (rows, cols) in patches, upright
    orientation: int  # EXIF orientation tag, 1 = as stored
    source: str = ""
    merge: int = 1

    @property
    def num_tokens(self) -> int:
        return (self.grid[0] // self.merge) * (self.grid[1] // self.merge)

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]


def normalize_pixels(
    pixels_PD: torch.Tensor, mean_D: torch.Tensor, std_D: torch.Tensor
) -> torch.Tensor:
    """uint8 patches (0..255, channel-major inside a patch) -> the normalised float32 patches the
    encoder reads: the processor's float path computes the same operations in the same order, so
    the numbers are equal (`mean_D`, `std_D`: per channel, each repeated patch_size**2 times)."""
    # a Python scalar multiplies in float32, as numpy's float32 scalar does; mean and std are
    # tensors, since CUDA divides by a scalar as a multiplication by its reciprocal
    x = pixels_PD.to(torch.float32) * (1 / 255.0)
    return (x - mean_D) / std_D


def channel_stats(
    values: tuple[float, ...], patch_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[3 * patch_size**2] float32: each channel's value repeated over a patch's pixels (c, ph, pw).
    Filled on `device` from Python floats (rounded to float32 as numpy rounds them): no copy from
    the host, so a GPU step does not wait for one."""
    out = torch.empty(len(values), patch_size**2, dtype=torch.float32, device=device)
    for c, v in enumerate(values):
        out[c].fill_(float(v))
    return out.reshape(-1)


class ImageProcessor:
    """Bytes, a path or a Pillow image -> patches. Two outputs of one computation: `pixels` (uint8,
    what the training loader ships; the model normalises them on its device: `normalize_pixels`)
    and `__call__` (normalised float32, for prompts and tools)."""

    def __init__(self, cfg: ImageProcessorConfig | None = None):
        self.cfg = cfg or ImageProcessorConfig()  # validated when it was made
        self._mean_3 = np.asarray(self.cfg.mean, dtype=np.float32)
        self._std_3 = np.asarray(self.cfg.std, dtype=np.float32)
        p2 = self.cfg.patch_size**2
        self._mean_D = np.repeat(self._mean_3, p2)
        self._std_D = np.repeat(self._std_3, p2)

    def __call__(
        self, image: "Image.Image | bytes | str | os.PathLike", source: str = ""
    ) -> ProcessedImage:
        pixels_PD, grid = self.pixels(image, source)
        # numpy, not torch: single-threaded and cheap in data-loader workers (torch's OpenMP pool
        # stalls on busy machines for arrays this small). The operations of normalize_pixels.
        x_PD = pixels_PD.astype(np.float32) * np.float32(1 / 255.0)
        x_PD = (x_PD - self._mean_D) / self._std_D
        return ProcessedImage(torch.from_numpy(x_PD), grid_coords(*grid), grid, self.cfg.merge)

    def pixels(
        self, image: "Image.Image | bytes | str | os.PathLike", source: str = ""
    ) -> tuple[np.ndarray, tuple[int, int]]:
        """([P, 3*patch*patch] uint8 patches, (rows, cols)). Encoded bytes (or a file) get their
        grid from the header, as the loader plans them; a Pillow image from its size."""
        if isinstance(image, Image.Image):
            img = self._finish(image, source or "<PIL image>")
            grid = choose_grid(img.height, img.width, self.cfg)
            out = np.empty((grid[0] * grid[1], 3 * self.cfg.patch_size**2), dtype=np.uint8)
            self._patchify_into(self._resize(img, grid), grid, out)
            return out, grid
        data, name = self._read(image, source)
        plan = self.plan(data, name)
        out = np.empty((plan.num_patches, 3 * self.cfg.patch_size**2), dtype=np.uint8)
        self.pixels_into(plan, out)
        return out, plan.grid

    # ------------------------------------------------------------ plan, then decode
    def plan(self, data: bytes, source: str = "") -> ImagePlan:
        """Read the header only (size, EXIF orientation) and choose the grid. Raises ImageTooLarge
        over max_pixels, ImageError when the header cannot be read or states no pixels."""
        w, h, orientation = self.read_header(data, source)
        self.check_size(w, h, source)
        return self.plan_size(data, w, h, orientation, source)

    def plan_size(
        self, data: bytes, w: int, h: int, orientation: int, source: str = ""
    ) -> ImagePlan:
        """The plan of an image whose header said (w, h, orientation) and whose size was checked
        (the loader's index keeps headers: data_pipelines.index)."""
        if orientation in (5, 6, 7, 8):
            w, h = h, w
        return ImagePlan(data, choose_grid(h, w, self.cfg), orientation, source, self.cfg.merge)

    def read_header(self, data: bytes, source: str = "") -> tuple[int, int, int]:
        """(width, height, EXIF orientation) as stored, from the header alone. Raises ImageTooLarge
        when Pillow's own guard refuses the header, ImageError when it cannot be read; the size is
        not checked against max_pixels here (`check_size`)."""
        img = self._open(data, source)
        w, h = img.size
        orientation = 1
        # A PNG keeps its EXIF in a chunk Pillow reads only with the pixels when it follows them:
        # the header's view is what both the plan and the decode go by.
        if "exif" in img.info or img.format not in ("PNG", None):
            try:
                orientation = int(img.getexif().get(ORIENTATION_TAG, 1) or 1)
            except Exception:  # noqa: BLE001 - a broken EXIF block: shown as stored, as Pillow does
                orientation = 1
            orientation = orientation if orientation in UPRIGHT else 1
        return w, h, orientation

    def pixels_into(self, plan: ImagePlan, out_PD: np.ndarray) -> None:
        """Decode a planned image into `out_PD` ([P, 3*patch*patch] uint8, P = its grid's patches):
        a JPEG at the smallest DCT scale still at least the grid's pixel size, upright, RGB, one
        bicubic resize to the grid. Raises ImageError when the pixels cannot be decoded."""
        name = plan.source or "<bytes>"
        img = self._open(plan.data, name)
        self._check_size(*img.size, name)
        rows, cols = plan.grid
        p = self.cfg.patch_size
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                if img.format == "JPEG" and img.mode in ("RGB", "L", "YCbCr"):
                    swap = plan.orientation in (5, 6, 7, 8)
                    img.draft(
                        img.mode, ((rows if swap else cols) * p, (cols if swap else rows) * p)
                    )
                img.load()
                if plan.orientation != 1:
                    img = img.transpose(UPRIGHT[plan.orientation])
                img = to_rgb(img)
        except Exception as e:  # noqa: BLE001 - truncated streams, bad chunks, decoder errors
            raise ImageError(f"image {name}: cannot be decoded ({type(e).__name__}: {e})") from None
        self._patchify_into(self._resize(img, plan.grid), plan.grid, out_PD)

    def _resize(self, img: Image.Image, grid: tuple[int, int]) -> Image.Image:
        p = self.cfg.patch_size
        size = (grid[1] * p, grid[0] * p)
        return img if img.size == size else img.resize(size, Image.Resampling.BICUBIC)

    def _patchify_into(self, img: Image.Image, grid: tuple[int, int], out_PD: np.ndarray) -> None:
        """Raster order over the grid, (c, ph, pw) inside a patch: one strided copy, in uint8."""
        rows, cols = grid
        p = self.cfg.patch_size
        x = rgb_view(img)
        out_PD.reshape(rows, cols, 3, p, p)[...] = x.reshape(rows, p, cols, p, 3).transpose(
            0, 2, 4, 1, 3
        )

    def tokens_for_size(self, height: int, width: int) -> int:
        """LLM tokens an image of this pixel size will take (without decoding it)."""
        rows, cols = choose_grid(height, width, self.cfg)
        return (rows // self.cfg.merge) * (cols // self.cfg.merge)

    def denormalize(self, patches_PD: torch.Tensor) -> torch.Tensor:
        """Patches back to values in 0..1: normalised floats undo the mean/std, uint8 pixels are
        divided by 255."""
        if patches_PD.dtype == torch.uint8:
            return patches_PD.float() / 255.0
        patches_PD = patches_PD.float()
        mean = torch.from_numpy(self._mean_D).to(patches_PD)
        std = torch.from_numpy(self._std_D).to(patches_PD)
        return patches_PD * std + mean

    # ------------------------------------------------------------ decoding
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
        if isinstance(image, Image.Image):
            return self._finish(image, source or "<PIL image>")
        data, name = self._read(image, source)
        return self._decode(data, name, for_patches)

    def _read(self, image, source: str) -> tuple[bytes, str]:
        if isinstance(image, (str, os.PathLike)):
            name = source or os.fspath(image)
            if not os.path.isfile(image):
                raise ImageError(f"image {name}: file not found")
            with open(image, "rb") as f:
                return f.read(), name
        if isinstance(image, (bytes, bytearray, memoryview)):
            return bytes(image), source or "<bytes>"
        raise ImageError(
            f"image {source or '<unknown>'}: expected a PIL "
            f"image, bytes or a path, got {type(image).__name__}"
        )

    def _open(self, data: bytes, name: str) -> Image.Image:
        if not data:
            raise ImageError(f"image {name}: empty data (0 bytes)")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                return Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as e:
            # Pillow's own guard fires in open() for absurd headers
            raise ImageTooLarge(
                f"image {name}: exceeds the pixel limit, "
                f"max_pixels={self.cfg.max_pixels} (decompression-bomb guard: {e})"
            ) from None
        except UnidentifiedImageError:
            raise ImageError(
                f"image {name}: not a recognised image format ({len(data)} bytes)"
            ) from None
        except Exception as e:  # noqa: BLE001 - Pillow raises many types (SyntaxError, struct.error, ...) on broken headers
            raise ImageError(f"image {name}: cannot be read ({type(e).__name__}: {e})") from None

    def check_size(self, w: int, h: int, name: str) -> None:
        """ImageError for an image without pixels, ImageTooLarge over max_pixels."""
        self._check_size(w, h, name)

    def _check_size(self, w: int, h: int, name: str) -> None:
        if w < 1 or h < 1:
            raise ImageError(f"image {name}: has no pixels ({w}x{h})")
        if w * h > self.cfg.max_pixels:  # read from the header: nothing has been decoded yet
            raise ImageTooLarge(
                f"image {name}: {w}x{h} = {w * h} pixels exceeds "
                f"max_pixels={self.cfg.max_pixels} (decompression-bomb guard)"
            )

    def _decode(self, data: bytes, name: str, for_patches: bool = False) -> Image.Image:
        return self._finish(self._open(data, name), name, for_patches)

    def _finish(self, img: Image.Image, name: str, for_patches: bool = False) -> Image.Image:
        w, h = img.size
        self._check_size(w, h, name)
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
