"""Patch n' Pack bookkeeping: which image each packed patch belongs to, the block-diagonal
attention, and the 2x2 merge that turns patches into LLM tokens.

Legend: D width, N flat tokens or patches, I images, P patches, Q query heads, J key/value heads, d
head width.

All images' patches share ONE sequence. `PackLayout` is computed once per forward from the patch
coordinates, the image grids and an optional validity mask (padding), and every layer reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # optional fast path on GPU; never required
    from flash_attn import flash_attn_varlen_func as _flash_varlen
except Exception:  # noqa: BLE001 - any import problem just means "not available"
    _flash_varlen = None


@dataclass
class PackLayout:
    image_ids_P: torch.Tensor  # [P] long, image index of each patch, -1 for padding
    coords_P2: torch.Tensor  # [P, 2] long, (row, col); padding rows are set to 0
    valid_P: torch.Tensor  # [P] bool
    # [N] long, merged-token index of each valid patch (N = valid patches)
    token_index_N: torch.Tensor
    sub_index_N: torch.Tensor  # [N] long, position inside its merge x merge block (raster order)
    cu_seqlens: torch.Tensor  # [I+1] int32, patch offsets per image when padding is absent
    num_tokens: int  # sum over images of (rows//merge)*(cols//merge)
    max_patches: int  # largest image in patches (for varlen kernels)
    merge: int
    has_padding: bool
    valid_index_N: torch.Tensor  # [N] long, positions of the valid patches (image 0's first)
    sizes: list[int]  # patches per image (python ints, for splitting)
    # largest rows and largest cols over the images (a canvas that holds any of them)
    grid_max: tuple[int, int]


def build_layout(
    coords_P2: torch.Tensor,
    image_grids_I2: torch.Tensor,
    merge: int,
    valid_P: torch.Tensor | None = None,
) -> PackLayout:
    """Check the packed inputs and derive everything the encoder needs from them.

    Valid patches belong to the images in order (image 0's rows*cols patches first); inside an image
    any order is allowed because the merge places each patch by its coordinates.
    """
    P = coords_P2.shape[0]
    device = coords_P2.device
    if image_grids_I2.ndim != 2 or image_grids_I2.shape[1] != 2:
        raise ValueError(
            f"image_grids must be [I, 2] (rows, cols), got shape {tuple(image_grids_I2.shape)}"
        )
    if coords_P2.ndim != 2 or coords_P2.shape[1] != 2:
        raise ValueError(
            f"patch coords must be [P, 2] (row, col), got shape {tuple(coords_P2.shape)}"
        )
    grids = image_grids_I2.to(device=device, dtype=torch.long)
    if bool((grids < merge).any()) or bool((grids % merge != 0).any()):
        raise ValueError(
            "every image grid must have rows and cols that are "
            f"positive multiples of merge={merge}, got {grids.tolist()}"
        )
    valid = (
        torch.ones(P, dtype=torch.bool, device=device)
        if valid_P is None
        else valid_P.to(device, torch.bool)
    )
    if valid.shape != (P,):
        raise ValueError(f"valid_P must be [P]={P} booleans, got shape {tuple(valid.shape)}")
    sizes_I = grids[:, 0] * grids[:, 1]
    n_valid = int(valid.sum())
    if n_valid != int(sizes_I.sum()):
        raise ValueError(
            f"{n_valid} valid patches but the image grids "
            f"{grids.tolist()} need {int(sizes_I.sum())}"
        )

    ids_N = torch.repeat_interleave(torch.arange(len(grids), device=device), sizes_I)
    image_ids_P = torch.full((P,), -1, dtype=torch.long, device=device)
    image_ids_P[valid] = ids_N
    coords = torch.where(
        valid[:, None], coords_P2.to(torch.long), torch.zeros_like(coords_P2, dtype=torch.long)
    )

    rc_N2 = coords[valid]
    g_N2 = grids[ids_N]
    if bool((rc_N2 < 0).any()) or bool((rc_N2 >= g_N2).any()):
        raise ValueError("a patch coordinate lies outside its image's grid")
    cols_m_N = g_N2[:, 1] // merge
    tokens_I = (grids[:, 0] // merge) * (grids[:, 1] // merge)
    tok_offset_I = torch.cumsum(tokens_I, 0) - tokens_I
    token_index_N = tok_offset_I[ids_N] + (rc_N2[:, 0] // merge) * cols_m_N + rc_N2[:, 1] // merge
    sub_index_N = (rc_N2[:, 0] % merge) * merge + rc_N2[:, 1] % merge
    num_tokens = int(tokens_I.sum())
    slot_N = token_index_N * merge * merge + sub_index_N
    if n_valid and int(torch.bincount(slot_N, minlength=num_tokens * merge * merge).max()) != 1:
        raise ValueError(
            "patch coordinates repeat inside an image: each (row, col) must appear exactly once"
        )
    cu = torch.zeros(len(grids) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(sizes_I, 0)
    return PackLayout(
        image_ids_P,
        coords,
        valid,
        token_index_N,
        sub_index_N,
        cu,
        num_tokens,
        int(sizes_I.max()) if len(grids) else 0,
        merge,
        n_valid != P,
        torch.nonzero(valid).squeeze(1),
        sizes_I.tolist(),
        tuple(grids.max(0).values.tolist()) if len(grids) else (0, 0),
    )


def block_mask(image_ids_P: torch.Tensor) -> torch.Tensor:
    """[P, P] bool: True where query and key are in the same image (padding attends only to padding)."""
    return image_ids_P[:, None] == image_ids_P[None, :]


def pick_backend(x: torch.Tensor, layout: PackLayout, backend: str) -> str:
    """Resolve `auto` to the fastest exact kernel for this input.

    flash: flash-attn varlen (CUDA, fp16/bf16, no padding). dense: one SDPA call over the whole
    sequence, needed only when there is more than one image or padding, with the P x P block mask
    (good on GPU for moderate P). per_image: one SDPA call per image, O(sum n_i^2) work instead
    of O(P^2); on CPU this is the fast choice because the dense mask computes every masked-out
    score as well.
    """
    flash_ok = (
        _flash_varlen is not None
        and x.is_cuda
        and x.dtype in (torch.float16, torch.bfloat16)
        and not layout.has_padding
    )
    if backend == "flash":
        if not flash_ok:
            raise RuntimeError(
                "attn_backend='flash' needs flash-attn installed, "
                "CUDA tensors in fp16/bf16 and no padding"
            )
        return "flash"
    if backend in ("dense", "per_image"):
        return backend
    if flash_ok:
        return "flash"
    if len(layout.sizes) == 1 and not layout.has_padding:
        return "single"
    return "dense" if x.is_cuda else "per_image"


def packed_attention(
    q_QPd: torch.Tensor,
    k_JPd: torch.Tensor,
    v_JPd: torch.Tensor,
    layout: PackLayout,
    kernel: str,
    mask_PP: torch.Tensor | None = None,
) -> torch.Tensor:
    """Non-causal attention restricted to each image (block-diagonal). Returns [Q, P, d].

    `kernel` comes from `pick_backend`; every kernel gives the same numbers on valid positions.
    """
    if kernel == "single":
        return F.scaled_dot_product_attention(q_QPd, k_JPd, v_JPd)
    if kernel == "flash":
        out_PQd = _flash_varlen(
            q_QPd.transpose(0, 1),
            k_JPd.transpose(0, 1),
            v_JPd.transpose(0, 1),
            layout.cu_seqlens,
            layout.cu_seqlens,
            layout.max_patches,
            layout.max_patches,
            causal=False,
        )
        return out_PQd.transpose(0, 1)
    if kernel == "dense":
        if mask_PP is None:
            mask_PP = block_mask(layout.image_ids_P)
        return F.scaled_dot_product_attention(
            q_QPd[None], k_JPd[None], v_JPd[None], attn_mask=mask_PP
        )[0]
    # per_image: gather each image's valid positions, attend inside it, scatter back (padding -> 0).
    idx = layout.valid_index_N
    qs = q_QPd[:, idx].split(layout.sizes, dim=1)
    ks = k_JPd[:, idx].split(layout.sizes, dim=1)
    vs = v_JPd[:, idx].split(layout.sizes, dim=1)
    out_QNd = torch.cat(
        [F.scaled_dot_product_attention(q, k, v) for q, k, v in zip(qs, ks, vs)], dim=1
    )
    if not layout.has_padding:
        return out_QNd
    out = torch.zeros_like(q_QPd)
    out[:, idx] = out_QNd
    return out


def merge_patches(x_PD: torch.Tensor, layout: PackLayout) -> torch.Tensor:
    """Qwen2-VL style merge: concatenate each merge x merge block's features -> [N, merge**2 * D].

    Tokens come out image by image, each image's tokens in raster order of its merged grid; inside a
    token the block's patches are concatenated top-left, top-right, bottom-left, bottom-right.
    """
    m2 = layout.merge**2
    out = x_PD.new_zeros(layout.num_tokens, m2, x_PD.shape[1])
    out[layout.token_index_N, layout.sub_index_N] = x_PD[layout.valid_P]
    return out.reshape(layout.num_tokens, m2 * x_PD.shape[1])
