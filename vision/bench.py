"""Time the packed NaViT encode against encoding the same images one at a time.

    python -m vision.bench --images 8 --hidden 384 --layers 6 --heads 6 --max-patches 256

Images get random sizes; they go through the real processor, then the encoder runs packed (one
sequence, block-diagonal mask) and image by image. Prints median times and the max output difference.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from PIL import Image

from vision.image_processor import ImageProcessor, ImageProcessorConfig
from vision.navit import NaViTConfig, NaViTEncoder


def _median_times(fns, repeats: int) -> list[float]:
    """Median wall time of each fn, measured interleaved so that machine load hits all of them alike."""
    for fn in fns:
        fn()  # warm-up
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--max-patches", type=int, default=256)
    ap.add_argument("--pos", default="rope2d", choices=["learned2d", "rope2d"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    proc = ImageProcessor(ImageProcessorConfig(max_patches=args.max_patches))
    imgs = [proc(Image.fromarray(rng.integers(0, 255, (int(rng.integers(32, 640)), int(rng.integers(32, 640)), 3),
                                              dtype=np.uint8)), f"bench{i}") for i in range(args.images)]
    enc = NaViTEncoder(NaViTConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                                   pos=args.pos), patch_size=proc.cfg.patch_size, merge=proc.cfg.merge).eval()
    x = torch.cat([p.patches_PD for p in imgs])
    rc = torch.cat([p.coords_P2 for p in imgs])
    grids = torch.tensor([p.grid for p in imgs])

    def packed(backend):
        def run():
            enc.cfg.attn_backend = backend
            return enc(x, rc, grids)
        return run

    def one_at_a_time():
        enc.cfg.attn_backend = "auto"
        return torch.cat([enc(p.patches_PD, p.coords_P2, torch.tensor([p.grid])) for p in imgs])

    with torch.inference_mode():
        alone_out = one_at_a_time()
        diffs = {b: float((packed(b)() - alone_out).abs().max()) for b in ("per_image", "dense")}
        t_per_image, t_dense, t_alone = _median_times([packed("per_image"), packed("dense"), one_at_a_time],
                                                      args.repeats)
    result = {"images": args.images, "patches": int(x.shape[0]), "tokens": int(alone_out.shape[0]),
              "grids": [p.grid for p in imgs], "packed_per_image_s": t_per_image, "packed_dense_s": t_dense,
              "one_at_a_time_s": t_alone, "max_abs_diff": diffs, "threads": torch.get_num_threads()}
    print(f"{args.images} images, {result['patches']} patches -> {result['tokens']} tokens "
          f"(hidden {args.hidden}, {args.layers} layers, {args.pos}, {result['threads']} threads, "
          f"median of {args.repeats})")
    print(f"packed, per-image attention: {t_per_image * 1e3:.1f} ms | packed, dense block mask: "
          f"{t_dense * 1e3:.1f} ms | one image at a time: {t_alone * 1e3:.1f} ms | "
          f"max |diff| vs one at a time: {max(diffs.values()):.1e}")
    return result


if __name__ == "__main__":
    main()
