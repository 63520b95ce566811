"""Counter-based random numbers for boundary sampling: a pure function of (seed, position), no
generator object.

Training draws boundaries from noise (eq. 6's Bernoulli, or Gaussian flip noise). A
`torch.Generator` cannot be traced by torch.compile, and the statistics pass and the real pass of a
step must draw the same boundaries, so the noise is a hash of each position's flat index and a seed
held in a tensor (a new seed is a new value in the same tensor: no recompilation). The same seed
gives the same noise on every device and under compile.

The hash is Chris Wellons' "lowbias32" integer mixer with both multipliers below 2^31, so that every
product of a 32-bit value fits in a signed int64 (no overflow in any backend).
"""

from __future__ import annotations

import math

import torch

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix of x in [0, 2^32), computed in int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def uniform(
    seed: torch.Tensor,
    shape: tuple[int, ...],
    device: torch.device,
    stream: int = 0,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 in [0, 1) of `shape`, one value per flat position, from a 0-d int64 `seed`; `stream`
    picks an independent sequence for the same seed (e.g. the two uniforms of Box-Muller). `index`
    (int64 of `shape`): the flat positions to draw at, where the tensor is part of a larger one (a
    sequence shard of a row: the noise is a function of the position in the row, not the rank)."""
    n = math.prod(shape)
    flat = torch.arange(n, device=device, dtype=torch.int64) if index is None else index.flatten()
    i = flat * 2 + stream
    s = seed.to(device=device, dtype=torch.int64)
    x = _mix32((i ^ (s & _M32)) & _M32)
    x = _mix32(x ^ ((s >> 32) & _M32))
    return ((x >> 8).to(torch.float32) * 2.0**-24).view(shape)


def normal(
    seed: torch.Tensor,
    shape: tuple[int, ...],
    device: torch.device,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Standard normal noise of `shape` (Box-Muller on two independent uniform streams); `index` as
    `uniform`'s."""
    u1 = 1.0 - uniform(seed, shape, device, 0, index)  # (0, 1]: log is finite
    u2 = uniform(seed, shape, device, 1, index)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * u2)
