"""How clusters start a run (docs/training.md, "Clusters"): SLURM tasks that `srun` started without a
launcher of their own join one run as its ranks (as Lightning reads SLURM's variables), a process of a
multi-task allocation that srun did not start refuses in one line, and the shipped batch script
(configs/slurm/train.sbatch: srun, one torchrun per node, c10d rendezvous) trains as one run across
"nodes", with srun and scontrol replaced by stand-ins that give each task the same environment."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from vlm.train.distributed import first_host, slurm_rank_env

ROOT = Path(__file__).resolve().parents[1]

SRUN = """#!/bin/bash
# srun stand-in: SLURM_NNODES copies of the command (one task per node), each with its task's
# variables, as srun gives them on SLURM_NNODES nodes; the first failure is the exit code
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
pids=()
for ((i = 0; i < ${SLURM_NNODES:-1}; i++)); do
    SLURM_PROCID=$i SLURM_NODEID=$i SLURM_LOCALID=0 SLURM_STEP_ID=0 "$@" &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
SCONTROL = """#!/bin/bash
echo 127.0.0.1
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(subprocess_env, **extra) -> dict:
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("SLURM_")}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def test_slurm_variables_give_each_task_its_rank():
    env = {
        "SLURM_NTASKS": "8",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-10]",
        "SLURM_JOB_ID": "123456",
    }
    got = slurm_rank_env(env)
    assert got == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(15000 + 123456 % 20000),
    }
    assert slurm_rank_env({**env, "MASTER_PORT": "29500"})["MASTER_PORT"] == "29500"
    assert slurm_rank_env({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    assert [first_host(x) for x in ("n5", "n5,n6", "gpu[012-013],cpu1", "a[3,7-9]")] == [
        "n5",
        "n5",
        "gpu012",
        "a3",
    ]


def test_a_task_srun_did_not_start_refuses_before_any_work(
    tiny_data, tiny_config, write_config, subprocess_env, tmp_path
):
    cfg = write_config(tiny_config(tiny_data), tmp_path / "c.yaml")
    env = _env(subprocess_env, SLURM_NTASKS=2, SLURM_PROCID=0, SLURM_JOB_ID=7)
    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "-m", "vlm.train", "--config", str(cfg), "--out", str(run)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2, p.stderr
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "not started by srun" in err[0] and "Traceback" not in p.stderr
    assert not run.exists()


@pytest.mark.slow
def test_slurm_tasks_without_a_launcher_train_as_one_run(
    tiny_data, tiny_config, write_config, subprocess_env, tmp_path
):
    cfg = write_config(tiny_config(tiny_data, train={"max_steps": 2}), tmp_path / "c.yaml")
    run, port = tmp_path / "run", _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "vlm.train", "--config", str(cfg), "--out", str(run)],
            env=_env(
                subprocess_env,
                SLURM_NTASKS=2,
                SLURM_STEP_ID=0,
                SLURM_PROCID=r,
                SLURM_LOCALID=r,
                SLURM_JOB_ID=11,
                SLURM_JOB_NODELIST="127.0.0.1",
                MASTER_PORT=port,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "2 rank(s)" in outs[0]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


@pytest.mark.slow
def test_the_batch_script_trains_one_run_across_two_nodes(
    tiny_data, tiny_config, write_config, subprocess_env, tmp_path
):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    cfg = write_config(tiny_config(tiny_data), tmp_path / "c.yaml")
    run = tmp_path / "run"
    env = _env(
        subprocess_env,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SLURM_NNODES=2,
        SLURM_JOB_ID=21,
        SLURM_JOB_NAME="test",
        SLURM_JOB_NODELIST="node[1-2]",
        CONFIG=cfg,
        OUT=run,
        GPUS_PER_NODE=1,
        PYTHON=sys.executable,
        MASTER_PORT=_free_port(),
    )
    p = subprocess.run(
        ["bash", str(ROOT / "configs" / "slurm" / "train.sbatch"), "train.max_steps=2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 rank(s)" in p.stdout
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2] and (run / "final" / "model.safetensors").is_file()
