"""Checkpoints: atomic saves, and a SIGKILLed + resumed run equal to an uninterrupted one, step by step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from vlm.train.metrics_sinks import is_timing


def _records(run_dir):
    return [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]


def _strip(rec):
    return {k: v for k, v in rec.items() if not is_timing(k)}


def test_latest_checkpoint_ignores_partial_saves(tmp_path):
    from vlm.train.checkpoint import clean_partial, latest_checkpoint, step_dir_name

    root = tmp_path / "checkpoints"
    good = root / step_dir_name(4)
    good.mkdir(parents=True)
    (good / "meta.json").write_text('{"step": 4, "world_size": 1}')
    (root / f".tmp-{step_dir_name(6)}" / "ds").mkdir(parents=True)  # crashed mid-save
    # no meta.json: never complete
    (root / step_dir_name(8)).mkdir()
    (root / f".del-{step_dir_name(2)}").mkdir()  # crashed mid-delete
    assert latest_checkpoint(root) == good
    clean_partial(root)
    assert sorted(p.name for p in root.iterdir()) == [step_dir_name(4), step_dir_name(8)]


@pytest.mark.slow
def test_sigkill_and_resume_reproduces_metrics(
    tiny_data, tmp_path, tiny_config, write_config, run_train_cli, ROOT, subprocess_env
):
    """A CPU test by nature: bit-for-bit equal runs need kernels that give the same bits every time,
    which the CPU's do (GPU kernels need not, deterministic-algorithm mode or not). The runs inherit
    the suite's DS_ACCELERATOR=cpu (conftest); the resumed run's log says where it ran."""
    cfg = tiny_config(
        tiny_data,
        train={"max_steps": 8, "threads": 1},
        checkpoint={"save_every": 2, "keep_last": 2},
        logging={"eval_every": 3, "histogram_every": 2},
    )
    path = write_config(cfg, tmp_path / "c.yaml")
    ref, killed = tmp_path / "ref", tmp_path / "killed"

    # the uninterrupted run, side by side with the one to kill
    ref_err = open(tmp_path / "ref.err", "w")
    ref_proc = subprocess.Popen(
        [sys.executable, "-m", "vlm.train", "--config", str(path), "--out", str(ref)],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=ref_err,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "vlm.train", "--config", str(path), "--out", str(killed)],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 600
    try:
        while time.time() < deadline and proc.poll() is None:
            metrics = killed / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(_records(killed)) >= 5
    ref_proc.wait(timeout=600)
    ref_err.close()
    assert ref_proc.returncode == 0, (tmp_path / "ref.err").read_text()[-3000:]
    assert not (killed / "final").exists()

    out = run_train_cli(["--config", str(path), "--out", str(killed), "--resume"], cwd=ROOT)
    assert "resumed from" in out.stdout and "rank(s) on cpu;" in out.stdout
    a, b = _records(ref), _records(killed)
    assert [r["step"] for r in b] == list(range(1, 9))
    for ra, rb in zip(a, b):
        assert _strip(ra) == _strip(rb), f"step {ra['step']} differs"
    # same final weights, bit for bit
    from safetensors.torch import load_file

    wa, wb = (
        load_file(ref / "final" / "model.safetensors"),
        load_file(killed / "final" / "model.safetensors"),
    )
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


def test_resume_refuses_a_changed_config(
    tiny_data, tmp_path, torch_globals, tiny_config, make_trainer, load_tiny
):
    from configs.config import ConfigError

    cfg = tiny_config(
        tiny_data, train={"max_steps": 2}, checkpoint={"save_every": 2}, logging={"eval_every": 0}
    )
    run_dir = tmp_path / "run"
    assert make_trainer(cfg, run_dir).train() == 0
    with pytest.raises(ConfigError, match="already has checkpoints"):
        make_trainer(cfg, run_dir, resume=False)
    # More steps is a legitimate continuation (automatic resume) ...
    cfg["train"]["max_steps"] = 3
    tr = make_trainer(cfg, run_dir)
    assert tr.run.resume_from is not None and tr.train() == 0 and tr.step == 3
    assert [r["step"] for r in _records(run_dir)] == [1, 2, 3]
    # ... a different learning rate is not.
    cfg["optim"]["lr"] = 0.1
    with pytest.raises(
        ConfigError, match="cannot resume: optim.lr was 0.003 in the checkpointed run, now 0.1"
    ):
        make_trainer(cfg, run_dir)
    # a DeepSpeed setting the run no longer states is named with what it got
    cfg["optim"]["lr"] = 3e-3
    with pytest.raises(
        ConfigError,
        match=r"deepspeed.extra was \{'wall_clock_breakdown': False\} in the checkpointed run, "
        r"now \{\}",
    ):
        from vlm.train.run_config import check_resume_config

        check_resume_config(
            {"deepspeed": {"extra": {"wall_clock_breakdown": False}}}, {"deepspeed": {"extra": {}}}
        )
    # --resume on a run with no checkpoint yet (preempted before its first save) starts it,
    # saying so
    said = []
    from vlm.train.trainer import Trainer

    fresh = Trainer(load_tiny(cfg), tmp_path / "empty", resume=True, log=said.append)
    assert fresh.run.resume_from is None and any(
        "no checkpoint in" in m and "from the beginning" in m for m in said
    )
    # ... but checkpoints that are all damaged are not silently trained over
    for ckpt in (run_dir / "checkpoints").iterdir():
        if (ckpt / "rank_00000.pt").is_file():
            (ckpt / "rank_00000.pt").write_bytes(b"damaged")
    cfg["optim"]["lr"] = 0.003
    with pytest.raises(ConfigError, match="--resume: no intact checkpoint"):
        make_trainer(cfg, run_dir, resume=True)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_latest_checkpoint_falls_back_to_an_intact_one(
    tiny_data, tmp_path, torch_globals, damage, tiny_config, load_tiny, make_trainer
):
    """Every checkpoint file's SHA-256 is recorded at save; a resume skips a checkpoint whose files
    no longer match, with a warning naming the file, and continues from the newest intact one."""
    from vlm.train.trainer import Trainer

    cfg = tiny_config(
        tiny_data,
        train={"max_steps": 4},
        checkpoint={"save_every": 2, "keep_last": 2},
        logging={"eval_every": 0},
    )
    run_dir = tmp_path / "run"
    assert make_trainer(cfg, run_dir).train() == 0
    ckpts = sorted((run_dir / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == ["step_00000002", "step_00000004"]
    victim = max(
        (p for p in (ckpts[1] / "ds").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    data = victim.read_bytes()
    if damage == "flip":
        victim.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    else:
        victim.unlink()
    said = []
    cfg["train"]["max_steps"] = 6
    tr = Trainer(load_tiny(cfg), run_dir, resume=True, log=said.append)
    assert tr.run.resume_from == ckpts[0]
    assert any("damaged" in m and victim.name in m for m in said), said


def test_checkpoints_without_checksums_still_resume(tmp_path):
    from vlm.train.checkpoint import newest_intact_checkpoint, step_dir_name

    old = tmp_path / step_dir_name(2)
    old.mkdir()
    # written before checksums existed
    (old / "meta.json").write_text('{"step": 2, "world_size": 1}')
    assert newest_intact_checkpoint(tmp_path, warn=lambda m: None) == old


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # unpickling would create the marker file


def test_trainer_state_loads_tensors_only(tmp_path):
    """A crafted trainer-state file cannot run code on resume: it is refused with the file named."""
    import torch

    from vlm.train.checkpoint import rng_state, set_rng_state
    from vlm.train.engine import safe_load as load_trainer_state

    marker = tmp_path / "pwned"
    torch.save({"step": 1, "payload": _RunsCode(str(marker))}, tmp_path / "rank_00000.pt")
    with pytest.raises(RuntimeError, match="rank_00000.pt: refused"):
        load_trainer_state(tmp_path / "rank_00000.pt")
    assert not marker.exists()
    # the real trainer state (RNG states included) round-trips through the safe loader
    import numpy as np

    torch.save({"rng": rng_state()}, tmp_path / "ok.pt")
    want = np.random.rand(3)
    np.random.rand(5)
    set_rng_state(load_trainer_state(tmp_path / "ok.pt")["rng"])
    assert np.array_equal(np.random.rand(3), want)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_zero_checkpoints_resume_through_the_safe_loader(
    tiny_data, tmp_path, torch_globals, zero_stage, tiny_config, make_trainer
):
    """DeepSpeed's own checkpoint files (ZeRO partitions included) load with tensors-only unpickling."""

    cfg = tiny_config(
        tiny_data,
        train={"max_steps": 2},
        deepspeed={"zero_stage": zero_stage},
        checkpoint={"save_every": 2},
        logging={"eval_every": 0},
    )
    assert make_trainer(cfg, tmp_path / "run").train() == 0
    cfg["train"]["max_steps"] = 3
    tr = make_trainer(cfg, tmp_path / "run", resume=True)
    assert tr.train() == 0 and tr.step == 3


def test_deepspeed_files_load_tensors_only(tmp_path):
    import torch

    from vlm.train.engine import safe_load

    marker = tmp_path / "pwned"
    torch.save({"module": {}, "x": _RunsCode(str(marker))}, tmp_path / "mp_rank_00_model_states.pt")
    with pytest.raises(RuntimeError, match="mp_rank_00_model_states.pt: refused"):
        safe_load(tmp_path / "mp_rank_00_model_states.pt")
    assert not marker.exists()


def test_accept_optim_change_resumes_with_the_new_rates(
    tiny_data, tmp_path, torch_globals, tiny_config, make_trainer, load_tiny
):
    """The documented fix after non-finite steps: resume with a lower optim.lr. The
    checkpoint's optimizer and scheduler state come back, but the rates (and other optimiser
    settings) are this config's."""
    from configs.config import ConfigError
    from vlm.train.trainer import Trainer

    cfg = tiny_config(
        tiny_data,
        train={"max_steps": 4},
        checkpoint={"save_every": 2},
        logging={"eval_every": 0},
        optim={"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 0, "schedule": "constant"},
    )
    run_dir = tmp_path / "run"
    assert make_trainer(cfg, run_dir).train() == 0
    cfg["train"]["max_steps"] = 6
    cfg["optim"].update(lr=1e-4, min_lr=1e-5, weight_decay=0.0)
    with pytest.raises(ConfigError, match="or --accept-optim-change"):
        make_trainer(cfg, run_dir)
    tr = Trainer(load_tiny(cfg), run_dir, log=lambda *_: None, accept_optim_change=True)
    tr.restore(tr.run.resume_from)
    assert tr.step == 4
    groups = tr.run.optimizer.param_groups
    assert max(g["lr"] for g in groups) == pytest.approx(1e-4) and all(
        g["weight_decay"] == 0.0 for g in groups
    )
    assert tr.run.optimizer.state  # Adam moments came back from the checkpoint


def test_accept_optim_change_continues_the_schedule_from_the_new_base_rates(
    tiny_data, tmp_path, torch_globals, tiny_config, load_tiny, make_trainer
):
    """Mid-cosine, with per-group rates (muP-free multipliers): every group's rate, and
    get_last_lr(), is the new config's base rate times the schedule's multiplier at the checkpoint's
    step; stepping on continues from there."""
    from vlm.train.trainer import Trainer

    cfg = tiny_config(
        tiny_data,
        train={"max_steps": 4},
        checkpoint={"save_every": 2},
        logging={"eval_every": 0},
        optim={"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 1, "schedule": "cosine"},
        params={"projector_lr_mult": 4.0},
        vision_warmup={"steps": 0},
    )
    run_dir = tmp_path / "run"
    assert make_trainer(cfg, run_dir).train() == 0
    cfg["train"]["max_steps"] = 8
    cfg["optim"].update(lr=1e-3, min_lr=1e-4)
    tr = Trainer(load_tiny(cfg), run_dir, log=lambda *_: None, accept_optim_change=True)
    fresh_base = list(tr.run.scheduler.base_lrs)
    tr.restore(tr.run.resume_from)
    sched = tr.run.scheduler
    assert tr.step == 4 and sched.last_epoch == 4
    assert sched.base_lrs == fresh_base and len(set(fresh_base)) > 1
    want = [b * fn(4) for b, fn in zip(fresh_base, sched.lr_lambdas)]
    assert sched.get_last_lr() == want
    assert [g["lr"] for g in tr.run.optimizer.param_groups] == want
    assert [g["initial_lr"] for g in tr.run.optimizer.param_groups] == fresh_base
    sched.step()
    assert sched.get_last_lr() == [b * fn(5) for b, fn in zip(fresh_base, sched.lr_lambdas)]
