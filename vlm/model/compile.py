"""Compile a model the way torchtitan does: each transformer block on its own, in place.

Per-block compilation keeps compile time flat in depth (one graph per distinct block signature,
reused by every layer), leaves the glue between stacks (embedding splice, chunking bookkeeping, the
distributed statistics hook) in eager, and keeps parameter names unchanged (`nn.Module.compile`
wraps `forward`, not the module), so checkpoints and exports read the same whether a model was
compiled or not.
"""

from __future__ import annotations

import torch
from torch import nn


def compile_default(device: torch.device) -> bool:
    """`model.compile: null` means: on for CUDA, off for CPU (on CPU, inductor's compile time is not
    repaid by the small models people train there)."""
    return device.type == "cuda"


def compile_blocks(model: nn.Module, fullgraph: bool = True, dynamic: bool | None = None) -> int:
    """Compile every transformer block of `model` (any wrapper of a ConceptMoELM) in place; returns
    how many.

    `fullgraph=True` makes a host synchronisation or graph break inside a block an error rather than
    a silent slowdown. The chunk module and the dechunk are compiled too, without fullgraph: the
    global parser's all-reduce runs inside the chunk module's forward."""
    from vlm.model.block import Block
    from vlm.model.chunking import ChunkModule
    from vlm.model.conceptmoe import ConceptMoELM
    from vlm.model.dechunk import Dechunk

    n = 0
    for m in model.modules():
        if isinstance(m, ConceptMoELM):
            # its stacks build masks for compiled blocks (no per-document host loop)
            m.compiled = True
        elif isinstance(m, Block):
            m.compile(fullgraph=fullgraph, dynamic=dynamic)
            n += 1
        elif isinstance(m, (ChunkModule, Dechunk)):
            m.compile(fullgraph=False, dynamic=dynamic)
    return n
