"""Fast guards, in one process, for bugs only the slow multi-rank tests caught (issue 52): the
global batch's accumulation over ranks, the shared Adam step after a universal load, the expert
clip's replicas, the boundary noise keyed by the global micro-batch, and an expert-parallel
checkpoint's shards (saved, checked, restored, put back together). Their two-rank counterparts,
real collectives on two gloo ranks, are in test_collectives_two_ranks.py.
"""

from __future__ import annotations

import pytest
import torch


# ======================================== the global batch's accumulation over ranks
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_each_rank_accumulates_its_share_of_the_global_batch(rows, world):
    """optim.global_batch_rows = G rows over every rank: each rank takes G / (rows x ranks)
    micro-batches a step, and DeepSpeed is told the same (its accumulation steps and its batch of
    micro-batches over the ranks)."""
    from configs.config import from_dict
    from vlm.train.config import TrainConfig
    from vlm.train.engine import deepspeed_config
    from vlm.train.run_config import with_global_batch

    G = 16
    cfg = from_dict(
        TrainConfig, {"data": {"rows_per_batch": rows}, "optim": {"global_batch_rows": G}}
    )
    got = with_global_batch(cfg, world, None)
    accum = got.optim.grad_accum
    assert accum * rows * world == G and got.optim.global_batch_rows == G, (
        f"global batch of {G} rows on {world} rank(s) of {rows} row(s) per micro-batch: each rank "
        f"accumulates {accum} micro-batches ({accum * rows * world} rows a step), not "
        f"{G // (rows * world)}: the global batch's accumulation ignores the ranks "
        "(vlm/train/run_config.py with_global_batch)"
    )
    ds = deepspeed_config(got.deepspeed, got.optim, world)
    assert ds["gradient_accumulation_steps"] == accum, ds["gradient_accumulation_steps"]
    assert ds["train_batch_size"] == accum * world, (
        f"DeepSpeed's train_batch_size {ds['train_batch_size']} is not the {accum} micro-batches "
        f"x {world} ranks of a step"
    )


def test_a_global_batch_left_unstated_is_rows_times_accumulation_on_the_starting_ranks():
    from configs.config import ConfigError, from_dict
    from vlm.train.config import TrainConfig
    from vlm.train.run_config import with_global_batch

    cfg = from_dict(TrainConfig, {"data": {"rows_per_batch": 2}, "optim": {"grad_accum": 3}})
    started = with_global_batch(cfg, 2, None)
    assert started.optim.global_batch_rows == 12 and started.optim.grad_accum == 3
    # resumed on 4 ranks with the 12 rows the run recorded: 12 / (2 x 4) is no whole number
    with pytest.raises(ConfigError, match=r"cannot resume on 4 rank\(s\).*global_batch_rows=12"):
        with_global_batch(cfg, 4, 12)
    assert with_global_batch(cfg, 6, 12).optim.grad_accum == 1
    assert with_global_batch(cfg, 1, 12).optim.grad_accum == 6


def test_the_loss_sees_the_micro_batches_of_every_rank(monkeypatch):
    """On R ranks DeepSpeed averages the ranks' gradients, so each micro-batch's loss is weighted by
    the global batch's micro-batches (accumulation x ranks: `Totals.micro_batches`). One process
    playing rank 1 of 2 with 3 micro-batches: the loss must be told 6."""
    from configs.batch import PackedBatch
    from vlm.model.conceptmoe import ConceptMoELM
    from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig
    from vlm.model.training_controls import TrainingControls
    from vlm.train.layout import ParallelLayout
    from vlm.train.losses import Loss
    from vlm.train.step import StepSettings, train_step

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
        encoder_layers=1, concept_layers=1, decoder_layers=1,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16), chunk=ChunkConfig(),
    )  # fmt: skip
    model = ConceptMoELM(cfg).train()
    seen = []

    class Recording(Loss):
        def __call__(self, out, batch, totals=None):
            seen.append(totals.micro_batches)
            return super().__call__(out, batch, totals)

    class Engine:
        module = model

        def __call__(self, batch, context):
            return model(batch, context=context)

        def backward(self, loss):
            loss.backward()

        def gradient_accumulation_steps(self):
            return 3

        def step(self):
            pass

        def was_step_applied(self):
            return True

    window = [PackedBatch.from_documents([[5, 6, 7, 8, 9, 10]]) for _ in range(3)]
    s = StepSettings(
        Recording(cfg), TrainingControls(model), 0, ParallelLayout(2, 1), torch.device("cpu")
    )
    train_step(Engine(), window, 0, s)
    assert seen == [6, 6, 6], (
        f"the loss of each of rank 1's 3 micro-batches was weighted for {seen} micro-batches in "
        "the global batch, not 3 x 2 ranks = 6: the global batch's accumulation counted on one "
        "rank only (vlm/train/step.py train_step)"
    )


# ======================================== the boundary noise: keyed by the global micro-batch
@pytest.mark.parametrize("world, accum", [(1, 4), (2, 2), (4, 1), (2, 3)])
def test_each_micro_batch_draws_the_noise_of_its_place_in_the_global_batch(world, accum):
    """Rank r's k-th micro-batch of a step is the loader's g = r + k x ranks within the step; its
    boundary noise is that g's on any number of ranks, so 1, 2 or 4 ranks draw the same boundaries
    for the same micro-batch."""
    from vlm.model.config import ModelConfig
    from vlm.train.layout import ParallelLayout
    from vlm.train.losses import Loss
    from vlm.train.step import StepSettings, boundary_seed, forward_context

    loss = Loss(ModelConfig())
    for rank in range(world):
        s = StepSettings(loss, None, 5, ParallelLayout(world, rank), torch.device("cpu"))
        for k in range(accum):
            g = rank + k * world
            got = int(forward_context(s, 3, k).noise_seed)
            assert got == boundary_seed(5, 3, g), (
                f"rank {rank} of {world}, micro-batch {k}: boundary seed {got} is not that of "
                f"global micro-batch {g}: the noise is not keyed by the micro-batch's place in "
                "the global batch (vlm/train/step.py forward_context)"
            )


# ======================================== the shared Adam step after a universal load
def test_a_universal_load_gives_each_parameter_its_own_adam_step(tmp_path):
    """DeepSpeed's ZeRO-3 universal loader gives every parameter's state one step-count tensor,
    which AdamW advances once per parameter (its bias correction runs ahead): after the mend each
    state has its own, and one optimizer step advances each by exactly one."""
    from test_guards_round5 import (
        _as_deepspeeds_zero3_loader_leaves_it,
        _groups_and_optimizer,
        _universal_folder,
    )

    from vlm.train.reshard import mend_optimizer

    opt, params = _groups_and_optimizer()
    root = _universal_folder(tmp_path, opt)
    shared = _as_deepspeeds_zero3_loader_leaves_it(opt)
    mend_optimizer(opt, root, "ds")
    steps = [opt.state[p]["step"] for p in params]
    assert all(float(s) == 1.0 for s in steps), [float(s) for s in steps]
    opt.step()
    after = [float(opt.state[p]["step"]) for p in params]
    assert after == [2.0] * len(params), (
        f"after a universal-checkpoint load one optimizer step moved the Adam step counts of "
        f"{len(params)} parameters to {after}, not 2 each: the parameters share one step tensor "
        "(vlm/train/reshard.py mend_optimizer); shared with the loader's: "
        f"{any(s is shared for s in steps)}"
    )


# ======================================== the expert clip counts each shard once
@pytest.mark.parametrize("ranks, replicas", [(2, 2), (4, 2), (4, 4), (2, 1)])
def test_the_expert_clip_divides_the_summed_shards_by_their_replicas(monkeypatch, ranks, replicas):
    """`ranks` ranks, each expert shard on `replicas` of them with the same gradient: the squared
    norm summed over the ranks counts each shard `replicas` times. The sum over ranks is played
    here by the one collective the clip makes (each rank's shard the same: x ranks)."""
    from vlm.train import collectives
    from vlm.train.expert_parallel import ExpertAwareClip

    monkeypatch.setattr(collectives, "expert_gradient_square", lambda local: local * ranks)
    g = torch.Generator().manual_seed(0)
    dense, expert = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))
    expert.allreduce = False  # DeepSpeed's mark of an expert parameter
    dense.grad, expert.grad = torch.randn(4, generator=g), torch.randn(3, generator=g)
    shards = ranks // replicas  # distinct shards, each the same here
    want = float((dense.grad.square().sum() + shards * expert.grad.square().sum()).sqrt())
    norm = float(ExpertAwareClip(1e9, replicas)([dense, expert]))
    assert norm == pytest.approx(want, rel=1e-6), (
        f"ExpertAwareClip on {ranks} ranks, {replicas} replicas per shard: global gradient norm "
        f"{norm:.6f}, not {want:.6f}: the expert clip's replicas (each shard counted "
        f"{replicas} times) (vlm/train/expert_parallel.py)"
    )


# ======================================== an expert-parallel checkpoint's shards
def _moe():
    from vlm.model.config import MoEConfig
    from vlm.model.moe import MoE

    torch.manual_seed(0)
    return torch.nn.ModuleDict(
        {"moe": MoE(MoEConfig(num_experts=4, top_k=2, expert_hidden=8), 16, init_std=0.3)}
    )


def test_expert_shards_are_saved_checked_restored_and_put_back_together(tmp_path):
    """4 ranks at parallel.expert=2 save their shards; under fp16 the checkpoint resumes on 2 x 2
    only (under the other forms it regroups onto any degree: expert_regroup), each rank gets its
    own shard back, and the shards put end to end (checkpoint_tensors: train.init_from and the
    regrouping load) rebuild every expert."""
    from configs.config import ConfigError
    from vlm.model.expert_parallel import LoopbackExchange
    from vlm.train.checkpoint_tensors import CheckpointTensors
    from vlm.train.expert_parallel import (
        SHARD_FILE,
        check_resume,
        restore_shard,
        save_shard,
        written_degree,
    )

    whole = {n: p.detach().clone() for n, p in _moe().named_parameters()}
    for rank in range(4):
        m = _moe()
        m["moe"].shard_experts(LoopbackExchange(2, rank % 2))
        save_shard(m, tmp_path, rank, 4, lambda obj, path: torch.save(obj, path))
    assert written_degree(tmp_path) == (2, 4), (
        f"4 ranks at parallel.expert=2 saved shards that read back as (degree, ranks) = "
        f"{written_degree(tmp_path)}: the ranks that wrote them are not recorded (save_shard)"
    )
    check_resume(tmp_path, 2, 4, "fp16")
    for expert, world in ((2, 2), (1, 4), (4, 4)):
        check_resume(tmp_path, expert, world, "zero0")
        with pytest.raises(ConfigError, match="parallel.expert=2 on 4 ranks"):
            check_resume(tmp_path, expert, world, "fp16")
    experts = ("moe.w_gate_EDF", "moe.w_up_EDF", "moe.w_down_EFD")
    for rank in range(4):
        m = _moe()
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()
        m["moe"].shard_experts(LoopbackExchange(2, rank % 2))
        why = restore_shard(m, tmp_path, rank)
        assert why is None, f"rank {rank} of 4 could not restore its own shard: {why}"
        part = slice(2 * (rank % 2), 2 * (rank % 2) + 2)
        for n, p in m.named_parameters():
            if n in experts:
                assert torch.equal(p, whole[n][part]), (
                    f"rank {rank}'s {n} after restore_shard is not its shard of the saved experts"
                )
    module_file = {n: (t[:2] if n in experts else t) for n, t in whole.items()}  # rank 0's
    shards = {}
    for r in range(4):
        shard = torch.load(tmp_path / SHARD_FILE.format(r), weights_only=True)
        shards.setdefault(shard["expert_rank"], shard["tensors"])
    rebuilt = CheckpointTensors(module_file, str(tmp_path), shards)
    for n, t in whole.items():
        got = rebuilt.rows(n, 0, t.shape[0]) if t.dim() else rebuilt.rows(n, 0, 1)
        assert torch.equal(got, t), f"the shards put end to end: {n} is not the whole layer's"
        assert rebuilt.shapes()[n] == tuple(t.shape), (n, rebuilt.shapes()[n])
    # a shard of the wrong expert rank is refused, naming it
    m = _moe()
    m["moe"].shard_experts(LoopbackExchange(2, 1))
    why = restore_shard(m, tmp_path, 0)
    assert why is not None and "written as expert rank 0 of 2" in why, why
