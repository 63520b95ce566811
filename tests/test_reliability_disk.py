"""Full disks are reported, not suffered: a checkpoint or export that cannot be written says so in
one line (the path and "No space left on device"), removes its partial files, keeps the previous
checkpoint (and final/) as they were, and `vlm train` exits 1. On a real, small tmpfs where mounting
is allowed (root), else by an injected OSError(ENOSPC) at the same writes."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import sys

import pytest

NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device"


def _digests(d):
    return {
        p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def _leftovers(run):
    return sorted(
        p.name
        for p in [*run.iterdir(), *(run / "checkpoints").iterdir()]
        if p.name.startswith((".tmp-", ".del-"))
    )


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs (skipped where mounting is not allowed)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root); test_injected_* cover the same paths")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(disk, leave: int):
    """Fill `disk` up to `leave` free bytes."""
    free = shutil.disk_usage(disk).free
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


def _cfg(tiny_config, tiny_data, steps):
    return tiny_config(
        tiny_data,
        train={"max_steps": steps},
        checkpoint={"save_every": 2, "keep_last": 2},
        logging={"eval_every": 0, "report_to": [], "histogram_every": 0},
    )


def test_disk_full_on_a_real_tmpfs(
    small_disk,
    tiny_data,
    tmp_path,
    tiny_config,
    write_config,
    make_trainer,
    torch_globals,
    ROOT,
    subprocess_env,
):
    from vlm.train.checkpoint import WriteError, damaged_file, list_checkpoints
    from vlm.train.export import export_final

    run = small_disk / "run"
    cfg = _cfg(tiny_config, tiny_data, 2)
    tr = make_trainer(cfg, run)
    assert tr.train() == 0
    step2 = run / "checkpoints" / "step_00000002"
    before, final_before = _digests(step2), _digests(run / "final")
    # room for log lines, not for a checkpoint (1.2 MB) or an export
    _fill(small_disk, leave=64 * 1024)

    with pytest.raises(WriteError) as e:  # the save, in-process (written in the background)
        tr.run.checkpointer.save(3, tr.trainer_state())
        tr.run.checkpointer.wait()
    msg = str(e.value)
    assert (
        NO_SPACE in msg
        and str(run / "checkpoints") in msg
        and str(step2) in msg
        and "\n" not in msg
    ), msg
    with pytest.raises(WriteError) as e:  # the export
        export_final(tr.run.engine, run, tr.run.tokenizer, 1.0, True, print)
    assert NO_SPACE in str(e.value) and str(run / ".tmp-final") in str(e.value)
    assert _leftovers(run) == [] and _digests(run / "final") == final_before

    # the command line: two more steps, the save at step 4 cannot be written
    cfg["train"]["max_steps"] = 4
    path = write_config(cfg, tmp_path / "c.yaml")
    proc = subprocess.run(
        [sys.executable, "-m", "vlm.train", "--config", str(path), "--out", str(run), "--resume"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("vlm train:")]
    assert "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr[-3000:]
    assert (
        errors[0].startswith("vlm train: cannot write checkpoint step 4: ")
        and NO_SPACE in errors[0]
    )
    assert f"the resume point stays {step2}" in errors[0]
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [2] and _digests(
        step2
    ) == before
    assert damaged_file(step2) is None and _leftovers(run) == []

    (small_disk / "filler").unlink()  # room again: the same command goes on from step 2
    proc = subprocess.run(
        [sys.executable, "-m", "vlm.train", "--config", str(path), "--out", str(run), "--resume"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "at step 2" in proc.stdout, proc.stderr[-3000:]


def test_injected_enospc_in_a_checkpoint_save(
    tiny_data, tmp_path, tiny_config, make_trainer, torch_globals, monkeypatch
):
    from vlm.train import write_errors as ckpt_lib

    run = tmp_path / "run"
    tr = make_trainer(_cfg(tiny_config, tiny_data, 2), run)
    assert tr.train() == 0
    step2 = run / "checkpoints" / "step_00000002"
    before = _digests(step2)
    written = [0]
    real_write = ckpt_lib._KeepsWriteError.write

    def write(self, data):  # the disk fills 100 kB into the save (inside DeepSpeed's torch.save)
        written[0] += len(data)
        if written[0] > 100_000:
            self.error = OSError(errno.ENOSPC, NO_SPACE)
            raise self.error
        return real_write(self, data)

    monkeypatch.setattr(ckpt_lib._KeepsWriteError, "write", write)
    with pytest.raises(ckpt_lib.WriteError) as e:  # reported once the background write ends
        tr.run.checkpointer.save(3, tr.trainer_state())
        tr.run.checkpointer.wait()
    msg = str(e.value)
    assert msg.startswith(
        f"cannot write checkpoint step 3: {run / 'checkpoints' / '.tmp-step_00000003'}/"
    )
    assert (
        f": {NO_SPACE}; removed the partial .tmp-step_00000003, the resume point stays {step2}"
        in msg
    )
    assert _leftovers(run) == [] and _digests(step2) == before


def test_injected_enospc_in_the_export_leaves_no_partial_final(
    tiny_data, tmp_path, tiny_config, make_trainer, torch_globals, monkeypatch
):
    from vlm.train import export as export_lib
    from vlm.train.checkpoint import WriteError

    run = tmp_path / "run"
    tr = make_trainer(_cfg(tiny_config, tiny_data, 2), run)
    assert tr.train() == 0
    final_before = _digests(run / "final")
    real = export_lib.save_pretrained

    # the weights get written, the tokenizer does not
    def half_then_full(module, out_dir, tokenizer=None):
        real(module, out_dir, tokenizer=None)
        raise OSError(errno.ENOSPC, NO_SPACE, str(out_dir / "tokenizer.json"))

    monkeypatch.setattr(export_lib, "save_pretrained", half_then_full)
    with pytest.raises(
        WriteError,
        match=f"cannot export {run / 'final'}: {run / '.tmp-final' / 'tokenizer.json'}: "
        f"{NO_SPACE}; removed the partial .tmp-final",
    ):
        export_lib.export_final(tr.run.engine, run, tr.run.tokenizer, 1.0, True, print)
    assert _leftovers(run) == [] and _digests(run / "final") == final_before
