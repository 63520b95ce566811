"""The next-token loss in tiles of tokens: the output layer's logits exist for one tile at a time,
never for a whole row.

Legend: N tokens (the rows flattened), D width.

At a 155K vocabulary a token's fp32 logits take 0.6 MB: a 32K-token row's 19 GB, and the
log-softmax a cross-entropy keeps for its backward as much again. Here the output layer runs on one
tile of tokens at a time: the tile's logits (in the model's dtype, then fp32, as the full-logits
loss computed them) give its tokens' losses (torch's cross-entropy: log-sum-exp minus the target's
logit) and are dropped. The backward recomputes each tile's logits (torch's non-reentrant
checkpoint around the tile) and back-propagates through them to the final hidden states and the
output layer's weight, one tile at a time. Each token's loss is computed alone, so the values are
the full-logits computation's; only the weight gradient's sum over tokens is grouped by tile (equal
within float rounding, and bit-equal with one tile).

The output layer is called as the module it is, so its hooks apply as in the model's own forward:
muP's logit multiplier (vlm.train.param_groups.install_logit_scale), ZeRO-3's gathering of its
partitioned weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

MiB = 2**20
# The default bound on one tile's fp32 logits. On the CPU it stays above 32 MiB: glibc's malloc
# serves smaller blocks from its heap, where the freed tiles fragment it and the process grows
# (measured at 151,936 entries over 2,048 tokens: 2.2 GB above the weights with 32 MiB tiles,
# 0.3 GB with 64 MiB ones); from 32 MiB up each tile is a mapping of its own, returned when freed.
TILE_BYTES = {"cpu": 64 * MiB}
ACCELERATOR_TILE_BYTES = 256 * MiB


def tokens_per_tile(vocab_size: int, device: torch.device, setting: int = 0) -> int:
    """Tokens per tile: `setting` (model.loss_tile_tokens) when > 0, else as many as keep one
    tile's fp32 logits within 256 MiB on an accelerator, 64 MiB on the CPU."""
    if setting > 0:
        return setting
    budget = TILE_BYTES.get(device.type, ACCELERATOR_TILE_BYTES)
    return max(1, budget // (4 * vocab_size))


def _tile_losses(head: nn.Module, h_ND: torch.Tensor, target_N: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(h_ND).float(), target_N, reduction="none")


def token_cross_entropy(
    h_ND: torch.Tensor, head: nn.Module, target_N: torch.Tensor, tile: int
) -> torch.Tensor:
    """[N] fp32: each token's cross-entropy of `head(h_ND)` against `target_N` (ids in [0, V)),
    with its gradient to `h_ND` and the head's parameters, computed `tile` tokens at a time. The
    loop is over tiles, a number fixed by the shapes (one graph under torch.compile)."""
    N = h_ND.shape[0]
    if N == 0:
        return h_ND.new_zeros(0, dtype=torch.float32)
    grad = torch.is_grad_enabled() and (
        h_ND.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    parts = []
    for s in range(0, N, tile):
        h, t = h_ND[s : s + tile], target_N[s : s + tile]
        if grad:  # keep only the tile's inputs; its logits are recomputed in the backward
            parts.append(
                torch.utils.checkpoint.checkpoint(
                    _tile_losses, head, h, t, use_reentrant=False, preserve_rng_state=False
                )
            )
        else:
            parts.append(_tile_losses(head, h, t))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
