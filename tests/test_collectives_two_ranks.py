"""Every named collective on two real ranks (gloo, a FileStore, no DeepSpeed engine), in seconds:
what only the slow multi-rank training tests caught before (issue 52). One start of the two ranks
runs every part; each test reads its part and names the collective that broke.

Legend: B rows, T tokens.

- the primitives and each named collective of vlm/train/collectives.py sum (or take the minimum,
  the maximum, rank 0's value, every rank's value in rank order) over the ranks;
- the expert collectives: the squared gradient norm over ranks, the group's maximum, the gathered
  shards (an export), the all-to-all, the held-out batches cut to the fewest;
- the expert clip (`ExpertAwareClip`) counts each expert shard once: its replicas hold the same
  gradient (2 ranks holding one shard), and the shards of an expert-parallel group are summed;
- a training step on two ranks of two micro-batches each (`vlm.train.step.train_step` with a
  stand-in engine that averages the gradients over the ranks, as DeepSpeed's does) equals one rank
  taking the four micro-batches: its loss terms over the global batch (the ratio loss with the
  global parser), the boundaries each micro-batch draws, the gradient, the balancing bias.
"""

from __future__ import annotations

import os
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

WORLD = 2


# ---------------------------------------------------------------- the step's model and data
def _tiny_lm():
    from vlm.model.conceptmoe import ConceptMoELM
    from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        encoder_layers=1,
        concept_layers=1,
        decoder_layers=1,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16, loss_free_balancing=True),
        # R = 4 while F starts near 1/2: the ratio loss's gradient is far from 0
        chunk=ChunkConfig(target_ratio=4.0),  # with loss.ratio 0.5 (_step)
    )
    return ConceptMoELM(cfg).train()


def _global_batch(n: int = 4):
    """Micro-batches g = 0..n-1 of one global batch, of different lengths and documents."""
    from configs.batch import PackedBatch

    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(n):
        lengths = [17 + 3 * k, 11, 48 - 30 - 3 * k]
        docs = [torch.randint(3, 64, (m,), generator=g).tolist() for m in lengths]
        out.append(PackedBatch.from_documents(docs, row_len=48))
    return out


class _AveragingEngine:
    """What train_step needs of DeepSpeed's engine, done as DeepSpeed does it: each micro-batch's loss
    divided by the accumulation steps, and at the accumulation boundary every gradient averaged
    over the ranks (an all-reduce, then / ranks) before the (here: no) update."""

    def __init__(self, module, accum: int, world: int):
        self.module, self.accum, self.world, self.calls, self.grads = module, accum, world, 0, {}

    def __call__(self, batch, context):
        return self.module(batch, context=context)

    def backward(self, loss):
        (loss / self.accum).backward()

    def gradient_accumulation_steps(self) -> int:
        return self.accum

    def step(self) -> None:
        import torch.distributed as dist

        self.calls += 1
        if self.calls % self.accum:
            return
        for n, p in self.module.named_parameters():
            g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
            if self.world > 1:
                dist.all_reduce(g)
                g /= self.world
            self.grads[n] = g
            p.grad = None

    def was_step_applied(self) -> bool:
        return True


def _step(rank: int, world: int, window) -> dict:
    """train_step over `window` (this rank's micro-batches) on `world` ranks: the step's logged
    scalars, the boundaries of each global micro-batch, the averaged gradient and the balancing
    biases after the step."""
    from vlm.model.training_controls import TrainingControls
    from vlm.train.layout import ParallelLayout
    from vlm.train.loss_config import LossConfig
    from vlm.train.losses import Loss
    from vlm.train.step import StepSettings, train_step

    model = _tiny_lm()
    settings = StepSettings(
        Loss(model.cfg, LossConfig(ratio=0.5), global_parser=True), TrainingControls(model), 7,
        ParallelLayout(world, rank),
        torch.device("cpu"),
    )  # fmt: skip
    engine = _AveragingEngine(model, len(window), world)
    drawn = {}

    def keep_boundaries(out, k):
        drawn[k * world + rank] = out.chunks.b_BT.clone()  # the loader's g of rank r's k-th
        return out

    res = train_step(engine, window, 0, settings, loss_hook=keep_boundaries)
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    return {"scalars": res.scalars, "drawn": drawn, "grads": engine.grads, "biases": biases}


# ---------------------------------------------------------------- the parts each rank runs
def _primitives(rank: int) -> dict:
    from vlm.train import collectives as c

    x = torch.tensor([1.0 + rank, -3.0 * rank, 10.0**rank])
    before = x.clone()
    module = torch.nn.Linear(2, 2)
    with torch.no_grad():
        module.weight.fill_(float(rank + 1))
    c.weights_of_rank0(module)
    c.barrier()
    return {
        "sum": c.all_reduce_sum(x),
        "min": c.all_reduce_min(x),
        "max": c.all_reduce_max(x),
        "input_kept": bool(torch.equal(x, before)),
        "broadcast": c.broadcast_object({"from": rank}),
        "decision": c.decision_of_rank0(f"rank {rank}"),
        "gather": c.gather_object(("r", rank)),
        "every_rank": c.every_rank(None if rank == 0 else f"refused on {rank}"),
        "weights_of_rank0": module.weight.detach().clone(),
    }


def _step_collectives(rank: int) -> dict:
    from vlm.train import collectives as c

    cpu = torch.device("cpu")
    sums = {
        "ratio": torch.arange(6, dtype=torch.float32).view(2, 3) * (rank + 1),
        "count": torch.tensor([3 + rank], dtype=torch.int64),
    }
    reduced, labelled = c.loss_statistics(sums, 100.0 + rank, cpu)
    return {
        "loss_statistics": reduced,
        "labelled": labelled,
        "finite_one_bad": c.all_finite(torch.tensor(rank == 0), cpu),
        "finite_all": c.all_finite(torch.tensor(True), cpu),
        "step_metrics": c.step_metrics(torch.tensor([1.0, 2.0 * rank])),
        "model_statistics": c.model_statistics(torch.tensor([0.5 + rank])),
        "data_counters": c.data_counters(torch.tensor([5.0, rank * 7.0])),
        "stop_one": c.stop_requested(rank == 1, cpu, WORLD),
        "stop_none": c.stop_requested(False, cpu, WORLD),
    }


def _expert_collectives(rank: int) -> dict:
    import torch.distributed as dist

    from vlm.train import collectives as c
    from vlm.train.expert_parallel import even_eval_batches

    ex = c.GroupExchange(dist.group.WORLD, WORLD, rank, None)
    # rank r sends block j (rows 2j, 2j+1) to rank j
    sent = torch.arange(4.0).view(4, 1) + 10 * rank
    return {
        "gradient_square": c.expert_gradient_square(torch.tensor([4.0 * (rank + 1)])),
        "group_max": c.expert_group_max(torch.tensor([3 - rank, rank]), ex.group),
        "gathered": c.all_gather_experts(torch.full((2, 3), float(rank)), ex),
        "all_to_all": ex.all_to_all(sent),
        "common_slots": ex.common_slots(5 + 4 * rank, torch.device("cpu")),
        "eval_batches": len(even_eval_batches(list(range(3 + rank)), ex, torch.device("cpu"))),
    }


def _clip_params(rank: int, shared_shard: bool) -> list[torch.nn.Parameter]:
    """A replicated parameter (the same gradient on every rank, as after DeepSpeed's reduction) and
    an expert shard: the same on both ranks (2 replicas of one shard) or each rank's own (2 expert
    ranks, one replica each)."""
    g = torch.Generator().manual_seed(3)
    dense = torch.nn.Parameter(torch.zeros(3, 4))
    dense.grad = torch.randn(3, 4, generator=g)
    expert = torch.nn.Parameter(torch.zeros(2, 5))
    expert.allreduce = False  # DeepSpeed's mark of an expert parameter
    shards = [torch.randn(2, 5, generator=g) for _ in range(WORLD)]
    expert.grad = shards[0 if shared_shard else rank].clone()
    return [dense, expert]


def _expert_clip(rank: int) -> dict:
    from vlm.train.expert_parallel import ExpertAwareClip

    out = {}
    for name, shared, replicas in (("replicas", True, 2), ("shards", False, 1)):
        params = _clip_params(rank, shared)
        norm = ExpertAwareClip(0.5, replicas)(params)
        out[name] = {"norm": float(norm), "grads": [p.grad.clone() for p in params]}
    return out


def _gathered_experts(rank: int) -> dict:
    """A MoE layer's experts split over the two ranks, gathered for an export and split again."""
    import torch.distributed as dist

    from vlm.model.config import MoEConfig
    from vlm.model.moe import MoE
    from vlm.train import collectives as c
    from vlm.train.expert_parallel import gathered_experts

    torch.manual_seed(0)
    m = MoE(MoEConfig(num_experts=4, top_k=2, expert_hidden=8), 16, init_std=0.3)
    whole = {n: p.detach().clone() for n, p in m.named_parameters()}
    m.shard_experts(c.GroupExchange(dist.group.WORLD, WORLD, rank, None))
    with gathered_experts(m):
        inside = {n: p.detach().clone() for n, p in m.named_parameters()}
    after = m.local_experts
    return {"whole": whole, "inside": inside, "after": after}


PARTS = {
    "primitives": _primitives,
    "step_collectives": _step_collectives,
    "expert_collectives": _expert_collectives,
    "expert_clip": _expert_clip,
    "gathered_experts": _gathered_experts,
    "step": lambda rank: _step(rank, WORLD, _global_batch()[rank::WORLD]),
}


def _worker(rank: int, store_path: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    results = {}
    try:
        for name, part in PARTS.items():
            try:
                results[name] = part(rank)
            except Exception:  # noqa: BLE001 - reported by the test of that part
                results[name] = {"error": traceback.format_exc(limit=4)}
    finally:
        torch.save(results, f"{out}.{rank}")
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Every part's results on each of the two ranks. Started from a fork server that imported the
    model once: two spawned ranks each import it (~5 s each, twice that on a busy 2-core machine),
    and a fork of this process would inherit whatever process group an earlier test made."""
    mp.set_forkserver_preload(["torch", "vlm.model.conceptmoe", "vlm.train.step", __name__])
    d = tmp_path_factory.mktemp("two_ranks")
    out = str(d / "result")
    ctx = mp.start_processes(
        _worker,
        args=(str(d / "store"), out),
        nprocs=WORLD,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    os.kill(p.pid, 9)
            pytest.fail("two gloo ranks did not finish their collectives in 120 s: a rank waits")
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(WORLD)]


def _part(ranks, name: str) -> list[dict]:
    got = [r[name] for r in ranks]
    for rank, g in enumerate(got):
        assert "error" not in g, f"{name} on rank {rank} raised (a collective broke):\n{g['error']}"
    return got


# ---------------------------------------------------------------- the tests
def test_the_primitives_sum_reduce_and_broadcast_over_the_ranks(ranks):
    x = [torch.tensor([1.0 + r, -3.0 * r, 10.0**r]) for r in range(WORLD)]
    want = {
        "sum": x[0] + x[1],
        "min": torch.minimum(x[0], x[1]),
        "max": torch.maximum(x[0], x[1]),
    }
    for rank, got in enumerate(_part(ranks, "primitives")):
        for op, w in want.items():
            assert torch.equal(got[op], w), (
                f"collectives.all_reduce_{op} on rank {rank} gave {got[op].tolist()}, not "
                f"{w.tolist()} (the {op} over both ranks' {[t.tolist() for t in x]})"
            )
        assert got["input_kept"], "a collective changed its input in place (it returns a copy)"
        assert got["broadcast"] == {"from": 0} and got["decision"] == "rank 0", (
            f"broadcast_object / decision_of_rank0 on rank {rank}: {got['broadcast']}, "
            f"{got['decision']!r}, not rank 0's"
        )
        assert got["gather"] == [("r", 0), ("r", 1)], (
            f"gather_object on rank {rank}: {got['gather']}, not every rank's in rank order"
        )
        assert got["every_rank"] == [None, "refused on 1"], got["every_rank"]
        assert torch.equal(got["weights_of_rank0"], torch.ones(2, 2)), (
            f"weights_of_rank0 on rank {rank}: the module's weights are not rank 0's"
        )


def test_the_steps_collectives_sum_over_the_ranks(ranks):
    ratio = [torch.arange(6, dtype=torch.float32).view(2, 3) * (r + 1) for r in range(WORLD)]
    for rank, got in enumerate(_part(ranks, "step_collectives")):
        stats = got["loss_statistics"]
        assert stats["ratio"].dtype == torch.float32 and stats["count"].dtype == torch.int64, (
            "loss_statistics changed a statistic's dtype"
        )
        assert torch.equal(stats["ratio"], ratio[0] + ratio[1]), (
            f"loss_statistics on rank {rank}: the ratio statistics {stats['ratio'].tolist()} are "
            f"not the sum over the ranks {(ratio[0] + ratio[1]).tolist()}"
        )
        assert stats["count"].tolist() == [3 + 4], (
            f"loss_statistics on rank {rank}: count {stats['count'].tolist()}, not [7]"
        )
        assert got["labelled"] == 201.0, (
            f"loss_statistics on rank {rank}: {got['labelled']} labelled tokens, not the global "
            "batch's 201 (100 + 101)"
        )
        assert got["finite_one_bad"] is False and got["finite_all"] is True, (
            f"all_finite on rank {rank}: a loss non-finite on one rank must stop every rank"
        )
        for name, want in (
            ("step_metrics", [2.0, 2.0]),
            ("model_statistics", [2.0]),
            ("data_counters", [10.0, 7.0]),
        ):
            assert got[name].tolist() == want, (
                f"collectives.{name} on rank {rank}: {got[name].tolist()}, not the sum over the "
                f"ranks {want}"
            )
        assert got["stop_one"] is True and got["stop_none"] is False, (
            f"stop_requested on rank {rank}: a stop seen on one rank must stop both"
        )


def test_the_expert_collectives_cover_both_ranks(ranks):
    for rank, got in enumerate(_part(ranks, "expert_collectives")):
        assert got["gradient_square"].tolist() == [12.0], (
            f"expert_gradient_square on rank {rank}: {got['gradient_square'].tolist()}, not the "
            "sum of both ranks' [4] + [8]"
        )
        assert got["group_max"].tolist() == [3, 1], got["group_max"]
        want = torch.cat([torch.zeros(2, 3), torch.ones(2, 3)])
        assert torch.equal(got["gathered"], want), (
            f"all_gather_experts on rank {rank}: not every rank's shard in rank order"
        )
        # rank r receives block r of every rank: rows 2r, 2r+1 of rank 0's, then of rank 1's
        rows = [2 * rank, 2 * rank + 1]
        expect = torch.tensor([[float(i + 10 * s)] for s in range(WORLD) for i in rows])
        assert torch.equal(got["all_to_all"], expect), (
            f"GroupExchange.all_to_all on rank {rank}: {got['all_to_all'].flatten().tolist()}, "
            f"not {expect.flatten().tolist()}"
        )
        assert got["common_slots"] == 9, f"common_slots on rank {rank}: not the group's largest"
        assert got["eval_batches"] == 3, (
            f"even_eval_batches on rank {rank}: {got['eval_batches']} held-out batches, not the "
            "fewest any rank has (3): the ranks would run different numbers of exchanged forwards"
        )


def _clip_expected(shared: bool) -> tuple[float, list[list[torch.Tensor]]]:
    """The global gradient norm, each expert shard counted once, and each rank's clipped grads."""
    grads = [[p.grad for p in _clip_params(r, shared)] for r in range(WORLD)]
    dense = grads[0][0].square().sum()
    experts = [g[1].square().sum() for g in grads]
    sq = dense + (experts[0] if shared else sum(experts))
    norm = float(sq.sqrt())
    coef = min(1.0, 0.5 / (norm + 1e-6))
    return norm, [[g * coef for g in gs] for gs in grads]


@pytest.mark.parametrize(
    "case, shared",
    [("replicas", True), ("shards", False)],
    ids=["one-shard-two-replicas", "two-shards-one-replica"],
)
def test_the_expert_clip_counts_each_shard_once(ranks, case, shared):
    norm, clipped = _clip_expected(shared)
    what = (
        "two replicas of one expert shard (the same gradient on both ranks)"
        if shared
        else "two expert ranks, each with its own shard"
    )
    for rank, got in enumerate(_part(ranks, "expert_clip")):
        assert got[case]["norm"] == pytest.approx(norm, rel=1e-6), (
            f"ExpertAwareClip with {what}: global gradient norm {got[case]['norm']:.6f} on rank "
            f"{rank}, not {norm:.6f}: the expert shards' squares not divided by their replicas "
            "(or not summed over the ranks) (vlm/train/expert_parallel.py)"
        )
        for g, w in zip(got[case]["grads"], clipped[rank]):
            torch.testing.assert_close(g, w, msg=lambda m: f"ExpertAwareClip's clipped grad: {m}")


def test_an_export_gathers_every_expert_from_the_shards(ranks):
    for rank, got in enumerate(_part(ranks, "gathered_experts")):
        for n, w in got["whole"].items():
            assert torch.equal(got["inside"][n], w), (
                f"gathered_experts on rank {rank}: {n} is not the whole layer's (shards out of "
                "order or missing)"
            )
        assert got["after"] == 2, "after the export each rank holds its shard again"


def test_two_ranks_take_the_step_one_rank_takes_over_the_same_global_batch(ranks):
    """The global batch's four micro-batches on one rank, and two on each of two ranks (rank r the
    loader's g = r, r + 2): the same loss terms, boundaries, averaged gradient and balancing bias.
    Breaks when a step's collective does not sum, when the micro-batches of the global batch are
    counted per rank (the loss's accumulation over micro-batches x ranks), or when a micro-batch's
    boundary noise is keyed by anything but its place in the global batch."""
    one = _step(0, 1, _global_batch())
    parts = _part(ranks, "step")
    drawn = {g: b for got in parts for g, b in got["drawn"].items()}
    assert sorted(drawn) == sorted(one["drawn"]) == [0, 1, 2, 3]
    for g, b in one["drawn"].items():
        assert torch.equal(drawn[g], b), (
            f"global micro-batch {g} drew other boundaries on 2 ranks than on 1: its boundary "
            "noise is not keyed by its place in the global batch (vlm/train/step.py "
            "forward_context)"
        )
    causes = (
        "a step's statistics not summed over the ranks, or the global batch's micro-batches "
        "counted on one rank only (Totals.micro_batches: micro-batches x ranks)"
    )
    for rank, got in enumerate(parts):
        for key in ("loss", "loss/lm", "loss/ratio", "tokens", "compression/ratio"):
            assert got["scalars"][key] == pytest.approx(one["scalars"][key], rel=1e-5), (
                f"{key} on rank {rank} of 2: {got['scalars'][key]}, one rank over the same "
                f"global batch: {one['scalars'][key]} ({causes})"
            )
        for n, g in one["grads"].items():
            torch.testing.assert_close(
                got["grads"][n],
                g,
                rtol=1e-4,
                atol=1e-7,
                msg=lambda m, n=n: (
                    f"rank {rank}'s gradient of {n} after averaging over 2 ranks is not one "
                    f"rank's over the same global batch ({causes}): {m}"
                ),
            )
        for n, b in one["biases"].items():
            torch.testing.assert_close(
                got["biases"][n],
                b,
                msg=lambda m, n=n: f"{n}: the balancing step did not see both ranks' loads: {m}",
            )
