"""One global order of micro-batches: what a rank trains on depends on the micro-batch's number
only, never on the number of ranks or workers, and a run resumes on any number of either. The
pixels reach the encoder as uint8 and are normalised there to exactly the numbers the host's float
path made. Counts summed over ranks are exact.

Legend: D width, P patches.
"""

from __future__ import annotations

import io
import math
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from data_pipelines.config import DataConfig, SourceConfig
from data_pipelines.loader import build_loader
from data_pipelines.schema import Sample
from data_pipelines.tokenizer import ByteTokenizer
from data_pipelines.writer import ShardWriter
from vision.config import VisionConfig
from vision.image_processor import ImageProcessorConfig, choose_grid, to_rgb

TOK = ByteTokenizer()


def _cfg(default_dir, **kw) -> DataConfig:
    base = dict(
        default_dir=str(default_dir), row_tokens=256, rows_per_batch=2, shuffle_buffer=16,
        pack_buffer=8,
    )  # fmt: skip
    return DataConfig(**{**base, **kw})


def _by_index(cfg: DataConfig, world: int, workers: int, n: int, state=None) -> dict:
    """{g: micro-batch} for the first n global micro-batches after `state`, from `world` ranks of
    `workers` workers each (rank r's k-th micro-batch is g = r + k * world)."""
    out = {}
    for r in range(world):
        ld = build_loader(replace(cfg, num_workers=workers), TOK, r, world)
        if state is not None:
            ld.load_state_dict(state)
        for k, b in zip(range(math.ceil((n - r) / world)), ld):
            out[r + k * world] = b
    assert sorted(out) == list(range(n)), (
        f"{world} rank(s) x {workers} worker(s) delivered micro-batches {sorted(out)}, not 0..{n - 1}"
    )
    return out


@pytest.mark.parametrize("world, workers", [(2, 0), (2, 2), (4, 1)])
def test_micro_batches_do_not_depend_on_ranks_or_workers(
    tiny_default, batches_equal, world, workers
):
    cfg = _cfg(tiny_default)
    single = _by_index(cfg, 1, 0, 8)
    assert any(b.pixel_patches is not None for b in single.values()), "no image in 8 batches"
    assert not batches_equal(single[0], single[1])
    split = _by_index(cfg, world, workers, 8)
    differ = [g for g in range(8) if not batches_equal(single[g], split[g])]
    assert not differ, (
        f"micro-batches {differ} differ on {world} ranks x {workers} workers from one rank's"
    )


def test_a_state_from_two_ranks_resumes_on_one_and_on_four(tiny_default, batches_equal):
    """A state is the position after a round (one micro-batch per rank): the same dict on every
    rank, and any number of ranks and workers continues from it with the next micro-batch."""
    cfg = _cfg(tiny_default)
    full = _by_index(cfg, 1, 0, 14)
    states = []
    for r in range(2):
        ld = build_loader(replace(cfg, num_workers=2), TOK, r, 2)
        got = [b for _, b in zip(range(3), ld)]  # rounds 0, 1, 2: g = 0..5
        differ = [r + 2 * k for k, b in enumerate(got) if not batches_equal(b, full[r + 2 * k])]
        assert not differ, f"rank {r} of 2: micro-batches {differ} differ from one rank's"
        buf = io.BytesIO()
        torch.save(ld.state_dict(), buf)  # as a checkpoint holds it
        states.append(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert states[0] == states[1], "the two ranks' loader states after the same round differ"
    for world, workers in ((1, 0), (4, 1), (4, 0)):
        rest = _by_index(cfg, world, workers, 8, state=states[0])
        differ = [6 + g for g in range(8) if not batches_equal(rest[g], full[6 + g])]
        assert not differ, (
            f"resumed on {world} rank(s) x {workers} worker(s) from a 2-rank state: micro-batches "
            f"{differ} differ from the uninterrupted run's"
        )


def test_a_state_of_the_split_loader_is_refused_in_one_line(tiny_default):
    ld = build_loader(_cfg(tiny_default), TOK)
    old = {"version": 1, "fingerprint": {}, "batches": 5, "next_worker": 0, "workers": [None]}
    with pytest.raises(ValueError, match="cannot be carried over") as e:
        ld.load_state_dict(old)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------ pixels


def _jpeg(w: int, h: int, seed: int, mode: str = "RGB", orientation: int | None = None) -> bytes:
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (h // 32 + 2, w // 32 + 2, 3), dtype=np.uint8)
    img = Image.fromarray(coarse, "RGB").resize((w, h), Image.Resampling.BICUBIC).convert(mode)
    buf = io.BytesIO()
    exif = None
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
    img.save(buf, "JPEG", quality=90, **({"exif": exif} if exif is not None else {}))
    return buf.getvalue()


def _png(w: int, h: int, mode: str) -> bytes:
    rng = np.random.default_rng(w * h)
    arr = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGBA").convert(mode).save(buf, "PNG")
    return buf.getvalue()


def _float_path_before(data: bytes, cfg: ImageProcessorConfig) -> torch.Tensor:
    """What the loader put in a batch before its pixels became uint8 (the processor at e057e07):
    draft-decoded JPEG, upright, RGB, grid from the decoded size, bicubic resize, normalised in
    float32 on the host."""
    p = cfg.patch_size
    img = Image.open(io.BytesIO(data))
    if img.format == "JPEG" and img.mode in ("RGB", "L", "YCbCr"):
        rows, cols = choose_grid(img.height, img.width, cfg)
        img.draft(img.mode, (cols * p, rows * p))
    img.load()
    ImageOps.exif_transpose(img, in_place=True)
    img = to_rgb(img)
    rows, cols = choose_grid(img.height, img.width, cfg)
    img = img.resize((cols * p, rows * p), Image.Resampling.BICUBIC)
    x = np.asarray(img, dtype=np.float32) * np.float32(1 / 255.0)
    x = (x - np.asarray(cfg.mean, np.float32)) / np.asarray(cfg.std, np.float32)
    x = x.reshape(rows, p, cols, p, 3).transpose(0, 2, 4, 1, 3).reshape(rows * cols, 3 * p * p)
    return torch.from_numpy(np.ascontiguousarray(x))


def test_the_pixels_reaching_the_encoder_equal_the_float_path_before(tmp_path):
    """uint8 patches through the loader and the batch, normalised in the vision tower: the same
    float32 numbers as the host's float path made before (and so the same bf16 ones), for photos of
    336-768 px, one decoded at a reduced DCT scale, one turned by its EXIF orientation, grayscale,
    and PNGs with transparency and a palette."""
    proc = ImageProcessorConfig(min_patches=16, max_patches=1024)
    images = [
        _jpeg(336, 500, 0),
        _jpeg(768, 600, 1),
        _jpeg(2000, 1400, 2),  # decoded at 1/2 scale, then resized
        _jpeg(640, 480, 3, orientation=6),  # shown turned by 90 degrees
        _jpeg(500, 420, 4, mode="L"),
        _png(300, 200, "RGBA"),
        _png(120, 90, "P"),
    ]
    with ShardWriter(tmp_path) as w:
        for i, data in enumerate(images):
            ext = "jpg" if data[:2] == b"\xff\xd8" else "png"
            w.write(Sample(f"s{i}", "pair", text=f"<image> image {i}", images=[data],
                           image_exts=[ext]))  # fmt: skip
    cfg = DataConfig(
        sources=[SourceConfig(path=str(tmp_path))], row_tokens=2048, rows_per_batch=8,
        shuffle_buffer=0, pack_buffer=1, epochs=1, processor=proc,
    )  # fmt: skip
    (batch,) = list(build_loader(cfg, TOK))
    assert batch.pixel_patches.dtype == torch.uint8
    want = torch.cat([_float_path_before(d, proc) for d in images])
    from vision.navit import NaViTConfig

    enc = NaViTConfig(hidden_size=32, num_layers=1, num_heads=2, pos="rope2d")
    tower = VisionConfig(processor=proc, encoder=enc).build(64)
    captured = []
    tower.encoder.forward = lambda x, *a, **k: (
        captured.append(x) or torch.zeros(x.shape[0], tower.encoder.out_dim)
    )
    tower(batch.pixel_patches, batch.patch_coords, batch.image_grids)
    assert captured[0].dtype == torch.float32 and torch.equal(captured[0], want)
    # the tower cast to bf16 (DeepSpeed's bf16) keeps its mean and std in float32
    tower.to(torch.bfloat16)
    got = tower.pixels_to_input(batch.pixel_patches)
    assert torch.equal(got, want) and torch.equal(got.bfloat16(), want.bfloat16())
    # the processor's own float path (prompts) gives the same numbers
    from vision.image_processor import ImageProcessor

    assert torch.equal(torch.cat([ImageProcessor(proc)(d).patches_PD for d in images]), want)


# ------------------------------------------------------------------------------ counts


def _bad_mix(d, png) -> None:
    """40 text samples and, among them, samples skipped in planning (bad JSON, an image whose
    header is not an image, an oversized one) and one whose PNG is cut short (found decoding it)."""
    with ShardWriter(d, "good", max_count=10) as w:
        for i in range(40):
            w.write(Sample(f"g{i}", "text", text=f"good sample {i} " + "y" * (i % 17)))
        w.write(Sample("cut", "pair", text="<image> cut", images=[png(60, 60, (1, 2, 3))[:-30]]))
        w.write(Sample("notimg", "pair", text="<image> not", images=[b"not an image at all"]))
        w.write(Sample("big", "pair", text="<image> big", images=[png(2000, 2000)]))
    import tarfile

    with tarfile.open(d / "badjson-000000.tar", "w") as tf:
        for key in ("j1", "j2"):
            ti = tarfile.TarInfo(f"{key}.json")
            ti.size = 5
            tf.addfile(ti, io.BytesIO(b"{bad}"))


EXPECTED = {"bad_json": 2, "corrupt_image": 2, "image_too_large": 1}


@pytest.mark.parametrize("world, workers", [(1, 0), (2, 2), (3, 0)])
def test_counts_summed_over_ranks_are_exact(tmp_path, png, decode_docs, world, workers):
    """Planning is repeated by every rank but counted by the rank that trains on the micro-batch;
    decoding is counted by the rank that decodes: the sums over ranks are the data's counts."""
    _bad_mix(tmp_path, png)
    cfg = DataConfig(
        sources=[SourceConfig(path=str(tmp_path), name="mix")], row_tokens=64, rows_per_batch=2,
        shuffle_buffer=8, pack_buffer=4, epochs=1, num_workers=workers,
        processor=ImageProcessorConfig(max_pixels=1_000_000),
    )  # fmt: skip
    seen, counters, read, by_source = Counter(), Counter(), 0, Counter()
    for r in range(world):
        ld = build_loader(cfg, TOK, r, world)
        for b in ld:
            seen.update(decode_docs(b, TOK))
        counters.update(ld.counters)
        read += ld.stats["samples_read"]
        by_source.update(ld.by_source().get("mix", (0, {}))[1])
    assert seen == Counter(f"good sample {i} " + "y" * (i % 17) for i in range(40))
    assert counters == EXPECTED and by_source == EXPECTED
    assert read == 40 + 3 + 2


def test_counts_survive_a_resume_on_another_number_of_ranks(tmp_path, png):
    """Resumed on 3 ranks from a state taken on 2, the counts summed over the 3 are those of the
    uninterrupted run: the state's totals are counted again on rank 0 only."""
    _bad_mix(tmp_path, png)
    cfg = DataConfig(
        sources=[SourceConfig(path=str(tmp_path))], row_tokens=64, rows_per_batch=2,
        shuffle_buffer=0, pack_buffer=4, epochs=1,
        processor=ImageProcessorConfig(max_pixels=1_000_000),
    )  # fmt: skip
    whole = build_loader(cfg, TOK)
    list(whole)
    first = [build_loader(cfg, TOK, r, 2) for r in range(2)]
    for ld in first:
        [b for _, b in zip(range(3), ld)]
    state = first[0].state_dict()
    counters, read = Counter(), 0
    for r in range(3):
        ld = build_loader(cfg, TOK, r, 3)
        ld.load_state_dict(state)
        list(ld)
        counters.update(ld.counters)
        read += ld.stats["samples_read"]
    planned = {k: v for k, v in whole.counters.items()}
    # the PNG cut short is found only when it is decoded: in this shard order after the state
    assert counters == planned and read == whole.stats["samples_read"]


def test_an_exported_model_normalises_uint8_pixels_as_the_trained_one(exported_vlm):
    """transformers builds a loaded model on the meta device: what the tower normalises with must
    not live in a buffer it leaves uninitialised."""
    from vision.image_processor import channel_stats, normalize_pixels
    from vlm.model.hf import load_vlm

    tower = load_vlm(exported_vlm).vision
    p = tower.patch_size
    pixels = torch.randint(0, 256, (6, 3 * p * p), dtype=torch.uint8)
    mean, std = (channel_stats(v, p) for v in (tower.pixel_mean, tower.pixel_std))
    assert torch.equal(tower.pixels_to_input(pixels), normalize_pixels(pixels, mean, std))
    assert torch.isfinite(tower.pixels_to_input(pixels)).all()


def test_a_second_iteration_does_not_stop_when_the_first_is_collected(tiny_default, batches_equal):
    """Each iteration owns its planning thread: dropping an earlier, unfinished iterator leaves the
    current one running, and both start from the position last delivered."""
    cfg = _cfg(tiny_default, num_workers=1)
    full = _by_index(cfg, 1, 0, 4)
    ld = build_loader(cfg, TOK)
    first = iter(ld)
    assert batches_equal(next(first), full[0])
    second = iter(ld)
    assert batches_equal(next(second), full[1])
    del first  # its cleanup must not stop the second iteration's planner
    assert batches_equal(next(second), full[2]) and batches_equal(next(second), full[3])
