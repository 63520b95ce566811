"""Issue 45, the data side: nothing stale or silently dropped, resumes that survive damage, and
import workers that end with their import.

- The resume fingerprint sees content: a caption edited or an image replaced since an import is
  refused with `--overwrite` named, never "nothing to do".
- A captions table listing an image several times (COCO: 5 captions) gives one sample per caption;
  a row naming a file the folder lacks is counted; a JSON object with a key written twice is
  skipped and counted (`duplicate_key`); a CSV header naming a column twice stops the import.
- A file name that is not UTF-8 is skipped and counted, the rest imported.
- A damaged import state falls back to the one saved before it; a shard the state lists that is
  gone makes the import start over (the issue's rerun reported 30000 samples in 15 shards with 14
  there).
- SIGTERM stops an import in one line saying where the same command resumes (exit 143); SIGTERM
  or kill -9 of the import leaves no worker process alive.
- A `build-default` killed part way leaves nothing the next build does not remove.

The lock on --out: tests/test_reliability_round4_locks.py."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_pipelines.cli import add_data_commands
from data_pipelines.import_sources import ImporterError
from data_pipelines.import_state import state_path
from data_pipelines.importers import import_folder, import_table
from data_pipelines.samples import iter_samples


def _cli(argv, capsys):
    p = argparse.ArgumentParser(prog="vlm")
    add_data_commands(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def _texts(out: Path) -> list[str]:
    return sorted(s.all_text() for s in iter_samples([str(out / "*.tar")]))


def _folder(root: Path, png, n: int = 3) -> Path:
    imgs = root / "imgs"
    imgs.mkdir(parents=True)
    for i in range(n):
        (imgs / f"{i}.png").write_bytes(png(colour=(60 * i, 0, 0)))
        (imgs / f"{i}.txt").write_text(f"picture {i}")
    return imgs


# ------------------------------------------------------------------------------------------------
# stale inputs
@pytest.mark.parametrize("change", ["caption edited", "image replaced", "image added"])
def test_a_changed_input_is_not_nothing_to_do(change, tmp_path, png):
    imgs = _folder(tmp_path, png)
    out = tmp_path / "out"
    import_folder(imgs, out)
    if change == "caption edited":
        (imgs / "1.txt").write_text("picture 1, now blue")
    elif change == "image replaced":
        (imgs / "1.png").write_bytes(png(w=48, colour=(0, 0, 255)))
    else:
        (imgs / "9.png").write_bytes(png())
        (imgs / "9.txt").write_text("picture 9")
    with pytest.raises(ImporterError) as e:
        import_folder(imgs, out)
    msg = str(e.value)
    assert "--overwrite" in msg and "\n" not in msg, msg
    if change != "image added":  # the file names are the same: only their content changed
        assert "changed since the import" in msg, msg
    res = import_folder(imgs, out, overwrite=True)
    assert not res.get("already_imported")
    if change == "caption edited":
        assert any("now blue" in t for t in _texts(out))


def test_an_unchanged_input_is_still_nothing_to_do(tmp_path, png):
    imgs = _folder(tmp_path, png)
    out = tmp_path / "out"
    first = import_folder(imgs, out)
    again = import_folder(imgs, out)
    assert again["already_imported"] and again["written"] == first["written"] == 3


def test_an_image_a_table_names_replaced_since_the_import_is_seen(tmp_path, png):
    imgs = _folder(tmp_path, png)
    rows = [{"image": f"imgs/{i}.png", "caption": f"picture {i}"} for i in range(3)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    import_table(tmp_path / "t.jsonl", out)
    assert import_table(tmp_path / "t.jsonl", out)["already_imported"]
    (imgs / "2.png").write_bytes(png(w=50, colour=(0, 255, 0)))
    with pytest.raises(ImporterError, match="files it read changed since the import"):
        import_table(tmp_path / "t.jsonl", out)


# ------------------------------------------------------------------------------------------------
# nothing dropped silently
def test_every_caption_of_an_image_listed_several_times_is_a_sample(tmp_path, png):
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    (imgs / "a.png").write_bytes(png())
    (imgs / "b.png").write_bytes(png(colour=(0, 0, 255)))
    caps = [("a.png", f"a red thing (take {i})") for i in range(5)] + [("b.png", "a blue thing")]
    caps += [("gone.png", "a file the folder does not hold")]
    (tmp_path / "caps.csv").write_text(
        "file_name,caption\n" + "".join(f"{f},{c}\n" for f, c in caps)
    )
    res = import_folder(imgs, tmp_path / "out", captions=tmp_path / "caps.csv", max_skip_share=1)
    assert res["written"] == 6 and res["skipped"] == {"missing_image_file": 1}, res
    assert _texts(tmp_path / "out") == sorted(f"<image>{c}" for _, c in caps[:6])


@pytest.mark.parametrize("fmt", ["jsonl", "json array"])
def test_a_json_row_with_a_key_written_twice_is_skipped_and_counted(fmt, tmp_path, png):
    (tmp_path / "a.png").write_bytes(png())
    good = '{"image": "a.png", "caption": "one caption"}'
    twice = '{"image": "a.png", "caption": "first", "caption": "second"}'
    nested = '{"image": "a.png", "conversations": [{"from": "human", "value": "q", "value": "p"}]}'
    rows = [good, twice, nested]
    if fmt == "jsonl":
        (tmp_path / "t.jsonl").write_text("\n".join(rows) + "\n")
        table = tmp_path / "t.jsonl"
    else:
        (tmp_path / "t.json").write_text("[" + ",\n".join(rows) + "]")
        table = tmp_path / "t.json"
    res = import_table(table, tmp_path / "out", max_skip_share=1)
    assert res["written"] == 1 and res["skipped"] == {"duplicate_key": 2}, res
    details = [e["detail"] for e in res["examples"]]
    assert "key 'caption' is written twice" in details[0] and "key 'value'" in details[1]


def test_a_csv_header_naming_a_column_twice_stops_the_import(tmp_path, png):
    (tmp_path / "a.png").write_bytes(png())
    (tmp_path / "t.csv").write_text("image,caption,caption\na.png,first,second\n")
    with pytest.raises(ImporterError, match="column 'caption' is named twice.*columns 2 and 3"):
        import_table(tmp_path / "t.csv", tmp_path / "out")
    assert not any(p.suffix == ".tar" for p in (tmp_path / "out").glob("*"))


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS file systems refuse non-UTF-8 names")
def test_a_file_name_that_is_not_utf8_is_skipped_and_counted(tmp_path, png, capsys):
    imgs = _folder(tmp_path, png, n=2)
    bad = os.path.join(os.fsencode(imgs), b"caf\xe9.png")
    with open(bad, "wb") as f:
        f.write(png())
    with open(bad[:-4] + b".txt", "wb") as f:
        f.write(b"a cafe")
    rc, out, err = _cli(
        ["data", "import-folder", str(imgs), "--out", str(tmp_path / "out"), "--workers", "0"]
        + ["--quiet", "--max-skip-share", "0.5"],
        capsys,
    )
    assert rc == 0, err
    assert "wrote 2 samples" in out and "non_utf8_file_name=1" in out and "caf\\xe9.png" in out
    assert not (tmp_path / "out" / ".shard.partial").exists()


# ------------------------------------------------------------------------------------------------
# resumes that survive damage
def _interrupted_import(tmp_path: Path, png, monkeypatch) -> tuple[Path, Path]:
    """An import of 12 rows into shards of 3, stopped (Ctrl-C) after its 3rd shard."""
    from data_pipelines.import_shards import ImportShards
    from data_pipelines.import_summary import ImportInterrupted

    (tmp_path / "a.png").write_bytes(png())
    rows = [{"image": "a.png", "caption": f"caption {i}"} for i in range(12)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    real = ImportShards.finish
    seen = []

    def finish(self, next_row):
        real(self, next_row)
        seen.append(next_row)
        if len(seen) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(ImportShards, "finish", finish)
    with pytest.raises(ImportInterrupted):
        import_table(tmp_path / "t.jsonl", out, max_count=3)
    monkeypatch.setattr(ImportShards, "finish", real)
    return tmp_path / "t.jsonl", out


@pytest.mark.parametrize(
    "damage", ["cut short", "not an object", "a count that is text", "the file gone"]
)
def test_a_damaged_state_falls_back_to_the_one_before(damage, tmp_path, png, monkeypatch, capsys):
    from data_pipelines.import_state import prev_state_path

    table, out = _interrupted_import(tmp_path, png, monkeypatch)
    sp = state_path(out, "shard")
    assert json.loads(sp.read_text())["next_row"] == 9
    assert json.loads(prev_state_path(out, "shard").read_text())["next_row"] == 6
    text = sp.read_text()
    if damage == "cut short":
        sp.write_text(text[: len(text) // 2])
    elif damage == "not an object":
        sp.write_text("[]")
    elif damage == "a count that is text":
        sp.write_text(json.dumps({**json.loads(text), "next_row": "9"}))
    else:
        sp.unlink()  # a save stopped between keeping the previous state and writing the new one
    res = import_table(table, out, max_count=3)
    err = capsys.readouterr().err
    assert res["resumed_at_row"] == 6 and res["written"] == 12, res
    if damage != "the file gone":
        assert "is damaged" in err and "resuming from the state saved before it (row 6)" in err
    assert _texts(out) == sorted(f"<image>caption {i}" for i in range(12))


def test_a_state_with_nothing_to_fall_back_to_is_one_line(tmp_path, png, monkeypatch):
    from data_pipelines.import_state import prev_state_path

    table, out = _interrupted_import(tmp_path, png, monkeypatch)
    state_path(out, "shard").write_text("{cut")
    prev_state_path(out, "shard").write_text("{cut")
    with pytest.raises(ImporterError) as e:
        import_table(table, out, max_count=3)
    assert "is damaged" in str(e.value) and "--overwrite" in str(e.value)


@pytest.mark.parametrize("complete", [True, False], ids=["complete", "interrupted"])
def test_a_lost_shard_is_imported_again_not_reported(complete, tmp_path, png, monkeypatch, capsys):
    """The issue's case: the rerun said 30000 samples in 15 shards while 14 were there."""
    if complete:
        (tmp_path / "a.png").write_bytes(png())
        rows = [{"image": "a.png", "caption": f"caption {i}"} for i in range(12)]
        (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        table, out = tmp_path / "t.jsonl", tmp_path / "out"
        import_table(table, out, max_count=3)
    else:
        table, out = _interrupted_import(tmp_path, png, monkeypatch)
    (out / "shard-000001.tar").unlink()
    res = import_table(table, out, max_count=3)
    err = capsys.readouterr().err
    assert "shard-000001.tar, listed by the import state, is missing" in err, err
    assert not res.get("already_imported") and res["written"] == 12 and len(res["shards"]) == 4
    assert _texts(out) == sorted(f"<image>caption {i}" for i in range(12))


# ------------------------------------------------------------------------------------------------
# signals and worker processes
@pytest.fixture
def slow_table(tmp_path):
    """A table whose images take a while to decode (1200 x 1200 noise PNGs), so an import with
    workers is still busy when it is signalled."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(4):
        Image.fromarray(rng.integers(0, 255, (1200, 1200, 3), dtype=np.uint8)).save(
            tmp_path / f"{i}.png"
        )
    rows = [{"image": f"{i % 4}.png", "caption": f"noise {i}"} for i in range(400)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "t.jsonl"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "kill -9"])
def test_the_workers_end_with_the_import(sig, slow_table, tmp_path, ROOT, subprocess_env):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vlm.cli", "data", "import-table", str(slow_table), "--out"]
        + [str(out), "--workers", "2", "--max-count", "8", "--quiet"],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers: list[int] = []
    try:
        deadline = time.time() + 120
        while len(_children(proc.pid)) < 2 or not (out / "shard-000000.tar").exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.05)
        workers = _children(proc.pid)
        proc.send_signal(sig)
        # orphaned workers would hold its output pipes open: a timeout here is that failure
        _, err = proc.communicate(timeout=60)
        deadline = time.time() + 10
        while any(_alive(w) for w in workers) and time.time() < deadline:
            time.sleep(0.05)
        assert not any(_alive(w) for w in workers), "a worker outlived its import"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for w in workers:  # what broken code leaves: not left running after the test
            if _alive(w):
                os.kill(w, signal.SIGKILL)
    if sig == signal.SIGTERM:
        lines = err.strip().splitlines()
        assert proc.returncode == 143 and len(lines) == 1 and "Traceback" not in err, err
        assert "stopped by SIGTERM after" in lines[0] and "resume at row" in lines[0], err
        row = int(lines[0].rsplit("resume at row ", 1)[1])
        assert row > 0 and row % 8 == 0
        assert json.loads(state_path(out, "shard").read_text())["next_row"] == row
    assert not (out / ".shard.partial").exists() or sig == signal.SIGKILL


# ------------------------------------------------------------------------------------------------
# the default dataset
def test_a_killed_build_leaves_nothing_the_next_build_keeps(tmp_path, TINY_DEFAULT):
    """kill -9 during `build-default` left a 28 MB temporary folder beside --out; now the build
    writes inside OUT under its lock, and the next build removes what a killed one left."""
    from data_pipelines.default_dataset import BUILD_TMP, build_default, default_info

    out = tmp_path / "default"
    (out / BUILD_TMP / "train").mkdir(parents=True)  # what a build killed part way leaves
    (out / BUILD_TMP / "train" / "vqa-000000.tar").write_bytes(b"x" * 1000)
    # a record of this machine (one of another machine is not taken over: issue 52)
    rec = {"pid": 999999999, "host": socket.gethostname(), "since": 0}
    (out / ".vlm-lock").write_text(json.dumps(rec))
    build_default(out, TINY_DEFAULT, progress=False)
    assert default_info(out) is not None
    assert sorted(p.name for p in out.iterdir()) == [
        "default.json",
        "test",
        "tokenizer",
        "train",
        "val",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["default"]
