"""What a training forward needs from the step that runs it, passed as an argument.

A module is never steered by an attribute set from outside: the boundary noise's seed, what the
forward does with the routing statistics it counts, whether it computes the logits and which router
losses arrive here,
with every forward. A module used alone (a test, a benchmark, a notebook) takes the default: a fresh
noise seed per forward, the statistics applied as it goes, and the logits of every position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

# What a training forward does with the routing statistics it counts (the MoE layers' expert loads,
# the top-k router's score quantiles):
#   "per_forward": counted, and the top-k threshold moves at once (a module used alone);
#   "per_step": counted, applied once per optimizer step by its owner (the trainer:
#               vlm.model.training_controls.TrainingControls.apply_statistics);
#   "off": not counted (a pass that must not count twice, e.g. the global parser's statistics pass).
Statistics = Literal["per_forward", "per_step", "off"]

# The router losses the MoE layers compute ("balance": Switch, "z": ST-MoE's z-loss): the trainer
# asks for those its loss weighs (vlm.train.losses.Loss.router_losses); a model used alone computes
# those the default loss section weighs (loss.balance 0.01, loss.z 0)
ROUTER_LOSSES = frozenset({"balance", "z"})
DEFAULT_ROUTER_LOSSES = frozenset({"balance"})


@dataclass(frozen=True)
class ForwardContext:
    # 0-d int64 tensor: the boundary noise of this forward is a pure function of this seed and the
    # position (vlm.model.noise); a tensor, so a new seed is no new compilation. None: a fresh draw
    # from torch's generator.
    noise_seed: torch.Tensor | None = None
    statistics: Statistics = "per_forward"
    # False: the output carries no [B, T, V] logits, only the final hidden states and the output
    # layer, from which the loss computes them in tiles of tokens (vlm.model.tiled_loss): what a
    # training forward, a statistics pass and a scoring pass ask for
    logits: bool = True
    router_losses: frozenset[str] = DEFAULT_ROUTER_LOSSES


DEFAULT = ForwardContext()
