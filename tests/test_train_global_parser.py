"""DLCM's global parser (vlm.train.global_parser) in training: it sums the chunker's boundary
statistics over ranks and micro-batches, so that every micro-batch's ratio loss is eq. 4 at the F, G
of the whole step's batch and the accumulated ratio-loss gradient is the one big batch's gradient;
with `train.global_parser: false` (DLCM Table 4's ablation) each micro-batch's ratio loss is eq. 4
at its own F, G. The rest of `vlm train` in one process: tests/test_train_run.py."""

from __future__ import annotations

import pytest
import torch


def test_global_parser_sums_ranks_and_micro_batches():
    from vlm.train.global_parser import GlobalParser

    two_ranks = GlobalParser(all_reduce=lambda x: 2 * x)  # two ranks holding the same sums
    a = torch.tensor([[3.0, 4.5, 10.0]])
    b = torch.tensor([[1.0, 2.0, 6.0]])
    two_ranks.start_step()
    assert torch.equal(two_ranks(a), 2 * a)  # one micro-batch: summed over ranks
    two_ranks.start_step()
    # two micro-batches: the statistics pass first
    two_ranks.collect()
    two_ranks(a), two_ranks(b)
    assert torch.equal(two_ranks.settle(), 2 * (a + b))
    assert torch.equal(two_ranks(a), 2 * (a + b)) and torch.equal(two_ranks(b), 2 * (a + b))


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


def test_global_parser_drives_the_chunker(tiny_data, load_tiny, tiny_config):
    """Every micro-batch's ratio loss is eq. 4 at the F, G of the whole step's batch."""
    from vlm.model.ratio_loss import ratio_loss
    from vlm.model.stats import summarize
    from vlm.train.global_parser import GlobalParser, install

    cfg, model, batches = _two_micro_batches(tiny_data, load_tiny, tiny_config)
    parser = GlobalParser(all_reduce=lambda x: x.clone())
    assert install(model, parser)
    parser.start_step()
    parser.collect()
    stats = [summarize(model(b), b) for b in batches]
    parser.settle()
    outs = [model(b) for b in batches]
    tok = sum(s["tokens/all"] for s in stats)
    bnd = sum(s["boundaries/all"] for s in stats)
    psum = sum(s["boundary_p/all"] * s["tokens/all"] for s in stats)
    assert parser.calls == 2 and parser.total_Z3[0, 2].item() == pytest.approx(tok)
    expected = ratio_loss(
        torch.tensor(bnd / tok), torch.tensor(psum / tok), cfg.model.chunk.target_ratio
    )
    for out in outs:
        assert out.ratio_loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_accumulated_ratio_loss_gradient_equals_the_one_big_batch_gradient(
    tiny_data, load_tiny, tiny_config
):
    """DLCM's global parser with gradient accumulation: the micro-batches' ratio-loss gradients,
    summed, are the gradient of the ratio loss of both micro-batches as one batch (early
    micro-batches see late ones' sums)."""
    from configs.batch import PackedBatch
    from vlm.train.global_parser import GlobalParser, install

    cfg, model, batches = _two_micro_batches(tiny_data, load_tiny, tiny_config)
    params = [p for p in model.lm.chunker.parameters() if p.requires_grad]
    install(model, None)
    # both micro-batches as one batch (same T)
    big = model(PackedBatch.stack(batches))
    g_big = torch.autograd.grad(big.ratio_loss, params)
    parser = GlobalParser(all_reduce=lambda x: x.clone())
    install(model, parser)
    parser.start_step()
    parser.collect()
    with torch.no_grad():
        for b in batches:
            model(b)
    parser.settle()
    g_acc = [torch.zeros_like(p) for p in params]
    for b in batches:
        for acc, g in zip(g_acc, torch.autograd.grad(model(b).ratio_loss, params)):
            acc += g
    for a, b in zip(g_acc, g_big):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_per_micro_batch_statistics_when_the_global_parser_is_off(
    tiny_data, tmp_path, torch_globals, tiny_config, make_trainer
):
    """train.global_parser=false (DLCM Table 4's ablation): no parser on the chunker, so each
    micro-batch's ratio loss is eq. 4 at its own F, G; training runs."""
    from vlm.model.ratio_loss import ratio_loss
    from vlm.model.stats import summarize

    cfg = tiny_config(
        tiny_data,
        optim={"grad_accum": 2},
        train={"max_steps": 2, "global_parser": False},
        logging={"eval_every": 0},
    )
    tr = make_trainer(cfg, tmp_path / "run")
    assert tr.parser is None and tr.engine.module.lm.chunker.stats_hook is None
    assert tr.train() == 0
    model = tr.engine.module
    batch = next(iter(tr.loader))
    out = model(batch)
    s = summarize(out, batch)
    local = ratio_loss(
        torch.tensor(s["boundaries/all"] / s["tokens/all"]),
        torch.tensor(s["boundary_p/all"]),
        tr.cfg.model.chunk.target_ratio,
    )
    assert out.ratio_loss.item() == pytest.approx(local.item(), rel=1e-5)
