"""A rank that never starts or stops answering ends the job (docs/training.md, "Timeouts"):
`parallel.timeout_s` bounds the start-up's wait for the other ranks and every collective after it,
the job ends on every rank with one line naming the timeout and the rank the others waited for, and
a SIGTERM while a rank waits for its peers is obeyed at once."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest
from rank_processes import free_port


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _task(cfg, run, rank: int, port: int, subprocess_env, *extra) -> subprocess.Popen:
    """Rank `rank` of 2 as srun starts it (no launcher of its own)."""
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("SLURM_")}
    env.update(
        SLURM_NTASKS="2",
        SLURM_STEP_ID="0",
        SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank),
        SLURM_JOB_ID="77",
        SLURM_JOB_NODELIST="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return subprocess.Popen(
        [sys.executable, "-m", "vlm.train", "--config", str(cfg), "--out", str(run), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_a_peer_that_never_starts_ends_the_wait_in_one_line(
    tiny_data, tiny_config, write_config, subprocess_env, tmp_path
):
    """Rank 0 of 2 alone: it waited ten minutes (DeepSpeed's 30) without a word."""
    cfg = write_config(tiny_config(tiny_data, parallel={"timeout_s": 5}), tmp_path / "c.yaml")
    t0 = time.time()
    p = _task(cfg, tmp_path / "run", 0, free_port(), subprocess_env)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1, err
    assert time.time() - t0 < 60
    assert len(_lines(err)) == 1 and "Traceback" not in err, err
    assert "did not all meet" in err and "parallel.timeout_s=5 s" in err


def test_a_sigterm_while_waiting_for_peers_is_obeyed(
    tiny_data, tiny_config, write_config, subprocess_env, tmp_path
):
    """torch waits for peers inside C++, where Python's handler never ran: SIGTERM and SIGINT were
    acknowledged and ignored."""
    cfg = write_config(tiny_config(tiny_data, parallel={"timeout_s": 300}), tmp_path / "c.yaml")
    port = free_port()
    p = _task(cfg, tmp_path / "run", 0, port, subprocess_env)
    end = time.time() + 120
    while time.time() < end and not _listening(port):  # rank 0 holds the store: in the rendezvous
        assert p.poll() is None, p.communicate()
        time.sleep(0.2)
    time.sleep(1)
    p.send_signal(signal.SIGTERM)
    t0 = time.time()
    out, err = p.communicate(timeout=60)
    assert time.time() - t0 < 10, "the SIGTERM was not obeyed while waiting for the other ranks"
    assert p.returncode == 143, err
    assert "stopped by SIGTERM while waiting for the other ranks" in err and "Traceback" not in err


@pytest.mark.slow
def test_a_stalled_rank_ends_the_job_naming_it(
    tiny_data, tiny_config, write_config, subprocess_env, tmp_path
):
    """Rank 1 stopped (SIGSTOP: a hung GPU, a dead mount) after step 2: rank 0's next collective
    gives up after parallel.timeout_s, says which rank it waited for, and the job ends."""
    cfg = write_config(
        tiny_config(tiny_data, parallel={"timeout_s": 20}, train={"max_steps": 40}),
        tmp_path / "c.yaml",
    )
    run, port = tmp_path / "run", free_port()
    ranks = [_task(cfg, run, r, port, subprocess_env) for r in range(2)]
    try:
        metrics = run / "metrics.jsonl"
        end = time.time() + 400
        while time.time() < end and not (
            metrics.is_file() and len(metrics.read_text().splitlines()) >= 2
        ):
            assert ranks[0].poll() is None, ranks[0].communicate()
            time.sleep(0.2)
        ranks[1].send_signal(signal.SIGSTOP)
        t0 = time.time()
        out, err = ranks[0].communicate(timeout=180)
        assert time.time() - t0 < 90, "the job did not end within the timeout and its grace"
    finally:
        for p in ranks:
            p.kill()
    assert ranks[0].returncode == 1, err
    line = [x for x in _lines(err) if "parallel.timeout_s" in x]
    assert len(line) == 1 and "Traceback" not in err, err
    assert "parallel.timeout_s=20 s" in line[0] and "rank(s) 1 did not reach it" in line[0], line
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps[:2] == [1, 2]


def test_logged_step_times_are_the_slowest_ranks(tmp_path):
    """Rank 0's own figures hid a straggler: a logged step's time and data wait are the slowest
    rank's, and which rank that was is logged."""
    from vlm.train.trainer import slowest_rank

    got = slowest_rank(
        {"step_time_s": 2.0, "data/wait_s": 0.5, "tokens": 100, "tokens_per_s": 50}, "cpu"
    )
    assert got["step_time_s"] == 2.0 and got["time/slowest_rank"] == 0
    assert got["tokens_per_s"] == 50.0


def test_groups_made_without_a_timeout_get_parallel_timeout_s():
    """DeepSpeed reduces the gradients in a clone of the world it makes without a timeout: with
    torch's default (30 minutes) a stalled rank hung the job past parallel.timeout_s. Written for
    torch 2.13, whose new_group reads its default from distributed_c10d's module global."""
    import datetime

    import torch
    from torch.distributed import distributed_c10d

    from vlm.train.distributed import default_group_timeout

    assert torch.__version__.startswith("2.13"), (
        f"torch {torch.__version__}: check vlm.train.distributed.default_group_timeout against "
        "torch.distributed.distributed_c10d._get_default_timeout, then update this pin"
    )
    before = distributed_c10d.default_pg_timeout, distributed_c10d.default_pg_nccl_timeout
    try:
        default_group_timeout(datetime.timedelta(seconds=7))
        got = distributed_c10d._get_default_timeout(distributed_c10d.Backend.GLOO)
        assert got == datetime.timedelta(seconds=7), f"a new gloo group would wait {got}"
    finally:
        distributed_c10d.default_pg_timeout, distributed_c10d.default_pg_nccl_timeout = before
