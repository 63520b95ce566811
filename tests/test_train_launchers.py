"""How clusters start a run (docs/training.md, "Clusters"): SLURM tasks that `srun` started without a
launcher of their own join one run as its ranks (as Lightning reads SLURM's variables), a process of a
multi-task allocation that srun did not start refuses in one line, and the shipped batch script
(configs/slurm/train.sbatch: srun, one torchrun per node, c10d rendezvous) trains as one run across
"nodes", with srun and scontrol replaced by stand-ins that give each task the same environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rank_processes import free_port

from configs.config import ConfigError
from vlm.train.distributed import first_host, slurm_port, slurm_rank_env

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
        "MASTER_PORT": str(slurm_port(env)),
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
    run, port = tmp_path / "run", free_port()
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
        MASTER_PORT=free_port(),
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


def test_two_jobs_or_two_steps_on_one_node_get_their_own_port():
    """A fixed port made the second of two jobs (or of two srun steps of one job) sharing a node
    die with EADDRINUSE."""
    ports = {
        slurm_port({"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step)})
        for job in (1000, 1001, 1002)
        for step in (0, 1, 2)
    }
    assert len(ports) == 9, "two (job, step) pairs share a rendezvous port"
    assert all(20000 <= p < 60000 for p in ports)


@pytest.mark.parametrize(
    "env, says",
    [
        (
            {"SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_PROCID": "2"},
            "SLURM_PROCID=2 is not one",
        ),
        ({"SLURM_NTASKS": "two", "SLURM_STEP_ID": "0"}, "SLURM_NTASKS='two' is not"),
        ({"SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, "SLURM_PROCID is not set"),
        (
            {"SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_JOB_ID": "x"},
            "SLURM_JOB_ID='x' is not",
        ),
    ],
)
def test_bad_slurm_variables_are_one_line(env, says):
    """A task number past the step's tasks waited ten minutes for peers; a missing or non-numeric
    variable was a traceback."""
    with pytest.raises(ConfigError, match=says) as e:
        slurm_rank_env(env)
    assert "\n" not in str(e.value)


def _stand_ins(tmp_path: Path, python: str) -> Path:
    """srun, scontrol and python stand-ins for the batch script: srun starts its command once per
    node and forwards SIGTERM to it (as srun does to its tasks); scontrol records `requeue`;
    `python` is the given script (the training processes)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = SRUN.replace("pids=()", "pids=()\ntrap 'kill -TERM ${pids[@]} 2>/dev/null' TERM")
    scontrol = f"""#!/bin/bash
if [[ $1 == requeue ]]; then echo "$@" >> {tmp_path}/scontrol.log; exit 0; fi
echo 127.0.0.1
"""
    for name, text in (("srun", srun), ("scontrol", scontrol), ("python", python)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


# a training process: says how it was started, trains until SIGTERM, then "saves" and exits 143
FAKE_TRAINING = """#!/bin/bash
echo "$@" > {log}/args.$SLURM_PROCID
trap 'echo saved > {log}/saved.$SLURM_PROCID; exit 143' TERM
for i in $(seq ${{FAKE_STEPS:-600}}); do sleep 0.1; done
"""


def _batch(tmp_path, subprocess_env, **extra):
    bin_dir = _stand_ins(tmp_path, FAKE_TRAINING.format(log=tmp_path))
    env = _env(
        subprocess_env,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SLURM_NNODES=2,
        SLURM_JOB_ID=4242,
        SLURM_JOB_NAME="myjob",
        SLURM_JOB_NODELIST="node[1-2]",
        GPUS_PER_NODE=1,
        **extra,
    )
    env.pop("MASTER_PORT", None)
    return subprocess.Popen(
        ["bash", str(ROOT / "configs" / "slurm" / "train.sbatch")],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _started(tmp_path, n=2, wait=30.0):
    import time

    end = time.time() + wait
    while time.time() < end and len(list(tmp_path.glob("args.*"))) < n:
        time.sleep(0.1)
    return [(tmp_path / f"args.{i}").read_text().split() for i in range(n)]


def test_the_time_limit_stops_saves_and_requeues(tmp_path, subprocess_env):
    """--requeue alone does not requeue a job that reaches its time limit: the batch script, told
    by SLURM before the limit (B:USR1), stops the training processes (SIGTERM: a step and a save)
    and requeues the job, which resumes in its own run folder."""
    import signal

    job = _batch(tmp_path, subprocess_env)
    args = _started(tmp_path)
    job.send_signal(signal.SIGUSR1)
    out = job.communicate(timeout=60)[0]
    assert job.returncode == 0, out
    assert all((tmp_path / f"saved.{i}").is_file() for i in range(2)), (
        "the training processes were not stopped with SIGTERM"
    )
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"], out
    # torchrun waits SAVE_S (300 s by default) for a worker to save before it kills it, not 30 s
    assert args[0][args[0].index("--shutdown-timeout") + 1] == "300"
    # one run folder per job (a requeued job keeps its id: the same folder, resumed)
    assert args[0][args[0].index("--out") + 1] == "runs/myjob-4242"
    port = int(args[0][args[0].index("--rdzv_endpoint") + 1].rsplit(":", 1)[1])
    assert port == slurm_port({"SLURM_JOB_ID": "4242"})


def test_a_job_that_ends_by_itself_is_not_requeued(tmp_path, subprocess_env):
    job = _batch(tmp_path, subprocess_env, OUT=tmp_path / "mine", FAKE_STEPS=3)
    out = job.communicate(timeout=60)[0]
    assert job.returncode == 0, out
    assert not (tmp_path / "scontrol.log").exists(), "requeued a run that finished"
    args = (tmp_path / "args.0").read_text().split()
    assert args[args.index("--out") + 1] == str(tmp_path / "mine"), "an explicit OUT is the run's"
