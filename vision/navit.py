"""Packed NaViT encoder ("Patch n' Pack"): images of any resolution share one sequence.

Legend: D width, N flat tokens or patches, I images, P patches, H height, W width, Q query heads, J
key/value heads, d head width.

Pre-norm ViT blocks whose parameter names follow timm's VisionTransformer (patch_embed.proj,
blocks.i.norm1 / attn.qkv / attn.proj / norm2 / mlp.fc1 / mlp.fc2, norm), so timm weights load
by name. Attention is block-diagonal over images; an optional 2x2 merge (Qwen2-VL) turns
patches into tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from configs.config import ValidatedOnInit, check
from vision.packing import (
    PackLayout,
    block_mask,
    build_layout,
    merge_patches,
    packed_attention,
    pick_backend,
)
from vision.positions import FactorisedPosEmbed, Rope2D, apply_rope


@dataclass
class NaViTConfig(ValidatedOnInit):
    """The encoder's own settings. Its patch geometry (patch_size, merge) is not stated here: it is
    the image processor's, which VisionConfig passes to NaViTEncoder."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_ratio: float = 4.0
    # the MLP's width stated outright (a pretrained tower's intermediate size, e.g. SigLIP's 4304 at
    # width 1152, which no float ratio reproduces exactly); null: hidden_size * mlp_ratio
    mlp_hidden: int | None = None
    pos: Literal["learned2d", "rope2d"] = "learned2d"
    max_grid: int = 128  # rows/cols a learned2d table covers (in patches)
    rope_theta: float = 10000.0
    # "linear": ViT's patch embedding (timm weights load into it); "conv": a stack of overlapping
    # 3x3 convs over each image's pixels down to one vector per patch (see ConvStem) for encoders
    # trained from scratch.
    stem: Literal["linear", "conv"] = "linear"
    # conv stem: channels of the first conv (doubling per stride-2 step)
    stem_channels: int = 32
    merger: Literal["mlp", "linear", "none"] = "mlp"  # how merged features map to out_dim
    # default hidden_size * merge**2 (the merged patch features as they are)
    out_dim: int | None = None
    norm_eps: float = 1e-6
    qkv_bias: bool = True
    # LayerScale (CaiT; timm's `init_values`): each block's residual branches start scaled by this,
    # so that a block trained from scratch starts near the identity instead of averaging every patch
    # into every other
    layer_scale: float | None = None
    # CLIP-style LayerNorm after the embedding (for CLIP timm weights)
    norm_pre: bool = False
    # see packing.pick_backend
    attn_backend: Literal["auto", "dense", "per_image", "flash"] = "auto"
    grad_checkpointing: bool = False

    @property
    def mlp_width(self) -> int:
        return (
            self.mlp_hidden
            if self.mlp_hidden is not None
            else int(self.hidden_size * self.mlp_ratio)
        )

    def validate(self) -> None:
        check(
            self.hidden_size >= 1 and self.num_heads >= 1, "hidden_size and num_heads must be >= 1"
        )
        check(
            self.hidden_size % self.num_heads == 0,
            f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}",
        )
        check(self.num_layers >= 0, f"num_layers must be >= 0, got {self.num_layers}")
        check(self.mlp_ratio > 0, f"mlp_ratio must be > 0, got {self.mlp_ratio}")
        check(
            self.mlp_hidden is None or self.mlp_hidden >= 1,
            f"mlp_hidden must be >= 1 or null, got {self.mlp_hidden}",
        )
        check(self.max_grid >= 1, f"max_grid must be >= 1, got {self.max_grid}")
        check(self.stem_channels >= 1, f"stem_channels must be >= 1, got {self.stem_channels}")
        check(
            self.layer_scale is None or self.layer_scale > 0,
            f"layer_scale must be > 0 or null, got {self.layer_scale}",
        )
        if self.pos == "rope2d":
            check(
                (self.hidden_size // self.num_heads) % 4 == 0,
                "pos='rope2d' needs head dim (hidden_size/num_heads = "
                f"{self.hidden_size // self.num_heads}) divisible by 4",
            )
        check(
            self.out_dim is None or self.out_dim >= 1, f"out_dim must be >= 1, got {self.out_dim}"
        )

    def out_dim_for(self, merge: int) -> int:
        """Features of one merged token: `out_dim`, by default the merge x merge patch features as they are."""
        merged = self.hidden_size * merge**2
        if self.merger == "none":
            check(
                self.out_dim is None or self.out_dim == merged,
                f"merger='none' outputs hidden_size*merge**2 = {merged} features; "
                f"out_dim={self.out_dim} needs merger 'mlp' or 'linear'",
            )
        return self.out_dim or merged


class PatchEmbed(nn.Module):
    """Linear patch embedding; equals timm's stride-p conv on (c, ph, pw)-flattened patches."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.proj = nn.Linear(in_dim, dim)

    def forward(self, patches_PD: torch.Tensor, layout: PackLayout) -> torch.Tensor:
        return self.proj(patches_PD.to(self.proj.weight.dtype))


def stem_strides(patch_size: int) -> list[int]:
    """Strides of the conv stem's layers: a 3x3 stride-2 conv per factor of two in the patch size,
    then one conv whose kernel and stride are what is left (patch 8: [2, 2, 2]; patch 14: [2, 7];
    patch 16: [2, 2, 2, 2])."""
    strides, rest = [], patch_size
    while rest % 2 == 0 and rest > 1:
        strides.append(2)
        rest //= 2
    return strides + ([rest] if rest > 1 else [])


class ConvStem(nn.Module):
    """Overlapping convolutions over each image's pixels, one output vector per patch ("Early
    convolutions help transformers see better", Xiao et al. 2021): stride-2 3x3 convs down to the
    patch grid, then a 3x3 conv on that grid.

    A linear patch embedding sees each patch alone, so a shape cut by a patch border must be pieced
    together by attention, which a small ViT trained from scratch learns slowly. The stem's 3x3
    kernels overlap patch borders from the first layer. Packed images are placed on a zero canvas of
    the batch's largest grid plus a one-patch margin (one canvas per image, nothing shared between
    images), and each patch's vector is read back at its coordinates."""

    def __init__(self, patch_size: int, dim: int, channels: int):
        super().__init__()
        self.patch_size = patch_size
        layers: list[nn.Module] = []
        c_in, c = 3, channels
        strides = stem_strides(patch_size)
        for i, s in enumerate(strides):
            last = i == len(strides) - 1
            c_out = dim if last else c
            k, pad = (3, 1) if s == 2 else (s, 0)
            layers.append(nn.Conv2d(c_in, c_out, k, stride=s, padding=pad))
            if not last:
                layers.append(nn.GELU())
            c_in, c = c_out, min(2 * c, dim)
        if not strides:  # patch size 1: a pointwise projection
            layers.append(nn.Conv2d(3, dim, 1))
        self.convs = nn.Sequential(*layers)
        # One more 3x3 conv on the patch grid: each patch vector then sees its neighbours, so an
        # object cut by patch borders is whole in its vector (without it shape is learnt several
        # times slower).
        self.grid_conv = nn.Conv2d(dim, dim, 3, padding=1)

    def forward(self, patches_PD: torch.Tensor, layout: PackLayout) -> torch.Tensor:
        p, P = self.patch_size, patches_PD.shape[0]
        idx = layout.valid_index_N
        img_N, rc_N2 = layout.image_ids_P[idx], layout.coords_P2[idx]
        # A one-patch zero margin around every image: the cells just outside it then hold the stem's
        # response to the image's edge, the same whether the image is packed with larger ones or
        # alone. (Zeroing them instead made image-text loss ~6 % worse at 600 steps: the grid conv
        # uses the border.)
        rows, cols = layout.grid_max[0] + 2, layout.grid_max[1] + 2
        r_N, c_N = rc_N2[:, 0] + 1, rc_N2[:, 1] + 1
        I = len(layout.sizes)
        w = self.convs[0].weight
        canvas = patches_PD.new_zeros(I, rows, cols, 3, p, p, dtype=w.dtype)
        canvas[img_N, r_N, c_N] = patches_PD[idx].to(w.dtype).view(-1, 3, p, p)
        pixels_I3HW = canvas.permute(0, 3, 1, 4, 2, 5).reshape(I, 3, rows * p, cols * p)
        feats_IDHW = self.grid_conv(F.gelu(self.convs(pixels_I3HW)))
        out_ND = feats_IDHW.permute(0, 2, 3, 1)[img_N, r_N, c_N]
        if not layout.has_padding:
            return out_ND
        return out_ND.new_zeros(P, out_ND.shape[1]).index_copy(0, idx, out_ND)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, qkv_bias: bool):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self,
        x_PD: torch.Tensor,
        layout: PackLayout,
        kernel: str,
        mask_PP: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        P, D = x_PD.shape
        qkv_3QPd = self.qkv(x_PD).view(P, 3, self.heads, self.head_dim).permute(1, 2, 0, 3)
        q_QPd, k_JPd, v_JPd = qkv_3QPd.unbind(0)
        if rope is not None:
            q_QPd, k_JPd = apply_rope(q_QPd, *rope), apply_rope(k_JPd, *rope)
        out_QPd = packed_attention(q_QPd, k_JPd, v_JPd, layout, kernel, mask_PP)
        return self.proj(out_QPd.transpose(0, 1).reshape(P, D))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Block(nn.Module):
    """Pre-norm ViT block (timm's names, LayerScale as timm's `ls1` / `ls2`)."""

    def __init__(self, cfg: NaViTConfig):
        super().__init__()
        d = cfg.hidden_size
        self.norm1 = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.attn = Attention(d, cfg.num_heads, cfg.qkv_bias)
        self.norm2 = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.mlp = Mlp(d, cfg.mlp_width)
        scale = cfg.layer_scale
        self.ls1 = LayerScale(d, scale) if scale is not None else nn.Identity()
        self.ls2 = LayerScale(d, scale) if scale is not None else nn.Identity()

    def forward(self, x_PD, layout, kernel, mask_PP, rope):
        x_PD = x_PD + self.ls1(self.attn(self.norm1(x_PD), layout, kernel, mask_PP, rope))
        return x_PD + self.ls2(self.mlp(self.norm2(x_PD)))


class Merger(nn.Module):
    """Maps concatenated merge x merge patch features [N, hidden*merge**2] to [N, out_dim]."""

    def __init__(self, kind: str, in_dim: int, out_dim: int):
        super().__init__()
        self.kind = kind
        if kind == "mlp":
            self.fc1, self.fc2 = nn.Linear(in_dim, in_dim), nn.Linear(in_dim, out_dim)
        elif kind == "linear":
            self.fc = nn.Linear(in_dim, out_dim)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        if self.kind == "mlp":
            return self.fc2(F.gelu(self.fc1(x_ND)))
        if self.kind == "linear":
            return self.fc(x_ND)
        return x_ND


class NaViTEncoder(nn.Module):
    """`patch_size` and `merge` are the image processor's (ImageProcessorConfig): the encoder reads its patches."""

    def __init__(self, cfg: NaViTConfig, *, patch_size: int, merge: int):
        super().__init__()
        self.cfg = cfg  # validated when it was made
        self.patch_size, self.merge = patch_size, merge
        self.out_dim = cfg.out_dim_for(merge)
        d = cfg.hidden_size
        self.patch_dim = 3 * patch_size**2
        self.patch_embed = (
            PatchEmbed(self.patch_dim, d)
            if cfg.stem == "linear"
            else ConvStem(patch_size, d, cfg.stem_channels)
        )
        self.pos_embed = FactorisedPosEmbed(cfg.max_grid, d) if cfg.pos == "learned2d" else None
        self.rope = Rope2D(d // cfg.num_heads, cfg.rope_theta) if cfg.pos == "rope2d" else None
        self.norm_pre = nn.LayerNorm(d, eps=cfg.norm_eps) if cfg.norm_pre else nn.Identity()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.merger = Merger(cfg.merger, d * merge**2, self.out_dim)
        self.apply(_init_weights)

    def layout(self, coords_P2, image_grids_I2, valid_P=None) -> PackLayout:
        return build_layout(coords_P2, image_grids_I2, self.merge, valid_P)

    def encode_patches(self, patches_PD: torch.Tensor, layout: PackLayout) -> torch.Tensor:
        """Per-patch features after the final norm, [P, hidden] (padding rows are meaningless)."""
        if patches_PD.ndim != 2 or patches_PD.shape[1] != self.patch_dim:
            raise ValueError(
                f"patches must be [P, 3*patch*patch={self.patch_dim}], "
                f"got {tuple(patches_PD.shape)}"
            )
        # Zero padding first: masked attention multiplies padded values by 0, and 0 * nan/inf
        # is nan.
        x = torch.where(
            layout.valid_P[:, None],
            patches_PD,
            torch.zeros((), dtype=patches_PD.dtype, device=patches_PD.device),
        )
        x_PD = self.patch_embed(x, layout)
        if self.pos_embed is not None:
            x_PD = x_PD + self.pos_embed(layout.coords_P2).to(x_PD.dtype)
        rope = self.rope.cos_sin(layout.coords_P2) if self.rope is not None else None
        x_PD = self.norm_pre(x_PD)
        kernel = pick_backend(x_PD, layout, self.cfg.attn_backend)
        # built once, shared by layers
        mask_PP = block_mask(layout.image_ids_P) if kernel == "dense" else None
        for blk in self.blocks:
            if self.cfg.grad_checkpointing and self.training and torch.is_grad_enabled():
                x_PD = torch.utils.checkpoint.checkpoint(
                    blk, x_PD, layout, kernel, mask_PP, rope, use_reentrant=False
                )
            else:
                x_PD = blk(x_PD, layout, kernel, mask_PP, rope)
        return self.norm(x_PD)

    def forward(
        self,
        patches_PD: torch.Tensor,
        coords_P2: torch.Tensor,
        image_grids_I2: torch.Tensor,
        valid_P: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed patches of all images -> [N, out_dim] tokens, image by image, raster order of merged grids."""
        layout = self.layout(coords_P2, image_grids_I2, valid_P)
        # a batch without images (the zero-size result keeps the graph simple)
        if layout.num_tokens == 0:
            w = next(self.patch_embed.parameters())
            return w.new_zeros(0, self.out_dim)
        return self.merger(merge_patches(self.encode_patches(patches_PD, layout), layout))


def _init_weights(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
