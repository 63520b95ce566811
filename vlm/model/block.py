"""Pre-norm transformer block (attention [+ cross-attention to concepts] + MoE feed-forward) and the
packed-row context a stack shares.

Legend: B rows, T tokens, D width, E experts, N flat tokens or patches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

from vlm.model.attention import (
    Attention,
    doc_segments,
    document_block_mask,
    flash_layout,
    packed_mask,
    resolve_backend,
)
from vlm.model.cache import KVCache
from vlm.model.config import MoEConfig
from vlm.model.context import DEFAULT_ROUTER_LOSSES, Statistics
from vlm.model.cross_attention import ConceptMemory, ConceptStep, CrossAttention
from vlm.model.layers import RMSNorm, rope_cos_sin
from vlm.model.moe import MoE, MoEStats
from vlm.model.sequence_parallel import SequenceShard


@dataclass
class StackContext:
    """What every layer of one stack needs about the packed rows; built once per stack and forward,
    outside the
    (compiled) blocks, so that no layer rebuilds a mask or synchronises with the host."""

    doc_BT: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor] | None
    backend: str
    # per backend: bool [B, 1, T, T] mask, BlockMask, document segments, or flash layout
    mask: object
    valid_BT: torch.Tensor  # bool: the real tokens (the ones the experts see)
    window: int = 0  # sliding-window attention (0: the whole document)
    # the router losses the MoE layers compute (vlm.model.context.ForwardContext.router_losses)
    router_losses: frozenset[str] = DEFAULT_ROUTER_LOSSES
    # sequence parallelism: the stack holds this rank's part of each row (valid_BT and rope are
    # its, doc_BT and the mask the whole row's: attention runs over the row, vlm.model.sequence_parallel)
    shard: SequenceShard | None = None

    @staticmethod
    def build(
        doc_BT,
        positions_BT,
        head_dim,
        theta,
        dtype,
        backend,
        use_rope=True,
        window: int = 0,
        compiled: bool = False,
        router_losses: frozenset[str] = DEFAULT_ROUTER_LOSSES,
        shard: SequenceShard | None = None,
    ) -> "StackContext":
        """`shard`: `doc_BT` is the whole rows', `positions_BT` this rank's part of them."""
        backend = resolve_backend(backend, doc_BT.device, compiled)
        rope = rope_cos_sin(positions_BT, head_dim, theta, dtype) if use_rope else None
        if backend in ("sdpa", "eager"):
            mask = packed_mask(doc_BT, window=window)
        elif backend == "flex":
            mask = document_block_mask(doc_BT, window=window)
        elif backend == "docs":
            mask = doc_segments(doc_BT)
        else:  # flash, varlen
            mask = flash_layout(doc_BT)
        valid_BT = (doc_BT if shard is None else shard.local(doc_BT)) >= 0
        return StackContext(doc_BT, rope, backend, mask, valid_BT, window, router_losses, shard)


class Block(nn.Module):
    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm: bool,
        norm_eps: float,
        moe: MoEConfig,
        init_std: float,
        joint: bool = False,
        cross: bool = False,
    ):
        """`joint`: the self-attention reads the concept (eq. 11); `cross`: a cross-attention
        sublayer to the concepts follows it (DLCM eq. 12-14)."""
        super().__init__()
        self.attn_norm = RMSNorm(dim, norm_eps)
        self.attn = Attention(
            dim, num_heads, num_kv_heads, head_dim, qk_norm, norm_eps, joint=joint
        )
        self.cross_norm = RMSNorm(dim, norm_eps) if cross else None
        self.cross = (
            CrossAttention(dim, num_heads, num_kv_heads, head_dim, qk_norm, norm_eps)
            if cross
            else None
        )
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.moe = MoE(moe, dim, init_std)

    def forward(
        self,
        x_BTD: torch.Tensor,
        ctx: StackContext,
        c: torch.Tensor | ConceptMemory | None = None,
        cache: KVCache | None = None,
        cross_cache: KVCache | None = None,
    ):
        """`c`: what this layer reads of the concepts, the EMA concept of each token (joint) or the
        concept memory (cross-attention); `cross_cache` (prefill) receives the cross-attention's
        concept keys and values."""
        c_BTD = c if self.attn.joint else None
        x_BTD = x_BTD + self.attn(
            self.attn_norm(x_BTD),
            ctx.doc_BT,
            ctx.rope,
            ctx.backend,
            ctx.mask,
            c_BTD,
            cache,
            window=ctx.window,
            shard=ctx.shard,
        )
        if self.cross is not None and c is not None:  # DLCM eq. 14's residual
            x_BTD = x_BTD + self.cross(
                self.cross_norm(x_BTD), c, ctx.doc_BT, ctx.backend, cross_cache
            )
        # Only real tokens reach the experts (padding would distort loads and the balancing bias);
        # the stack counts the loads (run_stack), outside any recomputation.
        B, T, D = x_BTD.shape
        y_ND, stats = self.moe(
            self.ffn_norm(x_BTD).view(B * T, D),
            ctx.valid_BT.reshape(B * T),
            accumulate_load=False,
            losses=ctx.router_losses,
            shard=ctx.shard,
        )
        return x_BTD + y_ND.view(B, T, D), stats

    def allocate_cache(self, B: int, capacity: int, like: torch.Tensor, window: int = 0) -> KVCache:
        """The self-attention's cache for `step`: `capacity` positions per row (`like`: dtype and device)."""
        return KVCache.allocate(
            B, self.attn.kv, capacity, self.attn.hd, like.dtype, like.device, window
        )

    def step(
        self,
        x_B1D: torch.Tensor,
        rope,
        cache: KVCache,
        advance_B: torch.Tensor | None = None,
        c: torch.Tensor | ConceptStep | None = None,
        cross_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """One new position per row (fixed shapes; rows with `advance_B` False, a concept that did
        not close, compute but do not keep their cache entry). `c`: the row's EMA concept (joint) or
        the concepts that closed with this token (cross-attention)."""
        x_B1D = x_B1D + self.attn.step(
            self.attn_norm(x_B1D), rope, cache, advance_B, c if self.attn.joint else None
        )
        if self.cross is not None and c is not None:
            x_B1D = x_B1D + self.cross.step(self.cross_norm(x_B1D), c, cross_cache)
        y_BD, _ = self.moe(self.ffn_norm(x_B1D[:, 0]), accumulate_load=False, losses=frozenset())
        return x_B1D + y_BD[:, None]


def _saved_by_selective_checkpoint(func) -> bool:
    """Selective activation checkpointing keeps the outputs of the matmuls, attention kernels and
    expert matmuls (compute-bound: recomputing them costs as much as the forward) and recomputes
    everything else (norms, activations, RoPE, routing: memory-bound, cheap to redo)."""
    name = str(getattr(func, "_overloadpacket", func))
    return any(
        k in name
        for k in (
            "aten.mm",
            "aten.addmm",
            "aten.bmm",
            "_grouped_mm",
            "vlm.grouped_mm",
            "scaled_dot_product",
            "flash_attn",
            "flex_attention",
        )
    )


def _selective_policy(ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return (
        CheckpointPolicy.MUST_SAVE
        if _saved_by_selective_checkpoint(func)
        else CheckpointPolicy.PREFER_RECOMPUTE
    )


def _checkpointed(block: "Block", mode: str, *args):
    """`block(*args)` with its activations recomputed in the backward: all of them ("full") or all
    but the matmul-type outputs ("selective")."""
    if mode == "full":
        return torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return torch.utils.checkpoint.checkpoint(
        block,
        *args,
        use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, _selective_policy),
    )


def run_stack(
    blocks: nn.ModuleList,
    x_BTD,
    ctx: StackContext,
    schedule: list[int] | None = None,
    c_BTD=None,
    joint_from: int | None = None,
    caches: list[KVCache] | None = None,
    checkpoint: str = "none",
    states: list | None = None,
    cross_caches: list[KVCache] | None = None,
    statistics: Statistics = "per_forward",
) -> tuple[torch.Tensor, list[MoEStats]]:
    """Run `blocks` in `schedule` order (layer loops repeat indices); layers >= joint_from get the
    concept input (`c_BTD`: a tensor for joint decoding, a ConceptMemory for cross-attention, whose
    prefill caches are `cross_caches`, one per layer from joint_from on). `checkpoint`: activation
    checkpointing per block in training ("none", "selective", "full"); `states` collects each
    block's output. In training each block's expert loads go into its MoE's `load_accum` here, once
    per pass (a recomputation does not count again), unless `statistics` is "off"
    (vlm.model.context)."""
    stats = []
    for n, i in enumerate(schedule if schedule is not None else range(len(blocks))):
        c = c_BTD if joint_from is not None and i >= joint_from else None
        cache = caches[n] if caches is not None else None
        xc = cross_caches[i - joint_from] if cross_caches and c is not None else None
        blk = blocks[i]
        # activations recomputed in the backward
        if checkpoint != "none" and blk.training and cache is None:
            x_BTD, s = _checkpointed(blk, checkpoint, x_BTD, ctx, c, None)
        else:
            x_BTD, s = blk(x_BTD, ctx, c, cache, xc)
        if blk.training and blk.moe.cfg.loss_free_balancing and statistics != "off":
            blk.moe.load_accum.add_(s.load_E)
        stats.append(s)
        if states is not None:
            states.append(x_BTD)
    return x_BTD, stats


def allocate_stack_caches(
    blocks: nn.ModuleList,
    B: int,
    capacity: int,
    like: torch.Tensor,
    schedule: list[int] | None = None,
    window: int = 0,
) -> list[KVCache]:
    """One self-attention cache per pass of `schedule` (a looped layer has one per pass), as `step_stack` reads them."""
    return [
        blocks[i].allocate_cache(B, capacity, like, window)
        for i in (schedule if schedule is not None else range(len(blocks)))
    ]


def allocate_cross_caches(
    blocks: nn.ModuleList, B: int, capacity: int, like: torch.Tensor
) -> list[KVCache]:
    """One concept cache per cross-attending block, in order (`capacity` concepts per row)."""
    return [blk.cross.allocate_cache(B, capacity, like) for blk in blocks if blk.cross is not None]


def step_stack(
    blocks: nn.ModuleList,
    x_B1D,
    rope,
    caches: list[KVCache],
    advance_B: torch.Tensor | None = None,
    schedule: list[int] | None = None,
    c_B1D=None,
    joint_from: int | None = None,
    cross_caches: list[KVCache] | None = None,
) -> torch.Tensor:
    """`run_stack` for one new position per row, reading and extending the caches (one per pass);
    rows with `advance_B` False do not keep their entries (see `Block.step`)."""
    for n, i in enumerate(schedule if schedule is not None else range(len(blocks))):
        c = c_B1D if joint_from is not None and i >= joint_from else None
        xc = cross_caches[i - joint_from] if cross_caches and c is not None else None
        x_B1D = blocks[i].step(x_B1D, rope, caches[n], advance_B, c, xc)
    return x_B1D
