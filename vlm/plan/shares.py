"""What one rank keeps of each parameter: its share of the routed experts and the ZeRO group its
training states are partitioned over.

STAND-IN: the trainer's own answer to "what does rank r keep of parameter X" is being written
with the code that makes each rank build only its share (issue 48 item 2, expected as
vlm/train/shares.py). Until it is merged this module says it the way the trainer does today, and
the planner asks only here, so that the two can be made one:
- a MoE layer's routed experts (`MoE.routed_expert_weights`) are split over `parallel.expert` ranks
  along their first dimension (vlm.model.expert_parallel.local_slice); their ZeRO partitions are
  spread over the shard's expert-data-parallel replicas (world / expert ranks);
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


def routed_expert_ids(model: nn.Module) -> set[int]:
    from vlm.model.moe import MoE

    return {id(p) for m in model.modules() if isinstance(m, MoE) for p in m.routed_expert_weights()}


def rank_shares(model: nn.Module, layout) -> list[Share]:
    """Each parameter of `model` (built whole, on the meta device) as rank `layout.rank` keeps
    it; `requires_grad` says whether it trains."""
    experts = routed_expert_ids(model)
    out = []
    for name, p in model.named_parameters():
        expert = id(p) in experts
        local = p.numel() // layout.expert if expert else p.numel()
        group = layout.expert_replicas if expert else layout.world
        out.append(Share(name, p.numel(), local, expert, p.requires_grad, group))
    return out
