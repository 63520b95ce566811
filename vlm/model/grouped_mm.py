"""Grouped matmul that torch.compile can trace in every dtype: `torch._grouped_mm` as
a custom operator.

Legend: D width, E experts, F expert hidden width, A (token, choice) slots sorted by expert.

`torch._grouped_mm(x_AD, w_EDF, offs=offs_E)` multiplies rows [offs[e-1], offs[e]) of x by w[e],
with no host synchronisation (the offsets stay on the device). Its compile-time (meta) kernel
accepts bf16 only, as the CUDA kernel does, so in fp32 (CPU training, tests) torch.compile cannot
trace it. Here it is an opaque custom operator with its own shape function and backward (two more
grouped matmuls), which compiles in any dtype; bf16 calls the native operator, which inductor knows.

Rows past the last offset are left unwritten by the kernel (garbage): callers mask them
(`torch.where`, not a multiplication, so that garbage NaNs do not leak), on the way in and on the
way out, and the backward's rows there are masked the same way by the caller's `where`.

Shapes are named as in the experts' gate and up projections, [A, D] x [E, D, F] -> [A, F]; the down
projection passes [A, F] and [E, F, D].
"""

from __future__ import annotations

import torch


@torch.library.custom_op("vlm::grouped_mm", mutates_args=())
def _grouped_mm_op(x_AD: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x_AD, w_EDF, offs=offs_E)


@_grouped_mm_op.register_fake
def _(x_AD, w_EDF, offs_E):
    return x_AD.new_empty(x_AD.shape[0], w_EDF.shape[-1])


@torch.library.custom_op("vlm::grouped_mm_weight_grad", mutates_args=())
def _weight_grad_op(x_AD: torch.Tensor, g_AF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """[E, K, N]: the weight gradient of group e, x[rows of e]^T @ g[rows of e]."""
    return torch._grouped_mm(x_AD.t(), g_AF, offs=offs_E)


@_weight_grad_op.register_fake
def _(x_AD, g_AF, offs_E):
    return x_AD.new_empty(offs_E.shape[0], x_AD.shape[1], g_AF.shape[1])


def _setup(ctx, inputs, output):
    x_AD, w_EDF, offs_E = inputs
    ctx.save_for_backward(x_AD, w_EDF, offs_E)


def _backward(ctx, g_AF):
    x_AD, w_EDF, offs_E = ctx.saved_tensors
    g_AF = g_AF.contiguous()
    gx = _grouped_mm_op(g_AF, w_EDF.transpose(-1, -2), offs_E) if ctx.needs_input_grad[0] else None
    gw = _weight_grad_op(x_AD, g_AF, offs_E) if ctx.needs_input_grad[1] else None
    return gx, gw, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (the native `_grouped_mm`
    backward needs it, and e.g. `out.sum().backward()` hands in a stride-0 gradient)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def grouped_mm(x_AD: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """[A, F]: rows [offs[e-1], offs[e]) of x times w[e]; rows past offs[-1] are unwritten (see the module doc)."""
    if x_AD.dtype == torch.bfloat16:
        return _ContiguousGrad.apply(torch._grouped_mm(x_AD, w_EDF, offs=offs_E))
    return _grouped_mm_op(x_AD.contiguous(), w_EDF, offs_E)
