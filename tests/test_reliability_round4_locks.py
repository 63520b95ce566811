"""Issue 45: one writer per folder. `vlm train` (its run folder; each `vlm chain` stage and the
chain's folder), `vlm convert` (its --out), `vlm data import-*` and `build-default` (their --out)
hold the folder's lock (configs.folder_lock: flock on FOLDER/.vlm-lock, which records the holder).
A second writer is refused in one line naming the first (pid, host, command, since when) and
changes nothing; a lock whose holder was killed is taken over with a line saying so; the lock file
is gone once its holder ends and never makes a folder look used.

The holder in these tests is a real second process (a Python that takes the lock and waits), so
what is tested is the kernel's flock between two processes, as two users' commands would meet."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

LOCK_NAME = ".vlm-lock"  # configs.folder_lock.LOCK_NAME
HOLD = """
import sys, time
from configs.folder_lock import lock_folder
lock = lock_folder(sys.argv[1], "holder-of-the-test")
print("held", flush=True)
time.sleep(600)
"""


def _holder(folder: Path, subprocess_env) -> subprocess.Popen:
    """Another process that holds `folder`'s lock until killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def holder(subprocess_env):
    procs = []

    def start(folder: Path) -> subprocess.Popen:
        procs.append(_holder(folder, subprocess_env))
        return procs[-1]

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != LOCK_NAME
    }


def _one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if "[WARNING]" not in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------------------------------------
# the lock itself
def test_a_second_writer_is_refused_naming_the_first(tmp_path, holder):
    from configs.folder_lock import FolderBusy, lock_folder

    proc = holder(tmp_path / "out")
    with pytest.raises(FolderBusy) as e:
        lock_folder(tmp_path / "out", "second")
    msg = str(e.value)
    assert f"pid {proc.pid} on {socket.gethostname()}" in msg, msg
    assert "holder-of-the-test" in msg and "since 20" in msg and "\n" not in msg, msg


def test_a_lock_left_by_a_killed_writer_is_taken_over_with_a_line(tmp_path, holder):
    from configs.folder_lock import lock_folder

    proc = holder(tmp_path / "out")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (tmp_path / "out" / LOCK_NAME).is_file()  # kill -9 left its record, not its flock
    said = []
    lock = lock_folder(tmp_path / "out", "next", say=said.append)
    assert len(said) == 1 and f"pid {proc.pid}" in said[0] and "no longer running" in said[0]
    assert json.loads((tmp_path / "out" / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / "out" / LOCK_NAME).exists()


def test_the_lock_file_goes_with_its_holder_and_is_not_a_run_or_an_import(tmp_path):
    """While held the folder holds only the lock file: no run outputs, no shards, an empty
    export folder; released, nothing is left."""
    from configs.folder_lock import LOCK_NAME as NAME
    from configs.folder_lock import lock_folder
    from vlm.train.run_dir import refusal, run_outputs

    assert NAME == LOCK_NAME

    run = tmp_path / "run"
    lock = lock_folder(run, "test")
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]
    assert run_outputs(run) == [] and refusal(run, None) is None
    # the same process may take it again (a second trainer for the same run in one process)
    again = lock_folder(run, "test")
    again.release()
    assert (run / LOCK_NAME).is_file()
    lock.release()
    assert list(run.iterdir()) == []


# ------------------------------------------------------------------------------------------------
# every command that writes a folder
@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_data, tiny_config, write_config, png):
    d = tmp_path_factory.mktemp("inputs")
    (d / "imgs").mkdir()
    for i in range(3):
        (d / "imgs" / f"{i}.png").write_bytes(png(colour=(80 * i, 0, 0)))
        (d / "imgs" / f"{i}.txt").write_text(f"picture {i}")
    rows = [{"image": f"imgs/{i}.png", "caption": f"picture {i}"} for i in range(3)]
    (d / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny_config(tiny_data, train={"max_steps": 2}, logging={"eval_every": 0})
    write_config(cfg, d / "tiny.yaml")
    return d


def _commands(inputs: Path, out: Path, exported: Path) -> dict[str, list[str]]:
    return {
        "train": ["train", "--config", str(inputs / "tiny.yaml"), "--out", str(out)],
        "train --resume": [
            "train",
            "--config",
            str(inputs / "tiny.yaml"),
            "--out",
            str(out),
            "--resume",
        ],
        "chain": ["chain", str(inputs / "tiny.yaml"), "--out", str(out)],
        "import-table": [
            "data",
            "import-table",
            str(inputs / "t.jsonl"),
            "--out",
            str(out),
            "--quiet",
        ],
        "import-folder": [
            "data",
            "import-folder",
            str(inputs / "imgs"),
            "--out",
            str(out),
            "--quiet",
        ],
        "build-default": ["data", "build-default", "--out", str(out), "--train-scenes", "4"],
        "convert": ["convert", str(exported), "--out", str(out)],
    }


@pytest.fixture(scope="module")
def baseline_export(tiny_vlm, tmp_path_factory):
    """An exported MoE baseline (chunking off): what `vlm convert` reads."""
    from vlm.model.hf import save_pretrained

    model, tok = tiny_vlm()
    out = tmp_path_factory.mktemp("base") / "final"
    return save_pretrained(type(model)(model.model_cfg.baseline(), model.vision_cfg), out, tok)


@pytest.mark.parametrize(
    "command",
    [
        "train",
        "train --resume",
        "chain",
        "import-table",
        "import-folder",
        "build-default",
        "convert",
    ],
)
def test_every_writer_is_refused_while_another_process_writes_its_folder(
    command, inputs, baseline_export, tmp_path, holder, subprocess_env, ROOT
):
    """The issue's cases (two `vlm train` into one --out, the second with its auto-resume; two
    imports 2 s apart), for every command that writes a folder: refused in one line naming the
    holder, exit 2, before any work, and the folder byte-identical."""
    out = tmp_path / "out"
    out.mkdir()
    if command not in ("build-default", "convert"):  # those two want an empty folder
        (out / "notes.txt").write_text("someone's file")
    before = _digests(out)
    proc = holder(out)
    t0 = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "vlm.cli", *_commands(inputs, out, baseline_export)[command]],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = _one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert f"{out} is being written by another process: pid {proc.pid}" in line, line
    assert "holder-of-the-test" in line, line
    assert _digests(out) == before
    assert time.time() - t0 < 120


def test_an_import_takes_over_from_a_killed_import_and_says_so(inputs, tmp_path, holder):
    """kill -9 of an import leaves its lock record; the same command resumes and says whose lock
    it took over."""
    import argparse

    from data_pipelines.cli import add_data_commands

    out = tmp_path / "out"
    proc = holder(out)
    proc.kill()
    proc.wait()
    p = argparse.ArgumentParser(prog="vlm")
    add_data_commands(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(
        ["data", "import-table", str(inputs / "t.jsonl"), "--out", str(out), "--quiet"]
    )
    import io
    from contextlib import redirect_stderr, redirect_stdout

    err, outp = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(outp):
        assert args.func(args) == 0
    said = [ln for ln in err.getvalue().splitlines() if "taking over" in ln]
    assert len(said) == 1 and f"pid {proc.pid}" in said[0], err.getvalue()
    assert "wrote 3 samples" in outp.getvalue()
    assert not (out / LOCK_NAME).exists()
