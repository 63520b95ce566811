"""Eq. 8's EMA over concepts, c_m = p_m x_m + (1 - p_m) c_{m-1}, as a blocked parallel scan (no loop over concepts).

Legend: B rows, D width, M concept slots, U scan blocks, L concepts per scan block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segsum(x: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [..., n, n] with out[i, j] = sum_{j < k <= i} x[k] (and -inf above the diagonal).
    The scan passes the decays within each block ([B, U, L]) and the blocks' totals ([B, U]).

    Built by a masked cumsum rather than differences of cumsums so that -inf entries
    (restarts) stay exact.
    """
    n = x.shape[-1]
    xx = x[..., None].expand(*x.shape, n)
    strict = torch.ones(n, n, dtype=torch.bool, device=x.device).tril(-1)
    ss = xx.masked_fill(~strict, 0).cumsum(-2)
    return ss.masked_fill(
        ~strict.logical_or(torch.eye(n, dtype=torch.bool, device=x.device)), float("-inf")
    )


def _decays(loga_BM: torch.Tensor, block: int):
    """The scan's weights, which depend on the decays alone (shared by every scan over the same p):
    within-block [B, U, L, L] exp(segsum), across-block [B, U, U] exp(segsum) and each position's
    decay since its block began."""
    B, M = loga_BM.shape
    loga_BUL = loga_BM.view(B, M // block, block)
    return (
        torch.exp(segsum(loga_BUL)),
        torch.exp(segsum(loga_BUL.sum(-1))),
        torch.exp(loga_BUL.cumsum(-1)),
    )


def _scan(u_BMD: torch.Tensor, decays) -> torch.Tensor:
    """y_m = u_m + exp(loga_m) y_{m-1} by blocks (fp32 in, fp32 out), with `_decays(loga, block)`."""
    within_BULL, across_BUU, decay_BUL = decays
    B, M, D = u_BMD.shape
    nb, block = decay_BUL.shape[1:]
    # within-block contributions
    y_BULD = within_BULL @ u_BMD.view(B, nb, block, D)
    # true state at the end of each block
    state_BUD = across_BUU @ y_BULD[:, :, -1]
    carry_BUD = F.pad(state_BUD[:, :-1], (0, 0, 1, 0))  # state entering each block
    return (y_BULD + decay_BUL[..., None] * carry_BUD[:, :, None]).reshape(B, M, D)


def ema_scan(
    x_BMD: torch.Tensor, p_BM: torch.Tensor, reset_BM: torch.Tensor, block: int = 64
) -> torch.Tensor:
    """Eq. 8 by a blocked parallel scan: c_m = p_m x_m + (1 - p_m) c_{m-1},
    restarted where reset_BM.

    Within blocks of `block` concepts the recurrence is a lower-triangular matmul with weights
    exp(segsum(log(1 - p))); the states carried between blocks use the same identity one level up.
    No loop over concepts; fp32 throughout.

    Where p == 1 exactly (not at a restart) the decay is exactly 0, log(1 - p) = -inf, and the log
    cuts the gradient of the (1 - p) c_{m-1} term. A second scan restores it: its input (a -
    a.detach()) c_{m-1} is zero in value but carries d/da = c_{m-1} into c_m, from where the scan
    propagates it as it does any input.
    """
    B, M, D = x_BMD.shape
    dtype = x_BMD.dtype
    pad = -(-M // block) * block - M
    p = F.pad(p_BM.float(), (0, pad))
    reset = F.pad(reset_BM, (0, pad), value=True)
    a = 1 - p
    open_ = (a > 0) & ~reset
    loga = torch.where(
        open_,
        torch.log(torch.where(open_, a, torch.ones_like(a))),
        torch.full_like(a, float("-inf")),
    )
    u = F.pad(x_BMD.float() * p_BM.float()[..., None], (0, 0, 0, pad))
    decays = _decays(loga, block)
    y = _scan(u, decays)
    shut = (a == 0) & ~reset  # p == 1 inside a document
    prev = F.pad(y[:, :-1].detach(), (0, 0, 1, 0))
    zero_u = torch.where(
        shut[..., None], (a - a.detach())[..., None] * prev, torch.zeros_like(prev)
    )
    y = y + _scan(zero_u, decays)
    return y[:, :M].to(dtype)
