"""A fixture shard with every kind of bad input: the good samples come through, the bad ones are counted."""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter

from PIL import Image

from data_pipelines.config import DataConfig, SourceConfig
from data_pipelines.loader import build_loader
from data_pipelines.schema import Sample
from data_pipelines.tokenizer import ByteTokenizer
from data_pipelines.writer import ShardWriter, update_manifest
from vision.image_processor import ImageProcessorConfig

TOK = ByteTokenizer()


def _bomb() -> bytes:
    """A 3000x3000 PNG of a few kB: over a 1-Mpx limit, caught from the header."""
    buf = io.BytesIO()
    Image.new("1", (3000, 3000)).save(buf, "PNG")
    return buf.getvalue()


def _raw_tar(path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))


def _js(obj) -> bytes:
    return json.dumps(obj).encode()


def _fixture(d, png):
    good = [
        Sample(key="good0", kind="text", text="good text zero"),
        Sample(key="good1", kind="pair", text="<image>good pair one", images=[png(30, 30)]),
        Sample(
            key="good2",
            kind="interleaved",
            text="good <image> inter <image> two",
            images=[png(), png(20, 50)],
        ),
        Sample(
            key="good3",
            kind="pair",
            turns=[
                {"role": "user", "content": "<image>\ngood question"},
                {"role": "assistant", "content": "three"},
            ],
            images=[png()],
        ),
    ]
    truncated_png = png(60, 60, (1, 2, 3))[:-30]
    bad = [
        (
            "corrupt",
            [("json", _js({"kind": "pair", "text": "<image>x"})), ("0.png", truncated_png)],
        ),
        (
            "notimage",
            [
                ("json", _js({"kind": "pair", "text": "<image>x"})),
                ("0.png", b"this is not an image"),
            ],
        ),
        ("bomb", [("json", _js({"kind": "pair", "text": "<image>x"})), ("0.png", _bomb())]),
        (
            "huge",
            [
                (
                    "json",
                    _js({"kind": "interleaved", "text": "<image>" * 5 + "too many image tokens"}),
                )
            ]
            + [(f"{i}.png", png(600, 600)) for i in range(5)],
        ),
        ("empty", [("json", _js({"kind": "text", "text": " \n "}))]),
        ("nonutf8", [("txt", b"caf\xe9 au lait")]),
        ("nofield", [("json", _js({"kind": "text"}))]),
        ("badjson", [("json", b"{'single': 'quotes'}")]),
        (
            "count",
            [
                ("json", _js({"kind": "interleaved", "text": "<image> only one"})),
                ("0.png", png()),
                ("1.png", png()),
            ],
        ),
        ("reserved", [("json", _js({"kind": "text", "text": "sneaky <image_pad> token"}))]),
        ("deep", [("json", b'{"text": "x", "meta": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")]),
        ("surrogate", [("json", b'{"kind": "text", "text": "lone \\ud800 surrogate"}')]),
        (
            "badqa",
            [
                (
                    "json",
                    _js({"kind": "text", "text": "qa entries", "meta": {"qa": ["not an object"]}}),
                )
            ],
        ),
        ("badmeta", [("json", _js({"kind": "text", "text": "meta is a list", "meta": [1, 2]}))]),
    ]
    members = []
    for s in good[:2]:
        members += [(f"{s.key}.{k}", v) for k, v in _members(s)]
    for key, ms in bad:
        members += [(f"{key}.{k}", v) for k, v in ms]
    for s in good[2:]:
        members += [(f"{s.key}.{k}", v) for k, v in _members(s)]
    _raw_tar(d / "mixed-000000.tar", members)
    entries = [{"name": "mixed-000000.tar", "count": len(good) + len(bad)}]
    # a shard that breaks after two samples (the manifest promises five)
    with ShardWriter(d, "trunc") as w:
        for i in range(5):
            w.write(
                Sample(key=f"tr{i}", kind="text", text=f"truncated shard sample {i} " + "p" * 100)
            )
    data = (d / "trunc-000000.tar").read_bytes()
    cut = tarfile.open(d / "trunc-000000.tar").getmembers()[2].offset_data + 100  # inside sample 2
    (d / "trunc-000000.tar").write_bytes(data[:cut])
    # a shard listed in the manifest that is not a tar any more
    with ShardWriter(d, "junk") as w:
        w.write(Sample(key="j", kind="text", text="lost"))
    (d / "junk-000000.tar").write_bytes(b"garbage" * 100)
    update_manifest(d, entries)
    return [
        "good text zero",
        "good pair one",
        "good  inter  two",
        "\ngood questionthree",
        "truncated shard sample 0 " + "p" * 100,
        "truncated shard sample 1 " + "p" * 100,
    ]


def _members(s: Sample):
    from data_pipelines.schema import encode_sample

    return [(k, v) for k, v in encode_sample(s).items() if k != "__key__"]


def test_bad_inputs_are_skipped_and_counted(tmp_path, png, decode_docs):
    expected_texts = _fixture(tmp_path, png)
    cfg = DataConfig(
        sources=[SourceConfig(path=str(tmp_path))],
        row_tokens=256,
        rows_per_batch=2,
        epochs=1,
        shuffle_buffer=4,
        pack_buffer=4,
        processor=ImageProcessorConfig(max_patches=256, max_pixels=1_000_000),
    )
    loader = build_loader(cfg, TOK)
    seen = Counter()
    for batch in loader:
        seen.update(decode_docs(batch, TOK))
    assert seen == Counter(expected_texts)
    assert loader.counters == {
        "bad_json": 2,
        "corrupt_image": 2,
        "empty_text": 1,
        "image_count_mismatch": 1,
        "image_too_large": 1,
        "invalid_field": 3,
        "missing_field": 1,
        "non_utf8_text": 2,
        "too_long": 1,
        "truncated_shard": 2,
        "unreadable_member": 1,
        "unreadable_shard": 1,
    }
    assert "skipped" in loader.report() and "unreadable_shard=1" in loader.report()


def test_unreadable_shard_without_manifest_is_skipped_and_counted(tmp_path, decode_docs):
    """A shard that is not a tar and has no manifest entry does not stop the run: counted once, the rest read."""
    with ShardWriter(tmp_path, "good") as w:
        for i in range(3):
            w.write(Sample(key=f"g{i}", kind="text", text=f"good sample {i}"))
    (tmp_path / "bad-000000.tar").write_bytes(b"garbage" * 50)  # not in the manifest, not a tar
    cfg = DataConfig(
        sources=[SourceConfig(path=str(tmp_path))], row_tokens=256, rows_per_batch=1, epochs=1
    )
    loader = build_loader(cfg, TOK)
    seen = Counter()
    for batch in loader:
        seen.update(decode_docs(batch, TOK))
    assert seen == Counter(f"good sample {i}" for i in range(3))
    assert loader.counters == {"unreadable_shard": 1}


def test_stats_scan_decodes_images_like_the_loader(tmp_path, png):
    """`vlm data stats --scan` counts corrupt images as the loader does, not only schema problems."""
    from data_pipelines.stats import collect_stats

    _fixture(tmp_path, png)
    bad = collect_stats([str(tmp_path / "mixed-000000.tar")], scan=True)["bad"]
    assert bad["corrupt_image"] == 2  # the truncated PNG and the non-image bytes
    assert bad["bad_json"] == 2 and bad["non_utf8_text"] == 2
