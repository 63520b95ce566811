"""The formats researchers hold import whole (issue 26): each test fails when its format is not
recognised (the old importer wrote 0 samples from a LLaVA JSON array and ignored `Image` bytes and
the Cauldron's `texts`)."""

from __future__ import annotations

import io
import json

import pytest

from data_pipelines.importers import import_table
from data_pipelines.reader import iter_shard, resolve_shards
from data_pipelines.schema import decode_sample

datasets = pytest.importorskip("datasets")


def _read(directory):
    return [decode_sample(raw) for p in resolve_shards(directory) for _, raw in iter_shard(p)]


def _llava_rows(png):
    """LLaVA-1.5 mix rows: single image, a text-only ShareGPT row, a multi-image (LLaVA-Interleave) row."""
    return [
        {
            "id": "000000033471",
            "image": "coco/train2017/000000033471.jpg",
            "conversations": [
                {"from": "human", "value": "<image>\nWhat are the colors of the bus in the image?"},
                {"from": "gpt", "value": "The bus in the image is white and red."},
                {"from": "human", "value": "What feature can be seen on the back of the bus?"},
                {"from": "gpt", "value": "The back of the bus features an advertisement."},
            ],
        },
        {
            "id": "i6IyJda_0",
            "model": "",
            "conversations": [
                {"from": "human", "value": "How to tell if a customer segment is well segmented?"},
                {"from": "gpt", "value": "1. Homogeneity 2. Distinctiveness 3. Stability"},
            ],
        },
        {
            "id": "multi_1",
            "image": ["coco/train2017/a.jpg", "coco/train2017/b.jpg"],
            "conversations": [
                {"from": "human", "value": "<image> <image>\nWhat differs?"},
                {"from": "gpt", "value": "The second one is bigger."},
            ],
        },
    ]


def _images(root, png):
    d = root / "coco" / "train2017"
    d.mkdir(parents=True)
    (d / "000000033471.jpg").write_bytes(png(32, 24, fmt="JPEG"))
    (d / "a.jpg").write_bytes(png(16, 16, fmt="JPEG"))
    (d / "b.jpg").write_bytes(png(24, 24, fmt="JPEG"))


@pytest.mark.parametrize("layout", ["one_line", "pretty", "jsonl"])
def test_llava_json_array_and_jsonl(tmp_path, png, layout):
    _images(tmp_path / "images", png)
    rows = _llava_rows(png)
    table = tmp_path / ("llava.jsonl" if layout == "jsonl" else "llava_v1_5_mix665k.json")
    if layout == "jsonl":
        table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        table.write_text(json.dumps(rows, indent=2 if layout == "pretty" else None))
    res = import_table(table, tmp_path / "out", image_root=tmp_path / "images")
    assert res["status"] == "ok" and res["written"] == 3 and res["skipped"] == {}
    assert res["format"] == ("jsonl" if layout == "jsonl" else "json")
    a, b, c = _read(tmp_path / "out")
    assert (
        a.kind == "pair"
        and len(a.turns) == 4
        and a.turns[0]
        == {"role": "user", "content": "<image>\nWhat are the colors of the bus in the image?"}
    )
    assert a.images[0] == (tmp_path / "images/coco/train2017/000000033471.jpg").read_bytes()
    assert a.meta["id"] == "000000033471"
    assert b.kind == "text" and b.turns[1]["role"] == "assistant" and not b.images
    assert (
        c.kind == "interleaved"
        and len(c.images) == 2
        and c.turns[0]["content"].count("<image>") == 2
    )


def _hf_llava(png, n=4, with_bytes=True):
    feats = datasets.Features(
        {
            "id": datasets.Value("string"),
            "image": datasets.Image(),
            "conversations": [
                {"from": datasets.Value("string"), "value": datasets.Value("string")}
            ],
        }
    )
    rows = {
        "id": [f"ov{i}" for i in range(n)],
        # bytes with the path the file had when the dataset was made (not on disk here): the
        # bytes count
        "image": [
            {"bytes": png(10 + i, 12), "path": f"coco/{i}.png"} if with_bytes else f"pics/{i}.png"
            for i in range(n)
        ],
        "conversations": [
            [
                {"from": "human", "value": f"<image>\nHow wide is picture {i}?"},
                {"from": "gpt", "value": f"{10 + i} pixels"},
            ]
            for i in range(n)
        ],
    }
    return datasets.Dataset.from_dict(rows, features=feats)


def _check_ov(samples, png, n=4):
    assert len(samples) == n
    for i, s in enumerate(samples):
        assert s.kind == "pair" and s.images[0] == png(10 + i, 12)
        assert s.turns == [
            {"role": "user", "content": f"<image>\nHow wide is picture {i}?"},
            {"role": "assistant", "content": f"{10 + i} pixels"},
        ]


def test_parquet_with_image_bytes_and_paths(tmp_path, png):
    """`to_parquet` of an `Image` feature: bytes when the images were given as bytes, paths
    (relative to the file's folder) when given as files."""
    _hf_llava(png).to_parquet(str(tmp_path / "ov.parquet"))
    res = import_table(tmp_path / "ov.parquet", tmp_path / "out")
    assert res["written"] == 4 and res["skipped"] == {} and res["format"] == "parquet"
    _check_ov(_read(tmp_path / "out"), png)
    d = tmp_path / "bypath"
    (d / "pics").mkdir(parents=True)
    for i in range(4):
        (d / "pics" / f"{i}.png").write_bytes(png(10 + i, 12))
    import os

    cwd = os.getcwd()
    os.chdir(d)  # datasets stores the path as given
    try:
        _hf_llava(png, with_bytes=False).to_parquet("ov.parquet")
    finally:
        os.chdir(cwd)
    res = import_table(d / "ov.parquet", tmp_path / "out2")
    assert res["written"] == 4, res
    _check_ov(_read(tmp_path / "out2"), png)


def test_save_to_disk_folders_and_arrow_files(tmp_path, png):
    ds = _hf_llava(png)
    ds.save_to_disk(str(tmp_path / "saved"))
    res = import_table(tmp_path / "saved", tmp_path / "out")
    assert res["written"] == 4 and res["format"] == "arrow"
    _check_ov(_read(tmp_path / "out"), png)
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    assert import_table(arrow, tmp_path / "out_file")["written"] == 4
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(
        str(tmp_path / "dd")
    )
    from data_pipelines.importers import ImporterError

    with pytest.raises(ImporterError, match=r"splits \['train', 'test'\]: choose one with --split"):
        import_table(tmp_path / "dd", tmp_path / "out_dd")
    assert import_table(tmp_path / "dd", tmp_path / "out_dd", split="test")["written"] == 2


def test_hub_parquet_folder_with_splits(tmp_path, png):
    """The hub's layout: data/train-0000N-of-0000M.parquet (+ a test split, a README beside)."""
    ds = _hf_llava(png, n=6)
    (tmp_path / "hub" / "data").mkdir(parents=True)
    ds.select(range(3)).to_parquet(str(tmp_path / "hub/data/train-00000-of-00002.parquet"))
    ds.select(range(3, 6)).to_parquet(str(tmp_path / "hub/data/train-00001-of-00002.parquet"))
    ds.select(range(2)).to_parquet(str(tmp_path / "hub/data/test-00000-of-00001.parquet"))
    (tmp_path / "hub" / "README.md").write_text("---\nlicense: mit\n---\n")
    from data_pipelines.importers import ImporterError

    with pytest.raises(ImporterError, match="splits"):
        import_table(tmp_path / "hub", tmp_path / "out")
    res = import_table(tmp_path / "hub", tmp_path / "out", split="train")
    assert res["written"] == 6
    _check_ov(_read(tmp_path / "out"), png, n=6)


def test_the_cauldron_texts_and_images(tmp_path, png):
    feats = datasets.Features(
        {
            "images": datasets.Sequence(datasets.Image()),
            "texts": [
                {
                    "user": datasets.Value("string"),
                    "assistant": datasets.Value("string"),
                    "source": datasets.Value("string"),
                }
            ],
        }
    )
    ds = datasets.Dataset.from_dict(
        {
            "images": [
                [{"bytes": png(20, 20), "path": None}],
                [{"bytes": png(8, 8), "path": None}, {"bytes": png(9, 9), "path": None}],
            ],
            "texts": [
                [
                    {
                        "user": "Question: what is shown?",
                        "assistant": "A red square.",
                        "source": "vqav2",
                    },
                    {"user": "And its colour?", "assistant": "Red.", "source": "vqav2"},
                ],
                [
                    {
                        "user": "Compare the two.",
                        "assistant": "The second is larger.",
                        "source": "mimic",
                    }
                ],
            ],
        },
        features=feats,
    )
    ds.to_parquet(str(tmp_path / "cauldron.parquet"))
    res = import_table(tmp_path / "cauldron.parquet", tmp_path / "out")
    assert res["written"] == 2 and res["skipped"] == {}
    a, b = _read(tmp_path / "out")
    assert a.kind == "pair" and a.turns == [
        {"role": "user", "content": "<image>\nQuestion: what is shown?"},
        {"role": "assistant", "content": "A red square."},
        {"role": "user", "content": "And its colour?"},
        {"role": "assistant", "content": "Red."},
    ]
    assert b.kind == "interleaved" and b.images == [png(8, 8), png(9, 9)]
    assert b.turns[0]["content"] == "<image><image>\nCompare the two."


def test_interleaved_documents_and_message_parts(tmp_path, png):
    """OBELICS-style aligned `texts`/`images` lists, and chat `messages` whose content is a list of parts."""
    feats = datasets.Features(
        {
            "images": datasets.Sequence(datasets.Image()),
            "texts": datasets.Sequence(datasets.Value("string")),
        }
    )
    ds = datasets.Dataset.from_dict(
        {
            "images": [[None, {"bytes": png(12, 12), "path": None}, None]],
            "texts": [["A page about shapes.", None, "The square above is red."]],
        },
        features=feats,
    )
    ds.to_parquet(str(tmp_path / "obelics.parquet"))
    res = import_table(tmp_path / "obelics.parquet", tmp_path / "out")
    assert res["written"] == 1
    (doc,) = _read(tmp_path / "out")
    assert doc.text == "A page about shapes.\n<image>\nThe square above is red." and doc.images == [
        png(12, 12)
    ]

    (tmp_path / "p.png").write_bytes(png(14, 14))
    row = {
        "images": ["p.png"],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look: "},
                    {"type": "image"},
                    {"type": "text", "text": " what is it?"},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "A square."}]},
        ],
    }
    (tmp_path / "m.jsonl").write_text(json.dumps(row) + "\n")
    assert import_table(tmp_path / "m.jsonl", tmp_path / "out2")["written"] == 1
    (s,) = _read(tmp_path / "out2")
    assert s.turns == [
        {"role": "user", "content": "Look: <image> what is it?"},
        {"role": "assistant", "content": "A square."},
    ]


def test_workers_write_the_same_shards(tmp_path, png):
    """Images decoded and checked in two worker processes: the same bytes as in-process, bad rows counted."""
    _images(tmp_path / "images", png)
    rows = _llava_rows(png) * 30
    rows[5] = dict(rows[5], image="coco/train2017/missing.jpg")
    from PIL import Image

    noisy = io.BytesIO()
    Image.effect_noise((64, 64), 60).convert("RGB").save(noisy, "JPEG", quality=90)
    # cut inside the entropy-coded data: the header reads, only decoding finds the loss
    (tmp_path / "images/coco/train2017/broken.jpg").write_bytes(
        noisy.getvalue()[: len(noisy.getvalue()) // 2]
    )
    rows[7] = dict(rows[0], image="coco/train2017/broken.jpg")
    (tmp_path / "t.json").write_text(json.dumps(rows))
    outs = []
    for w in (0, 2):
        res = import_table(
            tmp_path / "t.json",
            tmp_path / f"w{w}",
            image_root=tmp_path / "images",
            workers=w,
            max_count=25,
        )
        assert res["written"] == 88 and res["skipped"] == {
            "corrupt_image": 1,
            "missing_image_file": 1,
        }
        outs.append([p.read_bytes() for p in sorted((tmp_path / f"w{w}").glob("*.tar"))])
    assert len(outs[0]) == 4 and outs[0] == outs[1]
