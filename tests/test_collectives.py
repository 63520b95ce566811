"""The step has one road to the model and one to the other ranks (issues 36 and 42).

Legend: B rows, T tokens.

- What a forward needs from the step arrives as an argument (`vlm.model.context.ForwardContext`):
  the step sets no attribute on a module and finds no buffer by its name; what forwards count for
  the updates after a step goes through `vlm.model.training_controls.TrainingControls`.
- Every collective of a run is a named function of `vlm.train.collectives`: no other module of vlm/
  calls torch.distributed's collectives (a collective that only some ranks would make cannot hide in
  a helper), and only collectives.py and distributed.py (the process group's set-up) use
  torch.distributed at all.
- After an applied step the model's statistics (expert loads, top-k quantiles) cross the ranks in
  one collective.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from vlm.model.chunking import ChunkModule
from vlm.model.config import ChunkConfig, MoEConfig
from vlm.model.context import ForwardContext
from vlm.model.moe import MoE
from vlm.model.training_controls import TrainingControls

VLM = Path(__file__).resolve().parents[1] / "vlm"
TRAIN = VLM / "train"
# the project's wrappers of torch.distributed's collectives (torch.distributed itself is used by
# collectives.py and distributed.py alone: the next test)
WRAPPERS = {
    "all_reduce_sum",
    "all_reduce_min",
    "barrier",
    "broadcast_object",
    "gather_object",
    "broadcast_module",
}
MODULE_INTERNALS = {"generator", "load_accum", "quantile_accum", "noise_seed", "expert_bias"}


def _calls_and_attributes(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute):
                owner = f.value.id if isinstance(f.value, ast.Name) else None
                yield "call", f.attr, owner, node.lineno
            elif isinstance(f, ast.Name):
                yield "call", f.id, None, node.lineno
        elif isinstance(node, ast.Attribute):
            yield "attr", node.attr, None, node.lineno
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield "str", node.value, None, node.lineno
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names]
            module = getattr(node, "module", None) or ""
            for n in [module] + names:
                yield "import", n, None, node.lineno


def test_no_module_of_vlm_calls_a_collective_but_collectives():
    found = [
        f"{p.relative_to(VLM)}:{line} {owner or ''}.{name}"
        for p in sorted(VLM.rglob("*.py"))
        if p.name != "collectives.py" or p.parent != TRAIN
        for kind, name, owner, line in _calls_and_attributes(p)
        if kind == "call" and name in WRAPPERS and owner != "collectives"
    ]
    assert found == []


def test_only_collectives_and_the_process_group_set_up_use_torch_distributed():
    found = [
        f"{p.relative_to(VLM)}:{line}"
        for p in sorted(VLM.rglob("*.py"))
        if not (p.parent == TRAIN and p.name in ("collectives.py", "distributed.py"))
        for kind, name, _, line in _calls_and_attributes(p)
        if kind in ("import", "str") and name.startswith("torch.distributed")
    ]
    assert found == []


def test_the_trainer_reaches_into_no_module():
    found = [
        f"{p.name}:{line} {name}"
        for p in sorted(TRAIN.glob("*.py"))
        for kind, name, _, line in _calls_and_attributes(p)
        if kind in ("attr", "str") and name in MODULE_INTERNALS
    ]
    assert found == []


def test_a_forward_is_steered_by_its_arguments():
    """The boundary noise is the context's seed's alone; a pass that must not count leaves the
    statistics as they were."""
    torch.manual_seed(0)
    chunker = ChunkModule(ChunkConfig(), 16).train()
    h = torch.randn(2, 40, 16)
    doc = torch.zeros(2, 40, dtype=torch.long)
    seed = lambda n: ForwardContext(torch.tensor(n))  # noqa: E731
    b = [chunker(h, doc, context=seed(n)).b_BT for n in (3, 3, 4)]
    assert torch.equal(b[0], b[1]) and not torch.equal(b[0], b[2])
    moe = MoE(MoEConfig(num_experts=4, top_k=2, expert_hidden=8), 16).train()
    topk = ChunkModule(ChunkConfig(router="topk"), 16).train()
    from vlm.model.block import Block, StackContext, run_stack

    blocks = torch.nn.ModuleList([Block(16, 2, 2, 8, True, 1e-6, moe.cfg, 0.02)])
    ctx = StackContext.build(doc, doc.cumsum(1) - 1, 8, 10000.0, h.dtype, "sdpa")
    run_stack(blocks, h, ctx, statistics="off")
    topk(h, doc, context=ForwardContext(statistics="off"))
    assert float(blocks[0].moe.load_accum.sum()) == 0 and float(topk.quantile_accum[1]) == 0
    run_stack(blocks, h, ctx, statistics="per_step")
    topk(h, doc, context=ForwardContext(statistics="per_step"))
    assert (
        float(blocks[0].moe.load_accum.sum()) == 2 * 40 * 2 and float(topk.quantile_accum[1]) == 1
    )
    assert float(topk.threshold) == 0  # per step: the trainer moves it, not the forward


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
    left = [float(t.abs().sum()) for t in ctl.statistics()]
    assert left == [0.0] * len(left), f"the accumulators hold {left} after the update, not zeros"
