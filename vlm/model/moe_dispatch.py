"""How the experts (and Grove's adjugate groups) see their tokens: the (token, choice) slots sorted
by group, so that each group reads one contiguous slice of rows, and the SwiGLU those rows go
through (one `torch._grouped_mm` per projection where it can run, else a loop over the groups).

Legend: D width, E experts, K experts chosen per token, F expert hidden width, G Grove groups, A
(token, choice) slots sorted by expert, N flat tokens or patches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlm.model.grouped_mm import grouped_mm


@dataclass
class Slots:
    """The N x K (token, choice) slots sorted by group (expert or adjugate group), padding last:
    each group reads one contiguous slice of rows, [offs[g-1], offs[g]); the rows that are not
    `dead_A1` are the ones a group computes."""

    tok_A: torch.Tensor  # the token of each sorted slot
    group_A: torch.Tensor  # its group (num_groups for padding / repeats)
    dead_A1: torch.Tensor  # bool [A, 1]: padding or a repeat, computed by no group
    counts_G: torch.Tensor  # rows per group (int64)
    order_A: torch.Tensor  # the sort: slot order_A[a] of the flattened [N, K] is row a


def sort_by_group(groups_NK: torch.Tensor, num_groups: int) -> Slots:
    """Sort the slots by group id (stable); ids equal to `num_groups` mark slots nobody computes and go last."""
    K = groups_NK.shape[1]
    flat = groups_NK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    group_A = flat[order]
    counts_G = torch.zeros(num_groups + 1, dtype=torch.long, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat)
    )[:num_groups]
    return Slots(order // K, group_A, (group_A == num_groups)[:, None], counts_G, order)


def grouped_mm_available(x_AD: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` can run these operands: it exists, the dtype is supported on this
    device, and every row stride is a multiple of 16 bytes (its alignment rule)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    dev = x_AD.device.type
    if dev == "cpu":
        ok_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    elif dev == "cuda":
        # The fast kernel is bf16 on Hopper and newer; elsewhere the loop is as good.
        ok_dtypes = (
            (torch.bfloat16,) if torch.cuda.get_device_capability(x_AD.device) >= (9, 0) else ()
        )
    else:
        ok_dtypes = ()
    if x_AD.dtype not in ok_dtypes:
        return False
    size = x_AD.element_size()
    dims = [x_AD.shape[-1]] + [d for w in weights for d in w.shape[-2:]]
    return all((d * size) % 16 == 0 for d in dims)


def expert_swiglu(
    x_ND: torch.Tensor,
    disp: Slots,
    w_gate_EDF: torch.Tensor,
    w_up_EDF: torch.Tensor,
    w_down_EFD: torch.Tensor,
    use_grouped: bool,
) -> torch.Tensor:
    """[A, D]: expert e's SwiGLU, down(silu(x @ gate) * (x @ up)), on the rows of its slice of the
    sorted slots; rows that are not live are exactly 0 (and pass no gradient back to x).

    grouped_mm: no host synchronisation, every shape static (the rows past the live ones are left
    to the kernel and masked). The per-expert loop (devices without grouped_mm) reads the counts
    on the host."""
    dt = x_ND.dtype
    wg, wu, wd = w_gate_EDF.to(dt), w_up_EDF.to(dt), w_down_EFD.to(dt)
    # a fill, not a product: garbage never leaks
    x_AD = x_ND[disp.tok_A].masked_fill(disp.dead_A1, 0)
    if use_grouped:
        # where each group's rows end in the sorted slots: grouped_mm's `offs`
        ends_G = disp.counts_G.cumsum(0, dtype=torch.int32)
        y_AD = grouped_mm(
            F.silu(grouped_mm(x_AD, wg, ends_G)) * grouped_mm(x_AD, wu, ends_G), wd, ends_G
        )
        return y_AD.masked_fill(disp.dead_A1, 0)
    sizes = disp.counts_G.tolist()
    pieces = [
        (F.silu(r_AD @ wg[e]) * (r_AD @ wu[e])) @ wd[e]
        for e, r_AD in enumerate(x_AD.split(sizes + [x_AD.shape[0] - sum(sizes)])[:-1])
        if r_AD.shape[0]
    ]
    pieces.append(x_AD.new_zeros(x_AD.shape[0] - sum(sizes), wd.shape[-1]))
    return torch.cat(pieces)
