"""The packed NaViT encoder against encoding the same images one at a time (images/s).

Legend: D width, P patches.

Images of random sizes go through the real image processor; the encoder then runs packed (one
sequence of all images' patches) with per-image attention or with one dense block-diagonal mask, and
image by image (the baseline). The JSON records each packed output's largest difference from the
one-at-a-time output.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from PIL import Image

from eval.bench import common
from vision.image_processor import ImageProcessor, ImageProcessorConfig
from vision.navit import NaViTConfig, NaViTEncoder

PART = "vision"
BASELINE = "one image at a time"


@dataclass
class Settings:
    images: list[int] = field(default_factory=lambda: [4, 8, 16])
    hidden: int = 384
    layers: int = 6
    heads: int = 6
    max_patches: int = 256
    pos: str = "rope2d"
    repeats: int = 5
    warmup: int = 1


SETTINGS = {
    "full": Settings(),
    "quick": Settings(images=[8, 16], hidden=64, layers=2, heads=4),
    "smoke": Settings(images=[2], hidden=32, layers=1, heads=2, max_patches=64, repeats=2),
}


def processed_images(n: int, max_patches: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    proc = ImageProcessor(ImageProcessorConfig(max_patches=max_patches))
    sizes = rng.integers(32, 640, (n, 2))
    return proc, [
        proc(
            Image.fromarray(rng.integers(0, 255, (int(h), int(w), 3), dtype=np.uint8)), f"bench{i}"
        )
        for i, (h, w) in enumerate(sizes)
    ]


def candidates(enc: NaViTEncoder, imgs) -> dict:
    """The baseline (one image at a time) and the two packed encodes of the same images."""
    x_PD = torch.cat([p.patches_PD for p in imgs])
    rc_P2 = torch.cat([p.coords_P2 for p in imgs])
    grids = torch.tensor([p.grid for p in imgs])

    def packed(backend):
        def call():
            enc.cfg.attn_backend = backend
            return enc(x_PD, rc_P2, grids)

        return call

    def one_at_a_time():  # a loop over images is the thing measured
        enc.cfg.attn_backend = "auto"
        return torch.cat([enc(p.patches_PD, p.coords_P2, torch.tensor([p.grid])) for p in imgs])

    return {
        BASELINE: one_at_a_time,
        "packed, per-image attention": packed("per_image"),
        "packed, dense block mask": packed("dense"),
    }


def run(s: Settings, log=print) -> dict:
    torch.manual_seed(0)
    out = []
    for n in s.images:
        proc, imgs = processed_images(n, s.max_patches)
        enc = NaViTEncoder(
            NaViTConfig(hidden_size=s.hidden, num_layers=s.layers, num_heads=s.heads, pos=s.pos),
            patch_size=proc.cfg.patch_size,
            merge=proc.cfg.merge,
        ).eval()
        fns = candidates(enc, imgs)
        patches = sum(int(p.patches_PD.shape[0]) for p in imgs)
        with torch.inference_mode():
            alone = fns[BASELINE]()
            extra = {
                name: {
                    "max_abs_diff_vs_alone": float((fn() - alone).abs().max()),
                    "patches": patches,
                    "tokens": int(alone.shape[0]),
                }
                for name, fn in fns.items()
            }
            secs = common.measure(fns, s.repeats, s.warmup)
        rs = common.rows(
            common.per_second(secs, n), BASELINE, {"images": n}, "images/s", "img/s", extra
        )
        out += rs
        log(
            f"  vision images={n}: "
            + ", ".join(f"{r['candidate']} x{r['ratio_vs_baseline']:.2f}" for r in rs)
        )
    return common.result(PART, asdict(s), out)


def plot(res: dict, path) -> None:
    common.plot(
        res,
        path,
        x="images",
        panels=(),
        ylabel="images/s vs one image at a time",
        title=f"packed NaViT (hidden {res['settings']['hidden']}, "
        f"{res['settings']['layers']} layers)",
    )
