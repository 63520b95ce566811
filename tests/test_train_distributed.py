"""Two data-parallel processes (gloo): same first step as one process on the same global batch; torchrun CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from rank_processes import free_port, join_world, spawn


def _worker(rank: int, world: int, port: int, cfg, out: str) -> None:
    join_world(rank, world, port)
    torch.set_num_threads(1)
    from data_pipelines.loader import build_loader
    from vlm.train.trainer import Trainer

    tr = Trainer(cfg, os.path.join(out, f"run{world}"), log=lambda *_: None)
    # The same two one-row batches everywhere: one process takes both as micro-batches, two take
    # one each.
    it = iter(build_loader(cfg.data, tr.run.tokenizer, 0, 1))
    rows = [next(it), next(it)]
    window = rows if world == 1 else [rows[rank]]
    res = tr.train_step(window)
    tr.after_step(res)
    assert res.applied and res.step == 1
    rec = res.scalars
    if rank == 0:
        params = {n: p.detach().clone() for n, p in tr.run.engine.module.named_parameters()}
        torch.save({"rec": rec, "params": params}, os.path.join(out, f"world{world}.pt"))
    torch.distributed.barrier()


@pytest.mark.slow
def test_two_ranks_match_one_rank_first_step(tiny_data, tmp_path, tiny_config, load_tiny):
    # the ratio loss on the step's global statistics (DLCM's global parser): one process makes a
    # statistics pass over its two micro-batches first, two processes all-reduce theirs, and both
    # update with the global batch's gradient
    base = tiny_config(tiny_data, data={"rows_per_batch": 1}, logging={"eval_every": 0})
    base["loss"] = {"ratio": 0.1}
    one = dict(base, optim={**base["optim"], "grad_accum": 2})
    two = dict(base, optim={**base["optim"], "grad_accum": 1})
    spawn(_worker, (1, free_port(), load_tiny(one), str(tmp_path)), 1, "one rank's first step")
    spawn(_worker, (2, free_port(), load_tiny(two), str(tmp_path)), 2, "two ranks' first step")
    a, b = torch.load(tmp_path / "world1.pt"), torch.load(tmp_path / "world2.pt")
    ra, rb = a["rec"], b["rec"]
    for key in ("tokens", "tokens/image"):
        assert ra[key] == rb[key], (
            f"{key}: {rb[key]} on two ranks, {ra[key]} on one: not the same global batch"
        )
    # same sampled boundaries
    for key in ("compression/ratio", "compression/text", "compression/image"):
        assert ra[key] == rb[key], (
            f"{key}: {rb[key]} on two ranks, {ra[key]} on one: other boundaries drawn (the "
            "noise is keyed by the micro-batch's place in the global batch)"
        )
    for key in (
        "loss",
        "loss/lm",
        "loss/ratio",
        "loss/balance",
        "loss/text_only",
        "loss/image_text",
        "boundary_p/text",
        "boundary_p/image",
    ):
        if ra[key] is None:
            assert rb[key] is None, f"{key}: {rb[key]} on two ranks, not logged on one"
            continue
        assert rb[key] == pytest.approx(ra[key], rel=1e-6, abs=1e-7), (
            f"{key}: {rb[key]} on two ranks, {ra[key]} on one over the same global batch (a "
            "statistic not summed over the ranks?)"
        )
    # and the same update
    for n, p in a["params"].items():
        torch.testing.assert_close(
            b["params"][n], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}"
        )


@pytest.mark.slow
def test_torchrun_two_processes_cli(
    tiny_data, tmp_path, tiny_config, write_config, subprocess_env, ROOT
):
    cfg = tiny_config(
        tiny_data,
        train={"max_steps": 2},
        checkpoint={"save_every": 2},
        logging={"eval_every": 2},
        deepspeed={"zero_stage": 2},
    )
    path = write_config(cfg, tmp_path / "c.yaml")
    run_dir = tmp_path / "run"
    env = subprocess_env()
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            "-m",
            "vlm.train",
            "--config",
            str(path),
            "--out",
            str(run_dir),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2] and all(r["loss/lm"] > 0 for r in recs)
    ckpt = run_dir / "checkpoints" / "step_00000002"
    assert (ckpt / "rank_00000.pt").is_file() and (ckpt / "rank_00001.pt").is_file()
    assert (run_dir / "final" / "config.json").is_file()
    assert proc.stdout.count("summary") == 1  # only rank 0 reports
