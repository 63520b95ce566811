"""MoE layer: dispatch paths vs a dense reference, Grove adjugate experts, loss-free balancing,
routers. The balancing's bookkeeping (loads counted, bias steps): tests/test_moe_bias_update.py.

Legend: D width, E experts, K experts chosen per token, F expert hidden width, G Grove groups, A
(token, choice) slots sorted by expert, N flat tokens or patches.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import vlm.model.moe as moe_mod
from configs.config import ConfigError, from_dict
from vlm.model.config import MoEConfig
from vlm.model.moe import MoE, grouped_mm_available, route, router_z_loss, switch_balance_loss

HAS_GMM = hasattr(torch, "_grouped_mm")


def make_moe(dim=16, **kw) -> MoE:
    base = dict(
        num_experts=8,
        top_k=3,
        expert_hidden=12,
        shared_hidden=8,
        # Grove's bound g/n for 2 groups of 8
        grove_hidden=8,
        grove_lambda=0.25,
    )
    base.update(kw)
    torch.manual_seed(0)
    # A larger init than the default makes expert outputs and router scores far from zero, so a
    # wrong weight or a wrong selection shows up well above float noise.
    return MoE(MoEConfig(**base), dim, init_std=0.3)


def reference_routing(m: MoE, x_ND):
    """Routing written out from the spec, independently of vlm.model.moe."""
    logits = x_ND.float() @ m.router.weight.float().t()
    # Grove eq. 9-10: choose by sigmoid + bias, weigh by the softmax over all experts
    if m.cfg.router == "grove":
        biased = logits.sigmoid() + m.expert_bias if m.cfg.loss_free_balancing else logits.sigmoid()
        sel_NK = biased.topk(m.cfg.top_k, dim=-1).indices
        w_NK = logits.softmax(-1).gather(1, sel_NK)
        if m.cfg.grove_weights == "renormalised":
            w_NK = w_NK / w_NK.sum(-1, keepdim=True)
        return sel_NK, w_NK
    scores = logits.softmax(-1) if m.cfg.router == "softmax" else logits.sigmoid()
    biased = scores + m.expert_bias if m.cfg.loss_free_balancing else scores
    sel_NK = biased.topk(m.cfg.top_k, dim=-1).indices
    w_NK = scores.gather(1, sel_NK)
    if m.cfg.norm_topk_prob:
        w_NK = w_NK / w_NK.sum(-1, keepdim=True)
    return sel_NK, w_NK


def swiglu(x, wg, wu, wd):
    return (F.silu(x @ wg) * (x @ wu)) @ wd


def dense_reference(m: MoE, x_ND):
    """Every expert (and adjugate) on every token; the selection only masks the combine weights."""
    T, E = x_ND.shape[0], m.num_experts
    sel_NK, w_NK = reference_routing(m, x_ND)
    dense_NE = torch.zeros(T, E).scatter(1, sel_NK, w_NK)
    y_END = torch.stack(
        [swiglu(x_ND, m.w_gate_EDF[e], m.w_up_EDF[e], m.w_down_EFD[e]) for e in range(E)]
    )
    out = torch.einsum("te,etd->td", dense_NE, y_END)
    if m.cfg.grove_groups:
        G = m.cfg.grove_groups
        rho_NG = dense_NE.view(T, G, E // G).sum(-1)
        a_GND = torch.stack(
            [swiglu(x_ND, m.adj_gate_GDF[g], m.adj_up_GDF[g], m.adj_down_GFD[g]) for g in range(G)]
        )
        out = out + m.cfg.grove_lambda * torch.einsum("tg,gtd->td", rho_NG, a_GND)
    if m.shared is not None:
        out = out + m.shared(x_ND)
    return out


def run_with_grads(m: MoE, x_ND, fn):
    m.zero_grad(set_to_none=True)
    x = x_ND.clone().requires_grad_(True)
    y = fn(x)
    # A non-uniform upstream gradient, then a stride-0 one (.sum()) that _grouped_mm's backward
    # rejects raw.
    g = torch.linspace(-1, 1, y.numel()).view_as(y)
    ((y * g).sum() + y.sum()).backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    return y.detach(), x.grad.clone(), grads


@pytest.mark.parametrize(
    "router,shared,grove,norm",
    [
        ("softmax", 0, 0, True),
        ("softmax", 2, 4, True),
        ("sigmoid", 1, 2, False),
        ("softmax", 0, 4, False),
        ("grove", 0, 4, False),
    ],
)
def test_grouped_mm_equals_loop_equals_dense(router, shared, grove, norm):
    m = make_moe(
        router=router,
        num_shared_experts=shared,
        grove_groups=grove,
        norm_topk_prob=norm,
    )
    m.expert_bias.copy_(torch.linspace(-0.05, 0.05, 8))  # the bias must change selection only
    x = torch.randn(37, 16)
    ref = run_with_grads(m, x, lambda x: dense_reference(m, x))
    paths = ["loop"] + (["grouped_mm"] if HAS_GMM else [])
    if HAS_GMM:
        assert grouped_mm_available(x, m.w_gate_EDF, m.w_down_EFD)
    for path in paths:
        mp = with_dispatch(m, path)
        got = run_with_grads(mp, x, lambda x: mp(x)[0])
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5, msg=f"{path} forward")
        torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5, msg=f"{path} grad x")
        assert got[2].keys() - {"router.weight"} == ref[2].keys() - {"router.weight"}
        for name, g in ref[2].items():
            torch.testing.assert_close(
                got[2][name], g, rtol=1e-4, atol=1e-5, msg=f"{path} grad {name}"
            )


def with_dispatch(m: MoE, path: str) -> MoE:
    """The same layer (weights, bias, dtype) with its experts run by `path` (moe.dispatch)."""
    twin = MoE(dataclasses.replace(m.cfg, dispatch=path), m.dim).to(m.w_gate_EDF.dtype)
    twin.load_state_dict(m.state_dict())
    return twin


@pytest.mark.skipif(not HAS_GMM, reason="torch._grouped_mm not in this torch")
def test_expert_swiglu_grouped_backward_takes_any_gradient_layout():
    # .sum().backward() feeds a stride-0 gradient straight into the last grouped matmul; an empty
    # expert too; and two padding slots (group id = the expert count) that no expert computes: they
    # come out as exactly 0 and pass no gradient back, although the grouped kernel leaves their
    # rows unwritten.
    torch.manual_seed(0)
    groups_N1 = torch.tensor([0] * 3 + [2] * 5 + [3] * 2 + [4] * 2)[torch.randperm(12)][:, None]
    slots = moe_mod.sort_by_group(groups_N1, 4)
    assert (
        slots.counts_G.tolist() == [3, 0, 5, 2]
        and slots.dead_A1[:, 0].tolist() == [False] * 10 + [True] * 2
    )
    ws = [torch.randn(4, 8, 12), torch.randn(4, 8, 12), torch.randn(4, 12, 8)]
    x = torch.randn(12, 8)
    res = []
    for grouped in (True, False):
        leaves = [w.clone().requires_grad_(True) for w in ws]
        xl = x.clone().requires_grad_(True)
        y = moe_mod.expert_swiglu(xl, slots, *leaves, use_grouped=grouped)
        y.sum().backward()
        assert (y[10:] == 0).all()
        assert (xl.grad[slots.tok_A[10:]] == 0).all()
        res.append([y.detach(), xl.grad] + [w.grad for w in leaves])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_GMM, reason="torch._grouped_mm not in this torch")
def test_grouped_mm_bf16_and_fallback_on_misaligned_dims():
    m = make_moe(dim=16, expert_hidden=16, grove_groups=2, grove_hidden=16).to(torch.bfloat16)
    x = torch.randn(29, 16, dtype=torch.bfloat16)
    assert grouped_mm_available(x, m.w_gate_EDF, m.w_down_EFD)
    outs = {}
    for path in ["loop", "grouped_mm"]:
        mp = with_dispatch(m, path)
        outs[path] = run_with_grads(mp, x, lambda x: mp(x)[0])
    torch.testing.assert_close(outs["grouped_mm"][0], outs["loop"][0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs["grouped_mm"][1], outs["loop"][1], rtol=2e-2, atol=2e-2)
    # dim=6 breaks the 16-byte row alignment: "auto" must fall back to the loop, "grouped_mm" must
    # say why.
    m6 = make_moe(dim=6)
    x6 = torch.randn(11, 6)
    assert not grouped_mm_available(x6, m6.w_gate_EDF, m6.w_down_EFD)
    torch.testing.assert_close(m6(x6)[0], dense_reference(m6, x6), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="16-byte"):
        with_dispatch(m6, "grouped_mm")(x6)


def test_grove_adjugate_once_per_token_per_group_and_eq4(monkeypatch):
    # 8 experts in 2 groups with top-3: every token has >= 2 selected experts in one group
    # (pigeonhole), so a per-expert adjugate would run more often than a per-group one.
    m = make_moe(num_experts=8, top_k=3, grove_groups=2)
    x = torch.randn(23, 16)
    calls = []
    real = moe_mod.expert_swiglu

    def spy(x_ND, slots, w_gate, *rest):
        if w_gate is m.adj_gate_GDF:  # the adjugate rows computed: live slots only, by group
            calls.append((int((~slots.dead_A1).sum()), slots.counts_G.tolist()))
        return real(x_ND, slots, w_gate, *rest)

    monkeypatch.setattr(moe_mod, "expert_swiglu", spy)
    y, stats = m(x)

    sel_NK, w_NK = reference_routing(m, x)
    per_group = 8 // 2  # experts per group
    hand_pairs = [{int(e) // per_group for e in row} for row in sel_NK]
    hand_total = sum(len(s) for s in hand_pairs)
    hand_per_group = [sum(g in s for s in hand_pairs) for g in range(2)]
    assert hand_total < x.shape[0] * 3
    assert calls == [(hand_total, hand_per_group)]
    assert float(stats.adjugate_per_token) == pytest.approx(hand_total / x.shape[0])
    # Grove's range per token
    assert all(math.ceil(3 / per_group) <= len(s) <= 3 for s in hand_pairs)

    # Eq. 4 evaluated directly: y = sum_i rho_i (E_i(x) + lambda A_j(x)), token by token.
    lam = m.cfg.grove_lambda
    with torch.no_grad():
        y_ref = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for i, rho in zip(sel_NK[t].tolist(), w_NK[t]):
                j = i // per_group
                e_i = swiglu(x[t], m.w_gate_EDF[i], m.w_up_EDF[i], m.w_down_EFD[i])
                a_j = swiglu(x[t], m.adj_gate_GDF[j], m.adj_up_GDF[j], m.adj_down_GFD[j])
                y_ref[t] += rho * (e_i + lam * a_j)
    torch.testing.assert_close(y.detach(), y_ref, rtol=1e-5, atol=1e-5)


def imbalance(load_E: torch.Tensor) -> tuple[float, float]:
    """(max/mean load, coefficient of variation) of per-expert loads."""
    return float(load_E.max() / load_E.mean()), float(load_E.std(unbiased=False) / load_E.mean())


@pytest.mark.parametrize(
    "router,update", [("softmax", "sign"), ("sigmoid", "sign"), ("grove", "rms")]
)
def test_loss_free_balancing_reduces_imbalance(router, update):
    m = make_moe(router=router, top_k=2, bias_update_rate=0.003, grove_groups=0, bias_update=update)
    D = m.dim
    gen = torch.Generator().manual_seed(1)
    u = F.normalize(torch.randn(D, generator=gen), dim=0)
    with torch.no_grad():  # skew: experts 0 and 1 like the inputs' common direction
        m.router.weight.copy_(0.5 * torch.randn(8, D, generator=gen))
        m.router.weight[:2] += 1.5 * u
    for p in m.parameters():  # weights frozen: only the bias can fix the balance
        p.requires_grad_(False)

    def batch(n=256):
        return torch.randn(n, D, generator=gen) + 2.0 * u

    m.eval()
    before = imbalance(m(batch(4096))[1].load_E)  # large held-out batches keep sampling noise small
    m.train()
    for _ in range(250):
        m(batch())
        m.update_bias()  # the trainer's per-optimizer-step call
    m.eval()
    x = batch(4096)
    y, stats = m(x)
    after = imbalance(stats.load_E)
    print(
        f"\n[{router}] max/mean load {before[0]:.2f} -> "
        f"{after[0]:.2f}, CV {before[1]:.2f} -> {after[1]:.2f}"
    )
    assert before[0] > 2.5 and before[1] > 0.8
    assert after[1] < before[1] / 3 and after[0] < 0.6 * before[0]
    if router in ("sigmoid", "grove"):  # sigmoid selection balances tightly (Grove eq. 9-10)
        assert after[0] < 1.25
    assert abs(float(m.expert_bias.mean())) < 1e-6 and float(m.expert_bias.abs().max()) > 0.05

    # Weights still come from the unbiased scores: the layer equals the reference that weighs the
    # (biased) selection with unbiased scores, and not one that weighs it with biased scores.
    r = route(x @ m.router.weight.t(), m.cfg, m.expert_bias)
    sel_NK, w_NK = reference_routing(m, x)
    assert torch.equal(r.experts_NK, sel_NK)
    torch.testing.assert_close(r.weights_NK, w_NK)
    biased_w = (r.scores_NE + m.expert_bias).gather(1, sel_NK)
    biased_w = biased_w / biased_w.sum(-1, keepdim=True) if m.cfg.norm_topk_prob else biased_w
    assert (biased_w - w_NK).abs().max() > 1e-2
    torch.testing.assert_close(y, dense_reference(m, x), rtol=1e-5, atol=1e-5)


def test_softmax_router_matches_mixtral_formula_and_qwen_norm_false():
    torch.manual_seed(3)
    logits = torch.randn(9, 8)
    cfg = MoEConfig(num_experts=8, top_k=2, norm_topk_prob=True, loss_free_balancing=False)
    r = route(logits, cfg, None)
    top_logits, top_idx = logits.topk(2, dim=-1)
    assert torch.equal(r.experts_NK, top_idx)
    # Mixtral: softmax over selected logits
    torch.testing.assert_close(r.weights_NK, top_logits.softmax(-1))
    r_raw = route(
        logits,
        MoEConfig(num_experts=8, top_k=2, norm_topk_prob=False, loss_free_balancing=False),
        None,
    )
    # Qwen norm_topk_prob=False
    torch.testing.assert_close(r_raw.weights_NK, logits.softmax(-1).gather(1, top_idx))


def test_grove_router_eq9_weighs_the_chosen_experts_by_the_full_softmax():
    """Grove eq. 9-10: y = sum over argtopk(rho^(sigma) + b) of rho^(h)_i e_i, rho^(h) the softmax
    over all n experts, not renormalised over the chosen ones. One token, logits (2, 1, 0, -1), bias
    0.6 on expert 2: sigmoid + b = (0.881, 0.731, 1.1, 0.269) chooses experts 2 and 0; rho^(h) = e^x
    / 11.475217."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.6, 0.0])
    r = route(logits, MoEConfig(num_experts=4, top_k=2, router="grove"), bias)
    assert r.experts_NK.tolist() == [[2, 0]]
    torch.testing.assert_close(
        r.weights_NK, torch.tensor([[0.087144, 0.643914]]), rtol=0, atol=1e-6
    )
    # < 1: eq. 9 does not renormalise
    assert float(r.weights_NK.sum()) == pytest.approx(0.731058, abs=1e-6)
    # the non-paper option: the same two weights rescaled to sum to 1
    r = route(
        logits,
        MoEConfig(num_experts=4, top_k=2, router="grove", grove_weights="renormalised"),
        bias,
    )
    torch.testing.assert_close(
        r.weights_NK, torch.tensor([[0.119203, 0.880797]]), rtol=0, atol=1e-6
    )
    # the layer: every token's output is eq. 9's sum, and its chosen weights sum to less than 1
    m = make_moe(router="grove", grove_groups=0, num_shared_experts=0)
    x = torch.randn(11, 16)
    w_sum = route(x @ m.router.weight.detach().t(), m.cfg, m.expert_bias).weights_NK.sum(-1)
    assert float(w_sum.max()) < 0.99
    torch.testing.assert_close(m(x)[0], dense_reference(m, x), rtol=1e-5, atol=1e-5)


def test_grove_lambda_bound_is_part_of_the_config():
    """Grove 3.2: lambda <= g / n, checked wherever a MoEConfig is validated (not only when upcycling)."""
    bound = r"grove_lambda=0.9 must be in \(0, grove_groups / num_experts = 2/8 = 0.25\]"
    with pytest.raises(ConfigError, match=bound):
        from_dict(MoEConfig, {"num_experts": 8, "grove_groups": 2, "grove_lambda": 0.9})
    with pytest.raises(ConfigError, match="grove_lambda=0.26"):
        MoE(MoEConfig(num_experts=8, grove_groups=2, grove_lambda=0.26), 16)
    # at the bound
    from_dict(MoEConfig, {"num_experts": 8, "grove_groups": 2, "grove_lambda": 0.25})
    # no adjugates
    from_dict(MoEConfig, {"num_experts": 8, "grove_groups": 0, "grove_lambda": 0.9})


@pytest.mark.parametrize("arch,norm", [("mixtral", True), ("qwen3", True), ("qwen3", False)])
def test_matches_hf_sparse_moe_block(arch, norm):
    """Same weights -> same outputs as transformers' Mixtral / Qwen3-MoE blocks (what conversion relies on)."""
    D, E, hidden, K = 16, 8, 12, 2
    if arch == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        hf_cfg = MixtralConfig(
            hidden_size=D, intermediate_size=hidden, num_local_experts=E, num_experts_per_tok=K
        )
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        hf_cfg = Qwen3MoeConfig(
            hidden_size=D,
            moe_intermediate_size=hidden,
            num_experts=E,
            num_experts_per_tok=K,
            norm_topk_prob=norm,
        )
    torch.manual_seed(0)
    hf = Block(hf_cfg).eval()
    ours = MoE(
        MoEConfig(num_experts=E, top_k=K, expert_hidden=hidden, norm_topk_prob=norm), D
    ).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        ours.router.weight.copy_(hf.gate.weight)
        gate_up = hf.experts.gate_up_proj  # [E, 2H, D], applied as x @ W^T
        ours.w_gate_EDF.copy_(gate_up[:, :hidden].transpose(1, 2))
        ours.w_up_EDF.copy_(gate_up[:, hidden:].transpose(1, 2))
        ours.w_down_EFD.copy_(hf.experts.down_proj.transpose(1, 2))
        x = torch.randn(2, 11, D)
        torch.testing.assert_close(ours(x.view(-1, D))[0], hf(x).view(-1, D), rtol=1e-5, atol=1e-5)


def test_balance_and_z_loss_values_and_sigmoid_router():
    # Hand-made: 2 tokens, 4 experts, top-1 picks experts 0 and 1 -> f = [.5, .5, 0, 0], P = [.4,
    # .4, .1, .1].
    scores = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.7, 0.1, 0.1]])
    sel = torch.tensor([[0], [1]])
    assert float(switch_balance_loss(scores, sel, False)) == pytest.approx(
        4 * (0.5 * 0.4 + 0.5 * 0.4)
    )
    # Sigmoid scores are normalised per token first: doubling them changes nothing.
    assert float(switch_balance_loss(2 * scores, sel, True)) == pytest.approx(1.6)
    assert float(router_z_loss(torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]]))) == pytest.approx(
        (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2
    )

    # A uniform router (zero weights): balance loss is exactly 1 whatever the tie-break,
    # z-loss log(E)^2.
    m = make_moe(loss_free_balancing=False)
    with torch.no_grad():
        m.router.weight.zero_()
    stats = m(torch.randn(12, 16))[1]
    assert float(stats.balance) == pytest.approx(1.0, rel=1e-5)
    assert float(stats.z) == pytest.approx(math.log(8) ** 2, rel=1e-5)

    # Sigmoid router: weights are sigmoid(selected logits) renormalised, output matches the dense
    # reference, and the aux loss trains the router.
    m = make_moe(router="sigmoid", norm_topk_prob=True)
    x = torch.randn(20, 16)
    logits = x @ m.router.weight.t()
    r = route(logits, m.cfg, m.expert_bias)
    top = logits.sigmoid().topk(3, dim=-1)
    torch.testing.assert_close(r.weights_NK, top.values / top.values.sum(-1, keepdim=True))
    y, stats = m(x)
    torch.testing.assert_close(y, dense_reference(m, x), rtol=1e-5, atol=1e-5)
    (0.1 * stats.balance + 0.01 * stats.z).backward()
    assert m.router.weight.grad is not None and float(m.router.weight.grad.abs().sum()) > 0


def test_bad_input_and_config_errors():
    with pytest.raises(ConfigError, match="top_k"):
        MoE(MoEConfig(num_experts=4, top_k=5), 16)
    with pytest.raises(ConfigError, match="grove_groups"):
        MoE(MoEConfig(num_experts=8, grove_groups=3), 16)
    m = make_moe()
    with pytest.raises(ValueError, match=r"\[tokens, 16\]"):
        m(torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match="load_E"):
        m.update_bias(torch.ones(3))
    y, stats = make_moe(grove_groups=2, num_shared_experts=1)(torch.randn(0, 16))  # no valid tokens
    assert (
        y.shape == (0, 16)
        and float(stats.load_E.sum()) == 0
        and float(stats.adjugate_per_token) == 0
    )
