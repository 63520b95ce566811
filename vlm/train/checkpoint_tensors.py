"""A training checkpoint's model weights as stored tensors a rank reads its share of
(vlm.model.share_load), for `train.init_from`.

Every file is opened memory-mapped (`torch.load(mmap=True)`, tensors and plain containers only:
vlm.train.engine.safe_load), so a rank reads the pages of the elements it keeps and no more.
- ZeRO 0-2 keep the whole module in `ds/mp_rank_00_model_states.pt`. With experts split over ranks
  that file holds expert rank 0's shard; every rank's `experts_rank_NNNNN.pt` holds its own
  (vlm.train.expert_parallel), and the rows of an expert tensor are read from the shards that
  hold them.
- ZeRO-3 leaves the module empty: a trained parameter exists only as the W writers' fp32 optimizer
  partitions (`*_optim_states.pt`, `fp32_flat_groups`: each rank's partition of every parameter of
  a group, ceil(numel / W) elements each, one after another in the order of the model file's
  `param_shapes`), a frozen one as each rank's `frozen_param_fragments`, buffers in the module.
  Element k of a parameter is element k mod p of writer k // p's partition (DeepSpeed's
  zero_to_fp32 layout), so a rank reads the pieces of its share from the writers that hold them.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from vlm.model.legacy_names import current_key, current_keys
from vlm.model.share_load import InMemory, Stored
from vlm.model.shares import is_routed_expert
from vlm.train.engine import safe_load
from vlm.train.expert_parallel import SHARD_FILE, written_degree


def _mapped(path: Path) -> dict:
    return safe_load(path, map_location="cpu", load=functools.partial(torch.load, mmap=True))


class Renamed(Stored):
    """`stored` under today's names (legacy_names)."""

    def __init__(self, stored: Stored):
        self.stored, self.where = stored, stored.where
        self.names = {current_key(k): k for k in stored.shapes()}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        have = self.stored.shapes()
        return {k: have[v] for k, v in self.names.items()}

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        return self.stored.rows(self.names[name], a, b)


class CheckpointTensors(InMemory):
    """The module state of a checkpoint (memory-mapped where the file allows), with the routed
    experts read from the expert shards that hold their rows."""

    def __init__(self, module: dict, where: str, shards: dict[int, dict] | None, transform=None):
        super().__init__(module, where, transform)
        self.shards = shards or {}
        P = len(self.shards)
        self._shapes = super().shapes()
        for name in self._shapes:
            if P > 1 and is_routed_expert(name):
                per = self.shards[0][name].shape
                self._shapes[name] = (per[0] * P, *per[1:])

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        P = len(self.shards)
        if P <= 1 or not is_routed_expert(name):
            return super().rows(name, a, b)
        per = self.shards[0][name].shape[0]
        pieces = []
        for j in range(a // per, -(-b // per)):
            lo, hi = max(a, j * per) - j * per, min(b, (j + 1) * per) - j * per
            pieces.append(self.shards[j][name][lo:hi])
        return self.transform(name, torch.cat(pieces))


def _rank_of(f: Path) -> int:
    return int(f.name.split("zero_pp_rank_")[1].split("_")[0])


class Zero3Checkpoint(Stored):
    """The weights of a ZeRO-3 checkpoint's `ds/` directory, read by rows from the partitions of
    every rank that wrote it (memory-mapped: only the pages of the rows asked for are read)."""

    def __init__(self, ds_dir: Path, where: str, transform=None):
        self.where, self.transform = where, transform or (lambda name, t: t)
        model_files = sorted(ds_dir.glob("zero_pp_rank_*_model_states.pt"), key=_rank_of)
        optim_files = sorted(ds_dir.glob("*zero_pp_rank_*_optim_states.pt"), key=_rank_of)
        if not model_files or len(model_files) != len(optim_files):
            from configs.config import ConfigError

            raise ConfigError(
                f"{where}: a ZeRO-3 checkpoint needs every rank's model and optimizer states "
                f"(found {len(model_files)} and {len(optim_files)} files in {ds_dir})"
            )
        models = [_mapped(f) for f in model_files]
        self.W = len(models)
        self.flat = [
            list(_mapped(f)["optimizer_state_dict"]["fp32_flat_groups"]) for f in optim_files
        ]
        # name -> (offset of its partitions in each rank's concatenated groups, partition, shape)
        self.trained: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        offset = 0
        for group in models[0]["param_shapes"]:
            for name, shape in group.items():
                p = -(-math.prod(shape) // self.W)
                self.trained[name] = (offset, p, tuple(shape))
                offset += p
        self.frozen = {k: tuple(v) for k, v in (models[0].get("frozen_param_shapes") or {}).items()}
        self.fragments = [m.get("frozen_param_fragments") or {} for m in models]
        module = models[0].get("module") or {}
        self.buffers = {k: module[k] for k in models[0].get("buffer_names", []) if k in module}
        self.shared = dict(models[0].get("shared_params") or {})  # name -> the name it is

    def _own(self, name: str) -> str:
        return self.shared.get(name, name)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        out = {k: v[2] for k, v in self.trained.items()}
        out.update(self.frozen)
        out.update({k: tuple(v.shape) for k, v in self.buffers.items()})
        out.update({k: out[v] for k, v in self.shared.items() if v in out})
        return out

    def _partition(self, name: str, r: int, lo: int, hi: int) -> torch.Tensor:
        """Elements lo .. hi - 1 of writer r's partition of parameter `name`."""
        if name in self.frozen:
            return self.fragments[r][name].reshape(-1)[lo:hi]
        offset = self.trained[name][0]
        pieces, base = [], 0
        for t in self.flat[r]:  # the rank's groups, concatenated
            a, b = max(offset + lo, base), min(offset + hi, base + t.numel())
            if a < b:
                pieces.append(t[a - base : b - base])
            base += t.numel()
        return torch.cat(pieces) if len(pieces) != 1 else pieces[0]

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        own = self._own(name)
        if own in self.buffers:
            t = self.buffers[own]
            return self.transform(name, t if t.dim() == 0 else t[a:b])
        shape = self.frozen.get(own) or self.trained[own][2]
        p = -(-math.prod(shape) // self.W)
        per_row = math.prod(shape[1:]) if shape else 1
        start, stop = a * per_row, (b * per_row if shape else 1)
        pieces = [
            self._partition(own, r, max(start, r * p) - r * p, min(stop, (r + 1) * p) - r * p)
            for r in range(start // p, -(-stop // p))
        ]
        flat = torch.cat(pieces) if pieces else torch.empty(0)
        return self.transform(name, flat.view(b - a, *shape[1:]) if shape else flat.view(()))


def checkpoint_tensors(path: Path, transform=None) -> Stored:
    """The model weights of the checkpoint directory `path` (its `ds/` and expert shards) under
    today's names; `transform(name, rows)`: applied to every read (a muP head's fold)."""
    module_file = path / "ds" / "mp_rank_00_model_states.pt"
    state = _mapped(module_file) if module_file.is_file() else {}
    module = state.get("module")
    if not module:  # ZeRO-3: the optimizer's fp32 partitions hold the weights
        return Renamed(Zero3Checkpoint(path / "ds", str(path), transform))
    module = current_keys(module)
    P, _ = written_degree(path)
    shards: dict[int, dict] = {}
    if P > 1:
        for f in sorted(path.glob(SHARD_FILE.replace("{:05d}", "*"))):
            shard = _mapped(f)
            shards.setdefault(int(shard["expert_rank"]), current_keys(shard["tensors"]))
        if sorted(shards) != list(range(P)):
            from configs.config import ConfigError

            raise ConfigError(
                f"{path}: expert shards of {P} ranks expected, found {sorted(shards)}"
            )
    return CheckpointTensors(module, str(path), shards, transform)
