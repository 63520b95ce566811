"""Expert parallelism, the MoE layer (vlm.model.expert_parallel; training: test_expert_parallel_train.py).

Legend: E experts.

- Two ranks (gloo) holding 2 of 4 experts each compute what one layer holding all 4 computes on
  each rank's own tokens: outputs, statistics (loads, balance and z losses), the gradients of the
  tokens, the router and the Grove adjugates, and each expert's gradient summed over the ranks;
  the ranks may have different numbers of tokens and padding rows.
- A capacity below the worst case computes fewer slots and counts every one it leaves out.
- The exchanged forward has static shapes: it compiles with fullgraph=True (one process, a loopback
  exchange), and with one rank it is the layer itself.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
from rank_processes import spawn

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
        balance_loss_weight=0.01,
        z_loss_weight=1e-3,
        grove_groups=2,
        grove_hidden=8,
        grove_lambda=0.25,
        loss_free_balancing=True,
    )
    base.update(kw)
    torch.manual_seed(0)
    m = MoE(MoEConfig(**base), DIM, init_std=0.3)
    with torch.no_grad():  # a bias that changes the selection, as after some balancing steps
        m.expert_bias.copy_(torch.tensor([0.05, -0.02, 0.0, 0.03]))
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, factor, result: str) -> None:
    import torch.distributed as dist

    from vlm.train.collectives import GroupExchange
    from vlm.train.expert_parallel import even_eval_batches

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x, valid = _tokens(rank)
        whole = _run(make_moe(), x, valid)
        m = make_moe()
        m.shard_experts(GroupExchange(dist.group.WORLD, world, rank, factor))
        held = m.local_experts
        # the all-to-all's sizes are shapes: ranks that disagree on the capacity make gloo abort
        # the process ("op.preamble.length <= op.nbytes") without naming what differs
        own = len(x) * m.cfg.top_k
        agreed = [None] * world
        dist.all_gather_object(agreed, m.exchange.common_slots(own, torch.device("cpu")))
        if len(set(agreed)) > 1:
            why = (
                f"the ranks' exchange capacities differ: common_slots gave {agreed} for slot "
                "counts of their own; each must take the group's largest "
                "(collectives.GroupExchange.common_slots), else the all-to-all sizes disagree"
            )
            torch.save({"error": why}, f"{result}.{rank}")
            return
        split = _run(m, x, valid)
        # the whole layer's expert gradients, summed over the ranks (what a shard's gradient is)
        for n in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"):
            dist.all_reduce(whole[f"d.{n}"])
        # every rank's routed slots per expert, for the expected overflow
        loads = [torch.zeros(4) for _ in range(world)]
        dist.all_gather(loads, whole["load"])
        # held-out batches: every rank runs as many exchanged forwards (rank r has 3 + r)
        evals = len(even_eval_batches(list(range(3 + rank)), m.exchange, torch.device("cpu")))
        torch.save(
            {"whole": whole, "split": split, "held": held, "loads": loads, "evals": evals},
            f"{result}.{rank}",
        )
    finally:
        dist.destroy_process_group()


def _two_ranks(tmp_path, factor=None) -> list[dict]:
    result = str(tmp_path / "r")
    what = f"the MoE layer split over 2 gloo ranks (capacity factor {factor})"
    spawn(_worker, (2, _free_port(), factor, result), 2, what)
    out = [torch.load(f"{result}.{r}", weights_only=True) for r in range(2)]
    for rank, r in enumerate(out):
        assert "error" not in r, f"rank {rank}: {r['error']}"
    return out


def test_two_expert_ranks_compute_what_one_layer_does(tmp_path):
    for rank, r in enumerate(_two_ranks(tmp_path)):
        whole, split = r["whole"], r["split"]
        assert r["held"] == 2, f"rank {rank} holds {r['held']} of the 4 experts, not 2"
        assert r["evals"] == 3, (
            f"rank {rank} kept {r['evals']} held-out batches, not the fewest any rank has (3): "
            "the ranks would run different numbers of exchanged forwards "
            "(vlm/train/expert_parallel.py even_eval_batches)"
        )
        assert float(split["overflow"]) == 0, (
            f"rank {rank}: {float(split['overflow'])} slots over the capacity, dropless by default"
        )
        for k in ("out", "load", "balance", "z", "dx"):
            torch.testing.assert_close(split[k], whole[k], msg=lambda m, k=k: f"{k}: {m}")
        for k, g in split.items():
            if not k.startswith("d."):
                continue
            want = whole[k]
            if k in ("d.w_gate_EDF", "d.w_up_EDF", "d.w_down_EFD"):  # this rank's 2 experts
                want = want[2 * rank : 2 * rank + 2]
            torch.testing.assert_close(g, want, msg=lambda m, k=k: f"{k}: {m}")


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
        assert float(r["split"]["overflow"]) == want, (
            f"rank {rank}: {float(r['split']['overflow'])} slots counted over the capacity "
            f"{C}, the slots it left out are {want}"
        )
        # the statistics are the router's: the same whether or not a slot was computed
        torch.testing.assert_close(r["split"]["load"], r["whole"]["load"])
        assert not torch.allclose(r["split"]["out"], r["whole"]["out"])


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
    m.shard_experts(LoopbackExchange(2, 0))  # two expert ranks' shapes, without another process
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


def test_bench_alltoall_states_the_bytes_and_times_the_exchange():
    from eval.bench import alltoall

    res = alltoall.run(alltoall.SETTINGS["smoke"], log=lambda _: None)
    rows = {r["candidate"]: r for r in res["rows"]}
    assert set(rows) == {
        alltoall.BASELINE,
        "all_to_all (dropless)",
        "exchanged layer (dropless)",
        "all_to_all (capacity 1.25)",
        "exchanged layer (capacity 1.25)",
    }
    untimed = [c for c, r in rows.items() if not r["median"] > 0]
    assert not untimed, f"vlm bench alltoall: no time measured for {untimed}"
    # 64 tokens x top-2 = 128 slots per peer (dropless) of 64 fp32 values; half of it leaves
    assert rows["all_to_all (dropless)"]["capacity_rows"] == 128
    assert rows["all_to_all (dropless)"]["MB_sent_per_rank"] == round(2 * 128 * 64 * 4 / 2 / 1e6, 3)
    assert rows["all_to_all (capacity 1.25)"]["capacity_rows"] == capacity(128, 2, 1.25) == 80
    assert rows["exchanged layer (dropless)"]["overflow_slots"] == 0
    assert res["notes"] == [alltoall.LOOPBACK_NOTE]  # one process here


@pytest.mark.parametrize(
    "sections, says",
    [
        ({"parallel": {"expert": 3}}, "parallel.expert=3 does not divide model.moe.num_experts=8"),
        (
            {"parallel": {"expert": 2}, "deepspeed": {"zero_stage": 3}},
            "parallel.expert=2 with deepspeed.zero_stage 3",
        ),
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
