"""Issue 37, the data side: a full disk during `vlm data import-table` is one line naming the file
that could not be written and the row to resume at, whether the disk fills in a shard's data, in
OUT's manifest update or in the import-state save (an injected ENOSPC) or for real (a 1 MB tmpfs,
where mounting is allowed); the complete shards are kept, nothing half-written is left behind, and
the same command, once there is room, resumes and ends with the shards of an import that never
stopped. The rest of issue 37's data side: tests/test_data_reliability_round3.py."""

from __future__ import annotations

import argparse
import errno
import io
import json
import os
import pathlib
import random
import shutil
import subprocess

import pytest
from PIL import Image

import data_pipelines.writer as writer
from data_pipelines.cli import add_data_commands

NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device"


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


def _noise_png(seed: int, side: int = 24) -> bytes:
    """An incompressible image (a shard's size is then about its images' size)."""
    rnd = random.Random(seed)
    im = Image.frombytes(
        "RGB", (side, side), bytes(rnd.randrange(256) for _ in range(side * side * 3))
    )
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _table(tmp_path, n=60, side=24):
    (tmp_path / "img").mkdir(exist_ok=True)
    for i in range(n):
        (tmp_path / "img" / f"{i}.png").write_bytes(_noise_png(i, side))
    rows = [
        {
            "id": f"r{i}",
            "image": f"img/{i}.png" if i % 7 else "img/none.png",
            "caption": f"picture {i}",
        }
        for i in range(n)
    ]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "t.jsonl"


def _outputs(d):
    return {
        p.name: p.read_bytes()
        for p in sorted(d.iterdir())
        if p.suffix == ".tar" or p.name == "manifest.json"
    }


def _leftovers(d):
    return sorted(
        p.name
        for p in d.iterdir()
        if p.name.endswith(".tmp")
        or p.name.endswith(".partial")
        or p.name.startswith(".vlm-write-check-")
    )


class _Disk:
    """An injected full disk: shard files accept `budget` bytes in all, then every write raises
    ENOSPC; or the `nth` write of the file `name` (OUT's manifest, the import state; both written as
    NAME.tmp, then renamed) raises it."""

    def __init__(self, budget=None, name=None, nth=0):
        self.budget, self.name, self.nth, self.hits = budget, name, nth, 0

    def open(self, path, mode="r", *a, **k):
        f = open(path, mode, *a, **k)
        disk = self

        class Limited:
            def write(self, b):
                if disk.budget is not None and len(b) > disk.budget:
                    disk.hits += 1
                    raise OSError(errno.ENOSPC, NO_SPACE)
                if disk.budget is not None:
                    disk.budget -= len(b)
                return f.write(b)

            def __getattr__(self, name):
                return getattr(f, name)

        return Limited()

    def write_text(self, real):
        disk = self

        def write_text(path, data, *a, **k):
            if path == disk.name:
                disk.nth -= 1
                if disk.nth == 0:
                    disk.hits += 1
                    # a half-written file, then no room
                    path.write_bytes(data[: len(data) // 2].encode())
                    raise OSError(errno.ENOSPC, NO_SPACE)
            return real(path, data, *a, **k)

        return write_text


@pytest.mark.parametrize("where", ["shard", "manifest", "state"])
def test_a_full_disk_during_import_table_is_one_line_and_the_same_command_resumes(
    where, tmp_path, capsys, monkeypatch
):
    table = _table(tmp_path)
    argv = [
        "data",
        "import-table",
        str(table),
        "--max-count",
        "10",
        "--max-skip-share",
        "0.2",
        "--workers",
        "0",
        "--quiet",
        "--json",
    ]
    rc, out, _ = _cli(argv + ["--out", str(tmp_path / "ref")], capsys)
    ref = json.loads(out)
    assert rc == 0 and len(ref["shards"]) == 6
    sizes = [(tmp_path / "ref" / f"shard-{i:06d}.tar").stat().st_size for i in range(2)]
    if where == "shard":  # room for two shards and half the third
        disk = _Disk(budget=sum(sizes) + sizes[0] // 2)
        monkeypatch.setattr(writer, "open", disk.open, raising=False)
    else:  # the third shard's manifest update or state save
        name = {"manifest": "manifest.json.tmp", "state": "shard.import.json.tmp"}[where]
        disk = _Disk(name=tmp_path / "out" / name, nth=3)
        monkeypatch.setattr(pathlib.Path, "write_text", disk.write_text(pathlib.Path.write_text))
    dst = tmp_path / "out"
    rc, out, err = _cli(argv + ["--out", str(dst)], capsys)
    line = _one_line(err)
    assert rc == 2 and disk.hits == 1 and json.loads(out)["status"] == "write_error", (rc, out, err)
    what = {
        "shard": dst / ".shard.partial" / "shard-000002.tar",
        "manifest": dst / "manifest.json",
        "state": dst / "shard.import.json",
    }[where]
    assert (
        f"cannot write {what}: {NO_SPACE}; 20 samples in complete shards are kept; "
        "with room (or write access) again, run the same command to resume at row 24" in line
    ), line
    assert _leftovers(dst) == [] and sorted(p.name for p in dst.glob("*.tar")) == [
        "shard-000000.tar",
        "shard-000001.tar",
    ]
    assert json.loads((dst / "manifest.json").read_text())["totals"]["count"] == 20
    monkeypatch.undo()  # room again
    rc, out, _ = _cli(argv + ["--out", str(dst)], capsys)
    res = json.loads(out)
    assert rc == 0 and res["resumed_at_row"] == 24
    assert {k: res[k] for k in ("written", "skipped", "rows", "examples")} == {
        k: ref[k] for k in ("written", "skipped", "rows", "examples")
    }
    assert _outputs(dst) == _outputs(tmp_path / "ref") and _leftovers(dst) == []


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB tmpfs (skipped where mounting is not allowed)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip(
            "cannot mount a tmpfs here (needs root); the "
            "injected ENOSPC test covers the same writes"
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_real_full_disk_during_import_table(small_disk, tmp_path, capsys):
    table = _table(tmp_path, n=80, side=48)  # about 7 kB an image: 0.6 MB of shards
    argv = [
        "data",
        "import-table",
        str(table),
        "--max-count",
        "10",
        "--max-skip-share",
        "0.2",
        "--workers",
        "0",
        "--quiet",
        "--json",
    ]
    rc, out, _ = _cli(argv + ["--out", str(tmp_path / "ref")], capsys)
    assert rc == 0
    ref = json.loads(out)
    with open(small_disk / "filler", "wb") as f:
        f.write(b"\0" * (shutil.disk_usage(small_disk).free - 200_000))
    dst = small_disk / "out"
    rc, out, err = _cli(argv + ["--out", str(dst)], capsys)
    line = _one_line(err)
    assert (
        rc == 2 and f"{NO_SPACE}; " in line and "run the same command to resume at row" in line
    ), line
    assert _leftovers(dst) == [] and "write to closed file" not in err
    kept = sorted(p.name for p in dst.glob("*.tar"))
    assert 0 < len(kept) < len(ref["shards"])
    (small_disk / "filler").unlink()
    rc, out, _ = _cli(argv + ["--out", str(dst)], capsys)
    res = json.loads(out)
    assert rc == 0 and res["resumed_at_row"] > 0 and res["written"] == ref["written"]
    assert _outputs(dst) == _outputs(tmp_path / "ref") and _leftovers(dst) == []
