"""An expert-parallel checkpoint regrouped on load without ranks (issue 50 item 2): the files two
expert ranks wrote (their expert shards, DeepSpeed's optimizer file per expert rank with the names of
its parameters, the module file) load into one rank holding every expert (P' = 1) and into expert
rank 1 of 4 (P' = 4): the weights and both Adam moments of each expert are the run's, whatever the
degree. The multi-rank run that trains on after such a resume is tests/test_checkpoint_ranks.py."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

EXPERTS = ("moe.w_gate_EDF", "moe.w_up_EDF", "moe.w_down_EFD")


def _moe():
    from vlm.model.config import MoEConfig
    from vlm.model.moe import MoE

    torch.manual_seed(0)
    return torch.nn.ModuleDict(
        {"moe": MoE(MoEConfig(num_experts=4, top_k=2, expert_hidden=8), 16, init_std=0.3)}
    )


def _trained():
    """The whole layer after one AdamW step: the weights and moments a run of any degree holds."""
    model = _moe()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for i, p in enumerate(model.parameters()):
        p.grad = torch.randn_like(p) * (i + 1)
    opt.step()
    return model, opt


def _shard(model, opt, P: int, rank: int):
    """Expert rank `rank` of P's part of the run: its layer and an optimizer holding its rows."""
    from vlm.model.expert_parallel import LoopbackExchange

    whole = dict(model.named_parameters())
    part = copy.deepcopy(model)
    part["moe"].shard_experts(LoopbackExchange(P, rank))
    popt = torch.optim.AdamW(part.parameters(), lr=0.1)
    n = 4 // P
    for name, p in part.named_parameters():
        st = opt.state[whole[name]]
        rows = slice(rank * n, (rank + 1) * n) if name in EXPERTS else slice(None)
        popt.state[p] = {k: (v[rows].clone() if v.dim() else v.clone()) for k, v in st.items()}
    return part, popt


def _checkpoint(tmp_path, model, opt, P: int = 2, bf16: bool = False):
    """What P expert ranks on P ranks write (ZeRO 0). In bf16 the module holds bf16 weights and
    DeepSpeed's fp16 optimizer file the fp32 copies its torch optimizer steps (`fp32_groups`)."""
    from vlm.train import ds_internals
    from vlm.train.ckpt_save import optimizer_names
    from vlm.train.expert_parallel import save_shard

    ckpt = tmp_path / "step_00000003"
    (ckpt / "ds").mkdir(parents=True)
    for r in range(P):
        part, popt = _shard(model, opt, P, r)
        held, optimizer = part, popt
        if bf16:
            held = copy.deepcopy(part).to(torch.bfloat16)
            copies = [list(part.parameters())]
            optimizer = SimpleNamespace(fp16_groups=[list(held.parameters())], fp32_groups=copies)
        save_shard(held, ckpt, r, P, lambda obj, path: torch.save(obj, path))
        engine = SimpleNamespace(module=held, optimizer=optimizer)
        torch.save(
            {"step": 3, "optimizer_names": optimizer_names(engine)}, ckpt / f"rank_{r:05d}.pt"
        )
        state = popt.state_dict()
        if bf16:
            state = {"optimizer_state_dict": state, "fp32_groups": copies}
        torch.save({"optimizer": state}, ds_internals.moe_optimizer_file(ckpt / "ds", r))
        if r == 0:
            module = {"module": held.state_dict(), "global_steps": 3, "skipped_steps": 0}
            torch.save(module, ds_internals.module_file(ckpt / "ds"))
    return ckpt


def _loaded(ckpt, P: int, rank: int, bf16: bool = False):
    """A fresh run's expert rank `rank` of P after the regrouping load: (its module, the
    parameters its torch optimizer steps (in bf16 the fp32 copies), that optimizer)."""
    from vlm.model.expert_parallel import LoopbackExchange
    from vlm.train import expert_regroup

    fresh = _moe()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    if P > 1:
        fresh["moe"].shard_experts(LoopbackExchange(P, rank))
    stepped, wrapper = list(fresh.parameters()), None
    if bf16:
        fresh.to(torch.bfloat16)
        stepped = [p.detach().float().clone().requires_grad_() for p in fresh.parameters()]
        wrapper = SimpleNamespace(fp16_groups=[list(fresh.parameters())], fp32_groups=[stepped])
    opt = torch.optim.AdamW(stepped, lr=0.1)
    engine = SimpleNamespace(
        module=fresh,
        optimizer=wrapper,
        train_batch_size=lambda: 4,
        zero_optimization_stage=lambda: 0,
    )
    expert_regroup.load(engine, ckpt, opt)
    assert engine.global_steps == 3, "the engine's step counters were not restored"
    return fresh, dict(zip((n for n, _ in fresh.named_parameters()), stepped)), opt


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_expert_shards_and_their_moments_regroup_onto_any_degree(tmp_path, bf16):
    """ZeRO 0, fp32 and bf16 (DeepSpeed's fp16 optimizer: the torch optimizer steps fp32 copies
    of the bf16 weights, in its file beside the torch state dict): each expert's weights, its
    fp32 copy and both moments are the run's at any degree."""
    model, opt = _trained()
    ckpt = _checkpoint(tmp_path, model, opt, bf16=bf16)
    whole = dict(model.named_parameters())
    for P, rank in ((1, 0), (4, 1)):
        fresh, stepped, fopt = _loaded(ckpt, P, rank, bf16)
        n = 4 // P
        for name, p in fresh.named_parameters():
            rows = slice(rank * n, (rank + 1) * n) if name in EXPERTS else slice(None)
            want = whole[name].detach()[rows]
            assert torch.equal(p.detach(), want.to(p.dtype)), (
                f"P'={P}, rank {rank}: {name}'s weights"
            )
            q = stepped[name]
            assert torch.equal(q.detach(), want), (
                f"P'={P}, rank {rank}: {name}'s fp32 master is not the run's rows {rows}"
            )
            for key in ("exp_avg", "exp_avg_sq"):
                got, ref = fopt.state[q][key], opt.state[whole[name]][key][rows]
                assert torch.equal(got, ref), (
                    f"P'={P}, rank {rank}: {name}'s {key} is not the run's rows {rows}: the "
                    "expert shards' Adam moments were not regrouped (vlm/train/expert_regroup.py)"
                )
            assert float(fopt.state[q]["step"]) == 1.0


def test_a_zero_partition_reads_its_elements_from_the_fragments_that_hold_them():
    """A parameter's ZeRO 1-2 fragments (any order of arrival; a routed expert's shards end to
    end, each shard's replicas in rank order): a range across fragment boundaries is the whole
    run's elements, a range the writers do not hold is None, and a fragment outside the range is
    not read (a rank's reads follow its share)."""
    from vlm.train.expert_regroup import KEYS, Fragments

    whole = {k: torch.arange(20.0) * (i + 1) for i, k in enumerate(KEYS)}
    cuts = {(1, 3): (15, 20), (0, 0): (0, 6), (1, 1): (10, 15), (0, 2): (6, 10)}  # (shard, rank)
    frags = Fragments()
    for order, (a, b) in cuts.items():
        parts = {k: v[a:b] for k, v in whole.items()}
        if order == (1, 3):  # outside the read below: only its size may be looked at
            parts = {"fp32": parts["fp32"]}
        frags.add(order, parts, step=3)
    got = frags.read(4, 9)
    for k in KEYS:
        assert torch.equal(got[k], whole[k][4:13]), f"{k}: {got[k]} is not elements 4..12"
    assert got["step"] == 3
    partial = Fragments()
    for order in ((0, 0), (0, 2), (1, 1)):  # shard 1's replica on rank 3 is missing
        a, b = cuts[order]
        partial.add(order, {k: v[a:b] for k, v in whole.items()}, step=3)
    assert partial.read(12, 8) is None, "elements no writer held were made up"
