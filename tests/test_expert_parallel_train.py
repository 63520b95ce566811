"""Expert parallelism in training (issue 43 item 3), two processes with gloo: `parallel.expert=2`
trains the same losses and weights as `parallel.expert=1` on the same two ranks, with the variable
exchange and with the static one, token-level and concept-level MoE layers alike, with the loss-free
bias and Grove adjugates on; each rank holds half of every layer's routed experts; a run stopped at
step 2 resumes with the losses of the uninterrupted one; a checkpoint does not resume on another
expert degree under ZeRO 2 (one line; under ZeRO 0 it does: test_checkpoint_ranks.py) and starts a
new run of any degree through train.init_from. Under ZeRO-3
(the rest partitioned over the ranks) it trains and resumes what ZeRO-3 without expert parallelism
does. With 4 ranks, ZeRO 0, 2 and 3 reduce (and partition) each shard over its 2 replicas and train
the same losses and gradient norms; a small capacity logs its overflow."""

from __future__ import annotations

import json
import signal

import pytest
import torch
import torch.multiprocessing as mp
from rank_processes import free_port, join_world


def _worker(
    rank: int, world: int, port: int, cfg_dict, run_dir: str, result: str, stop_after: int
) -> None:
    join_world(rank, world, port)
    torch.set_num_threads(1)
    from configs.config import ConfigError, from_dict
    from vlm.model.moe import MoE
    from vlm.train.config import TrainConfig
    from vlm.train.signals import StopFlag
    from vlm.train.trainer import Trainer

    lines: list[str] = []
    stop, forwards = StopFlag(), []

    def stop_in_step(out, k):  # as a SIGTERM during that step: the run saves it and stops
        forwards.append(k)
        if len(forwards) == stop_after:
            stop.request(signal.SIGTERM)
        return out

    try:
        cfg = from_dict(TrainConfig, cfg_dict)
        tr = Trainer(cfg, run_dir, log=lines.append, stop=stop, loss_hook=stop_in_step)
    except ConfigError as e:
        if rank == 0:
            torch.save({"refused": str(e)}, result)
        return
    model = tr.run.engine.module
    held = {
        n: (m.local_experts, m.num_experts) for n, m in model.named_modules() if isinstance(m, MoE)
    }
    rc = tr.train()
    if rank == 0:
        torch.save({"rc": rc, "held": held, "log": lines}, result)


def _train(tmp_path, name: str, cfg: dict, stop_after: int = 0, world: int = 2) -> dict:
    """`cfg` trained on two processes into tmp_path/name (stopped as by a SIGTERM in step
    `stop_after` where given) on `world` processes: rank 0's exit code, the experts each MoE layer held, its log and
    metrics.jsonl, or the one line of a refused config."""
    run_dir, result = tmp_path / name, tmp_path / f"{name}.pt"
    args = (world, free_port(), cfg, str(run_dir), str(result), stop_after)
    mp.spawn(_worker, args=args, nprocs=world, join=True)
    out = torch.load(result, weights_only=False)
    if "refused" not in out:
        metrics = run_dir / "metrics.jsonl"
        out["steps"] = [json.loads(line) for line in metrics.read_text().splitlines()]
    return out


def _final_weights(run_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "model.safetensors"))


def _config(
    tiny_config, tiny_data, expert: int, steps: int = 4, eval_every: int = 0, **model
) -> dict:
    cfg = tiny_config(
        tiny_data,
        train={"max_steps": steps},
        logging={"eval_every": eval_every, "histogram_every": 0},
        checkpoint={"save_every": 2, "keep_last": 3},
        parallel={"expert": expert},
    )
    cfg["model"]["moe"].update(model)
    return cfg


LOSSES = ("loss", "loss/lm", "loss/ratio", "loss/balance", "compression/ratio")


def _same_steps(a: list[dict], b: list[dict], rel: float = 2e-5) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        held_out = tuple(k for k in ra if k.startswith("val/"))
        for key in LOSSES + held_out + (("grad_norm",) if "grad_norm" in ra else ()):
            assert rb[key] == pytest.approx(ra[key], rel=rel, abs=1e-6), (ra["step"], key)


@pytest.mark.slow
def test_two_expert_ranks_train_what_one_does_and_resume(tiny_data, tmp_path, tiny_config):
    # Grove adjugates (one group per pair of experts) and the loss-free bias on: every MoE layer
    # (encoder and decoder: token level; concept model: concept level) splits its 4 experts 2 + 2
    # held-out evaluations at steps 2 and 4: exchanged forwards in eval mode, the same on every rank
    kw = {"grove_groups": 2, "grove_lambda": 0.25, "loss_free_balancing": True, "eval_every": 2}
    one = _train(tmp_path, "ep1", _config(tiny_config, tiny_data, 1, **kw))
    two = _train(tmp_path, "ep2", _config(tiny_config, tiny_data, 2, **kw))
    assert "val/loss/lm" in two["steps"][1]
    assert one["rc"] == two["rc"] == 0
    assert set(two["held"].values()) == {(2, 4)} and set(one["held"].values()) == {(4, 4)}
    assert len(two["held"]) == 3  # encoder, concept and decoder layers
    assert any(
        "experts: 1/2 per rank" in line and "all-to-all variable" in line for line in two["log"]
    )
    # the variable exchange (the default) trains what one rank trains
    _same_steps(one["steps"], two["steps"], rel=1e-5)
    assert all(r["moe/overflow"] == 0 for r in two["steps"])  # dropless
    # the loss-free bias moved (it is part of the weights compared below)
    w1, w2 = _final_weights(tmp_path / "ep1"), _final_weights(tmp_path / "ep2")
    assert set(w1) == set(w2)
    bias = [k for k in w1 if k.endswith("expert_bias")]
    assert bias and all(float(w1[k].abs().sum()) > 0 for k in bias)
    for k in w1:  # the export gathered every expert
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")

    # stopped after step 2 (its checkpoint), resumed to step 4: the uninterrupted run's losses
    cfg = _config(tiny_config, tiny_data, 2, **kw)
    stopped = _train(tmp_path, "ep2_resumed", cfg, stop_after=2)
    assert stopped["rc"] == 128 + signal.SIGTERM and len(stopped["steps"]) == 2
    ckpt = tmp_path / "ep2_resumed" / "checkpoints" / "step_00000002"
    assert (ckpt / "experts_rank_00000.pt").is_file() and (ckpt / "experts_rank_00001.pt").is_file()
    resumed = _train(tmp_path, "ep2_resumed", cfg)
    assert resumed["rc"] == 0
    _same_steps(two["steps"], resumed["steps"])

    # onto another degree it regroups (test_checkpoint_ranks.py); a new run from the checkpoint's
    # weights at another degree, every expert whole
    fresh = _config(tiny_config, tiny_data, 1, steps=1, **kw)
    fresh["train"]["init_from"] = str(ckpt)
    assert _train(tmp_path, "from_ep2", fresh)["rc"] == 0


@pytest.mark.slow
@pytest.mark.extended
def test_the_static_exchange_trains_what_one_rank_does(tiny_data, tmp_path, tiny_config):
    # the layer-level check of both exchanges is tests/test_expert_parallel.py's; this is the
    # training run of test_two_expert_ranks_train_what_one_does_and_resume with the static one
    kw = {"grove_groups": 2, "grove_lambda": 0.25, "loss_free_balancing": True, "eval_every": 2}
    one = _train(tmp_path, "ep1", _config(tiny_config, tiny_data, 1, **kw))
    static_cfg = _config(tiny_config, tiny_data, 2, **kw)
    static_cfg["parallel"]["exchange"] = "static"
    static = _train(tmp_path, "ep2_static", static_cfg)
    assert one["rc"] == static["rc"] == 0
    assert any("all-to-all static" in line for line in static["log"])
    _same_steps(one["steps"], static["steps"], rel=1e-5)
    assert all(r["moe/overflow"] == 0 for r in static["steps"])  # dropless


@pytest.mark.slow
@pytest.mark.extended
def test_zero_reduces_each_expert_shard_over_its_replicas(tiny_data, tmp_path, tiny_config):
    # 4 ranks, 2 expert ranks: each shard is held by 2 ranks, which reduce its gradient between
    # themselves only (ZeRO 2 also partitions its optimizer state over them); the reference is
    # ZeRO 2 without expert parallelism, whose gradient norm DeepSpeed logs: with experts split
    # ZeRO 0 clips by the optimizer's own global norm (ExpertAwareClip), ZeRO 2 by DeepSpeed's
    def run(P, zero_stage, stop_after=0):
        cfg = _config(tiny_config, tiny_data, P, steps=3)
        cfg["deepspeed"] = {"zero_stage": zero_stage}
        out = _train(tmp_path, f"ep{P}_zero{zero_stage}", cfg, stop_after, world=4)
        assert out["rc"] == (128 + signal.SIGTERM if stop_after else 0)
        return out

    ref = run(1, 2)
    assert all("grad_norm" in r for r in ref["steps"])
    assert max(r["grad_norm"] for r in ref["steps"]) > 1.0  # optim.clip (1.0) acts
    for zero_stage in (0, 2, 3):
        if zero_stage == 3:
            # ZeRO-3 partitions each shard's weights over its 2 replicas too (AutoEP's
            # placement): stopped after step 2, its shards gathered into the checkpoint, and
            # resumed into the partitions
            run(2, zero_stage, stop_after=2)
        split = run(2, zero_stage)
        assert any("2 rank(s) per shard" in line for line in split["log"])
        _same_steps(ref["steps"], split["steps"])


@pytest.mark.slow
def test_zero3_with_split_experts_trains_and_resumes_what_zero3_does(
    tiny_data, tmp_path, tiny_config
):
    # ZeRO-3 partitions every replicated weight over the 2 ranks; each rank's expert shard has no
    # other replica here (it is partitioned over its expert-data-parallel group, of 1 rank), so
    # its checkpoint file is gathered from and restored into ZeRO-3's partitions
    def config(P):
        cfg = _config(tiny_config, tiny_data, P)
        cfg["deepspeed"] = {"zero_stage": 3}
        return cfg

    ref = _train(tmp_path, "z3_ep1", config(1))
    stopped = _train(tmp_path, "z3_ep2", config(2), stop_after=2)
    assert stopped["rc"] == 128 + signal.SIGTERM and len(stopped["steps"]) == 2
    assert any("experts: 1/2 per rank" in line for line in stopped["log"])
    resumed = _train(tmp_path, "z3_ep2", config(2))
    assert ref["rc"] == resumed["rc"] == 0
    # steps 1-2 before the stop, 3-4 after the resume: the losses and norms of ZeRO-3 alone
    _same_steps(ref["steps"], resumed["steps"])
    w1, w2 = _final_weights(tmp_path / "z3_ep1"), _final_weights(tmp_path / "z3_ep2")
    assert set(w1) == set(w2)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.slow
def test_a_small_capacity_logs_its_overflow(tiny_data, tmp_path, tiny_config):
    cfg = _config(tiny_config, tiny_data, 2, steps=1)
    cfg["parallel"]["capacity_factor"] = 0.5
    small = _train(tmp_path, "small", cfg)
    assert small["rc"] == 0 and small["steps"][0]["moe/overflow"] > 0
