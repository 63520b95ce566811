"""img2dataset output (LAION, CC3M, CC12M, DataComp) reads as it is (issue 26): `KEY.jpg` +
`KEY.txt` + `KEY.json` (metadata, not the sample schema), with `NNNNN.parquet` and
`NNNNN_stats.json` beside each tar."""

from __future__ import annotations

import argparse
import json
from collections import Counter

import pytest

from data_pipelines.cli import add_data_commands
from data_pipelines.config import DataConfig, SourceConfig
from data_pipelines.import_bench import write_img2dataset
from data_pipelines.loader import build_loader
from data_pipelines.samples import iter_samples
from data_pipelines.schema import BadSample, decode_sample
from data_pipelines.tokenizer import ByteTokenizer
from vision.image_processor import ImageProcessorConfig


def _cli(argv, capsys):
    p = argparse.ArgumentParser(prog="vlm")
    add_data_commands(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    rc = args.func(args)
    return rc, capsys.readouterr()


def test_img2dataset_shards_read_as_they_are(tmp_path, png, capsys, decode_docs):
    pytest.importorskip("pyarrow")
    d = tmp_path / "cc3m"
    images = [png(20 + j, 16, fmt="JPEG") for j in range(12)]
    # the last of each shard: its caption in the JSON only
    captions = write_img2dataset(d, images, shards=2)
    assert sorted(p.name for p in d.iterdir()) == [
        "00000.parquet",
        "00000.tar",
        "00000_stats.json",
        "00001.parquet",
        "00001.tar",
        "00001_stats.json",
    ]
    samples = list(iter_samples(d))
    assert [s.text for s in samples] == ["<image>" + c for c in captions]
    assert (
        all(s.kind == "pair" and len(s.images) == 1 for s in samples)
        and samples[0].images[0] == images[0]
    )
    assert samples[1].meta == {
        "key": "000000001",
        "url": "http://example.com/000000001.jpg",
        "status": "success",
        "width": 21,
        "height": 16,
        "original_width": 84,
        "original_height": 64,
    }
    # a glob also matches the .parquet/.json beside
    for args in ([str(d)], [str(d), "--scan"], [str(d / "*")]):
        rc, out = _cli(["data", "stats", *args, "--json"], capsys)
        res = json.loads(out.out)
        assert (
            rc == 0
            and res["totals"]["count"] == 12
            and res["bad"] == {}
            and res["totals"]["shards"] == 2
        ), args
    # importing it instead is a one-line pointer to reading it as it is (its .parquet is metadata,
    # no images)
    from data_pipelines.importers import ImporterError, import_table

    with pytest.raises(
        ImporterError, match="holds webdataset shards .*give the folder as a data source"
    ):
        import_table(d, tmp_path / "imported")
    tok = ByteTokenizer()
    cfg = DataConfig(
        sources=[SourceConfig(path=str(d))],
        row_tokens=256,
        rows_per_batch=2,
        epochs=1,
        processor=ImageProcessorConfig(patch_size=4, max_patches=16, min_patches=4, merge=2),
    )
    loader = build_loader(cfg, tok)
    docs = Counter()
    for batch in loader:
        docs.update(decode_docs(batch, tok))
    assert loader.counters == {} and docs == Counter(captions)


def test_metadata_json_is_told_apart_from_the_sample_schema():
    img = {"__key__": "k", "__url__": "u", "jpg": b"x"}
    ours = decode_sample(
        {**img, "json": json.dumps({"kind": "pair", "text": "<image>ours"}).encode()}
    )
    assert ours.text == "<image>ours"
    theirs = decode_sample(
        {
            **img,
            "txt": b"from txt",
            "json": json.dumps(
                {"caption": "c", "status": "success", "width": 3, "exif": "{}"}
            ).encode(),
        }
    )
    assert theirs.text == "<image>from txt" and theirs.meta == {"status": "success", "width": 3}
    # a .txt beside a JSON that looks like the schema: the JSON is metadata (our writer never
    # writes .txt)
    assert decode_sample({**img, "txt": b"t", "json": b'{"text": "other"}'}).text == "<image>t"
    assert (
        decode_sample(
            {**img, "json": b'{"text_en": "x", "caption_en": "y"}'}, caption_field="caption_en"
        ).text
        == "<image>y"
    )
    with pytest.raises(BadSample, match="metadata .* without a string 'caption'") as e:
        decode_sample({**img, "json": b'{"url": "http://x", "status": "success"}'})
    assert e.value.reason == "missing_field"


def test_a_source_names_the_metadata_field_that_holds_the_caption(tmp_path, png, decode_docs):
    """LAION-style metadata keeps its caption under another name (e.g. TEXT) and the shards have no .txt."""
    import io
    import tarfile

    d = tmp_path / "laion"
    d.mkdir()
    with tarfile.open(d / "00000.tar", "w") as tar:
        for i in range(3):
            for name, data in (
                (f"{i:09d}.jpg", png(20, 16, fmt="JPEG")),
                (
                    f"{i:09d}.json",
                    json.dumps({"TEXT": f"caption {i}", "status": "success"}).encode(),
                ),
            ):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    proc = ImageProcessorConfig(patch_size=4, max_patches=16, min_patches=4, merge=2)
    tok = ByteTokenizer()
    plain = build_loader(
        DataConfig(
            sources=[SourceConfig(path=str(d))],
            row_tokens=256,
            rows_per_batch=2,
            epochs=1,
            processor=proc,
        ),
        tok,
    )
    # no 'caption' field: skipped, counted
    assert list(plain) == [] and plain.counters == {"missing_field": 3}
    named = build_loader(
        DataConfig(
            sources=[SourceConfig(path=str(d), caption_field="TEXT")],
            row_tokens=256,
            rows_per_batch=2,
            epochs=1,
            processor=proc,
        ),
        tok,
    )
    docs = Counter()
    for batch in named:
        docs.update(decode_docs(batch, tok))
    assert docs == Counter(f"caption {i}" for i in range(3)) and named.counters == {}
