"""The step has one road to the model and one to the other ranks (issue 36 item 2).

- The step and the trainer reach into no module: they set no attribute on one and find no buffer by
  its name; what a step needs from the model goes through
  `vlm.model.training_controls.TrainingControls`.
- Every all-reduce of a run is a named function of `vlm.train.collectives`, called from one place:
  no other module of vlm/train/ calls one, so a collective that only some ranks would make cannot
  hide in a helper.
- After an applied step the model's statistics (expert loads, top-k quantiles) cross the ranks in
  one collective.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from vlm.model.chunking import ChunkModule
from vlm.model.config import ChunkConfig, MoEConfig
from vlm.model.moe import MoE
from vlm.model.training_controls import TrainingControls

TRAIN = Path(__file__).resolve().parents[1] / "vlm" / "train"
COLLECTIVE_CALLS = {"all_reduce_sum", "all_reduce_min", "all_reduce"}
MODULE_INTERNALS = {
    "stats_hook",
    "threshold_per_step",
    "generator",
    "load_accum",
    "quantile_accum",
    "noise_seed",
}


def _calls_and_attributes(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = (
                f.attr
                if isinstance(f, ast.Attribute)
                else f.id
                if isinstance(f, ast.Name)
                else None
            )
            yield "call", name, node.lineno
        elif isinstance(node, ast.Attribute):
            yield "attr", node.attr, node.lineno
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield "str", node.value, node.lineno


def test_no_module_of_the_trainer_calls_an_all_reduce_but_collectives():
    found = [
        f"{p.name}:{line} {name}"
        for p in sorted(TRAIN.glob("*.py"))
        if p.name not in ("collectives.py", "distributed.py")
        for kind, name, line in _calls_and_attributes(p)
        if kind == "call" and name in COLLECTIVE_CALLS
    ]
    assert found == []


def test_the_trainer_reaches_into_no_module():
    found = [
        f"{p.name}:{line} {name}"
        for p in sorted(TRAIN.glob("*.py"))
        for kind, name, line in _calls_and_attributes(p)
        if kind in ("attr", "str") and name in MODULE_INTERNALS
    ]
    assert found == []


def test_statistics_cross_the_ranks_in_one_collective_and_move_biases_and_thresholds():
    model = torch.nn.ModuleDict(
        {
            "a": MoE(MoEConfig(num_experts=4, top_k=2, expert_hidden=8), 8),
            "b": MoE(MoEConfig(num_experts=4, top_k=2, expert_hidden=8), 8),
            "chunk": ChunkModule(ChunkConfig(router="topk"), 8),
        }
    )
    ctl = TrainingControls(model)
    model["a"].load_accum.copy_(torch.tensor([4.0, 0, 0, 0]))
    model["b"].load_accum.copy_(torch.tensor([0.0, 0, 0, 4]))
    # two batches' quantiles summing to 3
    model["chunk"].quantile_accum.copy_(torch.tensor([3.0, 2.0]))
    calls = []
    # two ranks holding the same sums
    ctl.apply_statistics(lambda t: calls.append(t.clone()) or 2 * t)
    assert len(calls) == 1 and calls[0].numel() == 4 + 4 + 2
    # the over-loaded expert moves down
    assert model["a"].expert_bias[0] < 0 < model["a"].expert_bias[1]
    assert model["b"].expert_bias[3] < 0 < model["b"].expert_bias[0]
    # 0.9 * 0 + 0.1 * mean
    torch.testing.assert_close(model["chunk"].threshold, torch.tensor(0.1 * 6.0 / 4.0))
    # the accumulators start again
    assert all(float(t.abs().sum()) == 0 for t in ctl.statistics())
    saved = ctl.save_statistics()
    model["a"].load_accum.add_(1)
    ctl.restore_statistics(saved)
    assert float(model["a"].load_accum.sum()) == 0
