"""The vLLM plugin's concept path is the model's own (issue 42 item 3): `vlm/serve/middle.py` calls
`ConceptMoELM.middle` / `middle_step` with its per-request slots as the state, and holds no copy of
chunk -> concept model -> dechunk. Runs without vLLM: the slots are plain tensors laid out as
vLLM's (`vlm.serve.layout`), so what the serve tests (skipped without vLLM) check end to end is
checked here on every machine: prefill into a slot and batched steps over slots give the decoder
inputs that `ConceptMoELM.prefill` / `step` compute.

Legend: B rows, T tokens, D width, J key/value heads, C KV cache entries, d head width, V
vocabulary.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from configs.batch import PackedBatch
from vlm.model.cache import InferenceCache, KVCache
from vlm.model.conceptmoe import ConceptMoELM
from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig
from vlm.serve.layout import CHUNK, ConceptStates, StatePlan, state_dtypes, state_shapes
from vlm.serve.middle import Middle

ROOT = Path(__file__).resolve().parents[1]
V = 64


def lm_cfg(**chunk) -> ModelConfig:
    return ModelConfig(
        vocab_size=V,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        encoder_layers=1,
        concept_layers=2,
        decoder_layers=2,
        init_std=0.2,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        chunk=ChunkConfig(**chunk),
    )


class Layer:
    """What vLLM hands a `ConceptState`: its `kv_cache`, one tensor per state shape, `n` slots."""

    def __init__(self, mc: ModelConfig, plan: StatePlan, n: int):
        pairs = zip(state_shapes(mc, plan), state_dtypes(mc, torch.float32))
        self.kv_cache = tuple(torch.zeros(n, *s, dtype=d) for s, d in pairs)


def Slots(mc: ModelConfig, capacity: int, n: int, entries: int | None = None) -> ConceptStates:
    """The state layers of `n` slots for `capacity` concepts per pass: one layer per pass, or each
    pass cut into layers of `entries` (as `plan_state` cuts it to vLLM's pages)."""
    passes = max(1, len(mc.concept_schedule))
    e = entries or capacity
    plan = StatePlan(passes, -(-capacity // e), e)
    return ConceptStates([Layer(mc, plan, n) for _ in range(plan.layers)], plan)


def concepts(serve: Middle) -> torch.Tensor:
    """Each slot's concept count, as it lies in the slots' chunk state."""
    return CHUNK.of(serve.state.chunk, "n_concepts_B")


def _batch(lengths: list[int], seed: int) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    doc = torch.full((len(lengths), T), -1, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(2, V, (n,), generator=g)
        doc[r, :n] = 0
    pos = torch.arange(T).expand(len(lengths), T).clone()
    return PackedBatch(ids, torch.full_like(ids, -100), doc, pos, torch.zeros_like(ids))


def _recorded(model: ConceptMoELM, monkeypatch) -> list:
    """Every call of the model's middle: (encoder output, decoder input, concept read), copied (a
    step's concept read is a view of the state the next step updates)."""
    calls = []
    middle, middle_step = model.middle, model.middle_step

    def record_middle(h_BTD, *args, **kw):
        out = middle(h_BTD, *args, **kw)
        calls.append((h_BTD.clone(), out.z_BTD.clone(), out.c_BTD.clone()))
        return out

    def record_step(h_B1D, *args, **kw):
        out = middle_step(h_B1D, *args, **kw)
        calls.append(tuple(t[:, 0].clone() for t in (h_B1D, out.z_B1D, out.c_B1D)))
        return out

    monkeypatch.setattr(model, "middle", record_middle)
    monkeypatch.setattr(model, "middle_step", record_step)
    return calls


VARIANTS = {
    "sum_merge": lm_cfg(merge="sum"),
    "last_merge_delta": lm_cfg(merge="last", residual="delta"),
    "mean_merge_linear_router": lm_cfg(merge="mean", router="linear", residual="linear"),
    "looped_concept_layers": dataclasses.replace(
        lm_cfg(), loop_start=0, loop_end=2, loop_times=1, concept_pos="none"
    ),
}


@pytest.mark.parametrize("entries", [None, 5])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_slots_give_the_models_decoder_inputs(variant, entries, monkeypatch):
    """Two prompts (9 and 5 tokens) prefilled one by one into slots 3 and 0, then 12 steps batched
    over those slots: every z and c equals the model's own prefill and decode steps (a padded batch
    of both rows) to float precision; with each pass in one state layer, and cut into layers of 5
    concepts (vLLM's pages: a slot's concepts gathered from several layers, written to the right
    one)."""
    torch.manual_seed(0)
    model = ConceptMoELM(VARIANTS[variant]).eval()
    calls = _recorded(model, monkeypatch)
    lengths, slots, steps = [9, 5], torch.tensor([3, 0]), 12
    batch = _batch(lengths, seed=1)
    out, cache = model.prefill(batch, max_new_tokens=steps)
    tok = out.last_logits_BV.argmax(-1)
    for _ in range(steps):
        tok = model.step(model.embed(tok), cache).argmax(-1)
    assert len(calls) == 1 + steps
    monkeypatch.undo()  # the plugin calls the same methods: record no more

    serve = Middle(model, Slots(model.cfg, capacity=max(lengths) + steps, n=4, entries=entries))
    h_BTD, z_BTD, c_BTD = calls[0]
    fired = 0
    for r, (n, slot) in enumerate(zip(lengths, slots.tolist())):
        z, c = serve.prefill(h_BTD[r : r + 1, :n], slot)
        torch.testing.assert_close(z, z_BTD[r, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c, c_BTD[r, :n], rtol=1e-5, atol=1e-5)
    for h_BD, z_BD, c_BD in calls[1:]:
        before = concepts(serve)[slots].clone()
        z, c = serve.step(h_BD, slots)
        fired += int((concepts(serve)[slots] > before).sum())
        torch.testing.assert_close(z, z_BD, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c, c_BD, rtol=1e-5, atol=1e-5)
    # the steps closed concepts (the concept model ran on the slots), and kept them all
    assert fired > 0 and serve.overflows == 0
    n_concepts = concepts(serve)[slots].long()
    torch.testing.assert_close(n_concepts, cache.chunk.n_concepts_B)


def test_a_full_concept_cache_drops_the_concept_and_counts_it():
    """`middle_step` over concept caches of a fixed size (as a serving slot): a row whose caches are
    full keeps no new concept (its concept count and cache length stay, its entries but the last,
    the scratch one it writes, are untouched), `dropped_B` names it, and the other rows go on."""
    torch.manual_seed(0)
    model = ConceptMoELM(lm_cfg()).eval()
    out, cache = model.prefill(_batch([8, 8], seed=2), max_new_tokens=4)
    n_B = cache.chunk.n_concepts_B.clone()
    C = int(n_B[0])  # row 0's caches are exactly full; row 1's have room
    assert int(n_B[1]) < C, "row 1 must have room"
    fixed = [
        KVCache(kv.k_BJCd[:, :, :C].clone(), kv.v_BJCd[:, :, :C].clone(), n_B.clamp_max(C - 1))
        for kv in cache.concept
    ]
    kept = [(c.k_BJCd[0, :, : C - 1].clone(), c.v_BJCd[0, :, : C - 1].clone()) for c in fixed]
    state = InferenceCache([], fixed, [], cache.len_B.clone(), cache.chunk)
    h_B1D = torch.randn(2, 1, model.cfg.hidden_size)
    mid = model.middle_step(h_B1D, state, force_B=torch.tensor([True, True]))
    assert mid.dropped_B.tolist() == [True, False]
    assert state.chunk.n_concepts_B.tolist() == [C, int(n_B[1]) + 1]
    for c, (k0, v0) in zip(fixed, kept):
        assert torch.equal(c.k_BJCd[0, :, : C - 1], k0) and torch.equal(c.v_BJCd[0, :, : C - 1], v0)
        assert c.len_B.tolist() == [C - 1, int(n_B[1]) + 1]


def test_a_slot_overflow_is_counted_and_serving_goes_on(caplog):
    """A prompt with more concepts than its slot holds: the first ones are kept (the static
    capacity's rule), the rest counted and logged; later steps keep counting."""
    torch.manual_seed(0)
    model = ConceptMoELM(lm_cfg()).eval()
    serve = Middle(model, Slots(model.cfg, capacity=2, n=2))
    h = torch.randn(1, 24, model.cfg.hidden_size) * 3
    with caplog.at_level("WARNING"):
        serve.prefill(h, 1)
    assert serve.overflows > 0 and "concept capacity 2 reached" in caplog.text
    assert int(concepts(serve)[1]) == 2
    before = serve.overflows
    for _ in range(6):
        serve.step(torch.randn(1, model.cfg.hidden_size) * 3, torch.tensor([1]))
    assert int(concepts(serve)[1]) == 2 and serve.overflows > before


# what the concept path is made of: the plugin may call the model's middle, never these
CONCEPT_PATH = {
    "chunker",
    "dechunk",
    "concept_step",
    "run_stack",
    "step_stack",
    "merge",
    "smooth",
    "prefill_state",
}


def test_the_plugin_holds_no_copy_of_the_concept_path():
    """No file of vlm/serve calls a piece of chunk -> concept model -> dechunk itself; middle.py
    calls the model's middle."""
    called: dict[str, set[str]] = {}
    for path in sorted((ROOT / "vlm" / "serve").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            # `lm.chunker.merge(...)`, `lm.dechunk(...)`: any link of the called chain
            chain = set()
            while isinstance(f, ast.Attribute):
                chain.add(f.attr)
                f = f.value
            if (chain | {name}) & CONCEPT_PATH:
                called.setdefault(path.name, set()).update((chain | {name}) & CONCEPT_PATH)
    assert called == {}, f"the plugin re-implements the concept path: {called}"
    src = (ROOT / "vlm" / "serve" / "middle.py").read_text()
    assert "lm.middle(" in src and "lm.middle_step(" in src
