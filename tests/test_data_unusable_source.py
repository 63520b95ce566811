"""A source none of whose samples can be used stops the loader in one line naming it and why,
instead of reading its bad shards again and again before step 1 (issue 52: `vlm train` and `vlm
bench loader` spun at 50-60 % CPU for ever); and the loader benchmark's numbers are refused in one
line when they make no sense. Run in processes of their own with a timeout, so that a spin fails the
test instead of hanging the suite."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vlm.cli import main

LOAD = """
import sys
from data_pipelines.config import DataConfig, SourceConfig
from data_pipelines.loader import build_loader
from data_pipelines.schema import ShardError
from data_pipelines.tokenizer import ByteTokenizer
sources = [SourceConfig(path=p, name=f"s{i}") for i, p in enumerate(sys.argv[2:])]
cfg = DataConfig(sources=sources, row_tokens=64, num_workers=int(sys.argv[1]))
try:
    next(iter(build_loader(cfg, ByteTokenizer())))
except ShardError as e:
    print(e)
    sys.exit(2)
"""


def _garbage_shards(folder, n=3):
    folder.mkdir()
    for i in range(n):
        (folder / f"bad-{i:06d}.tar").write_bytes(b"not a tar file " * 100)
    return folder


def _run(args, env, ROOT, timeout=90):
    try:
        return subprocess.run(
            args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args[:4]}... still running after {timeout} s: it spins on the bad source")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_source_of_unreadable_shards_stops_the_loader_in_one_line(
    tmp_path, workers, subprocess_env, ROOT
):
    bad = _garbage_shards(tmp_path / "bad")
    done = _run([sys.executable, "-c", LOAD, str(workers), str(bad)], subprocess_env(), ROOT)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    line = done.stdout.strip()
    assert len(line.splitlines()) == 1, line
    assert line.startswith("source s0: no sample of its 3 shard(s) can be used"), line
    assert "unreadable_shard=3" in line and "cannot be opened or read as a tar file" in line, line


def test_a_source_whose_every_sample_is_too_long_is_named_among_good_ones(
    tmp_path, write_text_shards, subprocess_env, ROOT
):
    from data_pipelines.schema import Sample
    from data_pipelines.writer import ShardWriter

    write_text_shards(tmp_path / "good", 20, per_shard=10)
    with ShardWriter(tmp_path / "long", "long") as w:  # each sample's image does not fit a row
        for i in range(4):
            w.write(Sample(key=f"l{i}", kind="pair", text="<image>" + "x" * 70, images=[_png()]))
    args = [sys.executable, "-c", LOAD, "0", str(tmp_path / "good"), str(tmp_path / "long")]
    done = _run(args, subprocess_env(), ROOT)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("source s1: no sample of its 1 shard(s) can be used"), done.stdout
    assert "too_long=4" in done.stdout


def _png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (300, 300), (9, 9, 9)).save(buf, "PNG")
    return buf.getvalue()


def test_bench_loader_on_unreadable_shards_says_so_in_one_line(tmp_path, subprocess_env, ROOT):
    bad = _garbage_shards(tmp_path / "bad")
    args = [sys.executable, "-m", "vlm.cli", "bench", "loader", "--smoke", "--data", str(bad)]
    done = _run(args + ["--out", str(tmp_path / "out")], subprocess_env(), ROOT)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    said = [ln for ln in done.stderr.splitlines() if "no sample of" in ln]
    assert said == [done.stderr.strip().splitlines()[-1]], done.stderr[-2000:]
    assert f"source {bad}: no sample of its 3 shard(s) can be used" in said[0], said
    assert "Traceback" not in done.stderr


@pytest.mark.slow  # a training run's start-up (about 20 s here)
def test_train_on_unreadable_shards_ends_in_one_line(
    tmp_path, tiny_config, write_config, subprocess_env, ROOT, tiny_data
):
    bad = _garbage_shards(tmp_path / "bad")
    cfg = tiny_config(tiny_data, logging={"eval_every": 0})
    cfg["data"]["sources"] = [{"path": str(bad), "name": "broken"}]
    path = write_config(cfg, tmp_path / "c.yaml")
    args = [sys.executable, "-m", "vlm.train", "--config", str(path), "--out", str(tmp_path / "r")]
    done = _run(args, subprocess_env(), ROOT, timeout=240)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    last = done.stderr.strip().splitlines()[-1]
    assert "source broken: no sample of its 3 shard(s) can be used" in last, last
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "args, says",
    [
        (["--tokens-per-s", "-5"], "--tokens-per-s must be a number of tokens per second > 0"),
        (["--tokens-per-s", "0"], "--tokens-per-s must be a number of tokens per second > 0"),
        (["--world-size", "0"], "--world-size must be >= 1"),
        (["--world-size", "4", "--rank", "4"], "--rank must be in 0 .. 3"),
    ],
)
def test_bench_loader_refuses_numbers_that_make_no_sense(tmp_path, capsys, args, says):
    rc = main(["bench", "loader", "--smoke", "--out", str(tmp_path), *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and says in err, (rc, err)
    assert not (tmp_path / "loader.json").exists()
