"""Issue 52, the folder lock (configs.folder_lock) where a lock file alone cannot tell: a `.vlm-lock`
that is a symbolic link, a FIFO or a folder (refused in one line; nothing written through the link,
no open that blocks); a lock recorded by another machine (refused naming its host and pid, taken
over only with VLM_TAKE_OVER_LOCK=1); the lock file deleted while its holder runs (a second writer
still refused: the holder also locks the folder itself); a filesystem without flock (the lock file's
presence is the lock, said in one line); a writer into a folder inside a locked one (`vlm convert
--out RUN/final` while RUN trains) and the trainer's export over a `final/` that another writer made
during the run. Every refusal leaves no lock file and no folder it made.

The holders are real second processes (a Python that takes the lock and waits), as two users'
commands would meet."""

from __future__ import annotations

import errno
import io
import json
import os
import socket
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

LOCK = ".vlm-lock"  # configs.folder_lock.LOCK_NAME
HOLD = """
import sys, time
from configs.folder_lock import lock_folder
lock = lock_folder(sys.argv[1], "holder-of-the-test")
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(subprocess_env):
    """holder(folder) -> a second process that holds `folder`'s lock until the test ends."""
    procs = []

    def start(folder: Path) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(folder)],
            stdout=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
        )
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _one_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if "[WARNING]" not in ln]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def _import_table(inputs: Path, out: Path, subprocess_env, ROOT, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "vlm.cli", "data", "import-table", str(inputs / "t.jsonl")]
        + ["--out", str(out), "--quiet"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, png):
    d = tmp_path_factory.mktemp("inputs")
    (d / "imgs").mkdir()
    for i in range(3):
        (d / "imgs" / f"{i}.png").write_bytes(png(colour=(80 * i, 0, 0)))
    rows = [{"image": f"imgs/{i}.png", "caption": f"picture {i}"} for i in range(3)]
    (d / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


# ------------------------------------------------------------------------------------------------
# a lock file that is no file
def test_a_lock_that_is_a_symlink_is_refused_and_its_target_untouched(
    tmp_path, tiny_config, tiny_data, write_config, capsys
):
    """The issue's case: `vlm train --out RUN` with RUN/.vlm-lock a link to someone's file truncated
    that file and wrote its record there."""
    from vlm.cli import main

    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "notes.txt"
    victim.write_text("a week of notes\n")
    (run / LOCK).symlink_to(victim)
    cfg = write_config(tiny_config(tiny_data, train={"max_steps": 1}), tmp_path / "c.yaml")
    rc = main(["train", "--config", str(cfg), "--out", str(run)])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2, line
    assert f"{run / LOCK} is a symbolic link (to {victim})" in line and "remove it" in line, line
    assert victim.read_text() == "a week of notes\n"
    assert sorted(p.name for p in run.iterdir()) == [LOCK]  # nothing trained, nothing written


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_lock_that_is_a_fifo_or_a_folder_is_one_line_not_a_hang(
    kind, tmp_path, inputs, subprocess_env, ROOT
):
    """A FIFO blocked `vlm data import-table` for ever (SIGTERM ignored); a folder was a
    traceback. Both: one line naming it, exit 2, within seconds."""
    out = tmp_path / "out"
    out.mkdir()
    if kind == "fifo":
        os.mkfifo(out / LOCK)
    else:
        (out / LOCK).mkdir()
    done = _import_table(inputs, out, subprocess_env, ROOT)
    line = _one_line(done.stderr)
    assert done.returncode == 2, done.stderr
    what = "a FIFO (named pipe)" if kind == "fifo" else "a folder"
    assert f"{out / LOCK} is {what}, not a lock file" in line, line
    assert sorted(p.name for p in out.iterdir()) == [LOCK]  # no shard, no state


# ------------------------------------------------------------------------------------------------
# locks on clusters
def _record(folder: Path, host: str, pid: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rec = {"pid": pid, "host": host, "since": 1.7e9, "command": "vlm train elsewhere"}
    (folder / LOCK).write_text(json.dumps(rec))


def test_a_lock_recorded_by_another_host_is_not_taken_over(tmp_path, monkeypatch):
    """flock is per machine on many shared filesystems: a writer alive on node7 is invisible here.
    Its record is refused naming the host and pid; VLM_TAKE_OVER_LOCK=1 takes it over, saying so."""
    from configs.folder_lock import FolderBusy, lock_folder

    monkeypatch.delenv("VLM_TAKE_OVER_LOCK", raising=False)
    out = tmp_path / "run"
    _record(out, "node7-not-this-one", 4242)
    before = (out / LOCK).read_bytes()
    said: list[str] = []
    with pytest.raises(FolderBusy) as e:
        lock_folder(out, "second", say=said.append)
    msg = str(e.value)
    assert "pid 4242 on node7-not-this-one" in msg and "another machine" in msg, msg
    assert "VLM_TAKE_OVER_LOCK=1" in msg and "\n" not in msg, msg
    assert said == [] and (out / LOCK).read_bytes() == before  # its record stays as it was
    with pytest.raises(FolderBusy) as e:  # nor is a folder inside it written (vlm convert's final/)
        lock_folder(out / "final", "inside")
    assert f"{out / 'final'} is inside {out}" in str(e.value) and "node7" in str(e.value), e.value
    assert not (out / "final").exists()

    monkeypatch.setenv("VLM_TAKE_OVER_LOCK", "1")
    lock = lock_folder(out, "second", say=said.append)
    assert len(said) == 1 and "taking over the lock left by pid 4242 on node7" in said[0], said
    assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (out / LOCK).exists()


def test_deleting_the_lock_file_during_a_run_lets_no_second_writer_in(tmp_path, holder):
    """The holder also flocks the folder itself: a `.vlm-lock` removed by hand (taken for a stale
    file) does not let a second writer in, and the holder's `check()` finds its record gone."""
    from configs.folder_lock import FolderBusy, lock_folder

    out = tmp_path / "run"
    holder(out)
    (out / LOCK).unlink()
    with pytest.raises(FolderBusy) as e:
        lock_folder(out, "second")
    assert "is being written by another process" in str(e.value), e.value
    assert "was removed" in str(e.value)
    assert not (out / LOCK).exists()  # the refused writer left no record of its own

    mine = lock_folder(tmp_path / "mine", "me")
    (tmp_path / "mine" / LOCK).unlink()
    with pytest.raises(FolderBusy, match="was removed during the run"):
        mine.check()
    mine.release()


class _NoFlock:
    """fcntl as a filesystem without flock answers it (NFS without lockd, Lustre without
    `flock`): every lock request is ENOLCK."""

    LOCK_EX, LOCK_SH, LOCK_NB, LOCK_UN = 2, 1, 4, 8

    @staticmethod
    def flock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


def test_without_flock_the_lock_files_presence_is_the_lock(tmp_path, monkeypatch, holder):
    """ENOLCK was a traceback that left a lock file. Now: one line saying so, and the record file
    itself is the lock: a record of a live process of this machine is refused, one whose process is
    gone is taken over, and a release leaves nothing."""
    import configs.folder_lock as fl

    monkeypatch.setattr(fl, "fcntl", _NoFlock)
    said: list[str] = []
    lock = fl.lock_folder(tmp_path / "a", "first", say=said.append)
    assert len(said) == 1 and "no file locks (flock: No locks available)" in said[0], said
    assert json.loads((tmp_path / "a" / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert list((tmp_path / "a").iterdir()) == []

    alive = holder(tmp_path / "elsewhere")  # any live process of this machine
    _record(tmp_path / "b", socket.gethostname(), alive.pid)
    with pytest.raises(fl.FolderBusy, match=f"pid {alive.pid} on {socket.gethostname()}"):
        fl.lock_folder(tmp_path / "b", "second", say=said.append)
    assert json.loads((tmp_path / "b" / LOCK).read_text())["pid"] == alive.pid

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                          capture_output=True).stdout.strip()  # fmt: skip
    _record(tmp_path / "c", socket.gethostname(), int(gone))
    said.clear()
    lock = fl.lock_folder(tmp_path / "c", "third", say=said.append)
    assert any(f"taking over the lock left by pid {gone}" in s for s in said), said
    lock.release()
    assert not (tmp_path / "c" / LOCK).exists()


def test_an_import_without_flock_says_the_right_reason_and_leaves_nothing(
    tmp_path, monkeypatch, inputs, holder
):
    """The import said `cannot create it (No locks available)` and left the folder. Now it
    imports (the note in one line, no lock file left); a live holder's record is refused in one
    line naming it, exit 2."""
    import argparse

    import configs.folder_lock as fl
    from data_pipelines.cli import add_data_commands

    monkeypatch.setattr(fl, "fcntl", _NoFlock)
    p = argparse.ArgumentParser(prog="vlm")
    add_data_commands(p.add_subparsers(dest="command", required=True))

    def run(out: Path) -> tuple[int, str, str]:
        args = p.parse_args(
            ["data", "import-table", str(inputs / "t.jsonl"), "--out", str(out), "--quiet"]
        )
        err, outp = io.StringIO(), io.StringIO()
        with redirect_stderr(err), redirect_stdout(outp):
            rc = args.func(args)
        return rc, err.getvalue(), outp.getvalue()

    rc, err, said = run(tmp_path / "ok")
    assert rc == 0 and "wrote 3 samples" in said, (err, said)
    assert "cannot create" not in err and "no file locks" in err, err
    assert not (tmp_path / "ok" / LOCK).exists()

    alive = holder(tmp_path / "elsewhere")  # any live process of this machine
    busy = tmp_path / "busy"
    _record(busy, socket.gethostname(), alive.pid)
    rc, err, _ = run(busy)
    line = _one_line(err)
    assert rc == 2 and f"{busy} is being written by another process: pid {alive.pid}" in line, err
    assert sorted(p.name for p in busy.iterdir()) == [LOCK]  # its record, nothing else


# ------------------------------------------------------------------------------------------------
# folders inside a run folder
@pytest.fixture(scope="module")
def baseline_export(tiny_vlm, tmp_path_factory):
    """An exported MoE baseline (chunking off): what `vlm convert` reads."""
    from vlm.model.hf import save_pretrained

    model, tok = tiny_vlm()
    out = tmp_path_factory.mktemp("base") / "final"
    return save_pretrained(type(model)(model.model_cfg.baseline(), model.vision_cfg), out, tok)


def test_convert_into_the_final_folder_of_a_run_in_progress_is_refused(
    tmp_path, holder, baseline_export, capsys
):
    """`vlm convert SRC --out RUN/final` while RUN trains exited 0, and the trainer's export then
    replaced it without a word. The lock on RUN covers the folders inside it."""
    from vlm.cli import main

    run = tmp_path / "run"
    proc = holder(run)
    rc = main(["convert", str(baseline_export), "--out", str(run / "final")])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2, line
    assert f"{run / 'final'} is inside {run}, which is being written by another process" in line
    assert f"pid {proc.pid}" in line and "holder-of-the-test" in line, line
    assert sorted(p.name for p in run.iterdir()) == [LOCK]  # no final/ made


def test_the_export_leaves_a_final_folder_another_writer_made_during_the_run(tmp_path):
    """Where locks do not hold (a filesystem without them, a writer that takes none), the trainer's
    export still replaces `final/` only when it is the one the run started with: one made during
    the run is left as it is, and the export is one line."""
    from vlm.train.export import export_final
    from vlm.train.run_dir import hold_run_dir
    from vlm.train.write_errors import WriteError

    run = tmp_path / "run"
    with hold_run_dir(run, True, "test"):
        (run / "final").mkdir()
        (run / "final" / "config.json").write_text('{"converted": "by someone else"}')
        with pytest.raises(WriteError) as e:
            export_final(None, run, None, 1.0, True, print)
    msg = str(e.value)
    assert f"not exporting {run / 'final'}: {run / 'final'} was made during this run" in msg, msg
    assert "move" in msg and "\n" not in msg, msg
    assert json.loads((run / "final" / "config.json").read_text()) == {
        "converted": "by someone else"
    }
    assert not (run / ".tmp-final").exists()
