"""Imports that lose data say so (issues 26 and 31): nothing written exits non-zero with one line
naming the first skipped rows; too many skipped exits 1 after writing; `--json` gives a summary a
script can read; an interrupted import resumes where its last full shard ended and a finished one is
not redone."""

from __future__ import annotations

import argparse
import json

import pytest

import data_pipelines.importers as importers
from data_pipelines.cli import add_data_commands
from data_pipelines.importers import (
    ImporterError,
    ImportFailed,
    ImportInterrupted,
    import_folder,
    import_table,
)


def _cli(argv, capsys):
    p = argparse.ArgumentParser(prog="vlm")
    add_data_commands(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def _nothing_cases(tmp, png):
    """(name, argv) for inputs from which nothing can be read."""
    (tmp / "imgs").mkdir()
    (tmp / "imgs" / "a.png").write_bytes(png())  # an image without a caption
    (tmp / "empty_dir").mkdir()
    (tmp / "empty.json").write_text("")
    (tmp / "empty_array.json").write_text("[]")
    (tmp / "header.csv").write_text("image,caption\n")
    (tmp / "bad.jsonl").write_text("{oops\nnot json either\n")
    (tmp / "latin1.csv").write_bytes("caption\ncaf\xe9 cr\xe8me\n".encode("latin-1"))
    rows = [
        {
            "id": f"r{i}",
            "image": f"coco/{i}.jpg",
            "conversations": [
                {"from": "human", "value": "<image>\nwhat?"},
                {"from": "gpt", "value": "that"},
            ],
        }
        for i in range(4)
    ]
    (tmp / "llava.json").write_text(json.dumps(rows))
    (tmp / "truncated.json").write_text(json.dumps(rows)[:50])
    (tmp / "object.json").write_text(json.dumps({"data": rows}, indent=1))
    return [
        ("empty_file", ["data", "import-table", str(tmp / "empty.json")]),
        ("empty_array", ["data", "import-table", str(tmp / "empty_array.json")]),
        ("all_images_missing", ["data", "import-table", str(tmp / "llava.json")]),
        ("header_only_csv", ["data", "import-table", str(tmp / "header.csv")]),
        ("all_lines_bad", ["data", "import-table", str(tmp / "bad.jsonl")]),
        ("non_utf8_csv", ["data", "import-table", str(tmp / "latin1.csv")]),
        ("truncated_array", ["data", "import-table", str(tmp / "truncated.json")]),
        ("json_object", ["data", "import-table", str(tmp / "object.json")]),
        ("empty_table_folder", ["data", "import-table", str(tmp / "empty_dir")]),
        ("empty_image_folder", ["data", "import-folder", str(tmp / "empty_dir")]),
        ("no_captions", ["data", "import-folder", str(tmp / "imgs")]),
    ]


def test_an_import_that_writes_nothing_fails_in_one_line(tmp_path, png, capsys):
    reasons = {}
    for name, argv in _nothing_cases(tmp_path, png):
        rc, out, err = _cli(
            argv + ["--out", str(tmp_path / f"out_{name}"), "--workers", "0", "--quiet"], capsys
        )
        assert rc == 2, (name, rc, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, (
            name,
            err,
        )
        reasons[name] = lines[0]
    assert (
        "all 4 rows skipped (missing_image_file=4); first: row 0 (r0): missing_image_file (image 'coco/0.jpg'"
        in reasons["all_images_missing"]
    )
    assert "row 1 (r1)" in reasons["all_images_missing"]
    assert "latin1.csv line 2: not valid utf-8" in reasons["non_utf8_csv"]
    assert "holds no rows" in reasons["empty_file"] and "holds no rows" in reasons["empty_array"]
    assert (
        "invalid JSON after item 0" in reasons["truncated_array"]
        and "truncated.json" in reasons["truncated_array"]
    )
    assert (
        "missing_caption" in reasons["no_captions"] and "holds no" in reasons["empty_table_folder"]
    )
    assert (
        "holds no images" in reasons["empty_image_folder"]
        and "pretty-printed JSON object" in reasons["json_object"]
    )
    # --encoding reads the latin-1 file
    rc, out, _ = _cli(
        [
            "data",
            "import-table",
            str(tmp_path / "latin1.csv"),
            "--out",
            str(tmp_path / "o_l1"),
            "--encoding",
            "latin-1",
            "--workers",
            "0",
            "--json",
        ],
        capsys,
    )
    assert rc == 0 and json.loads(out)["written"] == 1


def test_json_summary_and_max_skip_share(tmp_path, png, capsys):
    (tmp_path / "ok.png").write_bytes(png())
    rows = [
        {"id": i, "image": "ok.png" if i < 7 else "gone.png", "caption": f"picture {i}"}
        for i in range(10)
    ]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["data", "import-table", str(tmp_path / "t.jsonl"), "--workers", "0", "--json"]
    rc, out, err = _cli(argv + ["--out", str(tmp_path / "a")], capsys)
    s = json.loads(out)
    assert rc == 1 and s["status"] == "too_many_skipped" and s["written"] == 7 and s["rows"] == 10
    assert (
        s["skipped"] == {"missing_image_file": 3}
        and s["skip_share"] == 0.3
        and s["max_skip_share"] == 0.1
    )
    assert [e["row"] for e in s["examples"]] == [7, 8, 9] and s["examples"][0]["id"] == "7"
    assert "more than the allowed 10.0 %" in err
    rc, out, _ = _cli(argv + ["--out", str(tmp_path / "b"), "--max-skip-share", "0.5"], capsys)
    assert rc == 0 and json.loads(out)["status"] == "ok"
    rc, out, err = _cli(
        argv[:-1] + ["--out", str(tmp_path / "c"), "--max-skip-share", "0.5"], capsys
    )
    assert (
        rc == 0
        and "wrote 7 samples" in out
        and "skipped 3 (30.0 %): missing_image_file=3; first: row 7 (7)" in out
    )
    with pytest.raises(SystemExit):
        _cli(argv + ["--out", str(tmp_path / "d"), "--max-skip-share", "2"], capsys)
    assert "is not a share between 0 and 1" in capsys.readouterr().err
    # nothing written: the summary still comes on stdout, the one line on stderr
    (tmp_path / "none.jsonl").write_text(json.dumps({"image": "gone.png", "caption": "x"}) + "\n")
    rc, out, err = _cli(
        [
            "data",
            "import-table",
            str(tmp_path / "none.jsonl"),
            "--workers",
            "0",
            "--json",
            "--quiet",
            "--out",
            str(tmp_path / "e"),
        ],
        capsys,
    )
    assert (
        rc == 2
        and json.loads(out)["status"] == "nothing_written"
        and len(err.strip().splitlines()) == 1
    )


def test_captions_table_without_known_columns_is_one_line(tmp_path, png, capsys):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png())
    (tmp_path / "caps.jsonl").write_text(
        json.dumps({"fname": "a.png", "desc": "a red thing"}) + "\n"
    )
    rc, out, err = _cli(
        [
            "data",
            "import-folder",
            str(tmp_path / "imgs"),
            "--captions",
            str(tmp_path / "caps.jsonl"),
            "--out",
            str(tmp_path / "out"),
            "--workers",
            "0",
        ],
        capsys,
    )
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "KeyError" not in err
    assert (
        "needs a file column (image, images" in err
        and "a caption column" in err
        and "'desc', 'fname'" in err
    )


def _table(tmp_path, png, n=100):
    (tmp_path / "img").mkdir(exist_ok=True)
    (tmp_path / "img" / "p.png").write_bytes(png(12, 12))
    rows = [
        {
            "id": f"{i:04d}",
            "image": "img/p.png" if i % 9 else "img/none.png",
            "caption": f"picture {i}",
        }
        for i in range(n)
    ]
    (tmp_path / "t.json").write_text(json.dumps(rows))
    return tmp_path / "t.json"


def test_interrupted_import_resumes_and_a_finished_one_is_not_redone(tmp_path, png, monkeypatch):
    table = _table(tmp_path, png)
    kw = dict(max_count=10, max_skip_share=0.2)
    ref = import_table(table, tmp_path / "ref", **kw)
    assert ref["written"] == 88 and ref["skipped"] == {"missing_image_file": 12}

    real, seen = importers.convert_row, []

    def crash_at_90(index, row, settings):
        seen.append(index)
        if index == 90:
            raise KeyboardInterrupt
        return real(index, row, settings)

    monkeypatch.setattr(importers, "convert_row", crash_at_90)
    # rows are converted 32 at a time: the crash at row 90 stops the chunk of rows 64-95; the rows
    # before it filled 5 shards of 10 (the sample that opened the 6th is at row 57)
    with pytest.raises(
        ImportInterrupted,
        match=r"interrupted after 64 rows; 50 samples in complete shards "
        r"are kept; run the same command again to resume at row 57",
    ):
        import_table(table, tmp_path / "out", **kw)
    # no partial shard left in the output
    assert not list((tmp_path / "out").glob(".*partial/*.tar"))
    assert len(list((tmp_path / "out").glob("*.tar"))) == 5
    # what a SIGKILL can leave besides: the shard being written, and a full shard moved out before
    # its state save
    (tmp_path / "out" / ".shard.partial").mkdir()
    (tmp_path / "out" / ".shard.partial" / "shard-000005.tar").write_bytes(b"half a shard")
    (tmp_path / "out" / "shard-000006.tar").write_bytes(b"a shard the state does not know")
    seen.clear()
    monkeypatch.setattr(importers, "convert_row", lambda i, r, s: seen.append(i) or real(i, r, s))
    res = import_table(table, tmp_path / "out", **kw)
    # only the rest is converted
    assert res["resumed_at_row"] == 57 and seen[0] == 57 and len(seen) == 43
    assert {k: res[k] for k in ("written", "skipped", "rows")} == {
        k: ref[k] for k in ("written", "skipped", "rows")
    }
    assert res["examples"] == ref["examples"]
    names = sorted(p.name for p in (tmp_path / "ref").glob("*.tar"))
    assert names == sorted(p.name for p in (tmp_path / "out").glob("*.tar")) and len(names) == 9
    assert not (tmp_path / "out" / ".shard.partial").exists()
    for n in names + ["manifest.json"]:
        ref_bytes, out_bytes = (
            (tmp_path / "ref" / n).read_bytes(),
            (tmp_path / "out" / n).read_bytes(),
        )
        assert ref_bytes == out_bytes, n
    seen.clear()
    again = import_table(table, tmp_path / "out", **kw)
    assert again["already_imported"] and seen == [] and again["written"] == 88


def test_an_output_folder_is_not_mixed_up_with_another_import(tmp_path, png):
    table = _table(tmp_path, png, n=20)
    import_table(table, tmp_path / "out", max_skip_share=0.2)
    with pytest.raises(
        ImporterError,
        match="already holds shard-\\*.tar from an import of "
        "another input or with other options; use --overwrite",
    ):
        import_table(table, tmp_path / "out", max_count=5, max_skip_share=0.2)
    res = import_table(table, tmp_path / "out", max_count=5, max_skip_share=0.2, overwrite=True)
    assert len(res["shards"]) == 4 and len(list((tmp_path / "out").glob("*.tar"))) == 4
    assert (
        import_table(table, tmp_path / "out", prefix="other", max_skip_share=0.2)["written"] == 17
    )
    with pytest.raises(ImportFailed):
        # no captions: nothing written, raises
        import_folder(tmp_path / "img", tmp_path / "out3")


def test_bad_images_are_skipped_and_counted_not_decoded_whole(tmp_path, png):
    """A decompression bomb (8000 x 8000, a few kB) is refused from its header; bytes that are no
    image are corrupt_image; the good row is written."""
    from PIL import Image

    Image.new("1", (8000, 8000)).save(tmp_path / "bomb.png")
    (tmp_path / "junk.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    (tmp_path / "ok.png").write_bytes(png())
    rows = [{"image": n, "caption": f"row with {n}"} for n in ("ok.png", "bomb.png", "junk.jpg")]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = import_table(tmp_path / "t.jsonl", tmp_path / "out", max_skip_share=1.0)
    assert res["written"] == 1 and res["skipped"] == {"image_too_large": 1, "corrupt_image": 1}
    assert "8000x8000 pixels exceeds" in res["examples"][0]["detail"]
