"""Issue 37, the data side: an output folder that cannot be written is one line, before any work;
FIFOs, devices and broken links among the images are skipped and counted, never opened; captions in
another encoding say so (`--encoding`); a refused image path names the flags that allow it; deleted
shards are named in one warning. A full disk during an import:
tests/test_data_import_full_disk.py."""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time

import pytest

import data_pipelines.importers as importers
from data_pipelines.cli import add_data_commands
from data_pipelines.importers import import_folder, import_table


def _cli(argv, capsys):
    p = argparse.ArgumentParser(prog="vlm")
    add_data_commands(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def _leftovers(d):
    return sorted(
        p.name
        for p in d.iterdir()
        if p.name.endswith(".tmp")
        or p.name.endswith(".partial")
        or p.name.startswith(".vlm-write-check-")
    )


# ------------------------------------------------------------------------------------------------
# unwritable --out
def _commands(tmp_path, png):
    (tmp_path / "imgs").mkdir(exist_ok=True)
    (tmp_path / "imgs" / "a.png").write_bytes(png())
    (tmp_path / "imgs" / "a.txt").write_text("a red thing")
    (tmp_path / "t.jsonl").write_text(
        json.dumps({"image": "imgs/a.png", "caption": "a red thing"}) + "\n"
    )
    return {
        "import-table": ["data", "import-table", str(tmp_path / "t.jsonl")],
        "import-folder": ["data", "import-folder", str(tmp_path / "imgs")],
    }


def _no_work(monkeypatch):
    """Record whether an import started reading its input (it must not, when OUT cannot be written)."""
    calls = []
    real_open, real_run = importers.open_source, importers.run_import
    monkeypatch.setattr(
        importers, "open_source", lambda *a, **k: calls.append("open_source") or real_open(*a, **k)
    )
    monkeypatch.setattr(
        importers, "run_import", lambda *a, **k: calls.append("run_import") or real_run(*a, **k)
    )
    return calls


@pytest.mark.parametrize("command", ["import-table", "import-folder"])
def test_a_read_only_out_is_one_line_before_any_work(
    command, read_only_dir, tmp_path, png, capsys, monkeypatch
):
    argv = _commands(tmp_path, png)[command]
    calls = _no_work(monkeypatch)
    # the folder itself, and one to be made in it
    for out in (read_only_dir, read_only_dir / "new" / "deeper"):
        rc, _, err = _cli(argv + ["--out", str(out), "--workers", "0", "--quiet"], capsys)
        line = _one_line(err)
        assert rc == 2 and f"--out {out}: cannot write in {read_only_dir}" in line, line
        assert "Read-only file system" in line or "Permission denied" in line, line
    assert calls == []


@pytest.mark.parametrize("command", ["import-table", "import-folder"])
def test_a_file_in_the_way_of_out_is_one_line(command, tmp_path, png, capsys, monkeypatch):
    argv = _commands(tmp_path, png)[command]
    (tmp_path / "blocker").write_text("a file, where --out wants a folder")
    calls = _no_work(monkeypatch)
    for out in (tmp_path / "blocker", tmp_path / "blocker" / "sub"):
        rc, _, err = _cli(argv + ["--out", str(out), "--workers", "0", "--quiet"], capsys)
        assert rc == 2 and f"{tmp_path / 'blocker'} is a file, not a folder" in _one_line(err), err
    assert calls == [] and not _leftovers(tmp_path)


# ------------------------------------------------------------------------------------------------
# not regular files
class _FifoWatch:
    """Polls a FIFO for a reader: opening it for writing without blocking succeeds only while
    someone has it open for reading (and then also frees that reader, so a test of broken code ends
    instead of hanging)."""

    def __init__(self, path):
        self.path, self.opened, self.stop = path, False, False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop:
            try:
                os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))
                self.opened = True
            except OSError:
                pass
            time.sleep(0.005)

    def close(self):
        self.stop = True
        self.thread.join()


def test_fifos_devices_and_broken_links_among_images_are_counted_never_opened(
    tmp_path, png, capsys
):
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for name in ("a", "b", "c", "pipe", "null", "gone"):
        (imgs / f"{name}.txt").write_text(f"a picture called {name}")
    for name in ("a", "b", "c"):
        (imgs / f"{name}.png").write_bytes(png())
    os.mkfifo(imgs / "pipe.png")
    (imgs / "null.png").symlink_to("/dev/null")  # a character device
    (imgs / "gone.png").symlink_to(imgs / "deleted.png")  # a link to nothing
    (tmp_path / "t.jsonl").write_text(
        "".join(json.dumps({"image": f"imgs/{n}.png", "caption": n}) + "\n" for n in ("a", "pipe"))
    )
    watch = _FifoWatch(imgs / "pipe.png")
    try:
        res = import_folder(imgs, tmp_path / "o1", allow_outside_root=True, max_skip_share=1)
        rc, out, _ = _cli(
            [
                "data",
                "import-folder",
                str(imgs),
                "--out",
                str(tmp_path / "o2"),
                "--workers",
                "0",
                "--quiet",
                "--max-skip-share",
                "1",
            ],
            capsys,
        )
        tab = import_table(tmp_path / "t.jsonl", tmp_path / "o3", max_skip_share=1)
    finally:
        watch.close()
    assert not watch.opened, "the importer opened the FIFO"
    assert res["written"] == 3 and res["skipped"] == {
        "missing_image_file": 1,
        "not_regular_file": 2,
    }
    details = {e["id"]: e["detail"] for e in res["examples"]}
    assert details == {
        "gone.png": "gone.png leads to nothing (a broken link?)",
        "null.png": "null.png is a character device, not a regular file",
        "pipe.png": "pipe.png is a FIFO (named pipe), not a regular file",
    }
    # without --allow-outside-root the link to /dev/null is refused first; the summary names the
    # new reason
    assert (
        rc == 0
        and "not_regular_file=1" in out
        and "outside_root=1" in out
        and "missing_image_file=1" in out
    )
    assert tab["written"] == 1 and tab["skipped"] == {"not_regular_file": 1}
    assert "is a FIFO (named pipe), not a regular file" in tab["examples"][0]["detail"]


# ------------------------------------------------------------------------------------------------
# encodings
def test_latin1_captions_say_encoding_and_import_folder_takes_it(tmp_path, png, capsys):
    side, table = tmp_path / "side", tmp_path / "table"
    for d in (side, table):
        d.mkdir()
        (d / "a.png").write_bytes(png())
    (side / "a.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    caps = tmp_path / "caps.csv"
    caps.write_bytes("file_name,caption\na.png,caf\xe9 cr\xe8me\n".encode("latin-1"))
    for folder, extra in ((side, []), (table, ["--captions", str(caps)])):
        base = ["data", "import-folder", str(folder), *extra, "--workers", "0", "--quiet", "--json"]
        rc, out, err = _cli(base + ["--out", str(tmp_path / f"u8_{folder.name}")], capsys)
        res = json.loads(out)
        # not missing_caption
        assert rc == 2 and res["skipped"] == {"non_utf8_text": 1}, (folder.name, res)
        assert "another encoding? see --encoding" in res["examples"][0]["detail"], res["examples"]
        rc, out, err = _cli(
            base + ["--out", str(tmp_path / f"l1_{folder.name}"), "--encoding", "latin-1"], capsys
        )
        assert rc == 0 and json.loads(out)["written"] == 1, err
        tar = next((tmp_path / f"l1_{folder.name}").glob("*.tar"))
        from data_pipelines.samples import iter_samples

        assert [s.text for s in iter_samples([str(tar)])] == ["<image>caf\xe9 cr\xe8me"]
    # a captions table with a row that cannot be read at all: the images it leaves without a caption
    # say so
    (tmp_path / "caps.jsonl").write_bytes(b'{"file_name": "a.png", "caption": "caf\xe9 \n')
    with pytest.raises(
        importers.ImportFailed,
        match=r"missing_caption \(a.png is not in the captions table, 1 of "
        r"whose rows could not be read \(another encoding\? see --encoding\)\)",
    ):
        import_folder(table, tmp_path / "broken", captions=tmp_path / "caps.jsonl")
    rc, _, err = _cli(
        ["data", "import-folder", str(side), "--out", str(tmp_path / "x"), "--encoding", "nope"],
        capsys,
    )
    assert rc == 2 and "unknown text encoding 'nope'" in _one_line(err)


# ------------------------------------------------------------------------------------------------
# refused paths
def test_a_refused_image_path_names_the_flags_that_allow_it(tmp_path, png):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "x.png").write_bytes(png())
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "t.jsonl").write_text(
        json.dumps({"image": "../outside/x.png", "caption": "x"})
        + "\n"
        + json.dumps({"image": str(tmp_path / "outside" / "x.png"), "caption": "y"})
        + "\n"
    )
    with pytest.raises(importers.ImportFailed) as e:
        import_table(tmp_path / "data" / "t.jsonl", tmp_path / "o1")
    assert (
        str(e.value).count(
            "--image-root FOLDER reads images under FOLDER, "
            "--allow-outside-root reads them anywhere"
        )
        == 2
    ), str(e.value)
    assert (
        import_table(
            tmp_path / "data" / "t.jsonl",
            tmp_path / "o2",
            # both lead into it
            image_root=tmp_path / "outside",
            allow_outside_root=False,
        )["written"]
        == 2
    )
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "x.png").symlink_to(tmp_path / "outside" / "x.png")
    (tmp_path / "imgs" / "x.txt").write_text("x")
    with pytest.raises(
        importers.ImportFailed,
        match=r"x.png leads outside .*imgs \(a link out; --allow-outside-root follows it\)",
    ):
        import_folder(tmp_path / "imgs", tmp_path / "o3")


# ------------------------------------------------------------------------------------------------
# deleted shards
@pytest.mark.parametrize("deleted, named, more", [(25, 10, " and 15 more"), (3, 3, "")])
def test_deleted_shards_are_named_in_one_warning(
    deleted, named, more, tmp_path, write_text_shards, caplog
):
    from data_pipelines.config import DataConfig, SourceConfig
    from data_pipelines.loader import build_loader
    from data_pipelines.tokenizer import ByteTokenizer

    write_text_shards(tmp_path, 60, per_shard=2)
    gone = [f"t-{i:06d}.tar" for i in range(3, 3 + deleted)]
    for name in gone:
        (tmp_path / name).unlink()
    cfg = DataConfig(
        sources=[SourceConfig(path=str(tmp_path), name="mine")],
        row_tokens=64,
        rows_per_batch=1,
        epochs=1,
        shuffle_buffer=0,
        num_workers=0,
    )
    with caplog.at_level(logging.WARNING, logger="data_pipelines"):
        loader = build_loader(cfg, ByteTokenizer())
        batches = sum(1 for _ in loader)
    assert loader.counters == {"missing_shard": 2 * deleted} and batches > 0
    about = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING
        and ".tar" in r.getMessage()
        and "skipping bad input" not in r.getMessage()
    ]
    assert about == [
        (
            f"source mine: {deleted} shard(s) listed in {tmp_path / 'manifest.json'} are gone "
            f"({2 * deleted} samples, counted as missing_shard): {', '.join(gone[:named])}{more}"
        )
    ], about
