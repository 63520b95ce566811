"""timm interop: load a timm ViT state dict from a LOCAL file into the packed NaViTEncoder, and an
optional wrapper that runs a timm ViT (incl. `naflexvit_*`) as the tower's encoder.

Legend: D width, N flat tokens or patches, I images, P patches, H height, W width.

Loading needs no timm: it maps timm's key names and shapes by hand. Nothing here downloads anything.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vision.hf_vision import hf_vision_to_timm, is_hf_vision_layout
from vision.image_processor import unpatchify
from vision.navit import Merger, NaViTEncoder
from vision.packing import build_layout, merge_patches

_DIRECT = re.compile(
    r"^(blocks\.\d+\.(norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)|norm\.(weight|bias)|norm_pre\.(weight|bias))$"
)
_WRAPPERS = ("state_dict", "model", "module", "state_dict_ema")
_PREFIXES = ("module.", "model.")


@dataclass
class LoadReport:
    loaded: list[str] = field(default_factory=list)  # checkpoint keys that landed
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint key, why not)
    # encoder params left at their init
    untouched: list[str] = field(default_factory=list)
    # e.g. pos-embed factorisation error
    notes: list[str] = field(default_factory=list)

    # skip reasons for checkpoint parts a packed encoder has no use for; every other skip is
    # a mismatch
    _NOT_USED = ("the packed encoder has no prefix tokens", "not part of the packed encoder")

    def mismatches(self) -> list[str]:
        """What keeps a checkpoint from loading whole: a tensor that did not fit, an encoder param at its init."""
        out = [f"{k}: {why}" for k, why in self.skipped if not why.startswith(self._NOT_USED)]
        return out + [
            f"encoder param {n} is not in the checkpoint (kept at init)" for n in self.untouched
        ]

    def __str__(self) -> str:
        lines = [
            (
                f"loaded {len(self.loaded)} tensors, skipped {len(self.skipped)}, "
                f"{len(self.untouched)} encoder params kept at init"
            )
        ]
        lines += [f"  skipped {k}: {why}" for k, why in self.skipped]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors from a local .safetensors / .pth / .pt / .bin file, or a Hugging Face model folder
    holding model.safetensors (common wrapper keys and prefixes removed; SigLIP / CLIP names mapped
    to timm's)."""
    path = Path(path)
    if path.is_dir():
        if not (path / "model.safetensors").is_file():
            raise FileNotFoundError(
                f"vision checkpoint folder {path} has no model.safetensors (a Hugging Face "
                "SigLIP / CLIP folder saved with save_pretrained, or give a weights file)"
            )
        path = path / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(
            f"timm checkpoint {path} does not exist (only "
            "local files are read, nothing is downloaded)"
        )
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        sd = load_file(str(path), device="cpu")
    elif path.suffix in (".pth", ".pt", ".bin", ".ckpt"):
        sd = torch.load(str(path), map_location="cpu", weights_only=True)
    else:
        raise ValueError(
            f"timm checkpoint {path}: unsupported extension {path.suffix!r}; "
            "allowed: .safetensors, .pth, .pt, .bin, .ckpt"
        )
    for key in _WRAPPERS:
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not isinstance(sd, dict):
        raise ValueError(
            f"timm checkpoint {path}: expected a dict of tensors, got {type(sd).__name__}"
        )
    out = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            continue
        for p in _PREFIXES:
            if k.startswith(p):
                k = k[len(p) :]
        out[k] = v
    return hf_vision_to_timm(out) if is_hf_vision_layout(out) else out


def factorise_pos_embed(grid_HWD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Least-squares additive fit grid[r, c] ~ row[r] + col[c]; returns (row, col,
    relative L2 error).

    The optimum is row = row-mean - mean/2, col = col-mean - mean/2 (the overall mean split evenly).
    """
    g = grid_HWD.float()
    mu = g.mean(dim=(0, 1))
    row, col = g.mean(dim=1) - mu / 2, g.mean(dim=0) - mu / 2
    fit = row[:, None] + col[None, :]
    err = float((fit - g).norm() / g.norm().clamp_min(1e-12))
    return row, col, err


def resample_table(table: torch.Tensor, size: int, mode: str) -> torch.Tensor:
    """Fit a 1D position table ([n, D]) to `size` entries.

    copy: entries keep their absolute index (exact for images at the checkpoint's grid), the last
    entry repeats beyond it and a longer table is truncated; interpolate: linear resize of the
    whole table (positions become relative to the table length, as timm does when it resizes for
    a new resolution).
    """
    n = table.shape[0]
    if mode == "interpolate":
        if n == size:
            return table
        return F.interpolate(table.T[None], size=size, mode="linear", align_corners=True)[0].T
    if n >= size:
        return table[:size]
    return torch.cat([table, table[-1:].expand(size - n, -1)], dim=0)


def _patch_weight(w: torch.Tensor, patch: int, channels_last: bool) -> torch.Tensor | str:
    """timm patch-embedding weight -> [D, 3*p*p] in our (c, ph, pw) order, or a reason string."""
    if w.ndim == 4:  # conv [D, C, p, p]
        if w.shape[1:] != (3, patch, patch):
            return f"conv weight {tuple(w.shape)} does not match 3 channels x patch {patch}"
        return w.reshape(w.shape[0], -1)
    if w.ndim == 2:  # naflex linear [D, p*p*C]
        if w.shape[1] != 3 * patch * patch:
            return f"linear weight {tuple(w.shape)} does not take 3*{patch}*{patch} inputs"
        if channels_last:  # (ph, pw, C) -> (C, ph, pw)
            return (
                w.reshape(w.shape[0], patch, patch, 3).permute(0, 3, 1, 2).reshape(w.shape[0], -1)
            )
        return w
    return f"unexpected patch weight rank {w.ndim}"


def load_timm_vit_state_dict(
    encoder: NaViTEncoder,
    path: str | Path,
    pos_resample: str = "copy",
    naflex_channels_last: bool = True,
) -> LoadReport:
    """Copy a timm ViT / NaFlexViT checkpoint's weights into `encoder` where names and shapes allow.

    Handles: patch_embed.proj (conv) or embeds.proj (naflex linear), blocks.i.{norm1, attn.qkv,
    attn.proj, norm2, mlp.fc1, mlp.fc2}, norm, norm_pre, and position embeddings (1D `pos_embed`
    with or without prefix tokens, naflex 2D `embeds.pos_embed`, factorised `embeds.pos_embed_y/x`)
    fitted into the learned2d row/col tables. Class/register tokens, heads and pooling have no place
    in a packed encoder.
    """
    if pos_resample not in ("copy", "interpolate"):
        raise ValueError(f"pos_resample must be 'copy' or 'interpolate', got {pos_resample!r}")
    sd = read_state_dict(path)
    params = dict(encoder.named_parameters())
    report = LoadReport()
    assigned: set[str] = set()
    patch = encoder.patch_size

    def put(src: str, dst: str, value: torch.Tensor) -> None:
        target = params.get(dst)
        if target is None:
            report.skipped.append(
                (
                    src,
                    f"encoder has no {dst}"
                    + (" (set encoder.norm_pre=true)" if dst.startswith("norm_pre") else ""),
                )
            )
        elif tuple(value.shape) != tuple(target.shape):
            report.skipped.append(
                (src, f"shape {tuple(value.shape)} != encoder {dst} {tuple(target.shape)}")
            )
        else:
            with torch.no_grad():
                target.copy_(value.to(target.dtype))
            report.loaded.append(src)
            assigned.add(dst)

    # Class and register tokens may own leading entries of a classic 1D pos_embed.
    prefix_tokens = sum(
        sd[k].shape[1]
        for k in ("cls_token", "reg_token", "embeds.cls_token", "embeds.reg_token")
        if k in sd and sd[k].ndim == 3
    )
    for key, value in sd.items():
        if _DIRECT.match(key):
            put(key, key, value)
        elif key in ("patch_embed.proj.weight", "embeds.proj.weight"):
            w = _patch_weight(value, patch, naflex_channels_last and key.startswith("embeds."))
            if isinstance(w, str):
                report.skipped.append((key, w))
            else:
                put(key, "patch_embed.proj.weight", w)
        elif key in ("patch_embed.proj.bias", "embeds.proj.bias"):
            put(key, "patch_embed.proj.bias", value)
        elif key in ("pos_embed", "embeds.pos_embed", "embeds.pos_embed_y", "embeds.pos_embed_x"):
            _load_pos(encoder, key, value, sd, prefix_tokens, pos_resample, report, assigned)
        elif key.endswith(("cls_token", "reg_token")):
            report.skipped.append(
                (
                    key,
                    (
                        "the packed encoder has no prefix tokens (patch features "
                        "no longer attend to them, so they differ from timm's)"
                    ),
                )
            )
        elif re.match(r"^blocks\.\d+\.", key):
            report.skipped.append(
                (
                    key,
                    (
                        "unsupported block part (layer scale, qk-norm, "
                        "...) or a layer the encoder does not have"
                    ),
                )
            )
        else:
            report.skipped.append(
                (key, "not part of the packed encoder (head / pooling / fc_norm / other)")
            )
    for name in params:
        if name not in assigned and not name.startswith("merger."):
            report.untouched.append(name)
    return report


def _load_pos(encoder, key, value, sd, prefix_tokens, mode, report, assigned) -> None:
    if encoder.pos_embed is None:
        report.skipped.append((key, "encoder uses rope2d: no learned position table to fill"))
        return
    size = encoder.cfg.max_grid
    if key == "embeds.pos_embed_x":
        return  # handled together with pos_embed_y
    if key == "embeds.pos_embed_y":
        if "embeds.pos_embed_x" not in sd:
            report.skipped.append((key, "factorised embedding without embeds.pos_embed_x"))
            return
        row, col = (
            value.reshape(-1, value.shape[-1]),
            sd["embeds.pos_embed_x"].reshape(-1, value.shape[-1]),
        )
        srcs = [key, "embeds.pos_embed_x"]
        err = 0.0
    else:
        if value.ndim == 4:  # naflex [1, H, W, D]
            grid = value[0]
        else:  # classic [1, (prefix +) N, D]
            n = value.shape[1]
            side = math.isqrt(n)
            if side * side != n:
                side = math.isqrt(n - prefix_tokens)
                if prefix_tokens and side * side == n - prefix_tokens:
                    value = value[:, prefix_tokens:]
                else:
                    report.skipped.append(
                        (
                            key,
                            (
                                f"{n} positions are not a square grid (with "
                                f"or without {prefix_tokens} prefix tokens)"
                            ),
                        )
                    )
                    return
            grid = value[0].reshape(side, side, -1)
        row, col, err = factorise_pos_embed(grid)
        srcs = [key]
    if row.shape[-1] != encoder.pos_embed.row.shape[1]:
        width = encoder.pos_embed.row.shape[1]
        report.skipped.append((key, f"embedding width {row.shape[-1]} != encoder hidden {width}"))
        return
    with torch.no_grad():
        encoder.pos_embed.row.copy_(resample_table(row, size, mode).to(encoder.pos_embed.row.dtype))
        encoder.pos_embed.col.copy_(resample_table(col, size, mode).to(encoder.pos_embed.col.dtype))
    report.loaded += srcs
    assigned.update({"pos_embed.row", "pos_embed.col"})
    report.notes.append(
        f"{key}: {row.shape[0]}x{col.shape[0]} grid fitted as row+col tables "
        f"(relative L2 error {err:.3g}), resampled to max_grid={size} by {mode!r}"
    )


def require_timm():
    try:
        import timm
    except Exception as e:  # noqa: BLE001 - ImportError, or torchvision failing to import on CPU torch
        raise ImportError(
            "vision backbone 'timm' needs the optional timm package: install the "
            f"project's `timm` extra (pip install -e '.[timm]') ({type(e).__name__}: {e})"
        ) from None
    return timm


class TimmBackbone(nn.Module):
    """Runs a timm ViT on the packed inputs and returns merged tokens like NaViTEncoder.

    `naflexvit_*` models take all images at once, padded one image per row (timm's own NaFlex
    layout); other ViTs are created with dynamic_img_size and run image by image. Prefix
    tokens are dropped.
    """

    def __init__(
        self,
        model_name: str,
        merge: int = 2,
        patch_size: int = 16,
        checkpoint: str | None = None,
        merger: str = "mlp",
        out_dim: int | None = None,
        **timm_kwargs,
    ):
        super().__init__()
        timm = require_timm()
        self.naflex = model_name.startswith("naflexvit")
        if not self.naflex:
            timm_kwargs.setdefault("dynamic_img_size", True)
        self.model = timm.create_model(model_name, pretrained=False, num_classes=0, **timm_kwargs)
        self.report = None
        if checkpoint:
            missing, unexpected = self.model.load_state_dict(
                read_state_dict(checkpoint), strict=False
            )
            self.report = LoadReport(
                untouched=list(missing), skipped=[(k, "unexpected") for k in unexpected]
            )
        self.merge, self.patch_size = merge, patch_size
        model_patch = getattr(
            getattr(self.model, "embeds", None) or getattr(self.model, "patch_embed", None),
            "patch_size",
            None,
        )
        model_patch = model_patch[0] if isinstance(model_patch, (tuple, list)) else model_patch
        if model_patch is not None and int(model_patch) != patch_size:
            raise ValueError(
                f"timm model {model_name} uses patch size {model_patch}, but the image processor "
                f"makes {patch_size}-pixel patches; set processor.patch_size={model_patch}"
            )
        self.prefix = int(getattr(self.model, "num_prefix_tokens", 0))
        dim = int(self.model.num_features)
        merged = dim * merge * merge
        self.merger = Merger(merger, merged, out_dim or merged)
        self.out_dim = out_dim or merged
        embeds = getattr(self.model, "embeds", None)
        self.channels_last = bool(getattr(embeds, "channels_last", True))

    def forward(self, patches_PD, coords_P2, image_grids_I2, valid_P=None):
        layout = build_layout(coords_P2, image_grids_I2, self.merge, valid_P)
        p = self.patch_size
        x_ND = patches_PD[layout.valid_P]
        ids_N = layout.image_ids_P[layout.valid_P]
        grids = image_grids_I2.tolist()
        if self.naflex:
            rank_N = torch.arange(len(ids_N), device=ids_N.device) - layout.cu_seqlens.long()[ids_N]
            I, P = len(grids), layout.max_patches
            if self.channels_last:
                x_ND = x_ND.reshape(-1, 3, p, p).permute(0, 2, 3, 1).reshape(len(x_ND), -1)
            patches = x_ND.new_zeros(I, P, x_ND.shape[1])
            coords = torch.zeros(I, P, 2, dtype=torch.long, device=x_ND.device)
            valid = torch.zeros(I, P, dtype=torch.bool, device=x_ND.device)
            patches[ids_N, rank_N] = x_ND
            coords[ids_N, rank_N] = layout.coords_P2[layout.valid_P]
            valid[ids_N, rank_N] = True
            feats = self.model.forward_features(
                patches=patches, patch_coord=coords, patch_valid=valid
            )
            feats = feats["patches"] if isinstance(feats, dict) else feats
            feat_ND = feats[:, self.prefix :][ids_N, rank_N]
        else:
            # Put each image's patches in raster order (inputs may come in any order), run,
            # map back.
            rc_N2 = layout.coords_P2[layout.valid_P]
            g_N2 = image_grids_I2.to(rc_N2.device)[ids_N]
            raster_N = layout.cu_seqlens.long()[ids_N] + rc_N2[:, 0] * g_N2[:, 1] + rc_N2[:, 1]
            x_sorted = torch.empty_like(x_ND)
            x_sorted[raster_N] = x_ND
            outs, start = [], 0
            for rows, cols in grids:  # one image at a time: classic ViTs have no packed attention
                n = rows * cols
                img = unpatchify(x_sorted[start : start + n], (rows, cols), p)[None]
                outs.append(self.model.forward_features(img)[0, self.prefix :])
                start += n
            feat_ND = torch.cat(outs)[raster_N]
        feat_PD = feat_ND.new_zeros(patches_PD.shape[0], feat_ND.shape[1])
        feat_PD[layout.valid_P] = feat_ND
        return self.merger(merge_patches(feat_PD, layout))
