"""Attention over packed rows: backends, and the GQA self-attention layer with joint
decoding (eq. 11).

Legend: B rows, T tokens, D width, N flat tokens or patches, Q query heads, J key/value heads, d
head width.

Every backend computes the same thing: causal attention restricted to the query's own document.
The choice is one function (`resolve_backend`), picked at run time; tests compare them on one input.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vlm.model.cache import KVCache
from vlm.model.layers import RMSNorm, apply_rope, rms_norm
from vlm.model.sequence_parallel import SequenceShard, ulysses_attention

try:  # optional GPU kernel
    from flash_attn import flash_attn_varlen_func  # type: ignore
except Exception:  # noqa: BLE001 - pragma: no cover - not installable on CPU machines
    flash_attn_varlen_func = None

try:  # PyTorch's own varlen flash kernel (CUDA only, torch >= 2.10)
    from torch.nn.attention.varlen import varlen_attn
except Exception:  # noqa: BLE001 - pragma: no cover - older torch
    varlen_attn = None


def resolve_backend(requested: str, device: torch.device, compiled: bool = False) -> str:
    """The attention backend that runs: `requested`, or for "auto" flash-attn on CUDA when
    installed, else a compiled FlexAttention document mask (fused, no T x T mask, no host
    synchronisation), and on CPU one SDPA per document. `compiled` (the blocks are compiled, or this
    runs under torch.compile): the per-document loop, which reads the documents on the host, becomes
    SDPA under the packed mask."""
    compiled = compiled or torch.compiler.is_compiling()
    if requested != "auto":
        if requested == "flash" and (flash_attn_varlen_func is None or device.type != "cuda"):
            raise RuntimeError(
                "attn_backend='flash' needs the flash-attn package and a CUDA device"
            )
        if requested == "varlen" and (varlen_attn is None or device.type != "cuda"):
            raise RuntimeError(
                "attn_backend='varlen' needs a CUDA device and "
                "torch >= 2.10 (torch.nn.attention.varlen)"
            )
        return "sdpa" if requested == "docs" and compiled else requested
    if device.type == "cuda":
        return "flash" if flash_attn_varlen_func is not None else "flex"
    # On CPU one SDPA call per document beats SDPA under the packed [B, 1, T, T] mask (prefill 0.57x
    # at 2K, 0.23x at 8K; `vlm bench attention`) and keeps memory linear in T.
    return "sdpa" if compiled else "docs"


def packed_mask(doc_BT: torch.Tensor, causal: bool = True, window: int = 0) -> torch.Tensor:
    """[B, 1, T, T] bool: may query i attend key j? Same document (and j <= i when causal;
    with a sliding `window` > 0 also i - j < window: each query sees itself and the window - 1
    keys before it).

    Padding queries (doc -1) attend only to themselves so that no row of the softmax is empty. What
    a padding position holds after attention differs between backends (the varlen kernels and the
    per-document loop give 0): no real token and no loss reads it.
    """
    T = doc_BT.shape[1]
    same = (doc_BT[:, :, None] == doc_BT[:, None, :]) & (doc_BT[:, None, :] >= 0)
    if causal:
        same &= torch.ones(T, T, dtype=torch.bool, device=doc_BT.device).tril()
    if window:
        same &= torch.ones(T, T, dtype=torch.bool, device=doc_BT.device).triu(-(window - 1))
    same |= torch.eye(T, dtype=torch.bool, device=doc_BT.device)
    return same[:, None]


def doc_segments(doc_BT: torch.Tensor) -> list[list[tuple[int, int, bool]]]:
    """Per row, its runs in order as (start, end, is_document): the documents and the padding
    between and after them, covering [0, T) (one host transfer; built once per stack)."""
    B, T = doc_BT.shape
    starts_BT = torch.ones_like(doc_BT, dtype=torch.bool)
    starts_BT[:, 1:] = doc_BT[:, 1:] != doc_BT[:, :-1]
    rows, cols = starts_BT.nonzero(as_tuple=True)
    docs = doc_BT[rows, cols]
    runs: list[list[tuple[int, int, bool]]] = [[] for _ in range(B)]
    for r, s, d in zip(rows.tolist(), cols.tolist(), docs.tolist()):
        if runs[r]:
            runs[r][-1] = (runs[r][-1][0], s, runs[r][-1][2])
        runs[r].append((s, T, d >= 0))
    return runs


def _per_document(q, k, v, doc_BT, segments, causal, window):
    """One SDPA call per document: no T x T mask, memory linear in the row length (a loop over
    documents, not tokens). Padding comes out as 0, as from the varlen kernels (what a padding
    position holds is read by no real token and no loss). The row is the concatenation of its runs'
    outputs: a cat's backward is views, where writing into a buffer would cost a copy and a fill
    each way."""
    rep = q.shape[1] // k.shape[1]
    rows = []
    for b, runs in enumerate(segments):
        parts = []
        for s, e, is_doc in runs:
            if not is_doc:
                parts.append(q.new_zeros(1, q.shape[1], e - s, v.shape[-1]))
                continue
            qs, ks, vs = q[b : b + 1, :, s:e], k[b : b + 1, :, s:e], v[b : b + 1, :, s:e]
            mask = None
            if window and e - s > window:
                n = e - s
                mask = (
                    torch.ones(n, n, dtype=torch.bool, device=q.device).tril().triu(-(window - 1))
                )
            parts.append(
                F.scaled_dot_product_attention(
                    qs,
                    ks,
                    vs,
                    attn_mask=mask,
                    is_causal=causal and mask is None,
                    enable_gqa=rep > 1,
                )
            )
        rows.append(torch.cat(parts, 2) if len(parts) > 1 else parts[0])
    return torch.cat(rows, 0) if len(rows) > 1 else rows[0]


def _eager(q, k, v, mask_B1TT):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask_B1TT, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


def flash_layout(doc_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The varlen layout of packed rows, built once per stack so no layer syncs with the host: flat
    indices of the real tokens, cumulative segment lengths (one segment per (row, document)) and the
    longest segment."""
    B, T = doc_BT.shape
    valid_N = (doc_BT >= 0).flatten().nonzero().squeeze(1)
    # offset doc ids by row so that segments of two rows never merge
    seg_N = (doc_BT + torch.arange(B, device=doc_BT.device)[:, None] * (T + 1)).flatten()[valid_N]
    _, counts = torch.unique_consecutive(seg_N, return_counts=True)
    cu = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    return valid_N, cu, int(counts.max()) if counts.numel() else 0


def _varlen(q, k, v, layout, causal, window=0, kernel: str = "flash"):
    """The packed rows' real tokens as one varlen batch of documents through flash-attn's kernel
    ("flash") or PyTorch's own (`torch.nn.attention.varlen`, "varlen"); padding comes out as 0."""
    B, Q, T, d = q.shape
    valid_N, cu, longest = layout
    pick = lambda x: x.transpose(1, 2).flatten(0, 1).index_select(0, valid_N)  # noqa: E731  [N, heads, d]
    # both take (left, right) windows: causal is (-1, 0); a window of w keys is w - 1 to the left
    left = window - 1 if window else -1
    if kernel == "flash":
        out = flash_attn_varlen_func(
            pick(q),
            pick(k),
            pick(v),
            cu,
            cu,
            longest,
            longest,
            causal=causal,
            window_size=(left, 0) if window else (-1, -1),
        )
    else:
        out = varlen_attn(
            pick(q),
            pick(k),
            pick(v),
            cu,
            cu,
            longest,
            longest,
            window_size=(left, 0 if causal else -1),
            enable_gqa=k.shape[1] != Q,
        )
    full = q.new_zeros(B * T, Q, d).index_copy(0, valid_N, out)
    return full.view(B, T, Q, d).transpose(1, 2)


def document_block_mask(doc_BT: torch.Tensor, causal: bool = True, window: int = 0):
    """FlexAttention's BlockMask for packed rows: the same rule as `packed_mask` (same document,
    causal, the sliding window; padding attends to itself), evaluated blockwise so that fully masked
    blocks (other documents, the future, padding) are skipped. Built once per stack; compiled when
    built outside torch.compile."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = doc_BT.shape

    def mask_mod(b, h, qi, ki):
        same = (doc_BT[b, qi] == doc_BT[b, ki]) & (doc_BT[b, ki] >= 0)
        if window:
            same = same & (qi - ki < window)
        if causal:
            same = same & (ki <= qi)
        return same | (qi == ki)

    return create_block_mask(
        mask_mod, B, None, T, T, device=doc_BT.device, _compile=not torch.compiler.is_compiling()
    )


_COMPILED_FLEX = None


def _flex():
    """flex_attention, compiled when called from eager code (uncompiled, it materialises the
    scores); under torch.compile the surrounding graph compiles it. Shapes are automatically dynamic
    after the first new one (generation and evaluation meet many lengths: one graph each would soon
    pass dynamo's recompile limit, past which flex would run uncompiled)."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention)
    return _COMPILED_FLEX


def attend(
    q_BQTd,
    k_BJTd,
    v_BJTd,
    doc_BT,
    backend: str,
    doc_mask=None,
    causal: bool = True,
    window: int = 0,
):
    """Packed attention. `doc_mask` may be passed in to share it across the layers of a stack (it
    then already holds the sliding `window`); what it is depends on the backend: "sdpa" and "eager"
    a bool [B, 1, T, T] tensor (`packed_mask`), "flash" and "varlen" the varlen layout
    (`flash_layout`: token indices, cumulative lengths, longest segment), "docs" the per-row
    document segments (`doc_segments`), "flex" a FlexAttention BlockMask
    (`document_block_mask`)."""
    if backend in ("flash", "varlen"):
        layout = doc_mask if doc_mask is not None else flash_layout(doc_BT)
        return _varlen(q_BQTd, k_BJTd, v_BJTd, layout, causal, window, backend)
    if backend == "docs":
        segments = doc_mask if doc_mask is not None else doc_segments(doc_BT)
        return _per_document(q_BQTd, k_BJTd, v_BJTd, doc_BT, segments, causal, window)
    if backend == "flex":
        block_mask = (
            doc_mask if doc_mask is not None else document_block_mask(doc_BT, causal, window)
        )
        return _flex()(
            q_BQTd,
            k_BJTd,
            v_BJTd,
            block_mask=block_mask,
            enable_gqa=k_BJTd.shape[1] != q_BQTd.shape[1],
        )
    if doc_mask is None:
        doc_mask = packed_mask(doc_BT, causal, window)
    if backend == "eager":
        return _eager(q_BQTd, k_BJTd, v_BJTd, doc_mask)
    return F.scaled_dot_product_attention(
        q_BQTd, k_BJTd, v_BJTd, attn_mask=doc_mask, enable_gqa=k_BJTd.shape[1] != q_BQTd.shape[1]
    )


class Attention(nn.Module):
    """GQA self-attention with RoPE, optional QK-norm and optional joint decoding (ConceptMoE eq. 11)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm: bool,
        norm_eps: float,
        joint: bool = False,
    ):
        super().__init__()
        self.h, self.kv, self.hd = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.joint = joint
        if joint:
            self.concept_norm = RMSNorm(dim, norm_eps)
            self.cq_proj = nn.Linear(dim, num_heads * head_dim, bias=False)
            self.ck_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
            self.cv_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=False)

    def joint_qkv(self, x_BTD, c_BTD):
        """Eq. 11: q = z W_q + c W^c_q (same for k, v), c the EMA concept each token reads.

        One deviation (docs/deviations.md): c is RMS-normed first. In a pre-norm layer the token
        side of eq. 11 is the normed z (the block's attn_norm) while c is the concept model's raw
        residual stream, whose scale is set by the concept stack's depth and width: 0.09-0.13 of the
        normed z's RMS in the 300-step experiment_text runs, and larger in deep models. The norm
        puts both sums on one scale, and the gradient of W^c (zero when converting a pretrained MoE)
        independent of that stream's. It costs nothing measurable: held-out loss at step 300, 3
        seeds, 0.9799 with it and 0.9799 without.

        Returned fused, [B, T, (heads + 2 kv_heads) * head_dim]: one matmul for q, k and v (the
        weights keep their transformers names and are concatenated per call)."""
        qkv = F.linear(
            x_BTD, torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        )
        if self.joint and c_BTD is not None:
            c = self.concept_norm(c_BTD)
            qkv = qkv + F.linear(
                c, torch.cat([self.cq_proj.weight, self.ck_proj.weight, self.cv_proj.weight])
            )
        return qkv

    def _heads(self, x_BTD, c_BTD, rope):
        """q [B, heads, T, d], k and v [B, kv_heads, T, d]: QK-norm and RoPE applied to queries and
        keys together (one kernel chain for both; the norm's weight per head)."""
        B, T, _ = x_BTD.shape
        qkv = self.joint_qkv(x_BTD, c_BTD).view(B, T, self.h + 2 * self.kv, self.hd).transpose(1, 2)
        qk, v = qkv.split([self.h + self.kv, self.kv], 1)
        if self.q_norm is not None:
            w = torch.cat(
                [self.q_norm.weight.expand(self.h, -1), self.k_norm.weight.expand(self.kv, -1)]
            )
            qk = rms_norm(qk, w[:, None], self.q_norm.eps)
        if rope is not None:
            qk = apply_rope(qk, *rope)
        q, k = qk.split([self.h, self.kv], 1)
        return q, k, v

    def forward(
        self,
        x_BTD,
        doc_BT,
        rope,
        backend: str,
        mask=None,
        c_BTD=None,
        cache: KVCache | None = None,
        window: int = 0,
        shard: SequenceShard | None = None,
    ):
        """`cache` (prefill): each row is one document; its keys and values are kept for `step`.
        `shard` (sequence parallelism): x holds this rank's tokens and `doc_BT` (and `mask`) the
        whole rows': Ulysses' exchange gives each rank the whole row for some heads."""
        B, T, _ = x_BTD.shape
        q, k, v = self._heads(x_BTD, c_BTD, rope)
        if cache is not None:
            cache.fill(k, v, (doc_BT >= 0).sum(1))
        if shard is not None:
            out = ulysses_attention(
                q,
                k,
                v,
                shard,
                lambda q, k, v: attend(q, k, v, doc_BT, backend, mask, window=window),
            )
        else:
            out = attend(q, k, v, doc_BT, backend, mask, window=window)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.h * self.hd))

    def step(self, x_B1D, rope, cache: KVCache, advance_B: torch.Tensor | None = None, c_B1D=None):
        """One new token (or concept) per row, attending over its row's cache; rows with `advance_B`
        False do not keep it (a concept that did not close)."""
        B = x_B1D.shape[0]
        q, k, v = self._heads(x_B1D, c_B1D, rope)
        out = cache.append_and_attend(q, k, v, advance_B)
        return self.o_proj(out.transpose(1, 2).reshape(B, 1, self.h * self.hd))
