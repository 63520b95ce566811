"""The training loss is named terms in one place (vlm.train.losses): each a value and a weight, the
total their weighted sum; a micro-batch's parts of a global batch add up to the whole batch's loss and
gradient; and a new term is one function and one weight, seen in the total, the gradient,
metrics.jsonl and TensorBoard (docs/design.md, "Adding a loss term").

Legend: B rows, T tokens, D width.
"""

from __future__ import annotations

import json

import pytest
import torch

from configs.batch import PackedBatch
from vlm.model.conceptmoe import ConceptMoELM
from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig
from vlm.model.stats import lm_loss
from vlm.train import losses
from vlm.train.loss_config import LossConfig
from vlm.train.losses import Loss, Term, Totals, labelled_tokens, ratio_loss_value

V = 64


def lm(**chunk) -> ConceptMoELM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=V,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        encoder_layers=1,
        concept_layers=2,
        decoder_layers=1,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16),
        chunk=ChunkConfig(**{"target_ratio": 4.0, "document_slack": 1.5, **chunk}),
    )
    return ConceptMoELM(cfg).eval()  # eval: the same boundaries in every pass


def rows(n: int, seed: int = 1) -> list[PackedBatch]:
    g = torch.Generator().manual_seed(seed)
    return [
        PackedBatch.from_documents(
            [torch.randint(3, V, (k,), generator=g).tolist() for k in (15 + 4 * i, 9, 20 - 2 * i)],
            row_len=48,
        )
        for i in range(n)
    ]


def test_the_total_is_the_weighted_sum_of_the_named_terms():
    m = lm()
    (batch,) = rows(1)
    out = m(batch)
    res = Loss(m.cfg, LossConfig(ratio=0.25))(out, batch)
    assert list(res.terms) == ["lm", "ratio", "balance"]  # z: weight 0, left out
    assert res.weights == {"lm": 1.0, "ratio": 0.25, "balance": 1.0}
    lm_value = lm_loss(out, batch)
    ratio = ratio_loss_value(out.chunks, batch.doc_ids, batch.modality, m.cfg.chunk)[0]
    balance = torch.stack([0.01 * s.balance for _, s in out.moe_passes]).mean()
    torch.testing.assert_close(res.terms["lm"].value, lm_value)
    torch.testing.assert_close(res.terms["ratio"].value, ratio)
    torch.testing.assert_close(res.backprop, lm_value + 0.25 * ratio + balance)
    shares = res.shares()
    torch.testing.assert_close(shares["loss"], res.backprop.detach())
    # the baseline has no ratio term
    assert list(Loss(lm(enabled=False).cfg).terms[i].name for i in range(2)) == ["lm", "balance"]


def test_micro_batches_add_up_to_the_whole_batch_in_value_and_gradient():
    """Three micro-batches with the step's totals: their back-propagated losses, averaged as the
    engine averages them, have the gradient of the three rows as one batch, and their logged shares
    sum to its values (LM loss weighted by tokens, ratio loss on the global F and G with its
    per-document band). The balance loss is a mean over micro-batches, so it is off here."""
    m = lm()
    loss = Loss(m.cfg, LossConfig(ratio=0.5, balance=0.0))
    micro = rows(3)
    whole = PackedBatch.stack(micro)
    params = [p for p in m.parameters() if p.requires_grad]
    res_whole = loss(m(whole), whole)
    g_whole = torch.autograd.grad(res_whole.backprop, params, allow_unused=True)
    outs = [m(b) for b in micro]
    sums = sum(loss.statistics(o, b)["ratio"] for o, b in zip(outs, micro))
    N = sum(float(labelled_tokens(b)) for b in micro)
    results = [
        loss(o, b, Totals(3, {"ratio": sums}, N, float(labelled_tokens(b))))
        for o, b in zip(outs, micro)
    ]
    total = sum(r.backprop for r in results) / 3  # the engine divides by the micro-batches
    g_parts = torch.autograd.grad(total, params, allow_unused=True)
    for a, b in zip(g_parts, g_whole):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    for name, value in res_whole.shares().items():
        torch.testing.assert_close(sum(r.shares()[name] for r in results), value, rtol=1e-5, atol=0)


def probe_term(out, batch, cfg, weights, totals) -> losses.TermValue:
    """A term added the way docs/design.md says: the mean square of this micro-batch's final hidden
    states (what a training forward returns: vlm.model.tiled_loss), a mean over the global batch's
    micro-batches."""
    value = out.final_BTD.float().square().mean()
    return losses.TermValue(value, 1.0, value.detach() / totals.micro_batches)


PROBE = Term("probe", probe_term, lambda cfg, weights: 0.5)


def test_a_new_term_is_in_the_total_and_the_gradient(monkeypatch):
    monkeypatch.setattr(losses, "TERMS", losses.TERMS + (PROBE,))
    m = lm()
    (batch,) = rows(1)
    out = m(batch)
    res = Loss(m.cfg)(out, batch)
    without = Loss(m.cfg, terms=losses.TERMS[:-1])(out, batch)
    h = out.final_BTD
    probe = h.float().square().mean()
    torch.testing.assert_close(res.backprop, without.backprop + 0.5 * probe)
    (g,) = torch.autograd.grad(res.backprop, [h], retain_graph=True)
    (g0,) = torch.autograd.grad(without.backprop, [h])
    torch.testing.assert_close(g - g0, 0.5 * 2 * h.detach() / h.numel())


def test_a_new_term_is_logged_under_its_name_everywhere(
    monkeypatch, tiny_data, tiny_config, make_trainer, tmp_path, torch_globals
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setattr(losses, "TERMS", losses.TERMS + (PROBE,))
    run = tmp_path / "run"
    tr = make_trainer(tiny_config(tiny_data, logging={"log_every": 1}), run)
    assert tr.train() == 0
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss/probe"] > 0 for r in recs)
    weights = tr.run.step.loss.weights
    assert weights["probe"] == 0.5
    for r in recs:
        total = sum(w * r[f"loss/{n}"] for n, w in weights.items())
        assert r["loss"] == pytest.approx(total, rel=1e-6)
    ea = EventAccumulator(str(run / "tb"))
    ea.Reload()
    logged = {e.step: e.value for e in ea.Scalars("loss/probe")}
    assert logged == {r["step"]: pytest.approx(r["loss/probe"]) for r in recs}
