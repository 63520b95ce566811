"""DLCM eq. 14 by concept replication: the causal cross-attention decoder's layer
(vlm.model.cross_attention, `model.decoder_mode: cross_attention`) equals the L x M masked form of
eq. 14 written out (each token attends to the concepts 0 .. j(t) of its own document, each concept
once), forward and backward, on every attention backend, with a sliding window that does not limit
the concepts, on a flash kernel that gets only causal varlen segments, and with a 256-wide head that
leaves flash for SDPA. The decoder in the model: tests/test_cross_attention_decoder.py.

Legend: B rows, T tokens, D width, M concept slots.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from vlm.model.block import StackContext
from vlm.model.cross_attention import ConceptMemory, CrossAttention


def packed_case(seed=0):
    """Two packed rows of several documents (and padding) with random boundaries; every document starts one."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.tensor([[0] * 7 + [1] * 12 + [2] * 5 + [-1] * 6, [0] * 3 + [1] * 18 + [2] * 9])
    valid = doc >= 0
    start = valid & torch.cat([torch.ones(2, 1, dtype=torch.bool), doc[:, 1:] != doc[:, :-1]], 1)
    b = ((torch.rand(doc.shape, generator=g) < 0.35) | start) & valid
    cidx = torch.where(valid, b.long().cumsum(1) - 1, -1)
    M = int(b.sum(1).max())
    cdoc = torch.full((2, M), -1)
    for r in range(2):  # the document of each concept: that of its closing boundary
        cdoc[r, : int(b[r].sum())] = doc[r][b[r]]
    return doc, b, cidx, cdoc


def reference_cross_attention(xattn: CrossAttention, x_BTD, concepts_BMD, doc, cidx, cdoc):
    """DLCM eq. 14 as written: token t attends to the concepts 0 .. j(t) of its own document through
    an explicit [L, M] mask, each concept once; no replication."""
    q = xattn.queries(x_BTD)  # [B, Q, T, d]
    k, v = xattn.concept_kv(concepts_BMD)  # [B, J, M, d]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    M = concepts_BMD.shape[1]
    m = torch.arange(M)
    allowed_BTM = (
        (cdoc[:, None, :] == doc[:, :, None])
        & (m[None, None, :] <= cidx[:, :, None])
        & (doc[:, :, None] >= 0)
    )
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed_BTM[:, None], float("-inf"))
    att = torch.nan_to_num(scores.softmax(-1))  # padding queries: no concept at all
    return xattn.out(att @ v)


@pytest.mark.parametrize(
    "backend,window", [("eager", 0), ("sdpa", 0), ("docs", 0), ("sdpa", 3), ("docs", 3)]
)
def test_replicated_cross_attention_equals_the_L_by_M_masked_form(backend, window):
    torch.manual_seed(0)
    doc, b, cidx, cdoc = packed_case()
    B, T = doc.shape
    D, M = 16, cdoc.shape[1]
    xattn = CrossAttention(D, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, norm_eps=1e-6)
    with torch.no_grad():
        for p in xattn.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.ndim == 2 else 1.0))
    x = torch.randn(B, T, D, requires_grad=True)
    concepts = torch.randn(B, M, D, requires_grad=True)
    # the decoder's context: its sliding window must not limit the concepts a token sees
    ctx = StackContext.build(doc, torch.zeros_like(doc), 8, 1e4, x.dtype, backend, window=window)
    mem = ConceptMemory.build(concepts, cidx, b, doc, ctx, xattn.hd)
    got = xattn(x, mem, doc, ctx.backend)
    ref = reference_cross_attention(xattn, x, concepts, doc, cidx, cdoc)
    valid = doc >= 0
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-5, atol=1e-5)
    # the backward too: the same gradients reach the tokens and the concepts
    w = torch.randn_like(ref) * valid[..., None]
    gx_got, gc_got = torch.autograd.grad((got * w).sum(), (x, concepts))
    gx_ref, gc_ref = torch.autograd.grad((ref * w).sum(), (x, concepts))
    torch.testing.assert_close(gx_got, gx_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gc_got, gc_ref, rtol=1e-4, atol=1e-5)
    # Naive replication (every copy live) weighs each earlier concept by its length: not eq. 14.
    naive = xattn(x, dataclasses.replace(mem, first_BT=torch.ones_like(b)), doc, ctx.backend)
    assert not torch.allclose(naive[valid], ref[valid], atol=1e-3)


def _varlen_by_segment(q, k, v, cu_q):
    """A stand-in for flash_attn_varlen_func written from its documented contract: causal SDPA per segment."""
    out = torch.empty_like(q)
    for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        seg = lambda x: x[s:e].transpose(0, 1)[None]  # noqa: E731
        out[s:e] = torch.nn.functional.scaled_dot_product_attention(
            seg(q), seg(k), seg(v), is_causal=True, enable_gqa=True
        )[0].transpose(0, 1)
    return out


def test_replication_needs_only_a_causal_kernel(monkeypatch):
    """The flash path (CUDA) gets no mask at all, only causal varlen segments; checked on CPU
    with a stand-in for flash_attn_varlen_func written from its documented contract: still eq.
    14's L x M form."""
    import vlm.model.attention as attention
    import vlm.model.block as block

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, window_size):
        assert causal and window_size == (-1, -1)  # cross-attention is never windowed
        return _varlen_by_segment(q, k, v, cu_q)

    monkeypatch.setattr(attention, "flash_attn_varlen_func", varlen)
    monkeypatch.setattr(block, "resolve_backend", lambda b, d, compiled=False: b)
    torch.manual_seed(1)
    doc, b, cidx, cdoc = packed_case(seed=1)
    xattn = CrossAttention(
        16, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=False, norm_eps=1e-6
    )
    x, concepts = torch.randn(*doc.shape, 16), torch.randn(2, cdoc.shape[1], 16)
    ctx = StackContext.build(doc, torch.zeros_like(doc), 8, 1e4, x.dtype, "flash", window=3)
    got = xattn(x, ConceptMemory.build(concepts, cidx, b, doc, ctx, xattn.hd), doc, ctx.backend)
    ref = reference_cross_attention(xattn, x, concepts, doc, cidx, cdoc)
    valid = doc >= 0
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-5, atol=1e-5)


def test_a_256_wide_head_leaves_flash_for_sdpa(monkeypatch):
    """The replication's extra bias dimension makes a 256-wide head 257 wide, beyond flash-attn 2's
    limit of 256: that cross-attention runs on SDPA under the packed mask (the stand-in kernel
    refuses > 256 as flash does), still eq. 14, while a 128-wide head stays on flash."""
    import vlm.model.attention as attention
    import vlm.model.block as block
    from vlm.model.cross_attention import cross_backend

    calls = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, window_size):
        assert q.shape[-1] <= 256, f"flash-attn 2 takes head_dim <= 256, got {q.shape[-1]}"
        calls.append(q.shape[-1])
        return _varlen_by_segment(q, k, v, cu_q)

    monkeypatch.setattr(attention, "flash_attn_varlen_func", varlen)
    monkeypatch.setattr(block, "resolve_backend", lambda b, d, compiled=False: b)
    assert cross_backend("flash", 256) == "sdpa" and cross_backend("flash", 255) == "flash"
    assert cross_backend("docs", 256) == "docs"
    torch.manual_seed(2)
    doc, b, cidx, cdoc = packed_case(seed=2)
    for head_dim, used in ((256, []), (128, [129])):
        calls.clear()
        xattn = CrossAttention(
            16, num_heads=2, num_kv_heads=1, head_dim=head_dim, qk_norm=True, norm_eps=1e-6
        )
        x, concepts = torch.randn(*doc.shape, 16), torch.randn(2, cdoc.shape[1], 16)
        ctx = StackContext.build(doc, torch.zeros_like(doc), head_dim, 1e4, x.dtype, "flash")
        got = xattn(x, ConceptMemory.build(concepts, cidx, b, doc, ctx, xattn.hd), doc, ctx.backend)
        ref = reference_cross_attention(xattn, x, concepts, doc, cidx, cdoc)
        valid = doc >= 0
        torch.testing.assert_close(got[valid], ref[valid], rtol=1e-5, atol=1e-5)
        assert calls == used
