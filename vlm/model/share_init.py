"""Initialising a rank's share of a parameter to exactly the values the whole parameter gets.

A model's initial weights are draws from torch's CPU generator in construction order (nn.Linear's
kaiming draws, then the model's own normal_ re-inits: vlm.model.conceptmoe, vlm.model.moe). A rank
that builds only its share (vlm.model.shares) must still advance the generator past every whole
tensor, or every later tensor would differ from a whole build's. `draw_normal_into` does that in
chunks: `torch.empty(n).normal_(mean, std)` on CPU fills n uniforms (one 32-bit draw each), turns
them into normals 16 at a time (Box-Muller on pairs j, j+8 of each block) and, when 16 does not
divide n, draws 16 more for the last 16 elements. Cut into chunks whose boundaries are multiples of
16, with the last chunk at least 16 long, the same call on each chunk in turn makes the same
draws at the same positions: bit-equal values (tests/test_share_build.py checks it), with one chunk
in memory instead of the whole tensor.

The init ops here (`init_normal_`, `fill_`, `scale_`, `assign_`, `assign_rows_`) take any parameter a rank may hold:
- a whole fp32 tensor: the plain torch op, as a whole build runs it;
- a whole tensor in another dtype (bf16): fp32 draws cast, as a whole fp32 build cast afterwards;
- rows a..b-1 of a tensor of R rows (`mark_rows`: a MoE layer's expert shard);
- a DeepSpeed ZeRO-3 partition (`param.ds_tensor`, the whole one's size in `param.ds_numel`): the
  flat range vlm.model.shares.zero3_partition gives its rank (`mark_partition`, else the rank of
  the build's sharding);
- a meta tensor (a build for shapes only): nothing, and no draws.
"""

from __future__ import annotations

import math

import torch

from vlm.model.shares import current, zero3_partition

CHUNK = 1 << 22  # elements drawn at once (16 MiB of fp32); a multiple of 16


def draw_normal_into(
    out: torch.Tensor, numel: int, mean: float, std: float, start: int, chunk: int | None = None
) -> None:
    """Write elements start .. start + out.numel() - 1 of what `torch.empty(numel).normal_(mean,
    std)` would draw now into `out` (flat, any dtype: cast), and advance torch's CPU generator past
    all `numel` as that call does. At most one chunk of fp32 is held besides `out`."""
    stop, chunk = start + out.numel(), CHUNK if chunk is None else chunk
    if numel <= chunk or numel < 16:
        whole = torch.empty(numel).normal_(mean, std)
        out.copy_(whole[start:stop])
        return
    bounds = [*range(0, numel, chunk), numel]
    if bounds[-1] - bounds[-2] < 16:  # the tail's 16 redraws need a last chunk of at least 16
        del bounds[-2]
    buf = torch.empty(chunk + 16)
    for a, b in zip(bounds, bounds[1:]):
        piece = buf[: b - a]
        piece.normal_(mean, std)
        lo, hi = max(a, start), min(b, stop)
        if lo < hi:
            out[lo - start : hi - start].copy_(piece[lo - a : hi - a])


def mark_rows(p: torch.Tensor, rows: tuple[int, int], whole_rows: int) -> None:
    """`p` holds rows rows[0] .. rows[1] - 1 of a tensor of `whole_rows` rows (and p's other dims)."""
    p.whole_rows = (int(rows[0]), int(rows[1]), int(whole_rows))


def partitioned(p: torch.Tensor) -> bool:
    """`p` is a DeepSpeed ZeRO-3 parameter whose data lives in its partition (`ds_tensor`)."""
    return getattr(p, "ds_tensor", None) is not None and p.data.numel() != getattr(p, "ds_numel", 0)


def mark_partition(p: torch.Tensor, world: int, rank: int) -> None:
    """`p`'s ZeRO-3 partition is rank `rank`'s of `world` (read by the init ops after the build)."""
    p.partition_of = (int(world), int(rank))


def whole_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole parameter `p` is (a share of)."""
    if hasattr(p, "ds_shape"):
        return tuple(p.ds_shape)
    rows = getattr(p, "whole_rows", None)
    return tuple(p.shape) if rows is None else (rows[2], *p.shape[1:])


def held(p: torch.Tensor, sharding=None) -> tuple[torch.Tensor, int, int]:
    """(the flat elements this rank holds of `p`, where they start in the whole tensor flattened,
    the whole tensor's number of elements)."""
    if partitioned(p):
        sharding = current() if sharding is None else sharding
        world, rank = getattr(p, "partition_of", (sharding.world, sharding.rank))
        start, stop, size = zero3_partition(p.ds_numel, world, rank)
        if size != p.ds_tensor.numel():
            raise RuntimeError(
                f"a ZeRO-3 partition of {p.ds_tensor.numel()} elements, the sharding "
                f"({sharding.world} ranks) makes it {size}"
            )
        return p.ds_tensor.data.view(-1)[: stop - start], start, p.ds_numel
    rows = getattr(p, "whole_rows", None)
    if rows is None:
        return p.data.view(-1), 0, p.numel()
    per_row = math.prod(p.shape[1:])
    return p.data.view(-1), rows[0] * per_row, rows[2] * per_row


@torch.no_grad()
def init_normal_(p: torch.Tensor, std: float, mean: float = 0.0, sharding=None) -> None:
    """`nn.init.normal_(p, mean, std)` on the whole parameter, kept at this rank's share."""
    if p.is_meta:  # draws nothing (a build that only advances the generator sees the op)
        p.normal_(mean, std)
        return
    if (
        not partitioned(p)
        and getattr(p, "whole_rows", None) is None
        and p.dtype == torch.float32
        and p.is_contiguous()
    ):
        p.normal_(mean, std)  # the whole tensor: the op a whole build runs
        return
    flat, start, numel = held(p, sharding)
    draw_normal_into(flat, numel, mean, std, start)


@torch.no_grad()
def fill_(p: torch.Tensor, value: float, sharding=None) -> None:
    """Every element of `p` (this rank's share) set to `value`."""
    if p.is_meta:
        return
    held(p, sharding)[0].fill_(value)


@torch.no_grad()
def scale_(p: torch.Tensor, factor: float, sharding=None) -> None:
    """`p` (this rank's share) multiplied by `factor`, as `p.mul_(factor)` on the whole."""
    if p.is_meta:
        return
    held(p, sharding)[0].mul_(factor)


@torch.no_grad()
def assign_(p: torch.Tensor, whole: torch.Tensor, sharding=None) -> None:
    """`p.copy_(whole)` with `whole` the whole parameter's value: this rank's share of it."""
    if p.is_meta:
        return
    flat, start, numel = held(p, sharding)
    if whole.numel() != numel:
        raise ValueError(f"assign_: {whole.numel()} elements for a parameter of {numel}")
    flat.copy_(whole.reshape(-1)[start : start + flat.numel()])


@torch.no_grad()
def assign_rows_(p: torch.Tensor, first: int, rows: torch.Tensor, sharding=None) -> None:
    """Rows first .. first + len(rows) - 1 of the whole parameter set to `rows`: the part of
    them in this rank's share."""
    if p.is_meta:
        return
    flat, start, _ = held(p, sharding)
    per_row = math.prod(rows.shape[1:])
    lo, hi = max(start, first * per_row), min(start + flat.numel(), (first + len(rows)) * per_row)
    if lo < hi:
        src = rows.reshape(-1)[lo - first * per_row : hi - first * per_row]
        flat[lo - start : hi - start].copy_(src)
