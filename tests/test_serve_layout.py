"""The serving slots are laid out from the model's state classes (issue 52): every field of the
chunk state (vlm/model/cache.py's `ChunkState`) and every field of a concept cache (`KVCache`) is
either held in a slot or known there, so a field added to a model state cannot be silently dropped
or misaligned by vlm/serve. Runs without vLLM (the slots are plain tensors, as in
test_serve_middle.py).

Legend: B rows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vlm.model.cache import ChunkState, KVCache, kept
from vlm.model.conceptmoe import ConceptMoELM
from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig
from vlm.serve.layout import (
    CHUNK,
    KV,
    NOT_STORED,
    ChunkRows,
    ConceptStates,
    StatePlan,
    state_dtypes,
    state_shapes,
)
from vlm.serve.middle import Middle


def lm_cfg(**chunk) -> ModelConfig:
    return ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        encoder_layers=1,
        concept_layers=2,
        decoder_layers=1,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        chunk=ChunkConfig(**chunk),
    )


class Layer:
    """What vLLM hands a state layer: its `kv_cache`, one tensor per state shape, `n` slots."""

    def __init__(self, mc: ModelConfig, plan: StatePlan, n: int):
        pairs = zip(state_shapes(mc, plan), state_dtypes(mc, torch.float32))
        self.kv_cache = tuple(torch.zeros(n, *s, dtype=d) for s, d in pairs)


def distinct_state(state: type, B: int, D: int, seed: int, absent=()) -> ChunkState:
    """A state whose every field holds values no other field holds: random vectors, and counts
    that differ per field and row (exact in the slots' fp32)."""
    g = torch.Generator().manual_seed(seed)
    values = {}
    for i, f in enumerate(dataclasses.fields(state)):
        if f.name in absent:
            values[f.name] = None
        elif f.name.endswith("_BD"):
            values[f.name] = torch.randn(B, D, generator=g) + 10 * i
        else:
            values[f.name] = torch.randperm(1000, generator=g)[:B] + 1000 * i
    return state(**values)


def assert_same_fields(got, want, where: str) -> None:
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if b is None:
            assert a is None, f"{where}: {f.name} was None and came back as a tensor"
            continue
        assert a is not None, f"{where}: {f.name} is not carried (it came back None)"
        want_dtype = torch.long if f.metadata["dtype"] == "long" else torch.float32
        assert a.dtype == want_dtype, f"{where}: {f.name} came back as {a.dtype}, not {want_dtype}"
        assert torch.equal(a, b.to(want_dtype)), (
            f"{where}: {f.name} came back changed (the slot layout drops or overlaps it)"
        )


@pytest.mark.parametrize("residual", ["delta", "identity"])
def test_every_chunk_state_field_survives_a_slot(residual):
    """Every field of the model's `ChunkState`, written into two slots by the serving middle and
    read back, is the value written, in its dtype: no field left out, none on top of another. A
    model without residual "delta" leaves `ema_in_BD` None, and gets None back."""
    torch.manual_seed(0)
    model = ConceptMoELM(lm_cfg(residual=residual)).eval()
    plan = StatePlan(len(model.cfg.concept_schedule), 1, 8)
    layers = [Layer(model.cfg, plan, 4) for _ in range(plan.layers)]
    serve = Middle(model, ConceptStates(layers, plan))
    slots_B = torch.tensor([2, 0])
    st = distinct_state(ChunkState, 2, model.cfg.hidden_size, seed=1, absent=serve.absent)
    serve._put(slots_B, st)
    assert_same_fields(serve._get(slots_B, torch.float32), st, f"residual {residual}")
    untouched = serve.state.chunk[torch.tensor([1, 3])]
    assert not untouched.any(), "writing slots 2 and 0 changed slots 1 and 3"


def test_a_field_added_to_the_chunk_state_gets_its_own_place():
    """The layout is computed from the class: a state with one more vector and one more count is
    laid out with one more row and one more counter column, and every field, old and new, comes
    back as written."""
    Grown = dataclasses.make_dataclass(
        "Grown",
        [
            ("extra_BD", torch.Tensor, kept("hidden", default=None)),
            ("extra_n_B", torch.Tensor, kept("long", default=None)),
        ],
        bases=(ChunkState,),
    )
    rows = ChunkRows(Grown)
    assert rows.rows == CHUNK.rows + 1, "a new vector field needs a row of its own"
    assert len(set(rows.at.values())) == len(dataclasses.fields(Grown)), (
        f"two fields share a place in the slots: {rows.at}"
    )
    st = distinct_state(Grown, 3, 8, seed=2)
    held = torch.zeros(3, *rows.shape(8))
    rows.write(st, held)
    assert_same_fields(rows.read(held, torch.float32), st, "a grown chunk state")


@pytest.mark.parametrize(
    "field, says",
    [
        (("hist_BT", torch.Tensor, kept("float32", default=None)), "Shrunk.hist_BT"),
        (("plain_BD", torch.Tensor, dataclasses.field(default=None)), "Shrunk.plain_BD"),
    ],
)
def test_a_field_the_slots_cannot_hold_is_refused_by_name(field, says):
    """A field whose width is not a vector or a number per row, or whose dtype is not declared
    (`kept`), is refused when the layout is computed, naming it, not dropped."""
    Shrunk = dataclasses.make_dataclass("Shrunk", [field], bases=(ChunkState,))
    with pytest.raises(TypeError, match=says):
        ChunkRows(Shrunk)


def test_every_concept_cache_field_is_held_or_known_in_a_slot():
    """A state layer holds one tensor per per-entry field of `KVCache` (its keys and values), then
    the chunk state; its other fields are each accounted for (`NOT_STORED`)."""
    names = [f.name for f in dataclasses.fields(KVCache)]
    assert sorted(names) == sorted(KV + tuple(NOT_STORED)), (
        f"KVCache's fields {names}: the serving state layers hold {KV} and know {list(NOT_STORED)}"
    )
    mc = lm_cfg()
    shapes = state_shapes(mc, StatePlan(1, 1, 5))
    assert shapes == (((mc.c_kv_heads, 5, mc.head_dim),) * len(KV)) + (
        (CHUNK.rows, mc.hidden_size),
    )
