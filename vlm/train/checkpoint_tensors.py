"""A training checkpoint's model weights as stored tensors a rank reads its share of
(vlm.model.share_load), for `train.init_from`.

Every file is opened memory-mapped (`torch.load(mmap=True)`, tensors and plain containers only:
vlm.train.engine.safe_load), so a rank reads the pages of the elements it keeps and no more.
- ZeRO 0-2 keep the whole module in `ds/mp_rank_00_model_states.pt`. With experts split over ranks
  that file holds expert rank 0's shard; every rank's `experts_rank_NNNNN.pt` holds its own
  (vlm.train.expert_parallel), and the rows of an expert tensor are read from the shards that
  hold them.
- ZeRO-3 leaves the module empty: a trained parameter exists only as its writers' fp32 optimizer
  partitions (`*_optim_states.pt`, `fp32_flat_groups`: per sub-group each rank's partition of its
  every parameter, ceil(numel / n) elements each over the sub-group's n ranks, one after another
  in the order of the model file's `param_shapes`; n is the world, or with experts split an expert
  shard's holders, as the file's `ds_zero_partition_groups` says), its Adam moments beside them
  in the same layout, a frozen one as each rank's `frozen_param_fragments`, buffers in the module.
  Element k of a parameter is element k mod p of its k // p-th partition (DeepSpeed's zero_to_fp32
  layout), so a rank reads the pieces of its share from the writers that hold them; a routed
  expert's whole tensor is its shards put end to end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from vlm.model.legacy_names import current_key, current_keys
from vlm.model.share_load import InMemory, Stored
from vlm.model.shares import is_routed_expert
from vlm.train.engine import load_mapped as _mapped
from vlm.train.expert_parallel import SHARD_FILE, written_degree


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

    # a ZeRO-3 checkpoint's optimizer state (Zero3Checkpoint)
    def elements(self, name: str, lo: int, hi: int, key: str = "fp32") -> torch.Tensor:
        return self.stored.elements(self.names[name], lo, hi, key)

    def optimized(self, name: str) -> bool:
        return self.stored.optimized(self.names[name])

    def adam_step(self):
        return self.stored.adam_step()


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
        return self.transform(name, shard_rows([self.shards[j][name] for j in range(P)], a, b))


def shard_rows(shards: list[torch.Tensor], a: int, b: int) -> torch.Tensor:
    """Rows [a, b) of `shards` put end to end (a routed expert's whole tensor: expert k is row k),
    sliced from the shards that hold them only (memory-mapped, the others are not read)."""
    out, start = [], 0
    for t in shards:
        lo, hi = max(a, start), min(b, start + t.shape[0])
        if lo < hi:
            out.append(t[lo - start : hi - start])
        start += t.shape[0]
    return torch.cat(out) if len(out) != 1 else out[0]


def _rank_of(f: Path) -> int:
    return int(f.name.split("zero_pp_rank_")[1].split("_")[0])


def _expert_ranks(ckpt: Path, W: int) -> list[int]:
    """Each writer's expert rank (all 0 without experts split): whose shard its expert
    parameters are."""
    P, _ = written_degree(ckpt)
    if P == 1:
        return [0] * W
    out = []
    for r in range(W):
        f = ckpt / SHARD_FILE.format(r)
        if not f.is_file():
            from configs.config import ConfigError

            raise ConfigError(f"{ckpt}: no expert shard of rank {r} ({f.name})")
        out.append(int(_mapped(f)["expert_rank"]))
    return out


@dataclass
class _Piece:
    """One writer-side tensor (a dense parameter, or one expert shard of an expert parameter) as
    its partitions lie: element k is element k % p of partition k // p, partition i at `offset`
    in sub-group `group` of writer `writer` (group None: a frozen tensor's fragment)."""

    shape: tuple[int, ...]
    p: int
    parts: dict[int, tuple[int, int | None, int]]  # partition index -> (writer, group, offset)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Zero3Checkpoint(Stored):
    """The weights of a ZeRO-3 checkpoint's `ds/` directory, read by rows from the partitions of
    every rank that wrote it (memory-mapped: only the pages of the rows asked for are read), and
    the Adam moments of a trained parameter by elements (`elements`: vlm.train.expert_regroup_zero3).
    Each optimizer sub-group is partitioned over its own group of writers (the optimizer file's
    `ds_zero_partition_groups`, with experts split: an expert shard's over the ranks holding it;
    without: every sub-group over every writer); a routed expert's whole tensor is its shards put
    end to end."""

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
        optims = [_mapped(f)["optimizer_state_dict"] for f in optim_files]
        self.W = len(models)
        self.flat = [list(o["fp32_flat_groups"]) for o in optims]
        self.states = [_group_states(o) for o in optims]
        self.fragments = [m.get("frozen_param_fragments") or {} for m in models]
        expert_rank = _expert_ranks(ds_dir.parent, self.W)
        # (name, expert rank or 0) -> its piece
        pieces: dict[tuple[str, int], _Piece] = {}
        for r, (m, o) in enumerate(zip(models, optims, strict=True)):
            groups = o.get("ds_zero_partition_groups")
            for g, shapes in enumerate(m["param_shapes"]):
                count, index = (
                    (groups[g]["partition_count"], groups[g]["partition_rank"])
                    if groups
                    else (self.W, r)
                )
                offset = 0
                for name, shape in shapes.items():
                    p = -(-math.prod(shape) // count)
                    key = (name, expert_rank[r] if is_routed_expert(current_key(name)) else 0)
                    piece = pieces.setdefault(key, _Piece(tuple(shape), p, {}))
                    piece.parts[index] = (r, g, offset)
                    offset += p
            for name, frag in self.fragments[r].items():
                routed = is_routed_expert(current_key(name))
                j = expert_rank[r] if routed else 0
                # a frozen tensor is partitioned as a trained one is: a shard over its holders
                holders = [w for w in range(self.W) if not routed or expert_rank[w] == j]
                shape = tuple(m["frozen_param_shapes"][name])
                piece = pieces.setdefault((name, j), _Piece(shape, frag.numel(), {}))
                piece.parts[holders.index(r)] = (r, None, 0)
        self.pieces: dict[str, list[_Piece]] = {}
        for (name, _), piece in sorted(pieces.items()):
            self.pieces.setdefault(name, []).append(piece)
        self.frozen = set(models[0].get("frozen_param_shapes") or {})
        module = models[0].get("module") or {}
        self.buffers = {k: module[k] for k in models[0].get("buffer_names", []) if k in module}
        self.shared = dict(models[0].get("shared_params") or {})  # name -> the name it is

    def _own(self, name: str) -> str:
        return self.shared.get(name, name)

    def _shape(self, name: str) -> tuple[int, ...]:
        first, *more = self.pieces[name]
        if not more:
            return first.shape
        return (sum(p.shape[0] for p in self.pieces[name]), *first.shape[1:])

    def shapes(self) -> dict[str, tuple[int, ...]]:
        out = {k: self._shape(k) for k in self.pieces}
        out.update({k: tuple(v.shape) for k, v in self.buffers.items()})
        out.update({k: out[v] for k, v in self.shared.items() if v in out})
        return out

    def _source(self, name: str, writer: int, group: int | None, key: str) -> torch.Tensor:
        if group is None:  # frozen: no optimizer state
            return self.fragments[writer][name].reshape(-1)
        if key == "fp32":
            return self.flat[writer][group]
        return self.states[writer][group][key]

    def _read(self, name: str, piece: _Piece, lo: int, hi: int, key: str) -> list[torch.Tensor]:
        """Elements lo .. hi - 1 of one piece, from the partitions that hold them."""
        out, p = [], piece.p
        for i in range(lo // p, -(-hi // p)):
            writer, group, offset = piece.parts[i]
            a, b = max(lo, i * p) - i * p, min(hi, (i + 1) * p) - i * p
            out.append(self._source(name, writer, group, key)[offset + a : offset + b])
        return out

    def elements(self, name: str, lo: int, hi: int, key: str = "fp32") -> torch.Tensor:
        """Elements lo .. hi - 1 of the whole parameter `name`, flat: its fp32 master (`fp32`) or
        an Adam moment (`exp_avg`, `exp_avg_sq`)."""
        own, pieces, base = self._own(name), [], 0
        for piece in self.pieces[own]:
            a, b = max(lo, base), min(hi, base + piece.numel)
            if a < b:
                pieces += self._read(own, piece, a - base, b - base, key)
            base += piece.numel
        if not pieces:  # a partition of padding only (a tensor smaller than its ranks)
            return torch.empty(0)
        return torch.cat(pieces) if len(pieces) != 1 else pieces[0]

    def optimized(self, name: str) -> bool:
        """`name` was trained (its Adam moments are in the writers' optimizer state)."""
        return self._own(name) not in self.frozen

    def adam_step(self):
        """Adam's step count as the writers kept it (every sub-group steps together)."""
        for states in self.states[0]:
            if states is not None and "step" in states:
                return states["step"]
        return None

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        own = self._own(name)
        if own in self.buffers:
            t = self.buffers[own]
            return self.transform(name, t if t.dim() == 0 else t[a:b])
        shape = self._shape(own)
        per_row = math.prod(shape[1:]) if shape else 1
        flat = self.elements(own, a * per_row, b * per_row if shape else 1)
        return self.transform(name, flat.view(b - a, *shape[1:]) if shape else flat.view(()))


def _group_states(zero_state: dict) -> list[dict | None]:
    """The base optimizer's state of each sub-group (its one flat fp32 partition), in sub-group
    order: the groups' parameters numbered one after another."""
    base = zero_state["optimizer_state_dict"]
    order = [i for group in base["param_groups"] for i in group["params"]]
    return [base["state"].get(i) for i in order]


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
