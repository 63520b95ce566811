"""Image processor: budgets, aspect ratio, every mode to RGB, safe decoding, exact patchify round trip.

Legend: D width, P patches, H height, W width.
"""

import io
import random
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from configs.config import ConfigError, from_dict
from vision.image_processor import (
    ImageError,
    ImageProcessor,
    ImageProcessorConfig,
    choose_grid,
    patchify,
    unpatchify,
)


def _check_valid(out, cfg):
    rows, cols = out.grid
    P = rows * cols
    assert (
        rows % cfg.merge == 0 and cols % cfg.merge == 0 and rows >= cfg.merge and cols >= cfg.merge
    )
    assert cfg.min_patches <= P <= cfg.max_patches
    assert (
        out.patches_PD.shape == (P, 3 * cfg.patch_size**2) and out.patches_PD.dtype == torch.float32
    )
    assert torch.isfinite(out.patches_PD).all()
    assert out.coords_P2.dtype == torch.long
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    assert torch.equal(out.coords_P2, torch.stack([r.flatten(), c.flatten()], 1))
    assert out.num_tokens == (rows // cfg.merge) * (cols // cfg.merge)


@pytest.mark.parametrize("merge", [1, 2])
@pytest.mark.parametrize(
    "size", [(1, 1000), (1000, 1), (1, 1), (1, 100000), (100000, 1), (3, 5), (4000, 3000)]
)
def test_extreme_sizes_give_valid_grid(size, merge):
    cfg = ImageProcessorConfig(merge=merge, max_patches=64, min_patches=4)
    out = ImageProcessor(cfg)(Image.new("RGB", size, (200, 30, 90)), "x")
    _check_valid(out, cfg)
    w, h = size
    if w > 50 * h:  # wide strip stays wide, tall strip stays tall
        assert out.grid[1] > out.grid[0]
    if h > 50 * w:
        assert out.grid[0] > out.grid[1]


def test_grid_keeps_aspect_and_respects_budget_everywhere():
    rng = random.Random(0)
    for _ in range(300):
        merge = rng.choice([1, 2])
        lo = rng.randint(1, 40)
        hi = rng.randint(max(lo, merge * merge, 4 * ((lo + 3) // 4)), 400)
        cfg = ImageProcessorConfig(
            merge=merge, min_patches=lo, max_patches=hi, patch_size=rng.choice([8, 14, 16])
        )
        h, w = rng.randint(1, 5000), rng.randint(1, 5000)
        rows, cols = choose_grid(h, w, cfg)
        assert rows % merge == 0 and cols % merge == 0 and rows >= merge and cols >= merge
        assert lo <= rows * cols <= hi, (h, w, rows, cols, cfg)
        # an image and its transpose get transposed grids
        assert choose_grid(w, h, cfg) == (cols, rows)
    cfg = ImageProcessorConfig(max_patches=256, merge=2)
    rows, cols = choose_grid(480, 640, cfg)  # big image: fills the budget, keeps 3:4
    assert rows * cols > 0.9 * 256 and abs(cols / rows - 4 / 3) < 0.1
    # small image keeps its natural size (no needless upscaling)
    assert choose_grid(56, 56, cfg) == (4, 4)
    assert choose_grid(56, 112, cfg) == (4, 8)


@pytest.mark.parametrize(
    "mode", ["1", "L", "LA", "RGBA", "P", "PA", "CMYK", "I;16", "I", "F", "YCbCr", "RGB"]
)
def test_odd_modes_become_rgb(mode):
    cfg = ImageProcessorConfig(max_patches=16)
    out = ImageProcessor(cfg)(Image.new(mode, (37, 23)), mode)
    _check_valid(out, cfg)


def _rgb_of(img):
    """Pixel (0,0) of the processor's decoded RGB image, in 0..255."""
    return ImageProcessor(ImageProcessorConfig()).load(img).getpixel((0, 0))


def test_mode_conversion_values():
    # transparent -> white
    assert _rgb_of(Image.new("RGBA", (4, 4), (255, 0, 0, 0))) == (255, 255, 255)
    assert _rgb_of(Image.new("RGBA", (4, 4), (255, 0, 0, 255))) == (255, 0, 0)
    assert _rgb_of(Image.new("LA", (4, 4), (0, 0))) == (255, 255, 255)
    assert _rgb_of(Image.new("L", (4, 4), 77)) == (77, 77, 77)
    # 16 bit scales, not clips
    assert _rgb_of(Image.new("I;16", (4, 4), 65535)) == (255, 255, 255)
    assert _rgb_of(Image.new("I;16", (4, 4), 257 * 100)) == (100, 100, 100)
    assert _rgb_of(Image.new("1", (4, 4), 1)) == (255, 255, 255)
    pal = Image.new("P", (4, 4), 1)
    pal.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    assert _rgb_of(pal) == (10, 20, 30)
    assert _rgb_of(Image.new("CMYK", (4, 4), (0, 0, 0, 0))) == (255, 255, 255)


def _encode(img, fmt):
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def test_path_bytes_and_pil_inputs_agree(tmp_path):
    arr = np.random.default_rng(0).integers(0, 255, (50, 70, 3), dtype=np.uint8)
    img = Image.fromarray(arr)
    data = _encode(img, "PNG")
    (tmp_path / "a.png").write_bytes(data)
    proc = ImageProcessor(ImageProcessorConfig(max_patches=32))
    a, b, c = proc(img), proc(data), proc(tmp_path / "a.png")
    assert torch.equal(a.patches_PD, b.patches_PD) and torch.equal(b.patches_PD, c.patches_PD)
    assert a.grid == b.grid == c.grid


def test_round_trip_reproduces_resized_image():
    arr = np.random.default_rng(1).integers(0, 255, (61, 83, 3), dtype=np.uint8)
    img = Image.fromarray(arr)
    cfg = ImageProcessorConfig(patch_size=7, max_patches=64, merge=2)
    proc = ImageProcessor(cfg)
    out = proc(img)
    rows, cols = out.grid
    resized = img.resize((cols * 7, rows * 7), Image.Resampling.BICUBIC)
    expected = np.asarray(resized, dtype=np.float32) / 255
    back_3HW = unpatchify(proc.denormalize(out.patches_PD), out.grid, 7)
    assert back_3HW.shape == (3, rows * 7, cols * 7)
    assert torch.allclose(back_3HW.permute(1, 2, 0), torch.from_numpy(expected), atol=1e-5)
    # patchify is the exact inverse of unpatchify
    x = torch.randn(3, 4 * 5, 6 * 5)
    assert torch.equal(unpatchify(patchify(x, 5), (4, 6), 5), x)
    # patch 7 = row 1, col 1; (c, ph, pw)
    assert torch.equal(patchify(x, 5)[7], x[:, 5:10, 5:10].reshape(-1))


def _fake_png_header(width, height):
    """A PNG whose header claims width x height RGB pixels but holds no pixel data (a bomb's header)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))  # noqa: E731
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_corrupt_inputs_raise_image_error_naming_source(tmp_path):
    proc = ImageProcessor(ImageProcessorConfig())
    good_jpg = _encode(Image.new("RGB", (300, 200), (10, 200, 30)), "JPEG")
    good_png = _encode(
        Image.fromarray(np.random.default_rng(0).integers(0, 255, (200, 300, 3), np.uint8)), "PNG"
    )
    cases = {
        "empty": b"",
        "garbage": bytes(random.Random(0).randrange(256) for _ in range(500)),
        "truncated_jpeg": good_jpg[: len(good_jpg) // 2],
        "truncated_png": good_png[: len(good_png) // 2],
        "header_only": good_png[:40],
        "bomb_header": _fake_png_header(8000, 8000),  # 64M px > max_pixels, nothing decoded
        "huge_bomb_header": _fake_png_header(100000, 100000),  # Pillow's own guard fires in open()
    }
    for key, data in cases.items():
        with pytest.raises(ImageError, match=f"shard-3/{key}") as info:
            proc(data, source=f"shard-3/{key}")
        # no chained Pillow traceback
        assert info.value.__context__ is None or info.value.__suppress_context__
        if "bomb" in key:
            assert "max_pixels" in str(info.value)
    path = tmp_path / "broken.jpg"
    path.write_bytes(good_jpg[:300])
    with pytest.raises(ImageError, match="broken.jpg"):
        proc(path)
    with pytest.raises(ImageError, match="file not found"):
        proc(tmp_path / "missing.png")
    with pytest.raises(ImageError, match="expected a PIL image"):
        proc(12345, "k")


def test_decoded_size_limit_is_configurable():
    proc = ImageProcessor(ImageProcessorConfig(max_pixels=10_000))
    data = _encode(Image.new("RGB", (200, 200)), "PNG")  # small file, 40k pixels when decoded
    with pytest.raises(ImageError, match="max_pixels=10000"):
        proc(data, "s/bomb")
    with pytest.raises(ImageError, match="max_pixels"):
        proc(Image.new("L", (101, 100)), "pil")
    assert proc(Image.new("L", (100, 100))).grid[0] >= 2


def test_config_validation():
    with pytest.raises(ConfigError, match="merge"):
        from_dict(ImageProcessorConfig, {"merge": 3})
    with pytest.raises(ConfigError, match="min_patches"):
        from_dict(ImageProcessorConfig, {"min_patches": 300, "max_patches": 256})
    with pytest.raises(ConfigError, match="max_patches"):
        from_dict(ImageProcessorConfig, {"max_patches": 3, "min_patches": 1, "merge": 2})
    with pytest.raises(ConfigError, match="widen the range"):
        from_dict(ImageProcessorConfig, {"min_patches": 5, "max_patches": 7, "merge": 2})
    with pytest.raises(ConfigError, match="std"):
        from_dict(ImageProcessorConfig, {"std": [0.5, 0.0, 0.5]})
    cfg = from_dict(ImageProcessorConfig, {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]})
    out = ImageProcessor(cfg)(Image.new("RGB", (28, 28), (255, 255, 255)))
    assert torch.allclose(out.patches_PD, torch.ones_like(out.patches_PD))  # (1 - 0.5) / 0.5


def test_jpeg_draft_decode_matches_full_decode():
    """Big JPEGs decode at a reduced DCT scale; the patches must stay close to a full decode + resize."""
    rng = np.random.default_rng(2)
    small = Image.fromarray(rng.integers(0, 255, (30, 40, 3), dtype=np.uint8))
    data = _encode(small.resize((1600, 1200), Image.Resampling.BILINEAR), "JPEG")
    proc = ImageProcessor(ImageProcessorConfig(max_patches=64))
    fast = proc(data, "big.jpg")
    full = proc(proc.load(data))  # already-decoded RGB image: no draft
    assert fast.grid == full.grid
    diff = (proc.denormalize(fast.patches_PD) - proc.denormalize(full.patches_PD)).abs()
    assert diff.mean() < 0.01 and diff.max() < 0.2, (float(diff.mean()), float(diff.max()))
