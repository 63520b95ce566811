"""The LM's output layer and its next-token loss in tiles of tokens: the logits exist for one tile
at a time, never for a whole row.

Legend: N tokens (the rows flattened), D width, V vocabulary.

At a 155K vocabulary a token's fp32 logits take 0.6 MB: a 32K-token row's 19 GB, and the
log-softmax a cross-entropy keeps for its backward as much again. `TiledCrossEntropy` runs the
output layer on one tile of tokens at a time: the tile's logits (in the model's dtype, times the
logit scale, then fp32: what the full-logits loss computed) give its tokens' losses (torch's
cross-entropy) and are dropped; it keeps the final hidden states for the backward, which recomputes
each tile's logits and log-softmax and back-propagates through them to the hidden states and the
weight, with torch's own cross-entropy backward kernels. Each token's loss and its logits'
gradient are computed alone, so they are the full-logits computation's, bit for bit; the weight's
gradient is summed over the tiles in fp32 (with one tile it is the full-logits gradient, bit for
bit; with several, equal within float rounding, and never a sum of hundreds of bf16 parts).

`LMHead` is the output layer: `head(h)` gives logits, `head(h, target_N, tile)` the loss per token.
Both go through the module's call, so that an engine's hooks see one use of its weight (ZeRO-3
gathers it once for the whole loss and again for its backward), and muP's logit multiplier (DLCM
eq. 21) is the layer's own `logit_scale`, applied alike in both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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


def _logits(h: torch.Tensor, weight_VD: torch.Tensor, scale: float) -> torch.Tensor:
    """[..., V] the logits of `h` ([..., D]) in the model's dtype, times the logit scale."""
    z = F.linear(h, weight_VD)
    return z * scale if scale != 1.0 else z


class TiledCrossEntropy(torch.autograd.Function):
    """[N] fp32: each token's cross-entropy of `scale * h_ND W^T` against `target_N` (ids in
    [0, V)), `tile` tokens at a time (see the module docstring). The loops are over tiles, a number
    fixed by the shapes (one graph under torch.compile)."""

    @staticmethod
    def forward(ctx, h_ND, weight_VD, target_N, scale: float, tile: int):
        parts = [
            F.cross_entropy(
                _logits(h_ND[s : s + tile], weight_VD, scale).float(),
                target_N[s : s + tile],
                reduction="none",
            )
            for s in range(0, h_ND.shape[0], tile)
        ]
        ctx.save_for_backward(h_ND, weight_VD, target_N)
        ctx.scale, ctx.tile = scale, tile
        if not parts:
            return h_ND.new_zeros(0, dtype=torch.float32)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @staticmethod
    def backward(ctx, g_N):
        h_ND, weight_VD, target_N = ctx.saved_tensors
        scale, tile = ctx.scale, ctx.tile
        want_h, want_w = ctx.needs_input_grad[:2]
        grad_h_ND = torch.empty_like(h_ND) if want_h else None
        grad_w_VD = None
        tiles = range(0, h_ND.shape[0], tile)
        for s in tiles:
            h, t, g = h_ND[s : s + tile], target_N[s : s + tile], g_N[s : s + tile].float()
            # d loss / d logits = (softmax - one-hot) * g, by torch's own nll and log-softmax
            # backward (what autograd computes for the full-logits loss, bit for bit)
            logp_NV = torch.log_softmax(_logits(h, weight_VD, scale).float(), -1)
            d_NV = torch.zeros_like(logp_NV).scatter_(1, t[:, None], -g[:, None])
            d_NV = torch.ops.aten._log_softmax_backward_data(d_NV, logp_NV, 1, torch.float32)
            del logp_NV
            # back through the cast to fp32 and the logit scale, in the model's dtype
            d_NV = d_NV.to(weight_VD.dtype)
            if scale != 1.0:
                d_NV = d_NV * scale
            if want_h:
                grad_h_ND[s : s + tile] = d_NV.mm(weight_VD)
            if want_w:
                part_VD = h.t().mm(d_NV).t()  # as autograd's mm backward orders it
                if len(tiles) == 1:
                    grad_w_VD = part_VD
                elif grad_w_VD is None:
                    grad_w_VD = part_VD.float()
                else:
                    grad_w_VD += part_VD
            del d_NV
        if grad_w_VD is not None:
            grad_w_VD = grad_w_VD.to(weight_VD.dtype)
        return grad_h_ND, grad_w_VD, None, None, None


class LMHead(nn.Linear):
    """The output layer: logits = logit_scale * h W^T, or each token's next-token loss computed
    from them in tiles (`TiledCrossEntropy`). `logit_scale` is muP's multiplier (DLCM eq. 21, set
    by vlm.train.param_groups.install_logit_scale; 1 without muP)."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, vocab_size, bias=False)
        self.logit_scale = 1.0

    def forward(
        self, h: torch.Tensor, target_N: torch.Tensor | None = None, tile: int = 0
    ) -> torch.Tensor:
        """The logits of `h` ([..., D] -> [..., V]); with `target_N`, `h` is [N, D] and the result
        is [N] fp32: each token's cross-entropy against its target, `tile` tokens at a time (0: the
        default size, `tokens_per_tile`)."""
        if target_N is None:
            return _logits(h, self.weight, self.logit_scale)
        tile = tile or tokens_per_tile(self.out_features, h.device)
        return TiledCrossEntropy.apply(h, self.weight, target_N, self.logit_scale, tile)
