"""Importers (folder + captions, JSONL/CSV tables) and the `vlm data` commands on small fixtures."""

from __future__ import annotations

import argparse
import base64
import csv
import json

import pytest

from data_pipelines.chat import iter_vqa_samples
from data_pipelines.cli import add_data_commands
from data_pipelines.importers import ImporterError, import_folder, import_table
from data_pipelines.reader import iter_shard, resolve_shards
from data_pipelines.schema import decode_sample
from data_pipelines.writer import read_manifest


def _read(directory):
    return [decode_sample(raw) for p in resolve_shards(directory) for _, raw in iter_shard(p)]


def test_import_folder_with_sidecars(tmp_path, png):
    src = tmp_path / "imgs"
    (src / "sub").mkdir(parents=True)
    (src / "a.png").write_bytes(png(10, 10))
    (src / "a.txt").write_text("a red square")
    (src / "sub" / "b.jpg").write_bytes(png(12, 8, fmt="JPEG"))
    (src / "sub" / "b.txt").write_text("a photo")
    (src / "nocap.png").write_bytes(png())
    (src / "broken.png").write_bytes(b"\x89PNG not really")
    (src / "broken.txt").write_text("caption of a broken file")
    (src / "latin.png").write_bytes(png())
    (src / "latin.txt").write_bytes(b"caf\xe9")
    res = import_folder(src, tmp_path / "out", max_count=1)
    assert res["written"] == 2 and len(res["shards"]) == 2
    assert res["skipped"] == {"missing_caption": 1, "corrupt_image": 1, "non_utf8_text": 1}
    got = _read(tmp_path / "out")
    assert [(s.kind, s.text, s.image_exts) for s in got] == [
        ("pair", "<image>a red square", ["png"]),
        ("pair", "<image>a photo", ["jpg"]),
    ]
    assert got[1].images[0] == (src / "sub" / "b.jpg").read_bytes()
    assert read_manifest(tmp_path / "out")["totals"]["count"] == 2


def test_import_folder_with_caption_file(tmp_path, png):
    src = tmp_path / "imgs"
    src.mkdir()
    (src / "x.png").write_bytes(png())
    (src / "y.png").write_bytes(png())
    with open(tmp_path / "caps.csv", "w", newline="") as f:
        csv.writer(f).writerows([["file_name", "caption"], ["x.png", "ex"], ["y.png", "why"]])
    res = import_folder(src, tmp_path / "out", captions=tmp_path / "caps.csv")
    assert res["written"] == 2 and [s.text for s in _read(tmp_path / "out")] == [
        "<image>ex",
        "<image>why",
    ]


def test_import_jsonl_table_vqa_chat_interleaved_text(tmp_path, png):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "1.png").write_bytes(png(16, 16))
    uri = "data:image/png;base64," + base64.b64encode(png(9, 9)).decode()
    rows = [
        {
            "image": "img/1.png",
            "question": "What colour?",
            "answer": "red",
            "question_type": "colour",
        },
        {
            "image": uri,
            "conversations": [
                {"from": "system", "value": "be nice"},
                {"from": "human", "value": "<image>\nDescribe."},
                {"from": "gpt", "value": "A dot."},
            ],
        },
        {
            "images": None,
            "image": ["img/1.png", {"bytes": None, "path": "img/1.png"}],
            "text": "two pictures",
        },
        {"image": "", "text": "just a document"},
        {"image": "img/missing.png", "text": "gone"},
        {"image": "img/1.png", "question": "empty answer?", "answer": ""},
    ]
    with open(tmp_path / "t.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        f.write("{not json\n")
    res = import_table(tmp_path / "t.jsonl", tmp_path / "out")
    assert res["written"] == 4
    assert res["skipped"] == {"missing_image_file": 1, "empty_text": 1, "bad_row": 1}
    a, b, c, d = _read(tmp_path / "out")
    assert a.kind == "pair" and a.turns == [
        {"role": "user", "content": "<image>\nWhat colour?"},
        {"role": "assistant", "content": "red"},
    ]
    assert a.meta["qa"] == [{"question": "What colour?", "answer": "red", "type": "colour"}]
    assert b.turns == [
        {"role": "user", "content": "<image>\nDescribe."},
        {"role": "assistant", "content": "A dot."},
    ]
    assert b.images[0] == png(9, 9)
    assert c.kind == "interleaved" and c.text == "<image><image>two pictures" and len(c.images) == 2
    assert d.kind == "text" and d.text == "just a document"
    vqa = list(iter_vqa_samples(tmp_path / "out"))
    assert [(v.question, v.answer, v.question_type) for v in vqa] == [
        ("What colour?", "red", "colour")
    ]


def test_import_csv_with_named_columns_and_errors(tmp_path, png):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "p.png").write_bytes(png())
    with open(tmp_path / "t.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["pic", "desc"])
        w.writerow(["p.png", "a caption"])
        w.writerow(["", "text only row"])
    res = import_table(
        tmp_path / "t.csv",
        tmp_path / "out",
        image_col="pic",
        text_col="desc",
        image_root=tmp_path / "pics",
    )
    assert res["written"] == 2 and [s.kind for s in _read(tmp_path / "out")] == ["pair", "text"]
    with pytest.raises(ImporterError, match="column 'nope' not found"):
        import_table(tmp_path / "t.csv", tmp_path / "o2", text_col="nope")
    with pytest.raises(ImporterError, match="unknown format"):
        import_table(tmp_path / "pics" / "p.png", tmp_path / "o3")
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        with pytest.raises(ImporterError, match="needs pyarrow"):
            import_table(tmp_path / "x.parquet", tmp_path / "o4")


def _cli(argv):
    p = argparse.ArgumentParser(prog="vlm")
    add_data_commands(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    return args.func(args)


def test_data_cli_build_stats_import(tmp_path, capsys):
    out = tmp_path / "dd"
    assert (
        _cli(
            [
                "data",
                "build-default",
                "--out",
                str(out),
                "--train-scenes",
                "30",
                "--val-scenes",
                "5",
                "--test-scenes",
                "5",
                "--text-docs",
                "10",
                "--interleaved-docs",
                "4",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    # 30 vqa + 30 caption + 4 interleaved + 10 text
    assert "== train" in text and "samples:           74" in text
    assert _cli(["data", "stats", str(out / "test"), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["totals"]["count"] == 10 and stats["totals"]["kinds"] == {"pair": 10}
    split_counts = []
    for split in ("train", "val", "test"):
        assert _cli(["data", "stats", str(out / split), "--json"]) == 0
        split_counts.append(json.loads(capsys.readouterr().out)["totals"]["count"])
    # the dataset folder: its split subfolders
    assert _cli(["data", "stats", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["totals"]["count"] == sum(split_counts) > 74
    assert _cli(["data", "stats", str(out / "val" / "*.tar"), "--scan"]) == 0
    assert "problems: -" in capsys.readouterr().out
    assert _cli(["data", "stats", str(tmp_path / "missing.tar")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "hello there"}) + "\n")
    assert (
        _cli(["data", "import-table", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "imp")])
        == 0
    )
    assert "wrote 1 samples" in capsys.readouterr().out
    # a text-only build (no scenes: its image splits are empty) is fine too
    assert (
        _cli(
            [
                "data",
                "build-default",
                "--out",
                str(tmp_path / "text"),
                "--train-scenes",
                "0",
                "--val-scenes",
                "0",
                "--test-scenes",
                "0",
                "--text-docs",
                "20",
                "--interleaved-docs",
                "0",
            ]
        )
        == 0
    )
    assert "== train" in capsys.readouterr().out
    assert (
        _cli(
            [
                "data",
                "train-tokenizer",
                str(out / "train"),
                "--vocab-size",
                "300",
                "--out",
                str(tmp_path / "tok"),
            ]
        )
        == 0
    )
    assert (tmp_path / "tok" / "tokenizer.json").is_file()


def test_importers_stay_inside_their_root(tmp_path, png):
    """A table's `../x` or absolute path and a symlink out of the image folder are not read (skipped
    and counted as outside_root) unless --allow-outside-root says so."""
    secret = tmp_path / "secret.png"
    secret.write_bytes(png(20, 20))
    root = tmp_path / "data"
    (root / "img").mkdir(parents=True)
    (root / "img" / "ok.png").write_bytes(png(20, 20))
    table = root / "t.jsonl"
    table.write_text(
        "\n".join(
            json.dumps({"image": p, "text": t})
            for p, t in [
                ("img/ok.png", "inside"),
                ("../secret.png", "dotdot"),
                (str(secret), "absolute"),
            ]
        )
    )
    res = import_table(table, tmp_path / "out1")
    assert res["written"] == 1 and res["skipped"] == {"outside_root": 2}
    assert import_table(table, tmp_path / "out2", allow_outside_root=True)["written"] == 3

    (root / "img" / "ok.txt").write_text("inside")
    (root / "img" / "link.png").symlink_to(secret)
    (root / "img" / "link.txt").write_text("a link out")
    res = import_folder(root / "img", tmp_path / "out3")
    assert res["written"] == 1 and res["skipped"] == {"outside_root": 1}
    assert [s.text for s in _read(tmp_path / "out3")] == ["<image>inside"]
    assert import_folder(root / "img", tmp_path / "out4", allow_outside_root=True)["written"] == 2


def test_importers_show_progress_as_plain_lines_in_a_redirected_log(tmp_path, png, capsys):
    """Under pytest stderr is not a terminal: no carriage-return bar, a `done/total` line instead."""
    src = tmp_path / "imgs"
    src.mkdir()
    for i in range(3):
        (src / f"{i}.png").write_bytes(png(10, 10))
        (src / f"{i}.txt").write_text(f"picture {i}")
    import_folder(src, tmp_path / "out", progress=True)
    err = capsys.readouterr().err
    assert "import-folder: 3/3 images" in err and "\r" not in err
    import_folder(src, tmp_path / "quiet", progress=False)
    assert capsys.readouterr().err == ""
