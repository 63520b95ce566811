"""Grouped matmul that torch.compile can trace in every dtype: `torch._grouped_mm` as a custom operator.

`torch._grouped_mm(x_MK, w_EKN, offs=offs_E)` multiplies rows [offs[e-1], offs[e]) of x by w[e], with no host
synchronisation (the offsets stay on the device). Its compile-time (meta) kernel accepts bf16 only, as the CUDA
kernel does, so in fp32 (CPU training, tests) torch.compile cannot trace it. Here it is an opaque custom operator
with its own shape function and backward (two more grouped matmuls), which compiles in any dtype; bf16 calls the
native operator, which inductor knows.

Rows past the last offset are left unwritten by the kernel (garbage): callers mask them (`torch.where`, not a
multiplication, so that garbage NaNs do not leak), on the way in and on the way out, and the backward's rows
there are masked the same way by the caller's `where`.
"""
from __future__ import annotations

import torch


@torch.library.custom_op("vlm::grouped_mm", mutates_args=())
def _grouped_mm_op(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x_MK, w_EKN, offs=offs_E)


@_grouped_mm_op.register_fake
def _(x_MK, w_EKN, offs_E):
    return x_MK.new_empty(x_MK.shape[0], w_EKN.shape[-1])


@torch.library.custom_op("vlm::grouped_mm_weight_grad", mutates_args=())
def _weight_grad_op(x_MK: torch.Tensor, g_MN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """[E, K, N]: the weight gradient of group e, x[rows of e]^T @ g[rows of e]."""
    return torch._grouped_mm(x_MK.t(), g_MN, offs=offs_E)


@_weight_grad_op.register_fake
def _(x_MK, g_MN, offs_E):
    return x_MK.new_empty(offs_E.shape[0], x_MK.shape[1], g_MN.shape[1])


def _setup(ctx, inputs, output):
    x_MK, w_EKN, offs_E = inputs
    ctx.save_for_backward(x_MK, w_EKN, offs_E)


def _backward(ctx, g_MN):
    x_MK, w_EKN, offs_E = ctx.saved_tensors
    g_MN = g_MN.contiguous()
    gx = _grouped_mm_op(g_MN, w_EKN.transpose(-1, -2), offs_E) if ctx.needs_input_grad[0] else None
    gw = _weight_grad_op(x_MK, g_MN, offs_E) if ctx.needs_input_grad[1] else None
    return gx, gw, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (the native `_grouped_mm` backward needs it,
    and e.g. `out.sum().backward()` hands in a stride-0 gradient)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def grouped_mm(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """[M, N]: rows [offs[e-1], offs[e]) of x times w[e]; rows past offs[-1] are unwritten (see the module doc)."""
    if x_MK.dtype == torch.bfloat16:
        return _ContiguousGrad.apply(torch._grouped_mm(x_MK, w_EKN, offs=offs_E))
    return _grouped_mm_op(x_MK.contiguous(), w_EKN, offs_E)
