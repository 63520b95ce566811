"""Every model path is one graph: no host synchronisation, no graph break (docs/design.md, "Static
shapes, no host synchronisation").

Legend: B rows, T tokens, D width, V vocabulary.

On the CPU, `torch.compile(..., fullgraph=True)` is the proof: an `.item()`, `int(tensor)`,
`.tolist()`, `nonzero`, boolean-mask indexing or a Python branch on a tensor's value inside the path
is a graph break, which fullgraph turns into an error. The fast tier traces with the `aot_eager`
backend (dynamo and AOT autograd see the whole forward and backward, as inductor does, without
generating code); the slow tier compiles with inductor, the GPU's compiler, and checks the compiled
code against eager. Per-block compilation (what the trainer does, vlm.model.compile) is checked over
steps: the same numbers as eager, and no recompilation.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch._dynamo

from configs.batch import PackedBatch
from vlm.model.compile import compile_blocks
from vlm.model.conceptmoe import ConceptMoELM
from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig
from vlm.model.context import ForwardContext
from vlm.train.loss_config import LossConfig
from vlm.train.losses import Loss, Totals, labelled_tokens

V = 97


def config(kind: str, **chunk) -> ModelConfig:
    """A tiny model with every feature on the path: GQA, QK-norm, shared and routed experts, balancing losses."""
    cfg = ModelConfig(
        vocab_size=V,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        encoder_layers=1,
        concept_layers=1,
        decoder_layers=1,
        attn_backend="auto",
        # the loss's logits in four tiles of the 224 tokens (vlm.model.tiled_loss), the last one
        # short: the tiles are part of the graph
        loss_tile_tokens=64,
        moe=MoEConfig(
            num_experts=4,
            top_k=2,
            expert_hidden=16,
            num_shared_experts=1,
            shared_hidden=16,
        ),
        chunk=ChunkConfig(**chunk),
    )
    return cfg.baseline() if kind == "baseline" else cfg


# the learned cosine router, Bernoulli noise
MODELS = {
    "baseline": {},
    "conceptmoe": {},
    # the other router family and eq. 3's gate
    "topk_grove": {"router": "topk", "residual": "delta"},
}


# every router loss in the graph
WEIGHTS = LossConfig(z=1e-3)


def packed_batch(seed: int = 0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    rows = [
        [torch.randint(3, V, (n,), generator=g).tolist() for n in lens]
        for lens in ((30, 50, 20), (64, 30))
    ]
    return PackedBatch.stack([PackedBatch.from_documents(r, row_len=112) for r in rows])


def totals(batch) -> Totals:
    """The global batch's sums a training loss reads, counted outside the graph (as the step does)."""
    n = float(labelled_tokens(batch))
    return Totals(1, {}, n, n)


def seeded(seed: int) -> ForwardContext:
    """The same boundary noise on every call (a tensor seed: no recompilation), and no logits: the
    trainer's forward, whose loss makes them a tile of tokens at a time."""
    return ForwardContext(
        torch.tensor(seed), logits=False, router_losses=frozenset({"balance", "z"})
    )


def train_loss(model, batch, totals, context, loss):
    """The training forward and the loss the trainer back-propagates (vlm.train.losses)."""
    out = model(batch, context=context)
    return loss(out, batch, totals).backprop, out.final_BTD


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_training_step(kind: str, backend: str) -> None:
    torch.manual_seed(0)
    cfg = config(kind, **MODELS.get(kind, {}))
    # Grove's adjugate experts: once per (token, group), in static shapes too
    if kind == "topk_grove":
        cfg = dataclasses.replace(
            cfg,
            moe=MoEConfig(
                num_experts=4, top_k=3, expert_hidden=16, grove_groups=2, grove_lambda=0.05
            ),
        )
    eager = ConceptMoELM(cfg).train()
    compiled = copy.deepcopy(eager)
    batch = packed_batch()
    torch._dynamo.reset()
    fn = torch.compile(train_loss, fullgraph=True, backend=backend)
    loss_c, final_c = fn(compiled, batch, totals(batch), seeded(7), Loss(cfg, WEIGHTS))
    loss_c.backward()
    loss_e, final_e = train_loss(eager, batch, totals(batch), seeded(7), Loss(cfg, WEIGHTS))
    loss_e.backward()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    # padding holds what each backend leaves there (eager: docs, compiled: sdpa)
    valid = batch.doc_ids >= 0
    torch.testing.assert_close(final_c[valid], final_e[valid], rtol=1e-4, atol=1e-5)
    ge, gc = grads(eager), grads(compiled)
    assert ge.keys() == gc.keys() and len(ge) > 10
    for n in ge:
        torch.testing.assert_close(gc[n], ge[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
    # the statistics the trainer reads after the step moved alike (expert loads; the top-k
    # router's quantiles)
    for (n, b_e), b_c in zip(eager.named_buffers(), compiled.buffers()):
        torch.testing.assert_close(b_c, b_e, rtol=1e-5, atol=1e-6, msg=lambda m: f"buffer {n}: {m}")


def prompts() -> PackedBatch:
    """Two right-padded one-document prompts of different lengths (what generation prefills)."""
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, V, (n,), generator=g).tolist() for n in (9, 21)]
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    doc = torch.tensor([[0] * len(r) + [-1] * (T - len(r)) for r in rows])
    pos = torch.tensor([list(range(len(r))) + [0] * (T - len(r)) for r in rows])
    return PackedBatch(ids, torch.full_like(ids, -100), doc, pos, torch.zeros_like(ids))


def check_prefill_and_decode(kind: str, backend: str) -> None:
    torch.manual_seed(0)
    model = ConceptMoELM(config(kind, **MODELS.get(kind, {}))).eval()
    batch, steps = prompts(), 6
    torch._dynamo.reset()
    prefill = torch.compile(
        lambda b: model.prefill(b, max_new_tokens=steps), fullgraph=True, backend=backend
    )
    out_c, cache_c = prefill(batch)
    out_e, cache_e = model.prefill(batch, max_new_tokens=steps)
    valid = batch.doc_ids >= 0
    # the prefill's logits are those of each prompt's last token
    torch.testing.assert_close(out_c.final_BTD[valid], out_e.final_BTD[valid], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out_c.last_logits_BV, out_e.last_logits_BV, rtol=1e-4, atol=1e-5)
    cache_c.used_tokens, cache_c.used_concepts = cache_e.used_tokens, cache_e.used_concepts
    decode = torch.compile(model.decode_step, fullgraph=True, backend=backend)
    tok = out_e.last_logits_BV.argmax(-1)
    fired = []
    for _ in range(steps):  # one graph for every step: fixed shapes whatever fires
        for cache in (cache_c, cache_e):
            cache.make_room(1)
        before = cache_e.chunk.n_concepts_B.clone() if cache_e.chunk is not None else None
        logits_c = decode(model.embed(tok), cache_c)
        logits_e = model.decode_step(model.embed(tok), cache_e)
        torch.testing.assert_close(logits_c, logits_e, rtol=1e-4, atol=1e-5)
        tok = logits_e.argmax(-1)
        if before is not None:
            fired += (cache_e.chunk.n_concepts_B - before).tolist()
    if cache_e.chunk is not None:  # rows whose boundary fired and rows whose did not both occurred
        assert torch.equal(cache_c.chunk.n_concepts_B, cache_e.chunk.n_concepts_B)
        assert set(fired) == {0, 1}
    for a, b in zip(
        cache_c.encoder + cache_c.concept + cache_c.decoder,
        cache_e.encoder + cache_e.concept + cache_e.decoder,
    ):
        assert torch.equal(a.len_B, b.len_B)


@pytest.mark.parametrize("kind", ["baseline", "conceptmoe", "topk_grove"])
def test_training_step_traces_as_one_graph(kind):
    check_training_step(kind, "aot_eager")


@pytest.mark.parametrize("kind", ["baseline", "conceptmoe"])
def test_prefill_and_decode_step_trace_as_one_graph(kind):
    check_prefill_and_decode(kind, "aot_eager")


@pytest.mark.slow
@pytest.mark.extended  # the trainer's path, inductor per block, is the test after these
@pytest.mark.parametrize("kind", ["baseline", "conceptmoe"])
def test_training_step_compiles_with_inductor_and_matches_eager(kind):
    check_training_step(kind, "inductor")


@pytest.mark.slow
@pytest.mark.extended
def test_prefill_and_decode_step_compile_with_inductor_and_match_eager():
    check_prefill_and_decode("conceptmoe", "inductor")


@pytest.mark.slow
def test_per_block_compilation_matches_eager_over_steps_without_recompiling():
    """What the trainer runs (model.compile): each block compiled in place (fullgraph), the glue in
    eager. Three optimizer steps on different batches and boundary seeds give eager's losses,
    gradients and parameters (SGD: Adam's normalisation would magnify float noise in near-zero
    gradients), and the second and third steps compile nothing new."""
    torch.manual_seed(0)
    eager = ConceptMoELM(config("conceptmoe")).train()
    compiled = copy.deepcopy(eager)
    assert compile_blocks(compiled) == 3
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled)]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphs = []
    for step in range(3):
        batch = packed_batch(seed=step)
        losses = []
        for m, opt in zip((eager, compiled), opts):
            opt.zero_grad()
            loss = train_loss(m, batch, totals(batch), seeded(step), Loss(m.cfg, WEIGHTS))[0]
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        for (n, a), b in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(
                b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"step {step} grad {n}: {m}"
            )
            torch.testing.assert_close(
                b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} {n}: {m}"
            )
    assert graphs[0] > 0 and graphs[1] == graphs[0] and graphs[2] == graphs[0]
    assert not torch._dynamo.utils.counters["graph_break"]


def test_flex_attention_document_mask_equals_the_packed_mask_forward():
    """FlexAttention (the CUDA default without flash-attn) with the document block mask computes
    what SDPA under the packed T x T mask does, sliding window included; on the CPU it has a
    compiled forward only."""
    from vlm.model.attention import attend, document_block_mask

    torch.manual_seed(0)
    doc = torch.tensor([[0] * 40 + [1] * 60 + [2] * 20 + [-1] * 8, [0] * 100 + [1] * 28])
    q, k, v = torch.randn(2, 4, 128, 16), torch.randn(2, 2, 128, 16), torch.randn(2, 2, 128, 16)
    for window in (0, 16):
        got = attend(q, k, v, doc, "flex", document_block_mask(doc, window=window), window=window)
        ref = attend(q, k, v, doc, "sdpa", window=window)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_backend_choice_per_device_and_under_compile():
    from vlm.model.attention import resolve_backend

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # eager CPU: one SDPA per document
    assert resolve_backend("auto", cpu) == "docs"
    # compiled: no host loop over documents
    assert resolve_backend("auto", cpu, compiled=True) == "sdpa"
    assert resolve_backend("docs", cpu, compiled=True) == "sdpa"
    # never the T x T mask by default on CUDA
    assert resolve_backend("auto", cuda) in ("flash", "flex")
    assert resolve_backend("sdpa", cuda) == "sdpa"  # asked for: the fallback


def _varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, -1), enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn from its documented contract (causal is window (-1, 0),
    a sliding window of w keys (w - 1, 0)), as SDPA per segment: the CPU check of the layout the
    CUDA kernel is given."""
    assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and max_q == max_k
    assert enable_gqa == (k.shape[1] != q.shape[1])
    out = torch.empty_like(q)
    for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        n = e - s
        assert n <= max_q
        i = torch.arange(n)
        left, right = window_size
        allowed = (i[None] <= i[:, None] + (right if right >= 0 else n)) & (
            i[None] >= i[:, None] - (left if left >= 0 else n)
        )
        seg = lambda x: x[s:e].transpose(0, 1)[None]  # noqa: E731
        out[s:e] = torch.nn.functional.scaled_dot_product_attention(
            seg(q), seg(k), seg(v), attn_mask=allowed, enable_gqa=enable_gqa
        )[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("window", [0, 5])
def test_varlen_backend_layout_and_window_on_a_stand_in(monkeypatch, window):
    """The "varlen" backend (PyTorch's own varlen flash kernel, CUDA only) is given the documents
    of the packed rows as segments, causal, with the sliding window as (w - 1, 0) and GQA:
    checked on the CPU against SDPA under the packed mask, with a stand-in written from the
    kernel's documented contract."""
    import vlm.model.attention as attention

    monkeypatch.setattr(attention, "varlen_attn", _varlen_stand_in)
    torch.manual_seed(0)
    doc = torch.tensor([[0] * 20 + [1] * 30 + [-1] * 6, [0] * 9 + [1] * 14 + [2] * 25 + [-1] * 8])
    q, k, v = torch.randn(2, 4, 56, 8), torch.randn(2, 2, 56, 8), torch.randn(2, 2, 56, 8)
    valid = doc >= 0
    got = attention.attend(q, k, v, doc, "varlen", window=window)
    ref = attention.attend(q, k, v, doc, "sdpa", window=window)
    torch.testing.assert_close(
        got.transpose(1, 2)[valid], ref.transpose(1, 2)[valid], rtol=1e-5, atol=1e-5
    )


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="torch.nn.attention.varlen is a CUDA kernel"
)
def test_varlen_kernel_equals_the_packed_mask_on_cuda():
    from vlm.model.attention import attend

    torch.manual_seed(0)
    dev = torch.device("cuda")
    doc = torch.tensor([[0] * 100 + [1] * 156, [0] * 200 + [-1] * 56], device=dev)
    q, k, v = (torch.randn(2, h, 256, 64, device=dev, dtype=torch.bfloat16) for h in (8, 2, 2))
    valid = doc >= 0
    # bf16 both ways: within 5 units of bf16's roundoff (2^-8) of outputs of size ~1
    for window in (0, 32):
        got = attend(q, k, v, doc, "varlen", window=window)
        ref = attend(q, k, v, doc, "sdpa", window=window)
        torch.testing.assert_close(
            got.transpose(1, 2)[valid].float(),
            ref.transpose(1, 2)[valid].float(),
            rtol=2e-2,
            atol=2e-2,
        )
