"""A training checkpoint's model weights as stored tensors a rank reads its share of
(vlm.model.share_load), for `train.init_from`.

ZeRO 0-2 keep the whole module in `ds/mp_rank_00_model_states.pt`: it is opened memory-mapped
(`torch.load(mmap=True)`, tensors and plain containers only), so a rank reads the pages of the rows
it keeps and no more. With experts split over ranks that file holds expert rank 0's shard; every
rank's `experts_rank_NNNNN.pt` holds its own (vlm.train.expert_parallel), also memory-mapped, and
the rows of an expert tensor are read from the shards that hold them. ZeRO-3 leaves the module file
empty: its weights exist only as every rank's fp32 optimizer partitions, flattened per parameter
group, and DeepSpeed's reader (`zero_to_fp32`) rebuilds the whole fp32 state from all of them on
each rank: such a checkpoint is read whole (a limit: reading a share of it would need the
partitions' layout, which only DeepSpeed's private reader knows; resuming it, or its export, is
per rank).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from vlm.model.legacy_names import current_keys
from vlm.model.share_load import InMemory
from vlm.model.shares import is_routed_expert
from vlm.train.engine import safe_load
from vlm.train.expert_parallel import SHARD_FILE, written_degree


def _mapped(path: Path) -> dict:
    return safe_load(path, map_location="cpu", load=functools.partial(torch.load, mmap=True))


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


def checkpoint_tensors(path: Path, transform=None) -> CheckpointTensors:
    """The model weights of the checkpoint directory `path` (its `ds/` and expert shards) under
    today's names; `transform(name, rows)`: applied to every read (a muP head's fold)."""
    module_file = path / "ds" / "mp_rank_00_model_states.pt"
    state = _mapped(module_file) if module_file.is_file() else {}
    module = state.get("module")
    if not module:  # ZeRO-3: only the optimizer's fp32 partitions hold the weights (read whole)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        module = get_fp32_state_dict_from_zero_checkpoint(str(path), tag="ds")
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
