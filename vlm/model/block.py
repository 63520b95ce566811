"""Pre-norm transformer block (attention [+ cross-attention to concepts] + MoE feed-forward) and the packed-row
context a stack shares."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

from vlm.model.attention import Attention, doc_segments, flash_layout, packed_mask, resolve_backend
from vlm.model.cache import KVCache
from vlm.model.config import MoEConfig
from vlm.model.cross_attention import ConceptMemory, ConceptStep, CrossAttention
from vlm.model.layers import RMSNorm, rope_cos_sin
from vlm.model.moe import MoE, MoEStats


@dataclass
class StackContext:
    """What every layer of one stack needs about the packed rows; built once per stack and forward, so that
    no layer synchronises with the host (boolean indexing would, once per layer)."""

    doc_BT: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor] | None
    backend: str
    mask: object              # per backend: bool [B, 1, T, T] mask, document segments, or the flash layout
    valid_N: torch.Tensor     # flat indices (into B * T) of the real tokens: the ones the experts see
    window: int = 0           # sliding-window attention (0: the whole document)

    @staticmethod
    def build(doc_BT, positions_BT, head_dim, theta, dtype, backend, use_rope=True, window: int = 0) -> "StackContext":
        backend = resolve_backend(backend, doc_BT.device)
        rope = rope_cos_sin(positions_BT, head_dim, theta, dtype) if use_rope else None
        mask = packed_mask(doc_BT, window=window) if backend in ("sdpa", "eager") else \
            doc_segments(doc_BT) if backend == "docs" else flash_layout(doc_BT) if backend == "flash" else None
        valid_N = mask[0] if backend == "flash" else (doc_BT >= 0).flatten().nonzero().squeeze(1)
        return StackContext(doc_BT, rope, backend, mask, valid_N, window)


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, qk_norm: bool,
                 norm_eps: float, moe: MoEConfig, init_std: float, joint: bool = False, cross: bool = False):
        """`joint`: the self-attention reads the concept (eq. 11); `cross`: a cross-attention sublayer to the
        concepts follows it (DLCM eq. 12-14)."""
        super().__init__()
        self.attn_norm = RMSNorm(dim, norm_eps)
        self.attn = Attention(dim, num_heads, num_kv_heads, head_dim, qk_norm, norm_eps, joint=joint)
        self.cross_norm = RMSNorm(dim, norm_eps) if cross else None
        self.cross = CrossAttention(dim, num_heads, num_kv_heads, head_dim, qk_norm, norm_eps) if cross else None
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.moe = MoE(moe, dim, init_std)

    def forward(self, x_BTD: torch.Tensor, ctx: StackContext, c: torch.Tensor | ConceptMemory | None = None,
                cache: KVCache | None = None, cross_cache: KVCache | None = None):
        """`c`: what this layer reads of the concepts, the EMA concept of each token (joint) or the concept memory
        (cross-attention); `cross_cache` (prefill) receives the cross-attention's concept keys and values."""
        c_BTD = c if self.attn.joint else None
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), ctx.doc_BT, ctx.rope, ctx.backend, ctx.mask, c_BTD, cache,
                                  window=ctx.window)
        if self.cross is not None and c is not None:   # DLCM eq. 14's residual
            x_BTD = x_BTD + self.cross(self.cross_norm(x_BTD), c, ctx.doc_BT, ctx.backend, cross_cache)
        # Only real tokens reach the experts: padding would distort loads and the balancing bias.
        x_ND = x_BTD.flatten(0, 1)
        y_ND, stats = self.moe(self.ffn_norm(x_ND.index_select(0, ctx.valid_N)))
        return x_ND.index_add(0, ctx.valid_N, y_ND).view_as(x_BTD), stats

    def allocate_cache(self, B: int, capacity: int, like: torch.Tensor, window: int = 0) -> KVCache:
        """The self-attention's cache for `step`: `capacity` positions per row (`like`: dtype and device)."""
        return KVCache.allocate(B, self.attn.kv, capacity, self.attn.hd, like.dtype, like.device, window)

    def step(self, x_R1D: torch.Tensor, rope, cache: KVCache, rows: torch.Tensor,
             c: torch.Tensor | ConceptStep | None = None, cross_cache: KVCache | None = None) -> torch.Tensor:
        """One new position for each of `rows` (every one a real token: no padding to skip). `c`: the row's
        EMA concept (joint) or the concepts that closed with this token (cross-attention, every row present)."""
        x_R1D = x_R1D + self.attn.step(self.attn_norm(x_R1D), rope, cache, rows, c if self.attn.joint else None)
        if self.cross is not None and c is not None:
            x_R1D = x_R1D + self.cross.step(self.cross_norm(x_R1D), c, cross_cache)
        y_RD, _ = self.moe(self.ffn_norm(x_R1D[:, 0]))
        return x_R1D + y_RD[:, None]


def run_stack(blocks: nn.ModuleList, x_BTD, ctx: StackContext, schedule: list[int] | None = None,
              c_BTD=None, joint_from: int | None = None, caches: list[KVCache] | None = None,
              checkpoint: bool = False, states: list | None = None, cross_caches: list[KVCache] | None = None
              ) -> tuple[torch.Tensor, list[MoEStats]]:
    """Run `blocks` in `schedule` order (layer loops repeat indices); layers >= joint_from get the concept input
    (`c_BTD`: a tensor for joint decoding, a ConceptMemory for cross-attention, whose prefill caches are
    `cross_caches`, one per layer from joint_from on). `checkpoint`: gradient checkpointing per block; `states`
    collects each block's output."""
    stats = []
    for n, i in enumerate(schedule if schedule is not None else range(len(blocks))):
        c = c_BTD if joint_from is not None and i >= joint_from else None
        cache = caches[n] if caches is not None else None
        xc = cross_caches[i - joint_from] if cross_caches and c is not None else None
        if checkpoint and blocks[i].training and cache is None:   # activations recomputed in the backward
            x_BTD, s = torch.utils.checkpoint.checkpoint(blocks[i], x_BTD, ctx, c, None, use_reentrant=False)
        else:
            x_BTD, s = blocks[i](x_BTD, ctx, c, cache, xc)
        stats.append(s)
        if states is not None:
            states.append(x_BTD)
    return x_BTD, stats


def allocate_stack_caches(blocks: nn.ModuleList, B: int, capacity: int, like: torch.Tensor,
                          schedule: list[int] | None = None, window: int = 0) -> list[KVCache]:
    """One self-attention cache per pass of `schedule` (a looped layer has one per pass), as `step_stack` reads them."""
    return [blocks[i].allocate_cache(B, capacity, like, window)
            for i in (schedule if schedule is not None else range(len(blocks)))]


def allocate_cross_caches(blocks: nn.ModuleList, B: int, capacity: int, like: torch.Tensor) -> list[KVCache]:
    """One concept cache per cross-attending block, in order (`capacity` concepts per row)."""
    return [blk.cross.allocate_cache(B, capacity, like) for blk in blocks if blk.cross is not None]


def step_stack(blocks: nn.ModuleList, x_R1D, rope, caches: list[KVCache], rows: torch.Tensor,
               schedule: list[int] | None = None, c_R1D=None, joint_from: int | None = None,
               cross_caches: list[KVCache] | None = None) -> torch.Tensor:
    """`run_stack` for one new position per row of `rows`, reading and extending the caches (one per pass)."""
    for n, i in enumerate(schedule if schedule is not None else range(len(blocks))):
        c = c_R1D if joint_from is not None and i >= joint_from else None
        xc = cross_caches[i - joint_from] if cross_caches and c is not None else None
        x_R1D = blocks[i].step(x_R1D, rope, caches[n], rows, c, xc)
    return x_R1D
