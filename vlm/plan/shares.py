"""What one rank keeps of each parameter for its training states: its share of the routed experts
(vlm.model.shares, the trainer's own answer) and the ZeRO group its states are partitioned over.
- a MoE layer's routed experts are split over `parallel.expert` ranks along their first dimension;
  their ZeRO partitions are spread over the shard's expert-data-parallel replicas (world / P);
- every other parameter is whole on every rank; ZeRO partitions it over the whole world (every
  rank, sequence-parallel ones included, computes gradients of its own tokens);
- under ZeRO-3 a parameter of at most `stage3_param_persistence_threshold` elements stays whole
  on every rank (DeepSpeed's persistence), the others keep ceil(numel / group) elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

# DeepSpeed's default stage3_param_persistence_threshold (deepspeed.runtime.zero.config)
PERSISTENCE_THRESHOLD = 100_000


@dataclass(frozen=True)
class Share:
    name: str
    numel: int  # the whole parameter
    local: int  # elements of it this rank's model holds (its expert shard, or all of it)
    expert: bool  # a routed expert weight (split over the expert ranks)
    trainable: bool
    group: int  # ranks its ZeRO partitions are spread over

    def partition(self, zero_stage: int, threshold: int = PERSISTENCE_THRESHOLD) -> int:
        """Elements of this rank's ZeRO partition of its weights (ZeRO-3) or of its optimizer
        state (ZeRO 1-3): ceil(local / group); a ZeRO-3 parameter at or below the persistence
        threshold is whole on every rank."""
        if zero_stage == 3 and self.local <= threshold:
            return self.local
        return math.ceil(self.local / self.group)


def rank_shares(model: nn.Module, layout) -> list[Share]:
    """Each parameter of `model` (built whole, on the meta device) as rank `layout.rank` keeps
    it; `requires_grad` says whether it trains."""
    from vlm.model.shares import Sharding, is_routed_expert, share_of

    sharding = Sharding.of(layout, 0, False)  # the expert slice; ZeRO's partition is Share's
    out = []
    for name, p in model.named_parameters():
        expert = is_routed_expert(name)
        local = share_of(sharding, name, p.shape).numel
        group = layout.expert_replicas if expert else layout.world
        out.append(Share(name, p.numel(), local, expert, p.requires_grad, group))
    return out
