"""What `vlm bench gpu` needs of torch.compile: the compiled decode step, a backend other than
inductor for `compile_blocks` (--smoke), Dynamo's graph count (recompiles while timed), and room for
many graphs.

Legend: B rows, D width.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch

from vlm.model.conceptmoe import ConceptMoELM


def compiled_step(model: ConceptMoELM, backend: str) -> Callable:
    """`model.step` with its fixed-shape part, `decode_step`, compiled whole (fullgraph; a graph per
    batch size): the host-side bookkeeping before it (`cache.make_room(1)`: the caches grow, rarely,
    between steps) stays eager, as generation runs it."""
    compiled = torch.compile(model.decode_step, fullgraph=True, dynamic=False, backend=backend)

    def step(x_BD, cache, force_B=None):
        cache.make_room(1)
        return compiled(x_BD, cache, force_B=force_B)

    return step


@contextmanager
def compile_backend(backend: str):
    """`compile_blocks` compiles with torch's default backend (inductor); --smoke asks for another
    one (aot_eager) by supplying it to every `nn.Module.compile` call made inside this block."""
    if backend == "inductor":
        yield
        return
    original = torch.nn.Module.compile

    def with_backend(self, *args, **kwargs):
        kwargs.setdefault("backend", backend)
        return original(self, *args, **kwargs)

    torch.nn.Module.compile = with_backend
    try:
        yield
    finally:
        torch.nn.Module.compile = original


def graphs_compiled() -> int | None:
    """Dynamo's count of graphs compiled so far in this process (None where the counter is not there)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001
        return None


def raise_recompile_limits() -> dict:
    """Per-block compilation of four models (and two modes), and the model's compiled FlexAttention
    (one graph per shape: every prefill length), meet more signatures than Dynamo's default limit of
    8 recompiles per code object, past which it would fall back to eager silently (FlexAttention in
    eager materialises the T x T scores). Returns the values it replaced, for
    `restore_recompile_limits`."""
    import torch._dynamo

    c = torch._dynamo.config
    before = {}
    for names, value in (
        (("recompile_limit", "cache_size_limit"), 64),
        (("accumulated_recompile_limit", "accumulated_cache_size_limit"), 2048),
    ):
        # torch renamed them; older ones have the second
        name = next((n for n in names if hasattr(c, n)), None)
        if name:
            before[name] = getattr(c, name)
            setattr(c, name, max(before[name], value))
    return before


def restore_recompile_limits(before: dict) -> None:
    import torch._dynamo

    for name, value in before.items():
        setattr(torch._dynamo.config, name, value)
