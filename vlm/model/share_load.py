"""Loading a rank's share of a model from stored tensors, reading only the rows it keeps.

A `Stored` names its tensors as the model does (`lm.embed.weight`, ...) and reads rows a .. b - 1
of dim 0 of one of them: from safetensors through `safe_open(...).get_slice` (nothing else of the
file is read), from a transformers MoE checkpoint (its per-expert tensors transposed into this
model's [E, D, F] layout, one expert at a time), or from tensors already in memory.
`load_share_` fills each parameter's share (vlm.model.share_init.held: the whole tensor, an expert
shard's rows, a ZeRO-3 partition's flat range) from the rows that cover it: a rank reads its share
and at most one row more at each end.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from vlm.model.config import ModelConfig
from vlm.model.legacy_names import current_key
from vlm.model.share_init import held, whole_shape
from vlm.model.weights_check import WeightsError


class Stored:
    """Tensors by the model's names: their whole shapes, and rows of them."""

    where: str = ""

    def shapes(self) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        """Rows a .. b - 1 of dim 0 of tensor `name` (a 0-d tensor: itself), in its stored dtype."""
        raise NotImplementedError

    def whole(self, name: str) -> torch.Tensor:
        shape = self.shapes()[name]
        return self.rows(name, 0, shape[0] if shape else 1)

    def file_of(self, name: str) -> str:
        """Where tensor `name` is stored, for messages."""
        return self.where


class InMemory(Stored):
    """Tensors already held (a state dict)."""

    def __init__(self, state: dict[str, torch.Tensor], where: str = "", transform=None):
        self.state, self.where = state, where
        self.transform = transform or (lambda name, t: t)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.state.items()}

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        t = self.state[name]
        return self.transform(name, t if t.dim() == 0 else t[a:b])


class Safetensors(Stored):
    """The tensors of safetensors files, named by `rename(stored name)` (None: not the model's)."""

    def __init__(self, files: Iterable[Path], rename: Callable[[str], str | None], where: str):
        from safetensors import safe_open

        self.where = where
        self._index: dict[str, tuple[Path, str]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as h:
                    for stored in h.keys():
                        name = rename(stored)
                        if name is None:
                            continue
                        sl = h.get_slice(stored)
                        self._index[name] = (Path(f), stored)
                        self._shapes[name] = tuple(sl.get_shape())
                        self._dtypes[name] = sl.get_dtype()
            except Exception as e:  # noqa: BLE001 - safetensors' own error types, OSError
                raise WeightsError(f"{f}: not a readable safetensors file ({e})") from None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def file_of(self, name: str) -> str:
        return str(self._index[name][0])

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        from safetensors import safe_open

        f, stored = self._index[name]
        with safe_open(str(f), framework="pt") as h:
            if not self._shapes[name]:
                return h.get_tensor(stored)
            return h.get_slice(stored)[a:b]


def export_tensors(path: Path) -> Safetensors:
    """The weights of an export (final/, `vlm convert`'s output) under the model's names (its
    files name them `vlm.lm...`, some under names since changed: legacy_names)."""
    from vlm.model.weights_check import weight_files

    def rename(stored: str) -> str | None:
        return current_key(stored.removeprefix("vlm.")) if stored.startswith("vlm.") else None

    return Safetensors(weight_files(Path(path)), rename, str(path))


def _split(n_layers: int, cfg: ModelConfig) -> list[tuple[str, int]]:
    return (
        [("encoder", i) for i in range(cfg.encoder_layers)]
        + [("concept", i) for i in range(cfg.concept_layers)]
        + [("decoder", i) for i in range(cfg.decoder_layers)]
    )


class TransformersMoE(Stored):
    """A transformers Qwen3-MoE / Mixtral checkpoint's safetensors as this model's `lm.*` tensors
    (the mapping of vlm.model.convert.hf_state_dict_to_ours, read per expert): its layers in order
    become the encoder, concept and decoder layers of `cfg`; each expert's gate / up [F, D] and
    down [D, F] projections (per-expert tensors, as the hub stores them, or transformers' fused
    `gate_up_proj` [E, 2F, D] / `down_proj` [E, D, F]) are transposed into rows of
    w_gate_EDF / w_up_EDF [E, D, F] and w_down_EFD [E, F, D]."""

    def __init__(self, path: Path, cfg: ModelConfig):
        from vlm.model.weights_check import weight_files

        self.where, self.cfg = str(path), cfg
        self.files = Safetensors(weight_files(Path(path)), lambda s: s, str(path))
        have = self.files.shapes()
        E, D, F = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.expert_hidden
        self.sources: dict[str, tuple] = {}  # our name -> how to read it
        self._shapes: dict[str, tuple[int, ...]] = {}

        def plain(ours: str, theirs: str) -> None:
            if theirs in have:
                self.sources[ours] = ("plain", theirs)
                self._shapes[ours] = have[theirs]

        plain("lm.embed.weight", "model.embed_tokens.weight")
        plain("lm.norm.weight", "model.norm.weight")
        plain("lm.lm_head.weight", "lm_head.weight")
        if "lm.lm_head.weight" not in self.sources:
            plain("lm.lm_head.weight", "model.embed_tokens.weight")
        stacks = _split(cfg.encoder_layers + cfg.concept_layers + cfg.decoder_layers, cfg)
        for j, (stack, i) in enumerate(stacks):
            src, dst = f"model.layers.{j}.", f"lm.{stack}.{i}."
            for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                plain(f"{dst}attn.{p}.weight", f"{src}self_attn.{p}.weight")
            plain(f"{dst}attn_norm.weight", f"{src}input_layernorm.weight")
            plain(f"{dst}ffn_norm.weight", f"{src}post_attention_layernorm.weight")
            for mlp in ("mlp", "block_sparse_moe"):
                plain(f"{dst}moe.router.weight", f"{src}{mlp}.gate.weight")
                fused = f"{src}{mlp}.experts.gate_up_proj"
                if fused in have:
                    self.sources[f"{dst}moe.w_gate_EDF"] = ("fused", fused, 0, F)
                    self.sources[f"{dst}moe.w_up_EDF"] = ("fused", fused, F, 2 * F)
                    self.sources[f"{dst}moe.w_down_EFD"] = (
                        "fused",
                        f"{src}{mlp}.experts.down_proj",
                        0,
                        D,
                    )
                for ours, names in (
                    ("w_gate_EDF", ("gate_proj", "w1")),
                    ("w_up_EDF", ("up_proj", "w3")),
                    ("w_down_EFD", ("down_proj", "w2")),
                ):
                    for theirs in names:
                        if f"{src}{mlp}.experts.0.{theirs}.weight" in have:
                            self.sources[f"{dst}moe.{ours}"] = (
                                "experts",
                                f"{src}{mlp}.experts.{{}}.{theirs}.weight",
                            )
            for ours in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"):
                if f"{dst}moe.{ours}" in self.sources:
                    self._shapes[f"{dst}moe.{ours}"] = (
                        (E, F, D) if ours == "w_down_EFD" else (E, D, F)
                    )

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def file_of(self, name: str) -> str:
        src = self.sources[name]
        key = src[1].format(0) if src[0] == "experts" else src[1]
        return self.files.file_of(key)

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        src = self.sources[name]
        if src[0] == "plain":
            return self.files.rows(src[1], a, b)
        if src[0] == "fused":  # [E, out, in] rows a..b-1, the projection's out-range, transposed
            return self.files.rows(src[1], a, b)[:, src[2] : src[3]].transpose(1, 2).contiguous()
        per = [self.files.whole(src[1].format(e)).t() for e in range(a, b)]
        return torch.stack(per) if per else torch.empty(0, *self._shapes[name][1:])


def state_targets(module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors `module.state_dict()` names (parameters, tied ones under each name, and
    persistent buffers), as the module holds them (its shares)."""
    names = set(module.state_dict().keys())
    out = {n: p for n, p in module.named_parameters(remove_duplicate=False) if n in names}
    out.update({n: b for n, b in module.named_buffers(remove_duplicate=False) if n in names})
    return out


def whole_shapes(targets: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {n: whole_shape(t) for n, t in targets.items()}


@torch.no_grad()
def load_share_(
    targets: dict[str, torch.Tensor],
    stored: Stored,
    names: dict[str, str] | None = None,
    sharding=None,
    rows_of: Callable[[str], int] | None = None,
) -> None:
    """Fill each target (a model name -> the tensor holding this rank's share) from `stored`
    (`names`: the stored name of each target, default the same), reading only the rows that cover
    the share and checking that they are finite. `rows_of(name)`: how many leading rows of the
    target the stored tensor has (a vocabulary grown past the stored one: the rest are left)."""
    for name, t in targets.items():
        src = (names or {}).get(name, name)
        flat, start, numel = held(t, sharding)
        if not flat.numel():
            continue
        shape = whole_shape(t)
        per_row = math.prod(shape[1:]) if shape else 1
        stop = start + flat.numel()
        if rows_of is not None:  # only the stored rows: the share's part below them
            stop = min(stop, rows_of(name) * per_row)
            if stop <= start:
                continue
        a, b = start // per_row, -(-stop // per_row)
        got = stored.rows(src, a, b).reshape(-1)[start - a * per_row : stop - a * per_row]
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            bad = int((~torch.isfinite(got)).sum())
            raise WeightsError(
                f"{stored.file_of(src)}: tensor {src} has {bad} non-finite values (NaN or inf)"
            )
        flat[: stop - start].copy_(got)
