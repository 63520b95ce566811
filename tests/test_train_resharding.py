"""Runs that change their number of processes (issue 43): the global batch is the config's, so 1 and
2 processes train the same steps on the same samples; a checkpoint written by N ranks resumes on M
(DeepSpeed's universal checkpoint for ZeRO's partitions), and the steps after the resume are the
uninterrupted run's (weights, Adam moments, schedule, step and data position carried over).

Each run is real processes (torch.multiprocessing, gloo), as `deepspeed` / `torchrun` would start."""

from __future__ import annotations

import json

import pytest
from rank_processes import free_port, join_world, spawn

pytestmark = pytest.mark.slow


def _worker(rank: int, world: int, port: int, cfg, run_dir: str) -> None:
    join_world(rank, world, port)
    import torch

    torch.set_num_threads(1)
    from vlm.train.trainer import Trainer

    assert Trainer(cfg, run_dir, log=lambda *_: None).train() == 0


def _train(world: int, cfg, run_dir) -> dict[int, dict]:
    """Train `cfg` in `run_dir` on `world` processes (resuming what is there); its metrics by step."""
    spawn(
        _worker, (world, free_port(), cfg, str(run_dir)), world, f"{run_dir.name} on {world} ranks"
    )
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def _config(tiny_data, tiny_config, load_tiny, zero: int, steps: int):
    """Four rows per optimizer step, one per micro-batch (4, 2 or 1 micro-batches per rank on 1, 2
    or 4 ranks); a constant rate, so that a run stopped at step 3 and continued to 6 follows the
    schedule of the uninterrupted one."""
    cfg = tiny_config(
        tiny_data,
        data={"rows_per_batch": 1},
        optim={"global_batch_rows": 4, "schedule": "constant", "warmup_steps": 0},
        deepspeed={"zero_stage": zero},
        logging={"eval_every": 0, "histogram_every": 0},
        checkpoint={"save_every": 3, "keep_last": 2},
        train={"max_steps": steps},
    )
    return load_tiny(cfg)


def _close(a: dict, b: dict, steps, keys=("loss", "loss/lm", "loss/ratio"), rel=1e-3) -> None:
    """Run b's steps `steps` log what run a's do (a: the reference)."""
    for s in steps:
        for k in keys:
            assert b[s][k] == pytest.approx(a[s][k], rel=rel), (
                f"step {s}: {k} = {b[s][k]}, the reference run's {a[s][k]} (rel. tolerance {rel})"
            )
        assert b[s]["tokens"] == a[s]["tokens"], (
            f"step {s} trained on {b[s]['tokens']} tokens, the reference run's on "
            f"{a[s]['tokens']}: not the same samples"
        )


def test_one_and_two_processes_train_the_same_steps(tiny_data, tiny_config, load_tiny, tmp_path):
    cfg = _config(tiny_data, tiny_config, load_tiny, zero=2, steps=3)
    one = _train(1, cfg, tmp_path / "one")
    two = _train(2, cfg, tmp_path / "two")
    _close(one, two, [1, 2, 3], rel=1e-5)


# each stage and both directions within the suite's budget; VLM_TEST_EXTENDED=1 adds the rest of
# the matrix (docs/training.md quotes a run of all of it)
RESHARDS = [(2, 1, 2), (1, 2, 3)] + [
    pytest.param(*r, marks=pytest.mark.extended)
    for r in [(2, 4, 1), (1, 2, 1), (1, 2, 2), (2, 1, 3), (2, 1, 1), (1, 4, 3), (4, 2, 2)]
]


@pytest.mark.parametrize("n,m,zero", RESHARDS, ids=str)
def test_a_run_stopped_on_n_ranks_continues_on_m(
    n, m, zero, tiny_data, tiny_config, load_tiny, tmp_path
):
    whole = _train(n, _config(tiny_data, tiny_config, load_tiny, zero, 6), tmp_path / "whole")
    run = tmp_path / "resumed"
    _train(n, _config(tiny_data, tiny_config, load_tiny, zero, 3), run)
    resumed = _train(m, _config(tiny_data, tiny_config, load_tiny, zero, 6), run)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6], (
        f"stopped at step 3 on {n} ranks and resumed on {m}: metrics.jsonl logs steps "
        f"{sorted(resumed)}, not 1..6 once each"
    )
    _close(whole, resumed, [4, 5, 6])
    assert (run / "checkpoints" / "step_00000003" / "universal" / "meta.json").is_file(), (
        f"a ZeRO-{zero} checkpoint of {n} ranks resumed on {m} without a universal/ conversion"
    )
