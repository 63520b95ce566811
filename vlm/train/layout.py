"""The parallel layout of a run: how the world's ranks share the work, built once per run.

Every rank is a point of the grid data x sequence (the world is their product): `sequence` (S)
consecutive ranks split each row of a micro-batch between them, and the world / S data-parallel
replicas each read micro-batches of their own. Expert parallelism cuts the same world another way:
`expert` (P) consecutive ranks split each MoE layer's routed experts between them (the tokens of
all their rows are exchanged with all-to-all), and the world / P ranks holding the same shard are
its expert-data-parallel replicas. Dense weights are replicated (or ZeRO-partitioned) over the
whole world, since every rank computes gradients of its own tokens.

Every component asks the layout for its group, rank and size; nothing else reads the world:
- the loader and the global batch: `data_rank` of `data` replicas (the S ranks of a row read the same
  micro-batches);
- the boundary noise: the global micro-batch index `k * data + data_rank`, a position in the global
  batch, never a rank;
- checkpoints record the layout they were written with (`as_dict`);
- expert groups: `expert_rank` of `expert`, `expert_replicas` per shard;
- the metrics' sums are over the world (every rank's tokens are its own); the loader's counters over
  the data replicas only (`counts_data`: the S ranks of a row read the same samples).

The layout itself is arithmetic (it needs no process group, so `vlm plan` builds it from a config
and a number of ranks); `vlm.train.distributed.make_groups` gives a running job its process groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from configs.config import ConfigError


@dataclass(frozen=True)
class ParallelLayout:
    world: int  # ranks in the job
    rank: int  # this rank, 0 .. world - 1
    sequence: int = 1  # S: ranks one row is split over (consecutive ranks)
    expert: int = 1  # P: ranks one MoE layer's routed experts are split over (consecutive ranks)

    @classmethod
    def of(cls, parallel, world: int, rank: int = 0) -> ParallelLayout:
        """The layout `parallel` (a ParallelConfig) asks for on `world` ranks; ConfigError (one
        line) where a degree does not divide the world."""
        S, P = parallel.sequence, parallel.expert
        for name, size in (("sequence", S), ("expert", P)):
            if world % size:
                raise ConfigError(
                    f"parallel.{name}={size} does not divide the {world} rank(s) of this run: "
                    "use a divisor of the number of ranks"
                )
        if not 0 <= rank < world:
            raise ConfigError(f"rank {rank} is not one of the {world} rank(s) of this run")
        return cls(world=world, rank=rank, sequence=S, expert=P)

    # ---- data x sequence
    @property
    def data(self) -> int:
        """Data-parallel replicas: each reads micro-batches of its own."""
        return self.world // self.sequence

    @property
    def data_rank(self) -> int:
        return self.rank // self.sequence

    @property
    def sequence_rank(self) -> int:
        """This rank's shard of each row (0: the first tokens)."""
        return self.rank % self.sequence

    @property
    def counts_data(self) -> bool:
        """Whether this rank's loader counters count: one rank per data replica does."""
        return self.sequence_rank == 0

    # ---- experts
    @property
    def expert_rank(self) -> int:
        return self.rank % self.expert

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same expert shard (its expert-data-parallel group)."""
        return self.world // self.expert

    # ---- groups as lists of global ranks (what distributed.make_groups hands torch)
    def sequence_groups(self) -> list[list[int]]:
        S = self.sequence
        return [list(range(g * S, (g + 1) * S)) for g in range(self.world // S)]

    def data_groups(self) -> list[list[int]]:
        """The ranks holding the same shard of the rows: one per sequence rank."""
        return [list(range(s, self.world, self.sequence)) for s in range(self.sequence)]

    def expert_groups(self) -> list[list[int]]:
        P = self.expert
        return [list(range(g * P, (g + 1) * P)) for g in range(self.world // P)]

    def expert_data_groups(self) -> list[list[int]]:
        return [list(range(e, self.world, self.expert)) for e in range(self.expert)]

    def global_micro_batch(self, k: int) -> int:
        """The index in the global batch of this rank's k-th micro-batch of a step (the loader
        deals micro-batch j of a step to data rank j mod `data`)."""
        return k * self.data + self.data_rank

    def as_dict(self) -> dict[str, int]:
        return {
            "world": self.world,
            "data": self.data,
            "sequence": self.sequence,
            "expert": self.expert,
        }

    def describe(self) -> str:
        """ "4 rank(s) (2 data-parallel x 2 sequence-parallel; experts split over 4)"; without
        sequence or expert parallelism "N rank(s)"."""
        parts = []
        if self.sequence > 1:
            parts.append(f"{self.data} data-parallel x {self.sequence} sequence-parallel")
        if self.expert > 1:
            parts.append(f"experts split over {self.expert}")
        return f"{self.world} rank(s)" + (f" ({'; '.join(parts)})" if parts else "")
