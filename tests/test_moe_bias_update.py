"""Loss-free balancing's bookkeeping (the MoE layer: vlm.model.moe): a layer counts its expert loads
in training only, once per routed token slot however activation checkpointing re-runs the forward;
update_moe_biases all-reduces every layer's loads in one call, moves each layer's bias by its own
loads (the sign step, or Grove eq. 8's RMS-normalised step), recentres it and resets the counts;
with balancing off the bias never moves; the balancing state stays fp32 in a bf16 layer. That the
bias evens the loads out: tests/test_moe.py.

Legend: D width, E experts, F expert hidden width.
"""

from __future__ import annotations

import torch

from vlm.model.config import MoEConfig
from vlm.model.moe import MoE, loss_free_bias_step, update_moe_biases
from vlm.train.losses import training_loss


# the layer tests/test_moe.py's tests build (test modules share no imported helpers)
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


def test_grove_eq8_rms_bias_step():
    from vlm.model.moe import loss_free_bias_step

    load = torch.tensor([30.0, 10.0, 10.0, 10.0])
    F_, Q = load / load.sum(), 0.25
    step = (F_ - Q) / ((F_ - Q) ** 2).mean().sqrt()
    expected = -0.01 * step
    torch.testing.assert_close(
        loss_free_bias_step(torch.zeros(4), load, 0.01, "rms"), expected - expected.mean()
    )
    assert torch.equal(
        loss_free_bias_step(torch.zeros(4), torch.full((4,), 5.0), 0.01, "rms"), torch.zeros(4)
    )


def test_load_accumulation_update_and_all_reduce():
    m = make_moe(bias_update_rate=1e-3)
    x1, x2 = torch.randn(10, 16), torch.randn(7, 16)
    m.train()
    l1, l2 = m(x1)[1].load_E, m(x2)[1].load_E
    assert float(l1.sum()) == 10 * 3 and float(l2.sum()) == 7 * 3
    torch.testing.assert_close(m.load_accum, l1 + l2)
    m.eval()
    m(x1)
    torch.testing.assert_close(m.load_accum, l1 + l2)  # eval does not count
    m.train()
    # Activation checkpointing re-runs forward inside backward; that run must not be counted
    # again: a stack counts its blocks' loads outside them (block.run_stack), with every
    # checkpointing mode.
    from configs.batch import PackedBatch
    from vlm.model.conceptmoe import ConceptMoELM
    from vlm.model.config import ModelConfig

    cfg = ModelConfig(
        vocab_size=50,
        hidden_size=16,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        encoder_layers=1,
        concept_layers=1,
        decoder_layers=1,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16),
    ).baseline()
    batch = PackedBatch.from_documents([list(range(3, 20)), list(range(5, 14))], row_len=32)
    accums = {}
    for mode in ("none", "full", "selective"):
        torch.manual_seed(0)
        lm = ConceptMoELM(cfg).train()
        lm.activation_checkpoint = mode
        training_loss(lm(batch), batch, cfg).backward()
        accums[mode] = torch.cat([moe.load_accum for moe in lm.modules() if isinstance(moe, MoE)])
    # 3 layers x top-2 x 26 real tokens: padding unseen
    assert float(accums["none"].sum()) == 3 * 2 * 26
    assert torch.equal(accums["full"], accums["none"]) and torch.equal(
        accums["selective"], accums["none"]
    )

    # update_moe_biases: one all-reduce (here: 2 identical ranks) then the sign step, recentred,
    # accumulator reset.
    m.load_accum.copy_(l1 + l2)
    expected = m.expert_bias + 1e-3 * torch.sign(2 * (l1 + l2).mean() - 2 * (l1 + l2))
    expected -= expected.mean()
    seen = []
    update_moe_biases(torch.nn.Sequential(m), all_reduce=lambda t: seen.append(t.clone()) or t * 2)
    assert len(seen) == 1 and torch.equal(seen[0], l1 + l2)
    torch.testing.assert_close(m.expert_bias, expected)
    assert float(m.load_accum.abs().sum()) == 0

    # Off: the bias never moves. bf16 cast: balancing state stays fp32.
    m_off = make_moe(loss_free_balancing=False)
    m_off.train()
    m_off(x1)
    assert float(m_off.load_accum.sum()) == 0
    m_off.update_bias(l1)
    assert float(m_off.expert_bias.abs().sum()) == 0
    mb = make_moe().to(torch.bfloat16)
    assert mb.expert_bias.dtype == torch.float32 and mb.load_accum.dtype == torch.float32
    assert mb.w_gate_EDF.dtype == torch.bfloat16


def test_loss_free_bias_of_each_layer_moves_by_its_own_loads():
    """Two MoE layers with opposite loads: after update_moe_biases each layer's bias is the step
    of its own loads (one all-reduce for all layers, split back in module order), with and
    without an all-reduce."""
    for all_reduce in (lambda t: t.clone(), None):
        a, b = make_moe(num_experts=4, top_k=1), make_moe(num_experts=4, top_k=1, bias_update="rms")
        a.load_accum.copy_(torch.tensor([9.0, 1.0, 1.0, 1.0]))
        b.load_accum.copy_(torch.tensor([1.0, 2.0, 3.0, 10.0]))
        want_a = loss_free_bias_step(a.expert_bias, a.load_accum, 1e-3, "sign")
        want_b = loss_free_bias_step(b.expert_bias, b.load_accum, 1e-3, "rms")
        update_moe_biases(torch.nn.ModuleList([a, b]), all_reduce)
        torch.testing.assert_close(a.expert_bias, want_a)
        torch.testing.assert_close(b.expert_bias, want_b)
        # the over-loaded expert goes down
        assert float(a.expert_bias[0]) < 0 and float(b.expert_bias[3]) < 0
