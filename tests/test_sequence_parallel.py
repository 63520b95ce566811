"""Sequence parallelism's cross-shard pieces (vlm.model.sequence_parallel) against the unsplit
computation, on 2 gloo ranks in one spawn: each piece's split result, gathered, equals the whole
row's (values and gradients), and so does a whole ConceptMoE forward and backward. Each check fails
on an off-by-one in its piece (a halo from the wrong shard, a carry that skips a shard, a prefix sum
that counts this shard's own boundaries, a per-document sum left local, heads or tokens exchanged
in the wrong order).

Legend: B rows, T tokens, D width, M concept slots, S document slots."""

from __future__ import annotations

import os

import pytest
import torch
from rank_processes import free_port

from tests.rank_processes import spawn

WORLD = 2


def _rows(T: int, seed: int = 0) -> torch.Tensor:
    """[2, T] document ids whose documents cross the shard boundary (T / 2), with padding."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(2):
        cuts = sorted(torch.randperm(T - 4, generator=g)[:3].add(2).tolist())
        doc = torch.zeros(T, dtype=torch.long)
        for i, c in enumerate(cuts):
            doc[c:] = i + 1
        doc[T - 3 :] = -1
        rows.append(doc)
    return torch.stack(rows)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max()) if a.numel() else 0.0


def _pieces(shard) -> dict[str, float]:
    """Each piece's largest difference from the unsplit computation (values and gradients)."""
    import torch.nn.functional as F

    from vlm.model.chunking import cosine_boundary_prob
    from vlm.model.ema_scan import ema_scan
    from vlm.model.layers import doc_starts
    from vlm.model.sequence_parallel import (
        gather_detached,
        previous_token,
        row_sum,
        sharded_ema_scan,
        ulysses_attention,
    )

    g = torch.Generator().manual_seed(1)
    out: dict[str, float] = {}
    B, T, D = 2, 32, 8
    # halo: the router's previous-token key
    q = torch.randn(B, T, D, generator=g, requires_grad=True)
    k = torch.randn(B, T, D, generator=g, requires_grad=True)
    whole = cosine_boundary_prob(q, k)
    whole.square().sum().backward()
    ql, kl = (shard.local(x.detach()).requires_grad_() for x in (q, k))
    cos = F.cosine_similarity(ql, previous_token(kl, shard), dim=-1, eps=1e-6)
    part = ((1 - cos) / 2).clamp(0, 1)
    if shard.rank == 0:  # position 0 has no previous token: p = 1 there, as cosine_boundary_prob
        part = torch.cat([torch.ones_like(part[:, :1]), part[:, 1:]], 1)
    part.square().sum().backward()
    out["halo"] = _err(part, shard.local(whole))
    # each slice's gradient, its own use and the next shard's halo (the gather's backward)
    gk = gather_detached(kl.grad, shard)
    out["halo_grad"] = _err(gk, k.grad)

    # EMA carry: eq. 8 over the row's concept slots, restarted at documents
    M = 32
    cdoc = _rows(M, seed=2)
    x = torch.randn(B, M, D, generator=g, requires_grad=True)
    p = torch.rand(B, M, generator=g).clamp(0.05, 0.95)
    p[0, 5] = 1.0  # p == 1 inside a document: the scan's gradient fix
    p.requires_grad_()
    w = torch.randn(B, M, D, generator=g)
    whole = ema_scan(x, p, doc_starts(cdoc))
    (whole * w).sum().backward()
    xl, pl = (shard.local(t.detach()).requires_grad_() for t in (x, p))
    part = sharded_ema_scan(xl, pl, shard.local(doc_starts(cdoc)), shard)
    (part * shard.local(w)).sum().backward()
    out["ema"] = _err(part, shard.local(whole))
    out["ema_grad"] = max(
        _err(gather_detached(xl.grad, shard), x.grad), _err(gather_detached(pl.grad, shard), p.grad)
    )

    # per-document statistics: a document's sums over the row, each rank's gradient its own
    doc = _rows(T, seed=3)
    v = torch.rand(B, T, generator=g, requires_grad=True)
    slots = doc.clamp_min(0) + 8 * torch.arange(B)[:, None]
    whole_S = torch.zeros(16).index_add(0, slots.flatten(), v.flatten() * (doc >= 0).flatten())
    (whole_S.square()).sum().backward()
    vl = shard.local(v.detach()).requires_grad_()
    loc = shard.local(doc >= 0).flatten() * vl.flatten()
    part_S = row_sum(torch.zeros(16).index_add(0, shard.local(slots).flatten(), loc), shard)
    (part_S.square()).sum().backward()
    out["doc_stats"] = _err(part_S, whole_S)
    out["doc_stats_grad"] = _err(gather_detached(vl.grad, shard), v.grad)

    # attention over the whole row (Ulysses), document masks intact, GQA heads (4 query, 2 kv)
    from vlm.model.attention import attend

    for backend in ("docs", "sdpa"):
        H, J, d = 4, 2, 8
        qa = torch.randn(B, H, T, d, generator=g, requires_grad=True)
        ka = torch.randn(B, J, T, d, generator=g, requires_grad=True)
        va = torch.randn(B, J, T, d, generator=g, requires_grad=True)
        wa = torch.randn(B, H, T, d, generator=g)
        whole = attend(qa, ka, va, doc, backend)
        (whole * wa).sum().backward()
        ql, kl2, vl2 = (shard.local(t.detach(), 2).requires_grad_() for t in (qa, ka, va))
        part = ulysses_attention(ql, kl2, vl2, shard, lambda a, b, c: attend(a, b, c, doc, backend))
        (part * shard.local(wa, 2)).sum().backward()
        out[f"attention_{backend}"] = _err(part, shard.local(whole, 2))
        out[f"attention_{backend}_grad"] = max(
            _err(gather_detached(t.grad, shard, 2), w.grad)
            for t, w in ((ql, qa), (kl2, ka), (vl2, va))
        )
    return out


def _model(shard) -> dict[str, float]:
    """A whole ConceptMoE training forward and backward, split and unsplit: the shard's final
    states, boundaries and concept count, and every parameter's gradient summed over the group."""

    from configs.batch import PackedBatch
    from vlm.model.conceptmoe import ConceptMoELM
    from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig
    from vlm.model.context import ROUTER_LOSSES, ForwardContext

    out: dict[str, float] = {}
    for name, chunk in (
        ("conceptmoe", ChunkConfig()),
        ("conceptmoe_mean_delta", ChunkConfig(merge="mean", residual="delta", router="linear")),
        ("moe_baseline", ChunkConfig(enabled=False)),
    ):
        cfg = ModelConfig(
            vocab_size=64,
            hidden_size=32,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            encoder_layers=1,
            concept_layers=2,
            decoder_layers=1,
            moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16),
            chunk=chunk,
        )
        torch.manual_seed(0)
        model = ConceptMoELM(cfg).train()
        T = 64
        doc = _rows(T, seed=4)
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(0, 64, (2, T), generator=g)
        from vlm.model.layers import positions_in_doc

        batch = PackedBatch(ids, ids, doc, positions_in_doc(doc), torch.zeros_like(ids))
        ctx = ForwardContext(torch.tensor(123), "off", logits=False, router_losses=ROUTER_LOSSES)
        w = torch.randn(2, T, cfg.hidden_size, generator=g)

        def loss_of(o, wt):
            aux = sum(s.balance + s.z for _, s in o.moe_passes)
            p = o.chunks.p_BT.sum() if o.chunks is not None else 0.0
            return (o.final_BTD * wt).sum() + aux + p

        whole = model(batch, context=ctx)
        loss_of(whole, w).backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        model.shard_sequence(shard)
        part = model(batch, context=ctx)
        # the balance / z terms are the row's on every rank: each rank's gradient is its share
        loss_of(part, shard.local(w)).backward()
        model.shard_sequence(None)
        out[f"{name}_final"] = _err(part.final_BTD, shard.local(whole.final_BTD))
        if whole.chunks is not None:
            out[f"{name}_boundaries"] = _err(part.chunks.b_BT, shard.local(whole.chunks.b_BT))
            out[f"{name}_p"] = _err(part.chunks.p_BT, shard.local(whole.chunks.p_BT))
            out[f"{name}_concepts"] = _err(
                part.chunks.row_cdoc_BM[:, : whole.chunks.cdoc_BM.shape[1]], whole.chunks.cdoc_BM
            )
        out[f"{name}_balance"] = max(
            _err(a.balance, b.balance) for (_, a), (_, b) in zip(part.moe_passes, whole.moe_passes)
        )
        worst = 0.0
        for n, p in model.named_parameters():
            if p.grad is None:
                continue
            gsum = p.grad.clone()
            shard.comm.sum_(gsum)
            worst = max(worst, _err(gsum, want[n]) / max(1.0, float(want[n].abs().max())))
        out[f"{name}_grads"] = worst
        model.zero_grad()
    return out


def _worker(rank: int, port: int, result: str) -> None:
    import torch.distributed as dist

    from vlm.model.sequence_parallel import SequenceShard
    from vlm.train.collectives import SequenceGroup

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        shard = SequenceShard(SequenceGroup(dist.group.WORLD), rank, WORLD)
        out = {**_pieces(shard), **_model(shard)}
        torch.save(out, f"{result}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def split_errors(tmp_path_factory) -> dict[str, float]:
    """Every check's largest difference over both ranks."""
    result = str(tmp_path_factory.mktemp("sp") / "r")
    spawn(_worker, (free_port(), result), WORLD, "sequence-parallel pieces on 2 gloo ranks")
    per_rank = [torch.load(f"{result}.{r}", weights_only=True) for r in range(WORLD)]
    return {k: max(r[k] for r in per_rank) for k in per_rank[0]}


TOL = 2e-5


@pytest.mark.parametrize("piece", ["halo", "halo_grad"])
def test_router_halo_matches_the_whole_row(split_errors, piece):
    assert split_errors[piece] < TOL, split_errors


@pytest.mark.parametrize("piece", ["ema", "ema_grad"])
def test_ema_carry_matches_the_whole_row(split_errors, piece):
    assert split_errors[piece] < TOL, split_errors


@pytest.mark.parametrize("piece", ["doc_stats", "doc_stats_grad"])
def test_per_document_statistics_are_the_rows(split_errors, piece):
    assert split_errors[piece] < TOL, split_errors


@pytest.mark.parametrize("backend", ["docs", "sdpa"])
def test_ulysses_attention_matches_the_whole_row(split_errors, backend):
    assert split_errors[f"attention_{backend}"] < TOL, split_errors
    assert split_errors[f"attention_{backend}_grad"] < TOL, split_errors


@pytest.mark.parametrize("name", ["conceptmoe", "conceptmoe_mean_delta", "moe_baseline"])
def test_split_model_matches_the_whole_row(split_errors, name):
    """Concept positions and counts (prefix sums over the group), the concept model's attention
    over the whole row's concepts, merge, EMA and read-back: the model computes the row's values
    and, summed over the group, its gradients."""
    keys = [k for k in split_errors if k.startswith(name + "_")]
    assert keys
    for k in keys:
        assert split_errors[k] < 1e-4, (k, split_errors)
