"""Checkpoints at scale on real ranks (gloo; issue 49 item 2, issue 50 item 2), one scenario: a run
with `parallel.expert=2` on 2 ranks saves at steps 3 and 6; its step-3 checkpoint (the later one
removed, as if the run had stopped there) resumes with `parallel.expert=1` on 1 rank and with
`parallel.expert=4` on 4 ranks, and steps 4-6 log the uninterrupted run's losses (weights, Adam
moments, schedule and data position carried over: the expert shards regrouped on load). The
2-rank and 4-rank saves record each file's writer: every rank wrote (and hashed) its own files and
rank 0 nothing beyond its share and the engine's module file; the resumes verified in parallel
(each rank's verification time is in metrics.jsonl, as are the saves'). The same resumes under
the optimizer's other forms: ZeRO 2 in bf16 (and fp32: make test-extended), bf16 at ZeRO 0, and
ZeRO 3."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from rank_processes import free_port, join_world, spawn

pytestmark = pytest.mark.slow


def _worker(rank: int, world: int, port: int, cfg, run_dir: str) -> None:
    join_world(rank, world, port)
    import torch

    torch.set_num_threads(1)
    from vlm.train.trainer import Trainer

    assert Trainer(cfg, run_dir, log=lambda *_: None).train() == 0


def _train(world: int, cfg, run_dir) -> dict[int, dict]:
    spawn(
        _worker, (world, free_port(), cfg, str(run_dir)), world, f"{run_dir.name} on {world} ranks"
    )
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def _config(tiny_data, tiny_config, load_tiny, expert: int, zero: int = 0, bf16: bool = False):
    """Four rows per optimizer step, one per micro-batch; a constant rate (the resumed run follows
    the uninterrupted one's schedule); experts split over `expert` ranks."""
    cfg = tiny_config(
        tiny_data,
        data={"rows_per_batch": 1},
        optim={"global_batch_rows": 4, "schedule": "constant", "warmup_steps": 0},
        logging={"eval_every": 0, "histogram_every": 0},
        checkpoint={"save_every": 3, "keep_last": 2},
        train={"max_steps": 6, "vqa_eval": False},
        parallel={"expert": expert},
        deepspeed={"zero_stage": zero, "bf16": bf16},
    )
    return load_tiny(cfg)


def _writers(ckpt) -> dict[int, set[str]]:
    meta = json.loads((ckpt / "meta.json").read_text())
    assert set(meta["writers"]) == set(meta["files"]), "a file of meta.json has no writer"
    out: dict[int, set[str]] = {}
    for rel, r in meta["writers"].items():
        out.setdefault(r, set()).add(rel)
    return out


def _check_own_files(ckpt, world: int) -> None:
    """Each rank wrote and hashed its trainer state and expert shard; rank 0 nothing but its own
    share and the engine's module file."""
    by = _writers(ckpt)
    assert sorted(by) == list(range(world)), (
        f"{ckpt.name} of {world} ranks: files written by ranks {sorted(by)}: not every rank "
        "wrote (and hashed) its own share"
    )
    for r in range(world):
        assert {f"rank_{r:05d}.pt", f"experts_rank_{r:05d}.pt"} <= by[r], (r, sorted(by[r]))
    allowed = {
        "rank_00000.pt",
        "experts_rank_00000.pt",
        "ds/mp_rank_00_model_states.pt",
        "ds/expp_rank_0_mp_rank_00_optim_states.pt",
    }
    assert by[0] <= allowed, f"rank 0 wrote more than its share: {sorted(by[0] - allowed)}"


def test_an_expert_parallel_checkpoint_resumes_on_other_degrees_and_ranks(
    tiny_data, tiny_config, load_tiny, tmp_path
):
    whole_dir = tmp_path / "whole"
    whole = _train(2, _config(tiny_data, tiny_config, load_tiny, 2), whole_dir)
    ckpts = whole_dir / "checkpoints"
    _check_own_files(ckpts / "step_00000003", 2)
    saved = whole[4]
    assert saved["checkpoint/step"] == 3 and len(saved["checkpoint/ranks"]["write_s"]) == 2, (
        "metrics.jsonl does not record the step-3 save's times by rank: "
        f"{ {k: v for k, v in saved.items() if k.startswith('checkpoint/')} }"
    )
    for expert, world in ((1, 1), (4, 4)):
        run = tmp_path / f"ep{expert}_on{world}"
        shutil.copytree(whole_dir, run, ignore=shutil.ignore_patterns("final", "summary.json"))
        shutil.rmtree(run / "checkpoints" / "step_00000006")  # as if stopped after step 3
        resumed = _train(world, _config(tiny_data, tiny_config, load_tiny, expert), run)
        assert sorted(resumed) == [1, 2, 3, 4, 5, 6], sorted(resumed)
        for s in (4, 5, 6):
            for k in ("loss", "loss/lm", "loss/ratio", "loss/balance"):
                # exact but for float summation order (measured: <= 5e-8); the experts' Adam
                # moments zeroed on load moved them by 3e-5 .. 5e-4, past the 1e-3 bound
                assert resumed[s][k] == pytest.approx(whole[s][k], rel=1e-6), (
                    f"parallel.expert=2 on 2 ranks resumed at step 3 with parallel.expert="
                    f"{expert} on {world} rank(s): step {s} {k} = {resumed[s][k]}, the "
                    f"uninterrupted run's {whole[s][k]}: the regrouped experts, their Adam "
                    "moments or the data position moved (vlm/train/expert_regroup.py)"
                )
            assert resumed[s]["tokens"] == whole[s]["tokens"], (s, "not the same samples")
        verify = resumed[4]["resume/ranks"]["verify_s"]
        assert len(verify) == world, f"the resume's verification times by rank: {verify}"
        if world == 4:
            _check_own_files(run / "checkpoints" / "step_00000006", 4)


@pytest.mark.parametrize(
    "zero, bf16",
    [
        # the ZeRO 1-2 regroup's code, in fp32: what zero2-bf16 runs, again (make test-extended)
        pytest.param(2, False, id="zero2-fp32", marks=pytest.mark.extended),
        pytest.param(2, True, id="zero2-bf16"),
        # the fp32 copies' regroup, without ranks: tests/test_expert_regroup.py (the runs: extended)
        pytest.param(0, True, id="zero0-bf16", marks=pytest.mark.extended),
        pytest.param(3, False, id="zero3-fp32"),
    ],
)
def test_the_optimizers_other_forms_resume_on_other_degrees_and_ranks(
    tiny_data, tiny_config, load_tiny, tmp_path, zero, bf16
):
    """The same under the optimizer's other forms (issue 50 item 2). ZeRO 2, in fp32 and in bf16
    (configs/gpu.yaml's and the paper configs' form): the optimizer state in flat fp32 partitions
    per parameter group (the expert groups' over their replicas); each rank reads its partitions'
    elements of the fp32 masters and moments from the writers' fragments
    (vlm.train.expert_regroup). bf16 at ZeRO 0: the torch optimizer steps fp32 copies of the
    weights, regrouped with their moments. ZeRO 3: every parameter exists only as its partitions
    (an expert shard's over the ranks holding it, the rest over the world); each rank's
    partitions of the weights, fp32 masters and moments are rebuilt from the writers'
    (vlm.train.expert_regroup_zero3; bf16 there measured by hand: step 4 exact, steps 5-6 within
    2e-4)."""
    cfg = lambda expert: _config(tiny_data, tiny_config, load_tiny, expert, zero=zero, bf16=bf16)  # noqa: E731
    whole_dir = tmp_path / "whole"
    whole = _train(2, cfg(2), whole_dir)
    if zero == 3:
        _check_whole_experts(whole_dir / "checkpoints" / "step_00000003")
    # the harder move only (4 ranks, each expert's rows from a shard's half) but in the extended
    # fp32 ZeRO 2 run; one rank's regroup (experts whole) is the same code with other rows
    for expert, world in ((1, 1), (4, 4)) if (zero, bf16) == (2, False) else ((4, 4),):
        run = tmp_path / f"ep{expert}_on{world}"
        shutil.copytree(whole_dir, run, ignore=shutil.ignore_patterns("final", "summary.json"))
        shutil.rmtree(run / "checkpoints" / "step_00000006")  # as if stopped after step 3
        resumed = _train(world, cfg(expert), run)
        assert sorted(resumed) == [1, 2, 3, 4, 5, 6], sorted(resumed)
        for s in (4, 5, 6):
            # step 4 runs on the loaded weights: exact in all. After it bf16 sums the gradients
            # over other ranks in another order (measured: steps 5-6 within 2.1e-4 under ZeRO 2,
            # 4.4e-5 under ZeRO 0, at 1 and 4 ranks). Planted on load: the experts' second
            # moments zeroed moved step 5 by 6 % (ZeRO 2 bf16) and 7 % (ZeRO 3), the fp32 copies
            # left unloaded by 6.4 % (ZeRO 0 bf16), every ZeRO-3 partition read from the first
            # one's place step 4 by 8 % at 4 ranks. fp32 ZeRO 3 measured within 2.4e-8.
            rel = 1e-6 if s == 4 or not bf16 else 1e-3
            for k in ("loss", "loss/lm", "loss/ratio", "loss/balance"):
                assert resumed[s][k] == pytest.approx(whole[s][k], rel=rel), (
                    f"ZeRO {zero}, bf16 {bf16}: parallel.expert=2 on 2 ranks resumed at step 3 "
                    f"with parallel.expert={expert} on {world} rank(s): step {s} {k} = "
                    f"{resumed[s][k]}, the uninterrupted run's {whole[s][k]}: the regrouped fp32 "
                    "masters, Adam moments or the data position moved "
                    "(vlm/train/expert_regroup.py, expert_regroup_zero3.py)"
                )
            assert resumed[s]["tokens"] == whole[s]["tokens"], (s, "not the same samples")


def _check_whole_experts(ckpt) -> None:
    """The checkpoint's ZeRO-3 partitions read whole (checkpoint_tensors: the regroup's and
    train.init_from's reader) give every expert as the ranks' gathered shards hold it: each
    expert sub-group is partitioned over its shard's holders only, not over the world."""
    from vlm.train.checkpoint_tensors import checkpoint_tensors
    from vlm.train.expert_parallel import SHARD_FILE

    stored = checkpoint_tensors(ckpt)
    shards = [torch.load(ckpt / SHARD_FILE.format(r))["tensors"] for r in range(2)]
    for name in shards[0]:
        assert torch.equal(stored.whole(name), torch.cat([s[name] for s in shards])), (
            f"{ckpt.name}: {name} read from the ZeRO-3 partitions is not the expert shards put "
            "end to end (vlm/train/checkpoint_tensors.py Zero3Checkpoint)"
        )
