"""Preemption with real signals to `python -m vlm.train`: SIGTERM / SIGINT / SIGHUP (a closed
terminal, issue 45) finish the step in flight, checkpoint it and exit 143 / 130 / 129 with one line;
a second signal exits at once; the vision warm-up checkpoints too, and the same command with
--resume continues it (ending where an uninterrupted warm-up ends) or starts a run that has no
checkpoint yet."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def _start(args, cwd, env, out_dir, new_session: bool = False):
    """`python -m vlm.train ARGS`; with `new_session` in a process group of its own (as a scheduler's job)."""
    out, err = open(out_dir / "out.txt", "w"), open(out_dir / "err.txt", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vlm.train", *args],
        cwd=cwd,
        env=env,
        stdout=out,
        stderr=err,
        start_new_session=new_session,
    )
    return proc, out, err


def _wait_for(cond, proc, what, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {what}"
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _steps(run):
    f = run / "metrics.jsonl"
    return (
        [json.loads(x)["step"] for x in f.read_text().splitlines() if x.strip()]
        if f.exists()
        else []
    )


def _finish(proc, out, err, tmp):
    proc.wait(timeout=300)
    out.close()
    err.close()
    return (tmp / "out.txt").read_text(), (tmp / "err.txt").read_text()


@pytest.mark.parametrize(
    "sig,code",
    [
        (signal.SIGTERM, 143),
        (signal.SIGINT, 130),
        # the handler SIGTERM and SIGINT take, again (make test-extended)
        pytest.param(signal.SIGHUP, 129, marks=pytest.mark.extended),
    ],
)
def test_a_signal_checkpoints_the_step_in_flight_and_exits_with_its_code(
    tiny_data, tmp_path, tiny_config, write_config, ROOT, subprocess_env, sig, code
):
    from vlm.train.checkpoint import list_checkpoints

    cfg = tiny_config(
        tiny_data,
        train={"max_steps": 400},
        checkpoint={"save_every": 1000, "keep_last": 2},
        logging={"eval_every": 0},
    )
    path = write_config(cfg, tmp_path / "c.yaml")
    run = tmp_path / "run"
    proc, out, err = _start(
        ["--config", str(path), "--out", str(run)], ROOT, subprocess_env(), tmp_path
    )
    try:
        _wait_for(lambda: len(_steps(run)) >= 3, proc, "3 steps")
        proc.send_signal(sig)
        stdout, stderr = _finish(proc, out, err, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert f"vlm train: {signal.Signals(sig).name} received: finishing this step" in stderr
    n = _steps(run)[-1]
    assert 3 <= n < 400
    # the last step that ran is the one checkpointed: nothing since the signal is redone
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [n]
    last = stdout.strip().splitlines()[-1]
    assert last == (
        f"stopped by {signal.Signals(sig).name} after step {n}: checkpoint "
        f"{run / 'checkpoints' / f'step_{n:08d}'}; continue with the same command and --resume"
    )
    assert not (run / "final").exists()

    if sig != signal.SIGTERM:  # the continuation is the same whichever signal stopped the run
        return
    cfg["train"]["max_steps"] = n + 2  # a legitimate continuation: the same run, two more steps
    write_config(cfg, path)
    done = subprocess.run(
        [sys.executable, "-m", "vlm.train", "--config", str(path), "--out", str(run), "--resume"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"at step {n}" in done.stdout and _steps(run) == list(range(1, n + 3))


def test_a_second_signal_exits_at_once_without_saving(
    tiny_data, tmp_path, tiny_config, write_config, ROOT, subprocess_env
):
    from vlm.train.checkpoint import list_checkpoints

    # long steps (32 micro-batches of 4 rows of 1024 tokens), so that the second signal lands while
    # the first one's step is still running; a first signal that arrives between two steps is saved
    # for at once, and a fast machine can finish that save before the second signal: such an attempt
    # proves nothing and is run again
    cfg = tiny_config(
        tiny_data,
        train={"max_steps": 400},
        checkpoint={"save_every": 1000},
        logging={"eval_every": 0},
        data={"row_tokens": 1024, "rows_per_batch": 4},
        optim={"grad_accum": 32},
    )
    path = write_config(cfg, tmp_path / "c.yaml")
    for attempt in range(4):
        run = tmp_path / f"run{attempt}"
        proc, out, err = _start(
            ["--config", str(path), "--out", str(run)], ROOT, subprocess_env(), tmp_path
        )
        try:
            _wait_for(lambda: len(_steps(run)) >= 2, proc, "2 steps")
            proc.send_signal(signal.SIGTERM)
            # two signals sent back to back merge into one: the second goes once the first was heard
            _wait_for(
                lambda: "SIGTERM received" in (tmp_path / "err.txt").read_text(),
                proc,
                "the first signal",
            )
            proc.send_signal(signal.SIGTERM)
            stdout, stderr = _finish(proc, out, err, tmp_path)
        finally:
            if proc.poll() is None:
                proc.kill()
        if "stopped by" not in stdout:
            break
    assert proc.returncode == 143
    assert (
        stderr.strip().splitlines()[-1]
        == "vlm train: second SIGTERM: exiting now, without a checkpoint"
    )
    assert list_checkpoints(run / "checkpoints") == [] and "stopped by" not in stdout


def test_the_vision_warmup_checkpoints_and_resume_continues_it(
    tiny_data, tmp_path, tiny_config, write_config, ROOT, subprocess_env
):
    """SIGTERM in the warm-up: exit 143 with its state saved; the same command with --resume (no run
    checkpoint yet) starts the run, continues the warm-up from that state, and ends with the weights
    of an uninterrupted run. Bit for bit, so a CPU test (the suite pins DS_ACCELERATOR=cpu; both
    runs' logs say so): GPU kernels need not give the same bits twice."""
    from safetensors.torch import load_file

    steps = 300
    cfg = tiny_config(
        tiny_data,
        train={"max_steps": 2},
        checkpoint={"save_every": 2},
        logging={"eval_every": 0},
        vision_warmup={"steps": steps, "images_per_step": 4, "min_word_count": 2, "held_out": 8},
    )
    path = write_config(cfg, tmp_path / "c.yaml")
    ref, run = tmp_path / "ref", tmp_path / "run"
    state = run / "checkpoints" / "vision_warmup"
    (tmp_path / "killed").mkdir()
    proc, out, err = _start(
        ["--config", str(path), "--out", str(run)], ROOT, subprocess_env(), tmp_path / "killed"
    )
    try:
        _wait_for(lambda: (state / "meta.json").is_file(), proc, "the warm-up's first checkpoint")
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = _finish(proc, out, err, tmp_path / "killed")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, stderr[-3000:]
    last = stdout.strip().splitlines()[-1]
    assert (
        last.startswith("stopped by SIGTERM in the vision warm-up at step ") and str(state) in last
    )
    stopped_at = int(last.split("at step ")[1].split("/")[0])
    assert 0 < stopped_at < steps
    assert not (run / "checkpoints" / "step_00000002").exists()

    again = subprocess.run(
        [sys.executable, "-m", "vlm.train", "--config", str(path), "--out", str(run), "--resume"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        "no checkpoint in" in again.stdout and "starting the run from the beginning" in again.stdout
    )
    assert f"continuing from {state} at step {stopped_at}/{steps}" in again.stdout

    whole = subprocess.run(
        [sys.executable, "-m", "vlm.train", "--config", str(path), "--out", str(ref)],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "rank(s) on cpu;" in again.stdout and "rank(s) on cpu;" in whole.stdout
    a, b = (
        load_file(ref / "final" / "model.safetensors"),
        load_file(run / "final" / "model.safetensors"),
    )
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    wa = json.loads((ref / "vision_warmup.json").read_text())
    wb = json.loads((run / "vision_warmup.json").read_text())
    assert wa["loss_last"] == wb["loss_last"]


def test_a_scheduler_sigterm_to_the_whole_job_with_loader_workers_checkpoints(
    tiny_data, tmp_path, tiny_config, write_config, ROOT, subprocess_env
):
    """SLURM and Kubernetes signal every process of the job, so the data-loader workers get the
    SIGTERM too: they leave it to the trainer (which would otherwise crash on a dead worker instead
    of saving), and the run resumes with no step lost or repeated."""
    import os

    cfg = tiny_config(
        tiny_data,
        train={"max_steps": 400},
        checkpoint={"save_every": 1000, "keep_last": 2},
        logging={"eval_every": 0},
        data={"num_workers": 2},
    )
    path = write_config(cfg, tmp_path / "c.yaml")
    run = tmp_path / "run"
    proc, out, err = _start(
        ["--config", str(path), "--out", str(run)],
        ROOT,
        subprocess_env(),
        tmp_path,
        new_session=True,
    )
    try:
        _wait_for(lambda: len(_steps(run)) >= 3, proc, "3 steps")
        os.killpg(proc.pid, signal.SIGTERM)  # the trainer and its two workers
        stdout, stderr = _finish(proc, out, err, tmp_path)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr and "killed by signal" not in stderr
    n = _steps(run)[-1]
    assert (
        stdout.strip().splitlines()[-1].startswith(f"stopped by SIGTERM after step {n}: checkpoint")
    )
    cfg["train"]["max_steps"] = n + 2
    write_config(cfg, path)
    done = subprocess.run(
        [sys.executable, "-m", "vlm.train", "--config", str(path), "--out", str(run), "--resume"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert _steps(run) == list(range(1, n + 3))
