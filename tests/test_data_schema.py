"""Shard schema: round trips of the three sample kinds, manifests, foreign shards, decode errors."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from data_pipelines.reader import iter_shard, resolve_shards, shard_counts
from data_pipelines.schema import (
    BAD_JSON,
    EMPTY_TEXT,
    FILTERED_KIND,
    IMAGE_COUNT,
    INVALID_FIELD,
    MISSING_FIELD,
    NON_UTF8,
    BadSample,
    Sample,
    decode_sample,
)
from data_pipelines.stats import collect_stats
from data_pipelines.writer import ShardWriter, read_manifest


def _samples(png):
    a, b, c = png(20, 10, (255, 0, 0)), png(8, 33, (0, 255, 0), fmt="JPEG"), png(5, 5, (0, 0, 255))
    return [
        Sample(key="pair0", kind="pair", text="<image>A red box.", images=[a], image_exts=["png"]),
        Sample(
            key="chat0",
            kind="pair",
            turns=[
                {"role": "user", "content": "<image>\nColour?"},
                {"role": "assistant", "content": "red"},
            ],
            images=[a],
            image_exts=["png"],
            meta={"qa": [{"question": "Colour?", "answer": "red", "type": "colour"}]},
        ),
        Sample(
            key="inter0",
            kind="interleaved",
            text="First <image> then <image> and <image>. Done.",
            images=[a, b, c],
            image_exts=["png", "jpg", "png"],
        ),
        Sample(key="text0", kind="text", text="Only text, ünïcödé ✓."),
    ]


def test_round_trip_all_kinds_and_manifest(tmp_path, png):
    samples = _samples(png)
    with ShardWriter(tmp_path, "s", max_count=3) as w:
        for s in samples:
            w.write(s)
    paths = resolve_shards(tmp_path)
    assert [p.name for p in paths] == ["s-000000.tar", "s-000001.tar"]
    assert shard_counts(paths) == [3, 1]
    got = [decode_sample(raw) for p in paths for _, raw in iter_shard(p)]
    for s, g in zip(samples, got):
        assert (g.key, g.kind, g.text, g.turns, g.images, g.image_exts, g.meta) == (
            s.key,
            s.kind,
            s.text,
            s.turns,
            s.images,
            s.image_exts,
            s.meta,
        )
    m = read_manifest(tmp_path)
    assert m["totals"]["count"] == 4
    assert m["totals"]["kinds"] == {"interleaved": 1, "pair": 2, "text": 1}
    assert m["totals"]["images"] == 5 and m["totals"]["chat"] == 1
    assert m["totals"]["images_per_sample"] == {"0": 1, "1": 2, "3": 1}
    assert m["totals"]["min_image_side"] == 5 and m["totals"]["max_image_side"] == 33
    assert m["totals"]["qa_types"] == {"colour": 1}
    # stats by reading agree with the manifest
    scanned = collect_stats([tmp_path], scan=True)
    assert scanned["totals"]["kinds"] == m["totals"]["kinds"] and scanned["bad"] == {}


def test_writer_is_deterministic_and_rolls_over_by_bytes(tmp_path, png):
    for d in ("a", "b"):
        with ShardWriter(tmp_path / d, "s", max_bytes=200) as w:
            for s in _samples(png):
                w.write(s)
    a, b = sorted((tmp_path / "a").glob("*.tar")), sorted((tmp_path / "b").glob("*.tar"))
    assert len(a) >= 2 and [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    with pytest.raises(ValueError, match="duplicate sample key"):
        with ShardWriter(tmp_path / "c") as w:
            w.write(Sample(key="k", kind="text", text="a"))
            w.write(Sample(key="k", kind="text", text="b"))
    with pytest.raises(ValueError, match="no '.'"):
        ShardWriter(tmp_path / "d").write(Sample(key="a.b", kind="text", text="x"))


def _tar(path, members: dict[str, bytes]):
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))


def test_foreign_webdataset_jpg_txt(tmp_path, png):
    _tar(
        tmp_path / "f.tar", {"a.jpg": png(fmt="JPEG"), "a.txt": b"a caption", "b.txt": b"just text"}
    )
    got = [decode_sample(raw) for _, raw in iter_shard(tmp_path / "f.tar")]
    assert [(g.kind, g.text, len(g.images)) for g in got] == [
        ("pair", "<image>a caption", 1),
        ("text", "just text", 0),
    ]


# stands for png() in the parameters below (the `png` fixture cannot run at collection)
PNG = object()


@pytest.mark.parametrize(
    "members,reason",
    [
        ({"json": b"{not json"}, BAD_JSON),
        ({"json": b"[1, 2]"}, BAD_JSON),
        ({"json": b'{"text": "caf\xe9"}'}, NON_UTF8),
        ({"txt": b"\xff\xfe bad"}, NON_UTF8),
        ({"cls": b"3"}, MISSING_FIELD),
        ({"json": b'{"kind": "pair"}', "0.png": PNG}, MISSING_FIELD),
        ({"json": b'{"kind": "pair", "text": "x"}'}, MISSING_FIELD),
        ({"json": b'{"kind": "video", "text": "x"}'}, INVALID_FIELD),
        ({"json": b'{"kind": "text", "text": 3}'}, INVALID_FIELD),
        ({"json": b'{"turns": [{"role": "system", "content": "x"}]}'}, INVALID_FIELD),
        ({"json": b'{"turns": [{"role": "user"}]}'}, MISSING_FIELD),
        (
            {
                "json": b'{"turns": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " '
                b'"}]}'
            },
            EMPTY_TEXT,
        ),
        ({"json": b'{"kind": "text", "text": "   "}'}, EMPTY_TEXT),
        ({"json": b'{"kind": "pair", "text": "<image>"}', "0.png": PNG}, EMPTY_TEXT),
        (
            {"json": b'{"kind": "interleaved", "text": "a <image> b"}', "0.png": PNG, "1.png": PNG},
            IMAGE_COUNT,
        ),
        (
            {
                "json": b'{"kind": "interleaved", "text": "a <image> b <image>"}',
                "0.png": PNG,
                "2.png": PNG,
            },
            IMAGE_COUNT,
        ),
    ],
)
def test_decode_reasons(members, reason, png):
    raw = {
        "__key__": "k",
        "__url__": "shard.tar",
        **{k: png() if v is PNG else v for k, v in members.items()},
    }
    with pytest.raises(BadSample) as e:
        decode_sample(raw)
    assert e.value.reason == reason
    assert "sample k in shard.tar" in str(e.value)


def test_kind_filter():
    raw = {
        "__key__": "k",
        "__url__": "u",
        "json": json.dumps({"kind": "text", "text": "hello"}).encode(),
    }
    assert decode_sample(raw, "text").kind == "text"
    with pytest.raises(BadSample) as e:
        decode_sample(raw, "pair")
    assert e.value.reason == FILTERED_KIND
