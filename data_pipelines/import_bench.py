"""Measure an import: generate a LLaVA-format JSON array, import it, report rows/s and peak memory.

    vlm data import-bench --rows 100000 --workers 2 --dir /tmp/bench

The file is one JSON array as `llava_v1_5_mix665k.json` is (id, image path, a two-turn conversation
of `text_bytes` characters), over `images` distinct generated noisy JPEGs of `image_side` px (rows
reuse them, so the folder stays small while every row still reads, decodes and checks its image);
`--text-only` leaves the images out (parsing and writing only). Peak memory is the resident set's
high-water mark (`ru_maxrss`) of this process and, with workers, of the largest worker; each run
belongs in a fresh process (the bench is one).
"""

from __future__ import annotations

import json
import random
import resource
import sys
import time
from pathlib import Path


def generate_llava(
    path: str | Path,
    rows: int,
    images: int = 200,
    image_side: int = 64,
    text_bytes: int = 400,
    text_only: bool = False,
    seed: int = 0,
    indent: int | None = None,
) -> Path:
    """Write a LLaVA-style JSON array of `rows` entries (streamed out, so any size fits) and its
    image folder `PATH.parent/images/` (unless text_only). Returns the JSON's path."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    if not text_only:
        img_dir = path.parent / "images" / "coco"
        img_dir.mkdir(parents=True, exist_ok=True)
        for i in range(images):
            p = img_dir / f"{i:06d}.jpg"
            if not p.exists():
                colour = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
                size = (image_side, image_side + i % 7)
                # a photo's entropy, not a flat colour
                noise = Image.effect_noise(size, 48).convert("RGB")
                Image.blend(Image.new("RGB", size, colour), noise, 0.5).save(p, "JPEG", quality=90)
    words = [
        "the",
        "a",
        "red",
        "circle",
        "square",
        "left",
        "of",
        "above",
        "picture",
        "shows",
        "two",
        "small",
    ]
    sep = "\n" if indent else ""
    with open(path, "w", encoding="utf-8") as f:
        f.write("[" + sep)
        for r in range(rows):
            q = " ".join(rng.choice(words) for _ in range(max(1, text_bytes // 12)))
            a = " ".join(rng.choice(words) for _ in range(max(1, text_bytes // 8)))
            human = ("" if text_only else "<image>\n") + q
            row = {
                "id": f"{r:09d}",
                "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": a}],
            }
            if not text_only:
                row["image"] = f"coco/{r % images:06d}.jpg"
            f.write(("," + sep if r else "") + json.dumps(row, indent=indent))
        f.write(sep + "]\n")
    return path


def write_img2dataset(
    folder: str | Path, images: list[bytes], shards: int = 2, caption_in_json_only: int = 1
) -> list[str]:
    """An img2dataset webdataset output of `images` (JPEG bytes) split over `shards`: NNNNN.tar with
    KEY.jpg + KEY.txt + KEY.json (metadata), and NNNNN.parquet + NNNNN_stats.json beside each tar.
    The last `caption_in_json_only` samples of each shard have no .txt (their caption is in the
    metadata only). Returns the captions in order."""
    import io
    import tarfile

    from PIL import Image

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-len(images) // shards)
    captions = []
    for s in range(shards):
        part = images[s * per : (s + 1) * per]
        rows = []
        with tarfile.open(folder / f"{s:05d}.tar", "w") as tf:
            for j, data in enumerate(part):
                key = f"{s:05d}{j:04d}"
                with Image.open(io.BytesIO(data)) as im:
                    w, h = im.size
                caption = f"a photo, number {s * per + j}"
                meta = {
                    "url": f"http://example.com/{key}.jpg",
                    "caption": caption,
                    "key": key,
                    "status": "success",
                    "error_message": None,
                    "width": w,
                    "height": h,
                    "original_width": 4 * w,
                    "original_height": 4 * h,
                    "exif": "{}",
                    "sha256": "0" * 64,
                }
                members = [("jpg", data)]
                if j < len(part) - caption_in_json_only:
                    members.append(("txt", caption.encode()))
                members.append(("json", json.dumps(meta).encode()))
                for ext, payload in members:
                    ti = tarfile.TarInfo(f"{key}.{ext}")
                    ti.size = len(payload)
                    tf.addfile(ti, io.BytesIO(payload))
                rows.append(meta)
                captions.append(caption)
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), folder / f"{s:05d}.parquet")
        except ImportError:
            (folder / f"{s:05d}.parquet").write_bytes(b"PAR1")
        (folder / f"{s:05d}_stats.json").write_text(
            json.dumps({"count": len(part), "successes": len(part), "failed_to_download": 0})
        )
    return captions


def peak_rss_mb() -> dict[str, float]:
    """High-water resident set of this process and of its largest finished child, in MB."""
    # kB on Linux, bytes on macOS
    scale = 1 / 1024 if sys.platform != "darwin" else 1 / 1024 / 1024
    return {
        "self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale,
        "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale,
    }


def add_arguments(p) -> None:
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument(
        "--dir", required=True, help="folder for the generated file, its images and the shards"
    )
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--image-side", type=int, default=64)
    p.add_argument("--text-bytes", type=int, default=400)
    p.add_argument("--text-only", action="store_true")
    p.add_argument("--generate-only", action="store_true")


def run(args) -> int:
    """`vlm data import-bench`: generate (once) and import; prints one JSON line."""
    d = Path(args.dir)
    table = d / f"llava_{args.rows}{'_text' if args.text_only else ''}.json"
    if not table.exists() or not (args.text_only or (d / "images").is_dir()):
        generate_llava(
            table, args.rows, args.images, args.image_side, args.text_bytes, args.text_only
        )
    if args.generate_only:
        return 0
    from data_pipelines.importers import import_table

    out = d / f"shards_{table.stem}_w{args.workers}"
    t0 = time.time()
    summary = import_table(
        table, out, image_root=d / "images", workers=args.workers, overwrite=True
    )
    dt = time.time() - t0
    print(
        json.dumps(
            {
                "rows": summary["rows"],
                "written": summary["written"],
                "workers": args.workers,
                "file_mb": round(table.stat().st_size / 1e6, 1),
                "seconds": round(dt, 2),
                "rows_per_s": round(summary["rows"] / dt),
                "peak_rss_mb": {k: round(v, 1) for k, v in peak_rss_mb().items()},
            }
        )
    )
    return 0
