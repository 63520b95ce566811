"""Chunk / dechunk equations against the paper (eq. 2-10, Appendix B).

Legend: B rows, T tokens, D width, M concept slots.
"""

import pytest
import torch

from vlm.model.cache import ChunkState
from vlm.model.chunking import ChunkModule, cosine_boundary_prob, sharpen
from vlm.model.config import ChunkConfig
from vlm.model.dechunk import Dechunk, plug_back, ste
from vlm.model.ema_scan import ema_scan
from vlm.model.ratio_loss import ratio_loss


def ema_loop_reference(concept_MD, prob_M):
    """Appendix B's loop, verbatim in spirit: concept_merge[i] = merge[i-1] (1 - p_i) + concept[i] p_i."""
    out = [concept_MD[0]]
    for i in range(1, concept_MD.shape[0]):
        out.append(out[-1] * (1 - prob_M[i]) + concept_MD[i] * prob_M[i])
    return torch.stack(out)


def test_ema_scan_matches_appendix_b_loop_with_gradients():
    torch.manual_seed(0)
    M, D = 150, 8  # several scan blocks
    x = torch.randn(M, D, dtype=torch.float64, requires_grad=True)
    p = torch.rand(M, dtype=torch.float64).clamp(0.05, 0.95)
    p[0] = 1.0
    p.requires_grad_(True)
    ref = ema_loop_reference(x, p)
    reset = torch.zeros(1, M, dtype=torch.bool)
    reset[0, 0] = True
    got = ema_scan(x[None], p[None], reset, block=32)[0]
    torch.testing.assert_close(got, ref.to(got.dtype), rtol=1e-5, atol=1e-5)
    w = torch.randn(M, D, dtype=torch.float64)
    gx_ref, gp_ref = torch.autograd.grad((ref * w).sum(), (x, p))
    gx, gp = torch.autograd.grad((got * w).sum(), (x, p))
    torch.testing.assert_close(gx, gx_ref, rtol=1e-4, atol=1e-5)
    # p_0 is the constant 1 forced at a document start (the loop never reads it), so compare from
    # 1 on.
    torch.testing.assert_close(gp[1:], gp_ref[1:], rtol=1e-4, atol=1e-5)


def test_ema_scan_restarts_at_document_starts():
    torch.manual_seed(1)
    x = torch.randn(1, 10, 4)
    p = torch.rand(1, 10) * 0.5 + 0.25
    reset = torch.zeros(1, 10, dtype=torch.bool)
    reset[0, [0, 6]] = True
    got = ema_scan(x, p, reset, block=4)
    # The second document alone, with its first p treated as a restart (state before it is zero).
    alone = ema_scan(x[:, 6:], p[:, 6:], reset[:, 6:], block=4)
    torch.testing.assert_close(got[:, 6:], alone)
    torch.testing.assert_close(got[:, 6], x[:, 6] * p[:, 6, None])


def test_ratio_loss_equals_eq4_and_pushes_G_to_one_over_R():
    R = 2.0
    F_, G = torch.tensor(0.7), torch.tensor(0.6)
    expected = R * 0.7 * 0.6 + R / (R - 1) * 0.3 * 0.4  # eq. 4, left form
    torch.testing.assert_close(ratio_loss(F_, G, R), torch.tensor(expected))
    assert abs(ratio_loss(torch.tensor(0.5), torch.tensor(0.5), R).item() - 1.0) < 1e-6
    # Gradient descent on G (F follows G, as when boundaries are drawn from p) converges to 1/R.
    for R, G0 in ((2.0, 0.9), (2.0, 0.1), (4.0, 0.8)):
        g = torch.tensor(G0, requires_grad=True)
        for _ in range(500):
            loss = ratio_loss(g.detach(), g, R)
            (grad,) = torch.autograd.grad(loss, g)
            with torch.no_grad():
                g -= 0.01 * grad
        assert abs(g.item() - 1 / R) < 0.02, (R, g.item())


def test_cosine_router_eq2_and_sharpen_eq5():
    q = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])
    k = torch.tensor([[[1.0, 0.0], [-1.0, 0.0], [1.0, 0.0]]])
    p = cosine_boundary_prob(q, k)
    # p_0 = 1; p_1 = (1 - cos(q_1, k_0))/2 = 0; p_2 = (1 - cos(q_2, k_1))/2 = 0.5
    torch.testing.assert_close(p, torch.tensor([[1.0, 0.0, 0.5]]))
    s = sharpen(torch.tensor([0.2, 0.5, 0.9]), 6.0)
    torch.testing.assert_close(
        s, torch.tensor([1 - 0.8 ** (1 / 6), 0.5 ** (1 / 6), 0.9 ** (1 / 6)])
    )


def test_ste_forward_one_backward_identity():
    x = torch.tensor([0.3, 0.8], requires_grad=True)
    y = ste(x)
    assert torch.equal(y, torch.ones(2))
    (g,) = torch.autograd.grad((y * torch.tensor([2.0, 3.0])).sum(), x)
    torch.testing.assert_close(g, torch.tensor([2.0, 3.0]))


def _hand_chunks(merge):
    """Row: doc 0 = 5 tokens, doc 1 = 3 tokens, 1 pad. Boundaries forced at 0, 2, 5 (doc starts) and 6."""
    cfg = ChunkConfig(merge=merge)
    mod = ChunkModule(cfg, 2).eval()
    doc = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, -1]])
    force = torch.tensor([[1, 0, 1, 0, 0, 0, 1, 0, 0]], dtype=torch.bool)
    h = torch.arange(1, 10, dtype=torch.float32)[None, :, None].expand(1, 9, 2).clone()
    ch = mod(h, doc, force=force)
    return mod, ch, h, doc


def test_merge_strategies_follow_the_causal_convention():
    for merge, expected in (
        ("last", [1, 3, 6, 7]),
        ("sum", [1, 2 + 3, 6, 7]),
        ("mean", [1, 2.5, 6, 7]),
    ):
        mod, ch, h, doc = _hand_chunks(merge)
        assert ch.b_BT.long().tolist() == [[1, 0, 1, 0, 0, 1, 1, 0, 0]]
        assert ch.cidx_BT.tolist() == [[0, 0, 1, 1, 1, 2, 3, 3, -1]]
        # concepts sit in a static capacity (here the whole row of 9), unused places marked -1; on
        # the CPU in eager mode the columns past the largest row's count are not built (the host
        # reads it for free there)
        assert mod.capacity(9) == mod.capacity(9, training=True) == 9
        M = ch.cdoc_BM.shape[1]
        assert M == 4
        assert ch.cdoc_BM.tolist() == [[0, 0, 1, 1] + [-1] * (M - 4)]
        assert ch.cpos_BM.tolist() == [[0, 1, 0, 1] + [0] * (M - 4)]
        assert float(ch.overflow) == 0
        c = mod.merge(h, doc, ch)[0, :, 0]
        # tokens 3,4 (doc 0 tail) and 7 (doc 1 tail) join no concept; nothing crosses documents
        torch.testing.assert_close(
            c, torch.tensor(expected + [0] * (M - 4), dtype=torch.float32), msg=merge
        )


def test_concepts_past_the_static_capacity_are_counted_and_read_by_no_token():
    """A row with more boundaries than its capacity (ceil(T slack / R) rounded up to 16):
    the concepts past it are not computed, counted in `overflow`, and the tokens that
    would read them read nothing (z = h); the concepts within capacity are exactly those
    of an unlimited capacity."""
    T = 40
    doc = torch.zeros(1, T, dtype=torch.long)
    force = torch.ones(1, T, dtype=torch.bool)  # 40 boundaries
    h = torch.randn(1, T, 3)
    tight = ChunkModule(ChunkConfig(eval_capacity_slack=1.0, target_ratio=4.0), 3).eval()
    assert tight.capacity(T) == 16  # ceil(40 / 4) = 10 -> 16
    assert tight.capacity(T, training=True) == 16  # ceil(40 * 1.25 / 4) = 13 -> 16
    ch = tight(h, doc, force=force)
    assert ch.cdoc_BM.shape == (1, 16) and float(ch.overflow) == T - 16
    assert ch.cidx_BT[0, :16].tolist() == list(range(16)) and (ch.cidx_BT[0, 16:] == -1).all()
    free = ChunkModule(ChunkConfig(target_ratio=4.0), 3).eval()  # eval capacity: T by default
    ch_free = free(h, doc, force=force)
    assert ch_free.cdoc_BM.shape == (1, T) and float(ch_free.overflow) == 0
    torch.testing.assert_close(tight.merge(h, doc, ch), free.merge(h, doc, ch_free)[:, :16])
    de = Dechunk(ChunkConfig(), 3)
    concepts = torch.randn(1, 16, 3)
    z, c_read, _ = de(h, concepts, ch)
    assert (c_read[0, 16:] == 0).all() and torch.equal(z[0, 16:], h[0, 16:])


def test_dechunk_plug_back_and_ste():
    mod, ch, h, doc = _hand_chunks("last")
    de = Dechunk(ChunkConfig(), 2)
    M = ch.cdoc_BM.shape[1]
    concepts = torch.randn(1, M, 2)
    z, c_read, _ = de(h, concepts, ch)
    reset = torch.tensor([[True, False, True, False] + [True] * (M - 4)])
    torch.testing.assert_close(
        c_read[0, :8], plug_back(ema_scan(concepts, ch.cp_BM, reset), ch.cidx_BT)[0, :8]
    )
    torch.testing.assert_close(z, h + c_read)  # identity residual, STE forward = 1


def test_ema_scan_gradient_is_exact_where_p_is_one_inside_a_document():
    """p == 1 at a non-restart position: the decay is exactly 0, but d c_m / d p_m = x_m - c_{m-1} is not."""
    torch.manual_seed(1)
    M, D = 70, 4
    x = torch.randn(M, D, dtype=torch.float64, requires_grad=True)
    p = torch.rand(M, dtype=torch.float64).clamp(0.05, 0.95)
    # 64: the first position of the second scan block
    p[0] = p[5] = p[33] = p[64] = 1.0
    p.requires_grad_(True)
    reset = torch.zeros(1, M, dtype=torch.bool)
    reset[0, 0] = True
    ref = ema_loop_reference(x, p)
    got = ema_scan(x[None], p[None], reset, block=32)[0]
    torch.testing.assert_close(got, ref.to(got.dtype), rtol=1e-5, atol=1e-5)
    w = torch.randn(M, D, dtype=torch.float64)
    (gp_ref,) = torch.autograd.grad((ref * w).sum(), p)
    (gp,) = torch.autograd.grad((got * w).sum(), p)
    torch.testing.assert_close(gp[1:], gp_ref[1:], rtol=1e-4, atol=1e-5)
    assert gp[5].abs() > 1e-3 and gp[33].abs() > 1e-3  # not cut to x_m's share alone


def test_train_mode_samples_boundaries_at_the_papers_flip_rate(monkeypatch):
    """Eq. 5-6: in training boundaries are drawn from sharpened p, not thresholded. With p spread
    evenly over [0, 1] and tau = 6 the expected share of tokens whose boundary differs from p >= 0.5
    is 1 - (12/7)(1 - 0.5^(7/6)) = 4.9 % (the paper reports ~4 %); in eval mode it is 0."""
    T = 50_000
    p = torch.linspace(0, 1, T)[None]
    mod = ChunkModule(ChunkConfig(tau=6.0), 2)
    start = torch.zeros(1, T, dtype=torch.bool)
    monkeypatch.setattr(mod, "boundary_prob", lambda h, doc, above=None, shard=None: (p, start))
    h, doc = torch.zeros(1, T, 2), torch.zeros(1, T, dtype=torch.long)
    torch.manual_seed(0)
    flips = (mod.train()(h, doc).b_BT != (p >= 0.5)).float().mean().item()
    assert flips == pytest.approx(1 - (12 / 7) * (1 - 0.5 ** (7 / 6)), abs=0.005)
    assert (mod.eval()(h, doc).b_BT == (p >= 0.5)).all()


def test_joint_decoding_reads_the_concepts():
    """Eq. 11: the decoder's q, k, v add projections of the EMA concept; changing those projections
    must change the logits (a decoder that ignored its concept read would not notice)."""
    from configs.batch import PackedBatch
    from vlm.model.conceptmoe import ConceptMoELM
    from vlm.model.config import ModelConfig, MoEConfig

    cfg = ModelConfig(
        vocab_size=50,
        hidden_size=16,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        encoder_layers=1,
        concept_layers=1,
        decoder_layers=1,
        moe=MoEConfig(num_experts=2, top_k=1, expert_hidden=16),
        chunk=ChunkConfig(),
    )
    torch.manual_seed(0)
    model = ConceptMoELM(cfg).eval()
    joint = [m for m in model.modules() if getattr(m, "joint", False)]
    assert joint, "no decoder layer has joint decoding"
    batch = PackedBatch.from_documents([list(range(3, 40))])
    before = model(batch).logits
    with torch.no_grad():
        for m in joint:
            for proj in (m.cq_proj, m.ck_proj, m.cv_proj):
                proj.weight.mul_(3.0)
    assert not torch.allclose(model(batch).logits, before, atol=1e-5)


def test_fixed_router_puts_a_boundary_every_R_tokens_of_each_document():
    mod = ChunkModule(ChunkConfig(router="fixed", target_ratio=3.0), 2)
    assert not list(mod.parameters())  # nothing to learn
    doc = torch.tensor([[0] * 7 + [1] * 4 + [-1]])
    for m in (mod.train(), mod.eval()):
        b = m(torch.randn(1, 12, 2), doc).b_BT[0].tolist()
        assert b == [True, False, False, True, False, False, True, True, False, False, True, False]


@pytest.mark.parametrize("noise", ["gaussian", "none"])
def test_boundary_noise_options(noise, monkeypatch):
    """gaussian: p + N(0, sigma) thresholded (flips only near 0.5); none: training thresholds like eval."""
    T = 20_000
    p = torch.linspace(0, 1, T)[None]
    mod = ChunkModule(ChunkConfig(boundary_noise=noise, noise_sigma=0.1), 2).train()
    monkeypatch.setattr(
        mod,
        "boundary_prob",
        lambda h, doc, above=None, shard=None: (p, torch.zeros(1, T, dtype=torch.bool)),
    )
    torch.manual_seed(0)
    flip = mod(torch.zeros(1, T, 2), torch.zeros(1, T, dtype=torch.long)).b_BT != (p >= 0.5)
    if noise == "none":
        assert not flip.any()
    else:
        # E|flip| = E over p of P(N(0, 0.1) crosses 0.5 - p) = 0.1 * sqrt(2/pi) = 0.080 for p uniform
        assert flip.float().mean().item() == pytest.approx(0.1 * (2 / torch.pi) ** 0.5, abs=0.01)
        assert not flip[0, (p[0] - 0.5).abs() > 0.45].any()


def test_fixed_router_refuses_settings_it_cannot_honour():
    from configs.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match="modality_target_ratios needs a learned router"):
        from_dict(
            ChunkConfig, {"router": "fixed", "modality_target_ratios": {"text": 2.0, "image": 2.0}}
        )
    with pytest.raises(ConfigError, match="rounds below 2"):
        from_dict(ChunkConfig, {"router": "fixed", "target_ratio": 1.4})


def test_topk_router_keeps_the_best_n_over_R_tokens_per_document_and_a_causal_threshold_at_inference():
    """Synergy eq. 1-2: in training each n-token document keeps its ceil(n / R) best-scoring tokens
    (plus its first); the threshold that inference uses instead follows the scores' (1 - 1/R)
    quantile, so eval-mode boundaries come at about 1/R of the tokens and depend on each token alone
    (a prefix never changes)."""
    torch.manual_seed(0)
    mod = ChunkModule(ChunkConfig(router="topk", target_ratio=4.0), 8).train()
    doc = torch.tensor([[0] * 20 + [1] * 9 + [-1] * 3, [2] * 32])
    for _ in range(60):
        h = torch.randn(2, 32, 8)
        ch = mod(h, doc)
        w = mod.score(h).squeeze(-1)
        for row, lo, hi in ((0, 0, 20), (0, 20, 29), (1, 0, 32)):
            b = ch.b_BT[row, lo:hi]
            k = -(-(hi - lo) // 4)
            best = set(w[row, lo:hi].topk(k).indices.tolist())
            assert set(b.nonzero().squeeze(1).tolist()) - {0} == best - {0} and b[0]
        assert not ch.b_BT[0, 29:].any()  # padding
    mod.eval()
    big_doc = torch.arange(64).repeat_interleave(64).view(8, 512)  # 64 documents of 64 tokens
    rate = mod(torch.randn(8, 512, 8), big_doc).b_BT.float().mean().item()
    # about 1/R (+ 1/64 document starts)
    assert 0.2 < rate < 0.33
    h = torch.randn(2, 32, 8)
    full = mod(h, doc).b_BT
    assert torch.equal(mod(h[:, :12], doc[:, :12]).b_BT, full[:, :12])  # a prefix decides alone


# ---------------------------------------------------------------- the modules' single-token steps
def _step_setup(router, merge="sum", residual="identity", T=12, t0=4, B=2, D=16):
    """A chunk module and a dechunk (eval mode), rows of one document each, the
    whole-sequence forward, and the state a prompt of the first t0 tokens leaves (as
    ConceptMoELM.prefill builds it)."""
    torch.manual_seed(0)
    cfg = ChunkConfig(router=router, merge=merge, residual=residual, target_ratio=3.0)
    chunker, de = ChunkModule(cfg, D).eval(), Dechunk(cfg, D)
    with torch.no_grad():
        if de.residual is not None:  # not the identity: the step must apply the projection
            de.residual.weight.add_(torch.randn(D, D) * 0.1)
    concept_model = lambda c: torch.tanh(c) * 1.5 - 0.2  # noqa: E731  (stands in for the concept layers)
    h = torch.randn(B, T, D)
    doc = torch.zeros(B, T, dtype=torch.long)

    def run(h_, doc_):
        ch = chunker(h_, doc_)
        c_in = chunker.merge(h_, doc_, ch)
        c_out = concept_model(c_in)
        z, c, c_in_read = de(h_, c_out, ch, c_in)
        return ch, c_in, c_out, z, c, c_in_read

    ch0, _, _, _, c0, c_in0 = run(h[:, :t0], doc[:, :t0])
    state = ChunkState.join(
        chunker.prefill_state(h[:, :t0], doc[:, :t0], ch0),
        de.prefill_state(doc[:, :t0], ch0, c0, c_in0),
    )
    return chunker, de, concept_model, h, run(h, doc), state


@pytest.mark.parametrize("merge", ["last", "sum", "mean"])
@pytest.mark.parametrize("router", ["cosine", "linear", "fixed", "topk"])
def test_chunk_step_token_by_token_equals_the_forward_and_merge(router, merge):
    """ChunkModule.step on one token at a time after a prompt: the boundary probability and
    decision `forward` gives that position, and for the rows that fired their concept as `merge`
    builds it and its gate (topk). Every row is computed (fixed shapes); the rows that did not fire
    are not read."""
    chunker, _, _, h, (ch, c_in, *_), state = _step_setup(router, merge)
    t0, T = 4, h.shape[1]
    fired = 0
    for t in range(t0, T):
        ck = chunker.step(h[:, t], state)
        torch.testing.assert_close(ck.p_B, ch.p_BT[:, t].float(), rtol=1e-5, atol=1e-5)
        assert torch.equal(ck.b_B, ch.b_BT[:, t])
        assert ck.c_BD.shape[0] == h.shape[0]
        rows = ch.b_BT[:, t].nonzero().squeeze(1)
        idx = ch.cidx_BT[rows, t]
        torch.testing.assert_close(ck.c_BD[rows], c_in[rows, idx], rtol=1e-5, atol=1e-5)
        if router == "topk":
            torch.testing.assert_close(
                ck.gate_B[rows], ch.cgate_BM[rows, idx], rtol=1e-5, atol=1e-6
            )
        else:
            assert ck.gate_B is None
        fired += rows.numel()
    assert 0 < fired < (T - t0) * h.shape[0]  # both cases met: the check is not vacuous


@pytest.mark.parametrize("residual", ["identity", "linear", "delta"])
@pytest.mark.parametrize("router", ["cosine", "topk"])
def test_dechunk_step_token_by_token_equals_the_forward(router, residual):
    """Dechunk.step after a prompt, fed the chunk module's step and the concept model's output
    (every row computes; the rows that did not fire must ignore it): every later position's z
    (eq. 10), the EMA concept it reads (eq. 8-9), the concept count, and for the rows that
    fired the smoothed new concept the cross-attention decoder appends, as `forward` / `smooth`
    give them for the whole sequence (Synergy's gate with the topk router; the EMA over the
    inputs with "delta")."""
    chunker, de, concept_model, h, (ch, _, c_out, z, c, _), state = _step_setup(
        router, "sum", residual
    )
    smoothed = de.smooth(c_out, ch)
    t0, T = 4, h.shape[1]
    fired = 0
    for t in range(t0, T):
        ck = chunker.step(h[:, t], state)
        rows = ck.b_B.nonzero().squeeze(1)
        fired += rows.numel()
        d = de.step(h[:, t, None], concept_model(ck.c_BD)[:, None], ck, state)
        torch.testing.assert_close(d.z_B1D[:, 0], z[:, t], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(d.c_B1D[:, 0], c[:, t], rtol=1e-5, atol=1e-5)
        assert torch.equal(state.n_concepts_B, ch.b_BT[:, : t + 1].sum(1))
        torch.testing.assert_close(
            d.c_B1D[rows, 0], smoothed[rows, ch.cidx_BT[rows, t]], rtol=1e-5, atol=1e-5
        )
    assert 0 < fired < (T - t0) * h.shape[0]
