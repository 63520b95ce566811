"""Projector from vision tokens to the LLM's hidden size (ConceptMoE sec. 4.2 uses a linear one)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from configs.config import ValidatedOnInit, check


@dataclass
class ProjectorConfig(ValidatedOnInit):
    kind: Literal["linear", "mlp"] = "linear"
    hidden_mult: float = 1.0   # mlp: hidden width = hidden_mult * out_dim
    bias: bool = True

    def validate(self) -> None:
        check(self.hidden_mult > 0, f"projector.hidden_mult must be > 0, got {self.hidden_mult}")


class Projector(nn.Module):
    def __init__(self, cfg: ProjectorConfig, in_dim: int, out_dim: int):
        super().__init__()
        if in_dim < 1 or out_dim < 1:
            raise ValueError(f"projector dims must be >= 1, got in_dim={in_dim}, out_dim={out_dim}")
        self.cfg, self.in_dim, self.out_dim = cfg, in_dim, out_dim
        if cfg.kind == "linear":
            self.fc = nn.Linear(in_dim, out_dim, bias=cfg.bias)
        else:
            hidden = max(1, int(round(cfg.hidden_mult * out_dim)))
            self.fc1 = nn.Linear(in_dim, hidden, bias=cfg.bias)
            self.fc2 = nn.Linear(hidden, out_dim, bias=cfg.bias)

    def forward(self, x_NV: torch.Tensor) -> torch.Tensor:
        if x_NV.shape[-1] != self.in_dim:
            raise ValueError(f"projector expects {self.in_dim} features, got {x_NV.shape[-1]}")
        if self.cfg.kind == "linear":
            return self.fc(x_NV)
        return self.fc2(F.gelu(self.fc1(x_NV)))
