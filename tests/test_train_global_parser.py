"""DLCM's global parser in training (vlm.train.losses' ratio term with the step's totals): the
chunker's boundary statistics summed over ranks and micro-batches, so that every micro-batch's ratio
loss is eq. 4 at the F, G of the whole step's batch and the accumulated ratio-loss gradient is the
one big batch's gradient; with `train.global_parser: false` (DLCM Table 4's ablation) each
micro-batch's ratio loss is eq. 4 at its own F, G. The rest of `vlm train` in one process:
tests/test_train_run.py."""

from __future__ import annotations

import pytest
import torch


def _two_micro_batches(tiny_data, load_tiny, tiny_config):
    from data_pipelines.loader import build_loader
    from data_pipelines.tokenizer import load_tokenizer
    from vlm.model.multimodal import ConceptMoEVLM

    cfg = load_tiny(tiny_config(tiny_data))
    torch.manual_seed(0)
    # eval: threshold boundaries, same in every pass
    model = ConceptMoEVLM(cfg.model, cfg.vision).eval()
    it = iter(build_loader(cfg.data, load_tokenizer("byte")))
    return cfg, model, [next(it) for _ in range(2)]


def _totals(loss, model, batches):
    """The step's totals of these micro-batches (one rank): their statistics, summed."""
    from vlm.train.losses import Totals, labelled_tokens

    outs = [model(b) for b in batches]
    sums = [loss.statistics(o, b) for o, b in zip(outs, batches)]
    labelled = sum(float(labelled_tokens(b)) for b in batches)
    return Totals(len(batches), {"ratio": sum(s["ratio"] for s in sums)}, labelled)


def test_global_statistics_drive_every_micro_batchs_ratio_loss(tiny_data, load_tiny, tiny_config):
    """Every micro-batch's ratio loss is eq. 4 at the F, G of the whole step's batch."""
    from vlm.model.ratio_loss import ratio_loss
    from vlm.model.stats import summarize
    from vlm.train.losses import Loss

    cfg, model, batches = _two_micro_batches(tiny_data, load_tiny, tiny_config)
    loss = Loss(cfg.model)
    totals = _totals(loss, model, batches)
    stats = [summarize(model(b), b) for b in batches]
    tok = sum(s["tokens/all"] for s in stats)
    bnd = sum(s["boundaries/all"] for s in stats)
    psum = sum(s["boundary_p/all"] * s["tokens/all"] for s in stats)
    assert totals.sums["ratio"][0, 2].item() == pytest.approx(tok)
    expected = ratio_loss(
        torch.tensor(bnd / tok), torch.tensor(psum / tok), cfg.model.chunk.target_ratio
    )
    for b in batches:
        got = loss(model(b), b, totals).terms["ratio"].value
        assert got.item() == pytest.approx(expected.item(), rel=1e-5)


def test_accumulated_ratio_loss_gradient_equals_the_one_big_batch_gradient(
    tiny_data, load_tiny, tiny_config
):
    """DLCM's global parser with gradient accumulation: the micro-batches' ratio-loss gradients,
    summed, are the gradient of the ratio loss of both micro-batches as one batch (early
    micro-batches see late ones' sums)."""
    from configs.batch import PackedBatch
    from vlm.train.losses import Loss

    cfg, model, batches = _two_micro_batches(tiny_data, load_tiny, tiny_config)
    params = [p for p in model.lm.chunker.parameters() if p.requires_grad]
    loss = Loss(cfg.model)
    big = PackedBatch.stack(batches)  # both micro-batches as one batch (same T)
    g_big = torch.autograd.grad(loss(model(big), big).terms["ratio"].value, params)
    totals = _totals(loss, model, batches)
    g_acc = [torch.zeros_like(p) for p in params]
    for b in batches:
        term = loss(model(b), b, totals).terms["ratio"].value
        for acc, g in zip(g_acc, torch.autograd.grad(term, params)):
            acc += g
    for a, b in zip(g_acc, g_big):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_per_micro_batch_statistics_when_the_global_parser_is_off(
    tiny_data, tmp_path, torch_globals, tiny_config, make_trainer
):
    """train.global_parser=false (DLCM Table 4's ablation): each micro-batch's ratio loss is eq. 4
    at its own F, G, and no statistics are summed before the forwards; training runs."""
    from vlm.model.ratio_loss import ratio_loss
    from vlm.model.stats import summarize

    cfg = tiny_config(
        tiny_data,
        optim={"grad_accum": 2},
        train={"max_steps": 2, "global_parser": False},
        logging={"eval_every": 0},
    )
    tr = make_trainer(cfg, tmp_path / "run")
    loss = tr.run.step.loss
    assert not loss.needs_output_statistics
    assert tr.train() == 0
    model = tr.run.engine.module
    batch = next(iter(tr.run.loader))
    out = model(batch)
    s = summarize(out, batch)
    local = ratio_loss(
        torch.tensor(s["boundaries/all"] / s["tokens/all"]),
        torch.tensor(s["boundary_p/all"]),
        tr.run.cfg.model.chunk.target_ratio,
    )
    from vlm.train.losses import Totals

    got = loss(out, batch, Totals(2, {}, 100.0)).terms["ratio"].value
    assert got.item() == pytest.approx(local.item(), rel=1e-5)
