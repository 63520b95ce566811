"""Expert parallelism, the MoE layer (vlm.model.expert_parallel; training: test_expert_parallel_train.py).

Legend: E experts.

- Two ranks (gloo) holding 2 of 4 experts each compute what one layer holding all 4 computes on
  each rank's own tokens, with the variable exchange and with the static one: outputs, statistics
  (loads, balance and z losses), the gradients of the tokens, the router and the Grove adjugates,
  and each expert's gradient summed over the ranks; the ranks may have different numbers of tokens
  and padding rows.
- A capacity below the worst case computes fewer slots and counts every one it leaves out; the
  variable exchange drops the same slots as the static one and computes the same.
- The variable exchange sends what was routed and nothing more: on 2 and 4 ranks with the same
  tokens per rank, each rank's bytes through the exchange are its counts, its routed rows and the
  results of the rows routed to it, the same at 4 ranks as at 2; the static exchange's grow with P.
- The static exchanged forward has static shapes: it compiles with fullgraph=True (one process, a
  loopback exchange), and with one rank it is the layer itself; the variable one breaks a compiled
  graph around the exchange and computes the same.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from rank_processes import free_port

from vlm.model.config import MoEConfig
from vlm.model.expert_parallel import LoopbackExchange, capacity
from vlm.model.moe import MoE

DIM = 16


def make_moe(**kw) -> MoE:
    base = dict(
        num_experts=4,
        top_k=2,
        expert_hidden=8,
        shared_hidden=8,
        grove_groups=2,
        grove_hidden=8,
        grove_lambda=0.25,
        loss_free_balancing=True,
    )
    base.update(kw)
    torch.manual_seed(0)
    m = MoE(MoEConfig(**base), DIM, init_std=0.3)
    with torch.no_grad():  # a bias that changes the selection, as after some balancing steps
        m.expert_bias.copy_(torch.tensor([0.05, -0.02, 0.0, 0.03]).repeat(m.num_experts // 4))
    return m


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-dependent tokens: rank r has 9 + 4r rows, its last two padding."""
    g = torch.Generator().manual_seed(100 + rank)
    n = 9 + 4 * rank
    valid = torch.ones(n, dtype=torch.bool)
    valid[-2:] = False
    return torch.randn(n, DIM, generator=g), valid


def _run(m: MoE, x: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_()
    out, st = m(x, valid)
    g = torch.Generator().manual_seed(7)
    loss = (out * torch.randn(out.shape, generator=g)).sum() + st.balance + st.z
    loss.backward()
    res = {
        "out": out.detach(),
        "load": st.load_E,
        "balance": st.balance.detach(),
        "z": st.z.detach(),
        "dx": x.grad,
        "overflow": torch.zeros((), dtype=torch.long) if st.overflow is None else st.overflow,
    }
    res.update({f"d.{n}": p.grad.clone() for n, p in m.named_parameters()})
    return res


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _split(factor, variable: bool, **kw) -> MoE:
    """The layer of `make_moe(**kw)` with its experts split over the world."""
    import torch.distributed as dist

    from vlm.train.collectives import GroupExchange

    m = make_moe(**kw)
    world, rank = dist.get_world_size(), dist.get_rank()
    m.shard_experts(GroupExchange(dist.group.WORLD, world, rank, factor, variable))
    return m


def _worker(rank: int, world: int, port: int, factor, result: str) -> None:
    import torch.distributed as dist

    from vlm.train.expert_parallel import even_eval_batches

    _init(rank, world, port)
    try:
        x, valid = _tokens(rank)
        whole = _run(make_moe(), x, valid)
        variable, static = _split(factor, True), _split(factor, False)
        held = variable.local_experts
        split = {"variable": _run(variable, x, valid), "static": _run(static, x, valid)}
        traffic = {"variable": variable.exchange.traffic.forward}
        # the whole layer's expert gradients, summed over the ranks (what a shard's gradient is)
        for n in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"):
            dist.all_reduce(whole[f"d.{n}"])
        # every rank's routed slots per expert, for the expected overflow
        loads = [torch.zeros(4) for _ in range(world)]
        dist.all_gather(loads, whole["load"])
        # held-out batches: every rank runs as many exchanged forwards (rank r has 3 + r)
        evals = len(
            even_eval_batches(list(range(3 + rank)), variable.exchange, torch.device("cpu"))
        )
        torch.save(
            {
                "whole": whole,
                "split": split,
                "held": held,
                "loads": loads,
                "evals": evals,
                "traffic": traffic,
            },
            f"{result}.{rank}",
        )
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path, worker, world: int, *args) -> list[dict]:
    result = str(tmp_path / f"r{world}")
    mp.spawn(worker, args=(world, free_port(), *args, result), nprocs=world, join=True)
    return [torch.load(f"{result}.{r}", weights_only=True) for r in range(world)]


def _two_ranks(tmp_path, factor=None) -> list[dict]:
    return _spawn(tmp_path, _worker, 2, factor)


def _same(got: dict, want: dict, keys, what: str) -> None:
    for k in keys:
        torch.testing.assert_close(got[k], want[k], msg=lambda m, k=k: f"{what}, {k}: {m}")


def test_two_expert_ranks_compute_what_one_layer_does(tmp_path):
    results = _two_ranks(tmp_path)
    loads = torch.stack(results[0]["loads"])  # [rank, expert]: slots routed
    for rank, r in enumerate(results):
        whole = r["whole"]
        assert r["held"] == 2, f"rank {rank} holds {r['held']} of the 4 experts, not 2"
        assert r["evals"] == 3, (
            f"rank {rank} kept {r['evals']} held-out batches, not the fewest any rank has (3): "
            "the ranks would run different numbers of exchanged forwards "
            "(vlm/train/expert_parallel.py even_eval_batches)"
        )
        # the variable exchange's forward sent the [2, 2] counts, the rank's routed rows out and
        # the rows routed to its experts back: no padding (the static one sends 2 x 13 x 2 rows)
        rows = int(loads[rank].sum() + loads[:, 2 * rank : 2 * rank + 2].sum())
        assert r["traffic"]["variable"] == 4 * 8 + rows * DIM * 4, "the variable exchange pads"
        for how, split in r["split"].items():
            assert float(split["overflow"]) == 0, (
                f"rank {rank}, {how}: {float(split['overflow'])} slots over the capacity, "
                "dropless by default"
            )
            _same(split, whole, ("out", "load", "balance", "z", "dx"), how)
            for k, g in split.items():
                if not k.startswith("d."):
                    continue
                want = whole[k]
                if k in ("d.w_gate_EDF", "d.w_up_EDF", "d.w_down_EFD"):  # this rank's 2 experts
                    want = want[2 * rank : 2 * rank + 2]
                torch.testing.assert_close(g, want, msg=lambda m, k=k: f"{how}, {k}: {m}")


def test_a_small_capacity_counts_the_slots_it_leaves_out(tmp_path):
    factor = 0.5
    results = _two_ranks(tmp_path, factor)
    # the capacity is computed from the largest rank's slots (13 tokens x 2 choices)
    C = capacity(13 * 2, 2, factor)
    assert C == 7
    for rank, r in enumerate(results):
        # rank s sends loads[s][2j : 2j + 2] to expert rank j: what exceeds C stays home
        sent = r["loads"][rank].view(2, 2).sum(1)
        want = float((sent - C).clamp_min(0).sum())
        assert want > 0  # the setting does overflow
        static, variable = r["split"]["static"], r["split"]["variable"]
        assert float(static["overflow"]) == want, (
            f"rank {rank}: {float(static['overflow'])} slots counted over the capacity {C}, "
            f"the slots it left out are {want}"
        )
        # the statistics are the router's: the same whether or not a slot was computed
        torch.testing.assert_close(static["load"], r["whole"]["load"])
        assert not torch.allclose(static["out"], r["whole"]["out"])
        # the variable exchange sends the same slots' rows (fewer bytes), drops the same ones
        _same(variable, static, list(static), "variable against static at capacity 0.5")


TRAFFIC_TOKENS = 12  # per rank, the same on every rank: 10 tokens and 2 padding rows
TRAFFIC_EXPERTS = 8


def _traffic_worker(rank: int, world: int, port: int, result: str) -> None:
    """Four ranks, as two expert groups of 2 (ranks 0-1, 2-3) and as one of 4: each rank runs one
    forward + backward of a layer whose 8 experts are split over its group, with the variable and
    the static exchange, dropless, on the same tokens; the bytes its exchange sent, and every
    rank's routed slots per expert."""
    import torch.distributed as dist

    from vlm.train.collectives import GroupExchange

    _init(rank, world, port)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        g = torch.Generator().manual_seed(300 + rank)
        x = torch.randn(TRAFFIC_TOKENS, DIM, generator=g)
        valid = torch.ones(TRAFFIC_TOKENS, dtype=torch.bool)
        valid[-2:] = False
        out = {}
        for P, group in ((2, pairs[rank // 2]), (4, dist.group.WORLD)):
            for how in ("variable", "static"):
                m = make_moe(num_experts=TRAFFIC_EXPERTS)
                m.shard_experts(GroupExchange(group, P, rank % P, None, how == "variable"))
                res = _run(m, x, valid)
                out[f"{how} {P}"] = m.exchange.traffic.forward
                out[f"overflow {how} {P}"] = float(res["overflow"])
        loads = [torch.zeros(TRAFFIC_EXPERTS) for _ in range(world)]
        dist.all_gather(loads, res["load"])  # the router's, the same with any exchange
        out["loads"] = torch.stack(loads)
        torch.save(out, f"{result}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_variable_exchange_sends_what_was_routed_and_no_padding(tmp_path):
    K, row = 2, DIM * 4  # top-2; fp32 rows of DIM values
    results = _spawn(tmp_path, _traffic_worker, 4)
    loads = results[0]["loads"]  # [rank, expert]: the slots each rank routed to each expert
    per_rank = {}
    for P in (2, 4):
        L = TRAFFIC_EXPERTS // P
        for rank, r in enumerate(results):
            group = range(rank // P * P, rank // P * P + P)
            j = rank % P  # its place in its group: it holds experts j*L ... (j+1)*L - 1
            routed = int(loads[rank].sum())
            assert routed == 10 * K  # the padding rows route nowhere
            got = int(sum(loads[s, j * L : (j + 1) * L].sum() for s in group))
            counts = P * L * 8  # the [P, L] int64 counts
            for how in ("variable", "static"):  # dropless: no choice dropped
                assert r[f"overflow {how} {P}"] == 0, (P, how)
            # forward: the counts, the rank's routed rows out, the rows routed to it back home
            want = counts + (routed + got) * row
            assert r[f"variable {P}"] == want, (
                f"P={P} rank {rank}: the variable exchange sent {r[f'variable {P}']} bytes, "
                f"not the counts and the routed rows ({want}): it pads"
            )
            # the static one: two [P, C] buffers, C = every slot of the rank, padding included
            assert r[f"static {P}"] == counts + 2 * P * TRAFFIC_TOKENS * K * row
        per_rank[P] = {h: sum(r[f"{h} {P}"] for r in results) / 4 for h in ("variable", "static")}
    # the same rows per rank: what a rank sends does not grow with the ranks
    assert per_rank[4]["variable"] <= 1.25 * per_rank[2]["variable"], per_rank
    assert per_rank[4]["static"] > 1.9 * per_rank[2]["static"], per_rank


def test_one_rank_exchange_is_the_layer_itself():
    x, valid = _tokens(1)
    whole = _run(make_moe(), x, valid)
    m = make_moe()
    m.shard_experts(LoopbackExchange(1, 0))
    split = _run(m, x, valid)
    for k, v in whole.items():
        torch.testing.assert_close(split[k], v, msg=lambda m, k=k: f"{k}: {m}")


def _static_shapes_backend(found: list):
    """A torch.compile backend that lists every value of the captured graph whose shape is not a
    constant (a data-dependent size: a host read in disguise), then runs it with aot_eager."""

    def backend(gm, inputs):
        for n in gm.graph.nodes:
            v = n.meta.get("example_value", n.meta.get("val"))
            for t in v if isinstance(v, (tuple, list)) else [v]:
                if isinstance(t, torch.SymInt) or (
                    isinstance(t, torch.Tensor) and not all(isinstance(d, int) for d in t.shape)
                ):
                    found.append(n.name)
        return torch._dynamo.lookup_backend("aot_eager")(gm, inputs)

    return backend


def test_exchanged_forward_compiles_with_fullgraph_and_static_shapes():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is missing: the loop dispatch reads counts on the host")
    m = make_moe(dispatch="grouped_mm")
    # two expert ranks' shapes, without another process
    m.shard_experts(LoopbackExchange(2, 0, variable=False))
    torch._dynamo.reset()
    dynamic: list[str] = []
    compiled = torch.compile(
        m, fullgraph=True, backend=_static_shapes_backend(dynamic), dynamic=False
    )
    x, valid = _tokens(0)
    x = x.requires_grad_()
    out, st = compiled(x, valid)
    (out.sum() + st.balance + st.z).backward()
    assert dynamic == []  # every size is a shape: nothing read back from the data
    ref, _ = m(x, valid)
    torch.testing.assert_close(out, ref)
    assert x.grad is not None and st.overflow is not None


def test_the_variable_exchange_breaks_a_compiled_graph_and_computes_the_same():
    # its sizes are read on the host: fullgraph refuses it, a graph in pieces runs it eagerly
    m = make_moe()
    m.shard_experts(LoopbackExchange(2, 0, variable=True))
    x, valid = _tokens(0)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="disable"):
        torch.compile(m, fullgraph=True, backend="eager")(x, valid)
    torch._dynamo.reset()
    xc = x.clone().requires_grad_()
    out, st = torch.compile(m, backend="aot_eager")(xc, valid)
    (out.sum() + st.balance).backward()
    ref, ref_st = m(x, valid)
    torch.testing.assert_close(out, ref)
    assert xc.grad is not None and float(st.overflow) == float(ref_st.overflow) == 0


def test_bench_alltoall_states_the_bytes_and_times_the_exchange():
    from eval.bench import alltoall

    res = alltoall.run(alltoall.SETTINGS["smoke"], log=lambda _: None)
    assert res["notes"] == [alltoall.LOOPBACK_NOTE, alltoall.ROUTING_NOTE]  # one process here
    by = {}
    for r in res["rows"]:
        by[r["setting"]["what"], r["setting"]["expert_ranks"], r["candidate"]] = r
    assert all(r["median"] > 0 for r in res["rows"])
    # 64 tokens x top-2 of 64 fp32 values; per forward the rows go out and come home
    routed = 2 * 64 * 2 * 64 * 4
    for P in (2, 4):
        static = by["exchange", P, "static exchange (dropless)"]
        variable = by["exchange", P, "variable exchange (dropless)"]
        # the static buffers hold P x every slot; the variable exchange what was routed
        assert static["x_routed"] == pytest.approx(P, rel=0.01)
        assert variable["x_routed"] == pytest.approx(1, rel=0.01)
        assert variable["MB_fwd"] == pytest.approx(routed / 1e6, rel=0.01)
        # the backward sends the rows again
        assert variable["MB_sent_per_rank_fwd_bwd"] == pytest.approx(2 * routed / 1e6, rel=0.01)
        assert variable["overflow_slots"] == static["overflow_slots"] == 0
        assert by["exchange", P, "static exchange (capacity 1.25)"]["x_routed"] < P
        assert by["layer", P, alltoall.BASELINE]["ratio_vs_baseline"] == 1
        assert by["layer", P, "variable exchanged layer (dropless)"]["overflow_slots"] == 0


@pytest.mark.parametrize(
    "sections, says",
    [
        ({"parallel": {"expert": 3}}, "parallel.expert=3 does not divide model.moe.num_experts=8"),
        ({"parallel": {"exchange": "padded"}}, "parallel.exchange must be one of variable, static"),
        ({"parallel": {"capacity_factor": 0}}, "parallel.capacity_factor must be > 0 or null"),
    ],
)
def test_a_config_expert_parallelism_cannot_run_is_one_line(sections, says):
    from configs.config import ConfigError
    from vlm.train.config import TrainConfig

    with pytest.raises(ConfigError, match=says) as e:
        TrainConfig(**sections)
    assert "\n" not in str(e.value)


def test_the_ranks_must_split_into_expert_groups():
    from configs.config import ConfigError
    from vlm.train.config import ParallelConfig
    from vlm.train.distributed import ProcessGroups
    from vlm.train.expert_parallel import set_up
    from vlm.train.layout import ParallelLayout

    with pytest.raises(ConfigError, match=r"parallel.expert=2 does not divide the 3 rank\(s\)"):
        ParallelLayout.of(ParallelConfig(expert=2), 3)
    layout = ParallelLayout.of(ParallelConfig(expert=8), 8)
    with pytest.raises(ConfigError, match="does not divide a MoE layer's 4 experts"):
        set_up(torch.nn.Sequential(make_moe()), ParallelConfig(expert=8), layout, ProcessGroups())
