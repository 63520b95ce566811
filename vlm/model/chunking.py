"""Chunk (ConceptMoE section 3.2) over packed rows; the dechunk (3.3) is in dechunk.py.

Legend: B rows, T tokens, D width, M concept slots, N flat tokens or patches, L tokens of a rank
(sequence parallelism), K concept slots of a rank (sequence parallelism).

Convention (docs/design.md, "Causality"): a boundary at n closes a concept made of the tokens after
the previous boundary (within the same document) up to and including n; tokens n .. next
boundary - 1 read that concept. The first token of every document is a boundary (p = 1), so no
token reads a concept of another document or one built from later tokens.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from vlm.model.cache import RouterState
from vlm.model.config import ChunkConfig
from vlm.model.context import DEFAULT, ForwardContext, Statistics
from vlm.model.layers import doc_starts, positions_in_doc
from vlm.model.noise import normal, uniform
from vlm.model.sequence_parallel import (
    SequenceShard,
    gather_detached,
    padded_slots,
    previous_token,
    reduce_scatter,
)


# ---------------------------------------------------------------- equations
def cosine_boundary_prob(q_BTD: torch.Tensor, k_BTD: torch.Tensor) -> torch.Tensor:
    """Eq. 2: p_n = (1 - cos(q_n, k_{n-1})) / 2 for n >= 1 (position 0 is set by the caller)."""
    cos = F.cosine_similarity(q_BTD[:, 1:].float(), k_BTD[:, :-1].float(), dim=-1, eps=1e-6)
    return F.pad(((1 - cos) / 2).clamp(0, 1), (1, 0), value=1.0)


def sharpen(p: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. 5: push p away from 0.5 so that sampling flips mostly the uncertain boundaries."""
    return torch.where(p >= 0.5, p.clamp_min(0).pow(1 / tau), 1 - (1 - p).clamp_min(0).pow(1 / tau))


def sample_boundaries(p_sharp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Eq. 6: b_n ~ Bernoulli(p_sharp_n), from uniforms u_n in [0, 1)."""
    return u < p_sharp


def concept_capacity(T: int, slack: float | None, R: float) -> int:
    """Concept positions per row: ceil(T * slack / R) rounded up to a multiple of 16 (kernel tiles),
    at most T; T when `slack` is None. A static function of the row length, so the concept model's
    shapes never depend on the data (no host synchronisation)."""
    if slack is None:
        return T
    return min(T, -(-math.ceil(T * slack / R) // 16) * 16)


def used_capacity(M: int, count_BT: torch.Tensor) -> int:
    """The static capacity M, or on an eager CPU the concepts the rows use (count_BT: each token's
    concept index, the boundaries' running count - 1). The CPU's host is its device: reading the
    largest count costs nothing there, and the capacity's unused columns (read by no token) need
    not be computed. Same numbers, less work; GPUs and compiled graphs keep the static shape."""
    if count_BT.device.type != "cpu" or torch.compiler.is_compiling():
        return M
    return min(M, int(count_BT[:, -1].max()) + 1) if count_BT.numel() else 0


# ---------------------------------------------------------------- modules
class Chunks(NamedTuple):
    """Everything the rest of the model needs to know about one chunking of a batch.

    A NamedTuple rather than a dataclass: DeepSpeed ZeRO-3 follows tensors through module outputs
    only inside tuples, lists and dicts."""

    p_BT: torch.Tensor  # boundary probability (0 at padding)
    b_BT: torch.Tensor  # bool boundaries (the router's, capacity overflow included)
    sel_BT: torch.Tensor  # probability of the selected outcome (p if boundary else 1-p)
    # psi(n): concept read by token n (-1 at padding and past the concept capacity)
    cidx_BT: torch.Tensor
    # document of each concept (-1 at padding); M is the static concept capacity
    cdoc_BM: torch.Tensor
    cpos_BM: torch.Tensor  # index of the concept within its document
    cp_BM: torch.Tensor  # p at each concept's boundary
    # 0-d: boundaries past their row's concept capacity (concepts not computed)
    overflow: torch.Tensor
    # Synergy eq. 3's gate sigmoid(w) at each concept's boundary (topk router); None: the concepts
    # are not gated and eq. 10's STE(sel) multiplies them
    cgate_BM: torch.Tensor | None = None
    # Sequence parallelism (vlm.model.sequence_parallel): the fields above are this rank's tokens
    # and concept slots; these are the whole row's boundaries and concept documents (index data,
    # the same on every rank of the group). None on one rank.
    row_b_BT: torch.Tensor | None = None
    row_cdoc_BM: torch.Tensor | None = None


def within_capacity(ch: Chunks, capacity: int) -> Chunks:
    """The chunking with at most `capacity` concepts per row (caches of that size given from
    outside, e.g. a serving engine's per-request slot): the static capacity's rule, concepts past it
    are not computed, the tokens that would read them read none, and they count as overflow."""
    if ch.cdoc_BM.shape[1] <= capacity:
        return ch
    cut = lambda t: None if t is None else t[:, :capacity]  # noqa: E731
    past_BT = ch.cidx_BT >= capacity
    return ch._replace(
        cidx_BT=torch.where(past_BT, torch.full_like(ch.cidx_BT, -1), ch.cidx_BT),
        cdoc_BM=cut(ch.cdoc_BM),
        cpos_BM=cut(ch.cpos_BM),
        cp_BM=cut(ch.cp_BM),
        cgate_BM=cut(ch.cgate_BM),
        overflow=ch.overflow + (ch.b_BT & past_BT).sum().float(),
    )


class ChunkStep(NamedTuple):
    """One decode step's chunking (`ChunkModule.step`): `forward` and `merge` for one new token per
    row. Every row is present (fixed shapes); only the rows with `b_B` close a concept, the others'
    values are not used."""

    p_B: torch.Tensor  # boundary probability
    b_B: torch.Tensor  # bool: the token closes a concept
    # the concept each row closes, as `merge` builds it (the concept model's input)
    c_BD: torch.Tensor
    # Synergy eq. 3's gate of that concept (topk router), as Chunks.cgate_BM
    gate_B: torch.Tensor | None = None


class ChunkModule(nn.Module):
    """Boundary router + concept merge."""

    def __init__(self, cfg: ChunkConfig, dim: int):
        super().__init__()
        self.cfg = cfg
        if cfg.router == "cosine":
            self.q_proj = nn.Linear(dim, dim, bias=False)
            self.k_proj = nn.Linear(dim, dim, bias=False)
        elif cfg.router == "linear":
            self.score = nn.Linear(2 * dim, 1)
        elif cfg.router == "topk":  # Synergy eq. 1: one score per token from its own state
            self.score = nn.Linear(dim, 1)
            self.register_buffer("threshold", torch.zeros(()))
            # (sum of batch quantiles, batches) since the last `update_threshold`; not saved: a
            # step's partial sums
            self.register_buffer("quantile_accum", torch.zeros(2), persistent=False)
        self.every = max(2, round(cfg.target_ratio))  # the fixed router's spacing

    @staticmethod
    def _noise_seed(context: ForwardContext, device: torch.device) -> torch.Tensor:
        """The seed of this forward's boundary noise: the step's, or a fresh draw from torch's
        generator."""
        if context.noise_seed is not None:
            return context.noise_seed
        return torch.randint(0, 2**62, (), device=device)

    def capacity(self, T: int, training: bool | None = None) -> int:
        """The static concept capacity of a T-token row (`concept_capacity` at the smallest target
        ratio), with the training or the eval slack (None: the module's mode)."""
        training = self.training if training is None else training
        slack = self.cfg.capacity_slack if training else self.cfg.eval_capacity_slack
        return concept_capacity(T, slack, self.cfg.smallest_target)

    def boundary_prob(self, h_BTD, doc_BT, above_BT=None, shard: SequenceShard | None = None):
        """p [B, T] and the document starts. `shard`: h holds this rank's tokens of rows whose
        documents `doc_BT` gives whole; the first token compares with the previous shard's last
        (`previous_token`: a one-token halo), and p and the starts are this rank's."""
        if shard is not None:
            if self.cfg.router not in ("cosine", "linear", "fixed") or above_BT is not None:
                raise ValueError(
                    "sequence parallelism supports the cosine, linear and fixed routers"
                )
            row_doc_BT = doc_BT
            doc_BT = shard.local(doc_BT)
        if self.cfg.router == "cosine" and shard is not None:
            q, k = self.q_proj(h_BTD), self.k_proj(h_BTD)
            cos = F.cosine_similarity(q.float(), previous_token(k, shard).float(), dim=-1, eps=1e-6)
            p = ((1 - cos) / 2).clamp(0, 1)
        elif self.cfg.router == "cosine":
            q, k = self.q_proj(h_BTD), self.k_proj(h_BTD)
            p = cosine_boundary_prob(q, k)
            if above_BT is not None:
                # 2D-aware: an image token also compares with the token above it in its patch grid.
                has = above_BT >= 0
                k_above = k.gather(1, above_BT.clamp_min(0)[..., None].expand_as(k))
                cos_up = F.cosine_similarity(q.float(), k_above.float(), dim=-1, eps=1e-6)
                p = torch.where(has, (p + ((1 - cos_up) / 2).clamp(0, 1)) / 2, p)
        elif self.cfg.router == "fixed":
            pos_BT = positions_in_doc(doc_BT if shard is None else row_doc_BT)
            pos_BT = pos_BT if shard is None else shard.local(pos_BT)
            p = (pos_BT % self.every == 0).to(h_BTD.dtype)
        elif self.cfg.router == "topk":
            # p = sigmoid(w - tau): p >= 0.5 is w >= tau, the causal rule inference uses
            # (see topk_boundaries)
            p = torch.sigmoid(self.score(h_BTD).squeeze(-1).float() - self.threshold)
        else:
            prev = previous_token(h_BTD, shard)
            p = torch.sigmoid(self.score(torch.cat([h_BTD, prev], -1)).squeeze(-1).float())
        start = doc_starts(doc_BT) if shard is None else shard.local(doc_starts(row_doc_BT))
        p = torch.where(start, torch.ones_like(p), p)
        return torch.where(doc_BT >= 0, p, torch.zeros_like(p)), start

    def topk_boundaries(
        self, w_BT: torch.Tensor, doc_BT: torch.Tensor, statistics: Statistics = "per_forward"
    ) -> torch.Tensor:
        """Synergy eq. 2 in training: the ceil(n / R) highest-scoring tokens of
        each n-token document.

        A top-k over a document looks ahead, so inference cannot use it. Synergy leaves the
        inference rule open (MoD trains a causal predictor); here a token is a boundary when its
        score clears `threshold`, a running average of the batches' (1 - 1/R) score quantile (see
        `update_threshold`). Each decision then depends on the token's own score alone, and a
        prefix's boundaries never change as tokens arrive; the rate matches 1/R over the batch, not
        per document (docs/deviations.md has the measured agreement with the top-k)."""
        B, T = w_BT.shape
        valid = doc_BT >= 0
        R = self.cfg.target_ratio
        by_score = torch.argsort(
            torch.where(valid, w_BT, float("-inf")), dim=1, descending=True, stable=True
        )
        # doc, then score
        order = by_score.gather(1, torch.argsort(doc_BT.gather(1, by_score), dim=1, stable=True))
        doc_s = doc_BT.gather(1, order)
        t = torch.arange(T, device=w_BT.device).expand(B, T)
        first = (
            torch.where(F.pad(doc_s[:, 1:] != doc_s[:, :-1], (1, 0), value=True), t, 0)
            .cummax(1)
            .values
        )
        n_doc = torch.zeros(B, T + 1, device=w_BT.device).scatter_add_(
            1, (doc_BT + 1).clamp(0, T), valid.float()
        )
        k_s = torch.ceil(n_doc.gather(1, (doc_s + 1).clamp(0, T)) / R)
        b = torch.zeros_like(valid).scatter(1, order, (t - first) < k_s) & valid
        # the batch's (1 - 1/R) score quantile, padding as NaN (no boolean indexing: no host sync)
        has = valid.any()
        q = torch.nanquantile(torch.where(valid, w_BT, float("nan")).flatten(), 1 - 1 / R)
        q = torch.where(has, q, torch.zeros_like(q))
        if statistics != "off":
            self.quantile_accum.add_(torch.stack([q, has.float()]))
        if statistics == "per_forward":
            self.update_threshold()
        return b

    @torch.no_grad()
    def update_threshold(self, accum: torch.Tensor | None = None) -> None:
        """threshold <- 0.9 threshold + 0.1 (mean batch quantile since the last update), then the
        statistics are reset. The trainer calls it once per applied optimizer step with `accum`
        summed over ranks, so the rate does not depend on gradient accumulation or on no-gradient
        statistics passes."""
        s = self.quantile_accum if accum is None else accum.to(self.quantile_accum)
        mean = s[0] / s[1].clamp_min(1)
        self.threshold.copy_(
            torch.where(s[1] > 0, 0.9 * self.threshold + 0.1 * mean, self.threshold)
        )
        self.quantile_accum.zero_()

    def concept_gate(self, h: torch.Tensor) -> torch.Tensor | None:
        """Synergy eq. 3: sigma_i = sigmoid(w_i), w_i (eq. 1) the score of the token that closes the
        concept; None for the other routers (their concepts are not gated; eq. 10's STE(sel)
        multiplies them instead). Against eq. 10's STE on the top-k router: held-out loss 0.9712 vs
        0.9718 at step 300, 3 seeds (docs/deviations.md). `h`: [B, T, D] in a forward, [B, D] in a
        decode step; the gate has its shape without D."""
        if self.cfg.router != "topk":
            return None
        return torch.sigmoid(self.score(h).squeeze(-1).float())

    def forward(
        self,
        h_BTD,
        doc_BT,
        above_BT=None,
        force: str | torch.Tensor | None = None,
        context: ForwardContext = DEFAULT,
        shard: SequenceShard | None = None,
    ) -> Chunks:
        """The boundaries of a packed batch and where its concepts go. `force`: boundaries set by the
        caller (a [B, T] mask, or "all"). In training the boundaries are sampled (eq. 5-6) with
        `context.noise_seed`; the ratio loss on p and the boundaries is the trainer's
        (vlm.train.losses). `shard` (sequence parallelism): h holds this rank's tokens, `doc_BT`
        (and a `force` mask) the whole rows'; see `sharded_layout`."""
        p, start = self.boundary_prob(h_BTD, doc_BT, above_BT, shard)
        row_doc_BT = doc_BT
        index = None
        if shard is not None:
            doc_BT = shard.local(doc_BT)
            force = shard.local(force) if isinstance(force, torch.Tensor) else force
            # the noise at each token's flat position in the rows, whatever the rank
            B, T = row_doc_BT.shape
            lo, hi = shard.span(T)
            index = torch.arange(B, device=p.device)[:, None] * T + torch.arange(
                lo, hi, device=p.device
            )
        valid = doc_BT >= 0
        if isinstance(force, torch.Tensor):
            b = force.bool() | start
        elif force == "all":
            # every token its own concept, p = 1: the lossless-conversion starting point
            p = torch.where(valid, torch.ones_like(p), p)
            b = valid.clone()
        elif self.training and self.cfg.router == "topk":
            # ranked by the raw scores: p = sigmoid(w - tau) saturates and would tie the best ones
            w_BT = self.score(h_BTD).squeeze(-1).detach().float()
            b = self.topk_boundaries(w_BT, doc_BT, context.statistics) | start
        elif self.training and self.cfg.boundary_noise == "bernoulli":
            u = uniform(self._noise_seed(context, p.device), tuple(p.shape), p.device, index=index)
            b = sample_boundaries(sharpen(p.detach(), self.cfg.tau), u) | start
        elif self.training and self.cfg.boundary_noise == "gaussian":
            seed = self._noise_seed(context, p.device)
            noise = normal(seed, tuple(p.shape), p.device, index) * self.cfg.noise_sigma
            b = (p.detach() + noise >= 0.5) | start
        else:
            b = (p >= 0.5) | start
        b = b & valid
        sel = torch.where(b, p, 1 - p)
        if shard is not None:
            return self.sharded_layout(p, b, sel, row_doc_BT, force == "all", shard)
        # Concepts go into a static capacity of M per row (no host synchronisation): everything
        # scatters into a spill column M (non-boundary tokens, and boundaries past the capacity)
        # that is dropped. Tokens whose concept lies past the capacity read none (cidx -1); those
        # concepts are counted, not hidden.
        M = doc_BT.shape[1] if force == "all" else self.capacity(doc_BT.shape[1])
        count_BT = b.long().cumsum(1) - 1
        M = used_capacity(M, count_BT)
        fits = count_BT < M
        cidx = torch.where(valid & fits, count_BT, torch.full_like(doc_BT, -1))
        overflow = (b & ~fits).sum().float()
        slot_BT = torch.where(b & fits, count_BT, torch.full_like(count_BT, M))
        cdoc = torch.full((doc_BT.shape[0], M + 1), -1, dtype=doc_BT.dtype, device=doc_BT.device)
        cdoc = cdoc.scatter(1, slot_BT, doc_BT)[:, :M]
        cp = p.new_zeros(doc_BT.shape[0], M + 1).scatter(1, slot_BT, p)[:, :M]
        gate_BT = self.concept_gate(h_BTD)
        cgate = None
        # each concept keeps its boundary token's gate (the spill column M is dropped)
        if gate_BT is not None:
            cgate = gate_BT.new_zeros(doc_BT.shape[0], M + 1).scatter(1, slot_BT, gate_BT)[:, :M]
        return Chunks(p, b, sel, cidx, cdoc, positions_in_doc(cdoc), cp, overflow, cgate)

    def sharded_layout(
        self,
        p_BL: torch.Tensor,
        b_BL: torch.Tensor,
        sel_BL: torch.Tensor,
        row_doc_BT: torch.Tensor,
        every_token: bool,
        shard: SequenceShard,
    ) -> Chunks:
        """`forward`'s concept layout under sequence parallelism, from this rank's boundaries: the
        row's boundary mask is gathered (one byte per token), so each concept's index in the row is
        a prefix sum over the group and every rank knows the documents of the row's concepts (the
        concept attention's masks); this rank keeps its tokens' reads and its concept slots (the
        row's static capacity M padded to a multiple of S), whose p arrive by a reduce-scatter from
        the shards that hold their boundaries. Overflow counts this rank's boundaries."""
        B, T = row_doc_BT.shape
        b_BT = gather_detached(b_BL, shard)
        M = T if every_token else self.capacity(T)
        count_BT = b_BT.long().cumsum(1) - 1
        M = used_capacity(M, count_BT)
        Mp = padded_slots(max(M, 1), shard.size)
        fits_BT = count_BT < M
        cidx_BT = torch.where((row_doc_BT >= 0) & fits_BT, count_BT, -1)
        slot_BT = torch.where(b_BT & fits_BT, count_BT, Mp)
        cdoc_BM = torch.full((B, Mp + 1), -1, dtype=row_doc_BT.dtype, device=row_doc_BT.device)
        cdoc_BM = cdoc_BM.scatter(1, slot_BT, row_doc_BT)[:, :Mp]
        slot_BL = shard.local(slot_BT)
        cp_BK = reduce_scatter(p_BL.new_zeros(B, Mp + 1).scatter(1, slot_BL, p_BL)[:, :Mp], shard)
        overflow = (b_BL & ~shard.local(fits_BT)).sum().float()
        return Chunks(
            p_BL,
            b_BL,
            sel_BL,
            shard.local(cidx_BT),
            shard.local(cdoc_BM),
            shard.local(positions_in_doc(cdoc_BM)),
            cp_BK,
            overflow,
            None,
            b_BT,
            cdoc_BM,
        )

    def merge(
        self,
        h_BTD: torch.Tensor,
        doc_BT: torch.Tensor,
        ch: Chunks,
        shard: SequenceShard | None = None,
    ) -> torch.Tensor:
        """Concepts [B, M, D] from token states: `last` takes h at the boundary, `sum`/`mean` pool
        the concept's tokens. `shard`: h holds this rank's tokens and `doc_BT` the whole rows';
        each shard pools its tokens into the row's concept slots, and a reduce-scatter sums the
        shards' parts of this rank's slots ([B, M / S, D])."""
        if shard is not None:
            return self._sharded_merge(h_BTD, doc_BT, ch, shard)
        B, M = ch.cdoc_BM.shape
        slot_BT = self.concept_slots(ch.b_BT, ch.cidx_BT, ch.cdoc_BM, doc_BT)
        # a spill slot M per row takes every non-member token and is dropped: no boolean indexing,
        # no host sync
        flat_N = (slot_BT + torch.arange(B, device=slot_BT.device)[:, None] * (M + 1)).flatten()
        D = h_BTD.shape[-1]
        out = h_BTD.new_zeros(B * (M + 1), D).index_add(0, flat_N, h_BTD.reshape(-1, D))
        out = out.view(B, M + 1, D)[:, :M]
        if self.cfg.merge == "mean":
            counts = h_BTD.new_zeros(B * (M + 1)).index_add(
                0, flat_N, h_BTD.new_ones(flat_N.shape[0])
            )
            out = out / counts.view(B, M + 1)[:, :M].clamp_min(1)[..., None]
        return out

    def concept_slots(self, b_BT, cidx_BT, cdoc_BM, doc_BT) -> torch.Tensor:
        """[B, T]: the concept slot each token is pooled into (M, the dropped spill slot, for none)."""
        M = cdoc_BM.shape[1]
        if self.cfg.merge == "last":
            return torch.where(b_BT & (cidx_BT >= 0), cidx_BT, M)
        # Token n belongs to the concept closed by the first boundary at or after n, if that
        # boundary is in n's own document (a document's tail after its last boundary forms no
        # concept) and within capacity.
        seg_BT = b_BT.long().cumsum(1) - b_BT.long()
        member = (
            (doc_BT >= 0)
            & (seg_BT < M)
            & (cdoc_BM.gather(1, seg_BT.clamp(0, max(M - 1, 0))) == doc_BT)
        )
        return torch.where(member, seg_BT, M)

    def _sharded_merge(self, h_BLD, row_doc_BT, ch: Chunks, shard: SequenceShard) -> torch.Tensor:
        B, Mp = ch.row_cdoc_BM.shape
        # a concept exists (within the capacity) where its slot holds a document
        count_BT = ch.row_b_BT.long().cumsum(1) - 1
        held_BT = ch.row_cdoc_BM.gather(1, count_BT.clamp(0, Mp - 1)) >= 0
        row_cidx_BT = torch.where((row_doc_BT >= 0) & (count_BT < Mp) & held_BT, count_BT, -1)
        slot_BT = self.concept_slots(ch.row_b_BT, row_cidx_BT, ch.row_cdoc_BM, row_doc_BT)
        rows_B1 = torch.arange(B, device=slot_BT.device)[:, None] * (Mp + 1)
        flat_N = (shard.local(slot_BT) + rows_B1).flatten()
        D = h_BLD.shape[-1]
        part = h_BLD.new_zeros(B * (Mp + 1), D).index_add(0, flat_N, h_BLD.reshape(-1, D))
        out_BKD = reduce_scatter(part.view(B, Mp + 1, D)[:, :Mp], shard)
        if self.cfg.merge == "mean":  # the pool sizes, from the row's layout (no exchange)
            counts = torch.zeros(B * (Mp + 1), device=slot_BT.device).index_add(
                0, (slot_BT + rows_B1).flatten(), torch.ones(slot_BT.numel(), device=slot_BT.device)
            )
            n_BK = shard.local(counts.view(B, Mp + 1)[:, :Mp]).clamp_min(1)
            out_BKD = out_BKD / n_BK[..., None].to(out_BKD.dtype)
        return out_BKD

    # ---------------------------------------------------------------- inference
    def step(
        self, h_BD: torch.Tensor, state: RouterState, force_B: torch.Tensor | None = None
    ) -> ChunkStep:
        """`forward` and `merge` for one new token per row (eval mode): whether it closes a concept
        and, for the rows where it does, that concept (and its gate). `force_B` sets the boundaries
        instead of the router (as `forward`'s `force`). Updates `state` in place; fixed shapes, no
        host synchronisation."""
        p_B, b_B = self.boundary_step(h_BD, state)
        b_B = b_B if force_B is None else force_B.bool()
        concept_BD = self.merge_step(h_BD, b_B, state)
        return ChunkStep(p_B, b_B, concept_BD, self.concept_gate(h_BD))

    def boundary_step(
        self, h_BD: torch.Tensor, state: RouterState
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One new token per row (eval mode): its boundary probability (eq. 2 against the previous
        token) and whether it closes a concept (p >= 0.5). Updates the state's last key."""
        if self.cfg.router == "cosine":
            q, key = self.q_proj(h_BD), self.k_proj(h_BD)
            cos = F.cosine_similarity(q.float(), state.last_key_BD.float(), dim=-1, eps=1e-6)
            p = ((1 - cos) / 2).clamp(0, 1)
        elif self.cfg.router == "fixed":  # this token's place in its document: pending tokens + 1
            key = h_BD
            p = ((state.pending_n_B + 1) % self.every == 0).float()
        elif self.cfg.router == "topk":
            key = h_BD
            p = torch.sigmoid(self.score(h_BD).squeeze(-1).float() - self.threshold)
        else:
            key = h_BD
            p = torch.sigmoid(
                self.score(torch.cat([h_BD, state.last_key_BD], -1)).squeeze(-1).float()
            )
        state.last_key_BD.copy_(key)  # in place: a captured (CUDA graph) step keeps its buffers
        return p, p >= 0.5

    def merge_step(self, h_BD: torch.Tensor, b_B: torch.Tensor, state: RouterState) -> torch.Tensor:
        """The concept each row would close with this token ([B, D]; meaningful where `b_B`), as
        `merge` builds it; rows that close one start a new pending concept."""
        n_B = state.pending_n_B + 1
        # in place, as every state update
        state.pending_n_B.copy_(torch.where(b_B, torch.zeros_like(n_B), n_B))
        # only the count of pending tokens is kept (the fixed router reads it)
        if self.cfg.merge == "last":
            return h_BD
        concept = state.pending_BD + h_BD
        state.pending_BD.copy_(torch.where(b_B[:, None], torch.zeros_like(concept), concept))
        if self.cfg.merge == "mean":
            concept = concept / n_B.clamp_min(1)[:, None].to(concept.dtype)
        return concept

    def prefill_state(self, h_BTD: torch.Tensor, doc_BT: torch.Tensor, ch: Chunks) -> RouterState:
        """The state after a prompt (one document per row): the last token's key and the tokens
        after the last boundary (no concept yet)."""
        B, T, _ = h_BTD.shape
        valid = doc_BT >= 0
        rows = torch.arange(B, device=h_BTD.device)
        last = valid.sum(1) - 1
        key = self.k_proj(h_BTD[rows, last]) if self.cfg.router == "cosine" else h_BTD[rows, last]
        t = torch.arange(T, device=h_BTD.device)
        last_b = torch.where(ch.b_BT, t, torch.full_like(t, -1)).amax(1)
        tail = valid & (t[None] > last_b[:, None])
        pending = (h_BTD * tail[..., None].to(h_BTD.dtype)).sum(1)
        return RouterState(key, pending, tail.sum(1))
