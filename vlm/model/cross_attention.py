"""DLCM's causal cross-attention decoder (DLCM 3.5.2, eq. 12-14) by concept replication
(4.1, eq. 17).

Legend: B rows, T tokens, D width, M concept slots, Q query heads, J key/value heads, d head width.

`model.decoder_mode: cross_attention` gives every concept-reading decoder layer (the same layers
joint decoding, ConceptMoE eq. 11, would use) a cross-attention sublayer between its self-attention
and its MoE: queries from the token stream (eq. 12), keys and values from the smoothed concepts (eq.
13; the smoothing S of DLCM 3.5.1 is the dechunk's EMA, ConceptMoE eq. 8), and `x + W_O softmax(QK^T
/ sqrt(d) + M) V` (eq. 14). Token t attends to the concepts 0 .. psi(t) of its own document, psi the
dechunk's index (the concept the token reads, closed at or before t), so no token sees a concept
built from later tokens. The decoder's input is still eq. 10's z: this mode replaces eq. 11 only.

Replication made exact. Eq. 17 repeats each concept's key and value at every token position that
reads it, so that the ordinary L x L causal kernels (every backend in attention.py, packed documents
included) apply. Done naively that is not eq. 14: under a causal L x L mask token t sees concept m
once per token of m up to t, so the softmax weighs each earlier concept by its length (and the
current one by the tokens of it so far), which the L x M softmax over distinct concepts does not. A
key-side bias of -log(length) cannot fix it (the current concept's count depends on the query).
Instead only each concept's first copy, at its closing boundary, stays live: the others get a score
of about -3e4 / sqrt(d), whose exp is exactly 0 in fp32 and bf16. No kernel takes a per-key bias, so
it rides in one extra head dimension: q gets a constant 1, k gets 0 (live) or -3e4 (copy), v gets 0,
and q is scaled so that the kernel's 1 / sqrt(d + 1) becomes eq. 14's 1 / sqrt(d). A live key's
score is then exactly q.k / sqrt(d) and every copy's weight exactly 0: the result is eq. 14's L x M
attention (tested against it), with the kernels' linear memory and no mask beyond the stack's own.
The cost is DLCM's trade: L x L instead of L x M score pairs (R times the ideal), and one more head
dimension. flash-attn 2 takes head dimensions up to 256, so a 256-wide head (257 with the extra one)
runs on SDPA under the packed mask instead (`cross_backend`; T x T mask memory per row).

Inference needs no replication: the cache keeps one key/value per realized concept (appended when a
boundary fires) and each new token attends over its row's concepts, eq. 14 for one query.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from vlm.model.attention import attend, packed_mask
from vlm.model.cache import KVCache
from vlm.model.layers import RMSNorm

# Added to a replicated (not first) copy's q.k before the 1 / sqrt(d) scaling: finite in fp16/bf16
# (no inf - inf anywhere), and for d <= 256 it puts the copy >= 1875 below its live original, so as
# long as a row's real scores span less than ~1700 (RMS-normed q, k: at most d times the norm gains)
# exp underflows to exactly 0 (fp32 < e^-104).
COPY_SCORE = -3.0e4
FLASH_MAX_HEAD_DIM = 256  # flash-attn 2's largest head dimension


def cross_backend(backend: str, head_dim: int) -> str:
    """The backend the replicated cross-attention runs on: the stack's, except that flash cannot
    take the extra bias dimension when head_dim + 1 > 256, and FlexAttention's kernels want
    power-of-two head dimensions; SDPA under the packed mask computes the same thing there."""
    if (backend in ("flash", "varlen") and head_dim + 1 > FLASH_MAX_HEAD_DIM) or backend == "flex":
        return "sdpa"
    return backend


@dataclass
class ConceptMemory:
    """What the cross-attention layers of one decoder forward read (built once per forward, shared by layers)."""

    concepts_BMD: torch.Tensor  # the smoothed concepts Z~ (eq. 8's EMA at concept level)
    # psi(n): the concept token n reads (-1 at padding), the dechunk's index
    cidx_BT: torch.Tensor
    # bool: n is the first position that reads its concept (its boundary) or padding
    first_BT: torch.Tensor
    n_concepts_B: torch.Tensor  # concepts per row (the prefill's cache lengths)
    mask: object  # what `attend` takes for this stack, without any sliding window
    # the packed mask where `cross_backend` leaves flash (built once, shared)
    sdpa_mask: torch.Tensor | None = None

    @staticmethod
    def build(concepts_BMD, cidx_BT, b_BT, doc_BT, ctx, head_dim: int) -> "ConceptMemory":
        """`ctx`: the decoder's StackContext; cross-attention sees every earlier concept even when
        the self-attention has a window, so the sdpa/eager mask is rebuilt without it (segments and
        the flash layout carry no window). A boundary past the concept capacity (cidx -1) has no
        concept: its copy is dead too."""
        mask = ctx.mask
        if ctx.window and ctx.backend in ("sdpa", "eager"):
            mask = packed_mask(doc_BT)
        sdpa_mask = (
            packed_mask(doc_BT) if cross_backend(ctx.backend, head_dim) != ctx.backend else None
        )
        first_BT = (b_BT & (cidx_BT >= 0)) | (doc_BT < 0)
        n_concepts_B = b_BT.sum(1).clamp_max(concepts_BMD.shape[1])
        return ConceptMemory(concepts_BMD, cidx_BT, first_BT, n_concepts_B, mask, sdpa_mask)


@dataclass
class ConceptStep:
    """Decode step: the concepts that closed with this token, to append to the caches (fixed shapes:
    every row writes, the rows whose boundary fired keep the entry)."""

    # every row's smoothed concept after this token (new where `fired_B`)
    concepts_B1D: torch.Tensor
    # bool: the rows whose boundary fired (the others keep their caches' lengths)
    fired_B: torch.Tensor


def replicate(x_BJMd: torch.Tensor, cidx_BT: torch.Tensor) -> torch.Tensor:
    """Eq. 17: concept m's key (or value) at every token position that reads it, [B, J, T, d] (a
    gather by the dechunk's index psi; `repeat_interleave` by segment lengths in the paper)."""
    B, J, _, d = x_BJMd.shape
    idx = cidx_BT.clamp_min(0)[:, None, :, None].expand(B, J, -1, d)
    return x_BJMd.gather(2, idx)


def replicated_cross_attention(
    q_BQTd, k_BJMd, v_BJMd, mem: ConceptMemory, doc_BT, backend: str
) -> torch.Tensor:
    """Eq. 14's attention (before W_O) over replicated concepts with a causal L x L kernel: each
    token attends to the first copies of concepts 0 .. psi(t) of its document, i.e. to each of those
    concepts exactly once."""
    d = q_BQTd.shape[-1]
    mask = mem.mask
    if cross_backend(backend, d) != backend:  # built with the memory (ConceptMemory.build)
        backend, mask = cross_backend(backend, d), mem.sdpa_mask
    k_BJTd, v_BJTd = replicate(k_BJMd, mem.cidx_BT), replicate(v_BJMd, mem.cidx_BT)
    B, J, T, _ = k_BJTd.shape
    bias_BJT1 = (
        torch.where(mem.first_BT, 0.0, COPY_SCORE)
        .to(k_BJTd.dtype)[:, None, :, None]
        .expand(B, J, T, 1)
    )
    # the kernel scales by 1 / sqrt(d + 1); this factor makes it eq. 14's 1 / sqrt(d)
    q1 = torch.cat([q_BQTd, q_BQTd.new_ones(*q_BQTd.shape[:-1], 1)], -1) * math.sqrt((d + 1) / d)
    k1 = torch.cat([k_BJTd, bias_BJT1], -1)
    v1 = torch.cat([v_BJTd, v_BJTd.new_zeros(B, J, T, 1)], -1)
    return attend(q1, k1, v1, doc_BT, backend, mask)[..., :d]


class CrossAttention(nn.Module):
    """Causal cross-attention from tokens to concepts, DLCM eq. 12-14 (the residual `+ H` is the block's)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm: bool,
        norm_eps: float,
    ):
        super().__init__()
        self.h, self.kv, self.hd = num_heads, num_kv_heads, head_dim
        # the concepts come from another stack (pre-norm, as eq. 11's c)
        self.concept_norm = RMSNorm(dim, norm_eps)
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, bias=False)
        # DLCM eq. 16: RMSNorm on queries and keys, where the self-attention has it
        # too (model.qk_norm)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def queries(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """Eq. 12 (and eq. 16's norm): Q = H W_Q, [B, heads, T, d]."""
        B, T, _ = x_BTD.shape
        q = self.q_proj(x_BTD).view(B, T, self.h, self.hd).transpose(1, 2)
        return self.q_norm(q) if self.q_norm is not None else q

    def concept_kv(self, concepts_BMD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 13 (and eq. 16's norm): K = Z~ W_K, V = Z~ W_V, once per concept, [B, kv_heads, M, d]."""
        B, M, _ = concepts_BMD.shape
        c = self.concept_norm(concepts_BMD)
        k = self.k_proj(c).view(B, M, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(c).view(B, M, self.kv, self.hd).transpose(1, 2)
        return (self.k_norm(k) if self.k_norm is not None else k), v

    def out(self, o_BQTd: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = o_BQTd.shape
        return self.o_proj(o_BQTd.transpose(1, 2).reshape(B, T, self.h * self.hd))

    def forward(
        self, x_BTD, mem: ConceptMemory, doc_BT, backend: str, cache: KVCache | None = None
    ):
        """Eq. 14 without the residual. `cache` (prefill, one document per row): the concepts' keys and values."""
        k, v = self.concept_kv(mem.concepts_BMD)
        if cache is not None:
            cache.fill(k, v, mem.n_concepts_B)
        return self.out(replicated_cross_attention(self.queries(x_BTD), k, v, mem, doc_BT, backend))

    def allocate_cache(self, B: int, capacity: int, like: torch.Tensor) -> KVCache:
        """The concept keys and values `step` reads: `capacity` concepts per row (`like`: dtype and device)."""
        return KVCache.allocate(B, self.kv, capacity, self.hd, like.dtype, like.device)

    def step(self, x_B1D, new: ConceptStep, cache: KVCache) -> torch.Tensor:
        """One new token per row: the rows whose boundary fired first append their new concept, then
        every row's query attends over its concepts (each once: the cache holds no copies)."""
        k, v = self.concept_kv(new.concepts_B1D)
        cache.append(k, v, new.fired_B)
        return self.out(cache.attend(self.queries(x_B1D)))
