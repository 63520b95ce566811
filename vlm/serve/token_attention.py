"""A token-level block of the project's model whose self-attention runs on vLLM's paged KV cache.

Legend: D width, N flat tokens or patches, P patches, H height.

The block's own weights compute q, k and v as `Attention._heads` does (QK-norm, RoPE, eq. 11's joint
concept term); only the attention over the cache is vLLM's. vLLM's CPU kernels take a few head sizes
(32, 64, 80, ...): a smaller head is zero-padded, which changes no dot product and no output (the
padded value columns are 0 and are cut off), at the price of the padding in the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.layers.attention import Attention

from vlm.model.block import Block
from vlm.serve.layout import padded_head_size


class PagedBlock(nn.Module):
    """`Block.forward` for the flattened tokens of a vLLM batch (one row of N
    tokens, every request's)."""

    def __init__(self, block: Block, cache_config, window: int, prefix: str):
        super().__init__()
        attn = block.attn
        # not a submodule: the weights keep the names the checkpoint gives them
        self.block_ref = [block]
        self.hd, self.pad = attn.hd, padded_head_size(attn.hd)
        self.attn = Attention(
            attn.h,
            self.pad,
            attn.hd**-0.5,
            num_kv_heads=attn.kv,
            cache_config=cache_config,
            per_layer_sliding_window=window or None,
            prefix=prefix,
        )

    def forward(self, x_ND: torch.Tensor, rope, c_ND: torch.Tensor | None = None) -> torch.Tensor:
        blk = self.block_ref[0]
        a = blk.attn
        q, k, v = a._heads(blk.attn_norm(x_ND)[None], None if c_ND is None else c_ND[None], rope)
        pad = self.pad - self.hd
        flat = lambda t: F.pad(t[0].transpose(0, 1), (0, pad)).flatten(1)  # noqa: E731
        out_NHP = self.attn(flat(q), flat(k), flat(v)).view(x_ND.shape[0], a.h, self.pad)
        x_ND = x_ND + a.o_proj(out_NHP[..., : self.hd].flatten(1))
        y_ND, _ = blk.moe(blk.ffn_norm(x_ND), accumulate_load=False, losses=frozenset())
        return x_ND + y_ND
