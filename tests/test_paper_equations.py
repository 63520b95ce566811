"""The papers' equations where a one-line slip keeps every other test green (issue 28's planted
bugs): joint decoding (ConceptMoE eq. 11), the delta residual's straight-through gradient (eq. 10),
Synergy's gate (eq. 3-4), the top-k router's inference threshold (moved once per optimizer step),
and DLCM's global parser under gradient accumulation (one big batch's gradient).

Legend: B rows, T tokens, D width, M concept slots.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from configs.batch import PackedBatch
from vlm.model.attention import Attention
from vlm.model.chunking import ChunkModule
from vlm.model.conceptmoe import ConceptMoELM
from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig
from vlm.model.dechunk import Dechunk, plug_back
from vlm.model.ema_scan import ema_scan
from vlm.model.layers import doc_starts
from vlm.train.loss_config import LossConfig


# ------------------------------------------------------------------ ConceptMoE eq. 11
def test_joint_decoding_eq11_adds_the_concept_to_q_k_and_v():
    """q = z W_q + c W^c_q, k = z W_k + c W^c_k, v = z W_v + c W^c_v: the concept enters all three,
    with c the RMS-normed EMA concept (the one deviation from eq. 11, docs/deviations.md)."""
    torch.manual_seed(0)
    attn = Attention(16, 4, 2, 8, qk_norm=False, norm_eps=1e-6, joint=True)
    with torch.no_grad():
        attn.concept_norm.weight.uniform_(0.5, 1.5)
    z, c = torch.randn(2, 5, 16), 3 * torch.randn(2, 5, 16)
    sizes = [attn.h * attn.hd, attn.kv * attn.hd, attn.kv * attn.hd]
    q, k, v = attn.joint_qkv(z, c).split(sizes, -1)  # q, k and v come out of one matmul
    cn = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * attn.concept_norm.weight
    for got, w, wc in (
        (q, attn.q_proj, attn.cq_proj),
        (k, attn.k_proj, attn.ck_proj),
        (v, attn.v_proj, attn.cv_proj),
    ):
        torch.testing.assert_close(got, z @ w.weight.t() + cn @ wc.weight.t(), rtol=1e-5, atol=1e-5)
    # without a concept (layers below joint_decoding_layers) it is plain attention
    q0, k0, v0 = attn.joint_qkv(z, None).split(sizes, -1)
    torch.testing.assert_close(q0, attn.q_proj(z))
    torch.testing.assert_close(v0, attn.v_proj(z))


# ------------------------------------------------------------------ ConceptMoE eq. 10 with
# residual "delta"
def forced_chunks(mod: ChunkModule, h, doc, b):
    ch = mod(h, doc, force=b)
    return ch._replace(sel_BT=ch.sel_BT.detach().requires_grad_(True), cp_BM=ch.cp_BM.detach())


def test_delta_residual_straight_through_gradient_reaches_p_through_the_whole_update():
    """z = h + (c - c_in) STE(sel): the forward is h + c - c_in, and d z / d sel = c - c_in (the STE
    multiplies the concept model's whole update, not c alone)."""
    torch.manual_seed(0)
    D = 8
    mod = ChunkModule(ChunkConfig(residual="delta"), D)
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1, -1]])
    b = torch.tensor([[1, 0, 1, 1, 1, 0, 0, 0]]).bool()
    h = torch.randn(1, 8, D)
    ch = forced_chunks(mod, h, doc, b)
    M = ch.cdoc_BM.shape[1]
    out_BMD, in_BMD = torch.randn(1, M, D), torch.randn(1, M, D)
    z, c, c_in = Dechunk(mod.cfg, D)(h, out_BMD, ch, in_BMD)
    reset = doc_starts(ch.cdoc_BM)
    torch.testing.assert_close(c, plug_back(ema_scan(out_BMD, ch.cp_BM, reset), ch.cidx_BT))
    torch.testing.assert_close(c_in, plug_back(ema_scan(in_BMD, ch.cp_BM, reset), ch.cidx_BT))
    torch.testing.assert_close(z, h + c - c_in)
    g = torch.randn_like(z)
    (z * g).sum().backward()
    torch.testing.assert_close(ch.sel_BT.grad, ((c - c_in) * g).sum(-1))


# ------------------------------------------------------------------ Synergy eq. 3-4
def test_topk_router_gates_each_concept_by_sigmoid_of_its_score_eq3():
    """y_i = x_i + m_i sigma_i Middle(x_i), sigma_i = sigmoid(w_i) (eq. 3-4). With every token a
    boundary (p = 1, the EMA is the identity) the decoder input is exactly eq. 4; otherwise a token
    reads the gated EMA concept of its chunk. The router learns through the gate (not eq. 10's
    straight-through factor), and only the top-k router gates."""
    torch.manual_seed(0)
    D = 8
    mod = ChunkModule(ChunkConfig(router="topk", target_ratio=2.0), D)
    with torch.no_grad():
        mod.score.weight.mul_(20)  # gates well away from 1/2
    dech = Dechunk(mod.cfg, D)
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1, -1]])
    h = torch.randn(1, 8, D)
    sigma = torch.sigmoid(mod.score(h).squeeze(-1))  # eq. 1, 3
    ch = mod(h, doc, force="all")
    # concept m = token m (7 real tokens)
    middle = torch.randn(1, ch.cdoc_BM.shape[1], D)
    z, _, _ = dech(h, middle, ch)
    torch.testing.assert_close(z[:, :7], h[:, :7] + sigma[:, :7, None] * middle[:, :7])  # eq. 4
    assert float((sigma[0, :7] - 0.5).abs().min().detach()) > 0.05

    b = torch.tensor([[1, 0, 1, 0, 1, 1, 0, 0]]).bool()
    ch = mod(h, doc, force=b)
    n = int(b.sum())
    # the boundary token's gate
    torch.testing.assert_close(ch.cgate_BM[:, :n], sigma[b][None])
    assert (ch.cgate_BM[:, n:] == 0).all()  # unused capacity
    middle = torch.randn(1, ch.cdoc_BM.shape[1], D)
    z, c, _ = dech(h, middle, ch)
    gated = ema_scan(middle * ch.cgate_BM[..., None], ch.cp_BM, doc_starts(ch.cdoc_BM))
    torch.testing.assert_close(c, plug_back(gated, ch.cidx_BT))
    torch.testing.assert_close(z, h + c)
    mod.zero_grad()
    # the gate is the only path left
    z, _, _ = dech(h, middle, ch._replace(cp_BM=ch.cp_BM.detach()))
    (z * torch.randn_like(z)).sum().backward()
    assert float(mod.score.weight.grad.abs().sum()) > 0

    assert ChunkModule(ChunkConfig(router="linear"), D)(h, doc, force=b).cgate_BM is None


# ------------------------------------------------------------------ engine and data for train_step
# the tiny model's loss: no balance loss (its step is a mean over micro-batches)
NO_BALANCE = LossConfig(balance=0.0)


def tiny_lm(**chunk) -> ConceptMoELM:
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
        moe=MoEConfig(
            num_experts=4,
            top_k=2,
            expert_hidden=16,
            loss_free_balancing=False,
        ),
        chunk=ChunkConfig(**chunk),
    )
    return ConceptMoELM(cfg).train()


def micro_batches(micro: int, T: int = 48) -> list[PackedBatch]:
    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(micro):
        # three documents and two padding tokens
        lengths = [17 + 3 * k, 11, T - 28 - 3 * k - 2]
        docs = [torch.randint(3, 64, (n,), generator=g).tolist() for n in lengths]
        out.append(PackedBatch.from_documents(docs, row_len=T))
    return out


def cat_rows(batches: list[PackedBatch]) -> PackedBatch:
    return PackedBatch(
        *(
            torch.cat([getattr(b, f) for b in batches])
            for f in ("input_ids", "labels", "doc_ids", "position_ids", "modality")
        )
    )


def engine_for(model: torch.nn.Module, micro: int):
    """A real DeepSpeed engine (stage 0, fp32, one process) with lr 0; `grads` holds each
    parameter's gradient as the optimizer step saw it."""
    from vlm.train.distributed import init_distributed
    from vlm.train.engine import initialize

    init_distributed()
    engine = initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": micro,
            "train_batch_size": micro,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 0},
            "bf16": {"enabled": False},
            "steps_per_print": 10**12,
            "zero_allow_untested_optimizer": True,
        },
    )
    engine.grads = {}
    real_step = engine.step

    # the last call is the accumulation boundary, before the optimizer zeroes the gradients
    def step():
        engine.grads = {
            n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
        }
        real_step()

    engine.step = step
    return engine


def settings(model, seed: int = 0, weights: LossConfig = NO_BALANCE):
    """What train_step needs from a run, for one rank on the CPU."""
    from vlm.model.training_controls import TrainingControls
    from vlm.train.layout import ParallelLayout
    from vlm.train.losses import Loss
    from vlm.train.step import StepSettings

    return StepSettings(
        Loss(model.cfg, weights),
        TrainingControls(model),
        seed,
        ParallelLayout(1, 0),
        torch.device("cpu"),
    )


# ------------------------------------------------------------------ DLCM global parser
def test_global_parser_with_gradient_accumulation_gives_one_big_batch_gradient():
    """Three micro-batches with the global parser and a non-zero ratio-loss weight: the summed
    gradient equals that of one batch holding all rows with the same boundaries (DLCM eq. 8-10). It
    needs the statistics pass to draw each micro-batch's own boundary samples (same seeds as its
    real pass) and the ratio loss weighted micro x ranks (each micro-batch's part of the global loss
    is summed, not averaged)."""
    from vlm.train.losses import training_loss
    from vlm.train.step import train_step

    # R = 4 while F starts near 1/2: the ratio loss's gradient is far from 0
    micro, R, weight = 3, 4.0, 0.5
    model = tiny_lm(target_ratio=R)
    weights = LossConfig(ratio=weight, balance=0.0)
    reference = copy.deepcopy(model)
    window = micro_batches(micro)
    engine = engine_for(model, micro)
    drawn = []
    res = train_step(
        engine,
        window,
        0,
        settings(model, seed=7, weights=weights),
        loss_hook=lambda out, k: drawn.append(out.chunks.b_BT) or out,
    )
    assert res.applied and len(drawn) == micro
    big = reference(cat_rows(window), force=torch.cat(drawn))
    F_ = float(big.chunks.b_BT.sum() / (cat_rows(window).doc_ids >= 0).sum())
    assert abs(F_ - 1 / R) > 0.1
    reference.zero_grad()
    training_loss(big, cat_rows(window), reference.cfg, weights).backward()
    want = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert engine.grads.keys() == want.keys()
    for n, g in want.items():
        torch.testing.assert_close(
            engine.grads[n], g, rtol=1e-4, atol=1e-7, msg=lambda m: f"{n}: {m}"
        )


# ------------------------------------------------------------------ the top-k router's
# inference threshold
def test_topk_threshold_moves_once_per_optimizer_step_from_the_real_passes():
    """Training forwards only accumulate the batches' (1 - 1/R) score quantiles; after the optimizer
    step the threshold takes one step, threshold <- 0.9 threshold + 0.1 mean(quantiles of the step's
    real passes), so its rate does not depend on gradient accumulation, and the global parser's
    no-gradient statistics pass (which sees the same micro-batches again) leaves no trace."""
    from vlm.train.step import train_step

    micro, R = 2, 3.0
    model = tiny_lm(router="topk", target_ratio=R)
    chunker = model.chunker
    seen = []
    real = chunker.topk_boundaries

    def spy(w_BT, doc_BT, statistics):
        seen.append(
            (
                torch.is_grad_enabled(),
                torch.nanquantile(
                    torch.where(doc_BT >= 0, w_BT, float("nan")).flatten(), 1 - 1 / R
                ),
            )
        )
        return real(w_BT, doc_BT, statistics)

    chunker.topk_boundaries = spy
    engine = engine_for(model, micro)
    before = float(chunker.threshold)
    train_step(engine, micro_batches(micro), 0, settings(model))
    real_q = [q for grad, q in seen if grad]
    assert len(real_q) == micro and len(seen) == 2 * micro  # the statistics pass ran too
    want = 0.9 * before + 0.1 * float(torch.stack(real_q).mean())
    assert float(chunker.threshold) == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert float(chunker.quantile_accum.abs().sum()) == 0

    # a skipped (non-finite) step moves nothing and leaves nothing behind for the next one
    res = train_step(
        engine,
        micro_batches(micro),
        1,
        settings(model),
        loss_hook=lambda out, k: dataclasses.replace(out, final_BTD=out.final_BTD + float("nan")),
    )
    assert not res.applied
    assert float(chunker.threshold) == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert float(chunker.quantile_accum.abs().sum()) == 0

    # used alone (no trainer) the module still moves its threshold on every training forward
    solo = ChunkModule(ChunkConfig(router="topk", target_ratio=R), 8).train()
    h, doc = torch.randn(1, 12, 8), torch.zeros(1, 12, dtype=torch.long)
    solo(h, doc)
    q = torch.quantile(solo.score(h).squeeze(-1).detach().flatten(), 1 - 1 / R)
    assert float(solo.threshold) == pytest.approx(0.1 * float(q), rel=1e-5)
