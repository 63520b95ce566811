"""The training loss, in one place: named terms, each a value and a weight; the total is their sum.

Legend: B rows, T tokens, E experts, N flat tokens, S documents, Z ratio groups (one joint group, or
one per modality).

A term is a function of what the model computed (`ModelOutput`: the final hidden states and the
output layer, the chunking, each MoE pass's router statistics), of the batch, and of `Totals`: sums
over the whole global batch (every micro-batch of every rank), which the step makes in one
all-reduce before any backward. It returns a `TermValue`:

- `value`: this micro-batch's value of the term, with its gradient;
- `scale`: the factor DeepSpeed's averaging needs (the engine divides each micro-batch's loss by the
  micro-batches of the global batch, `Totals.micro_batches`): 1 for a term that is a mean over
  micro-batches, `micro_batches` for one computed from global statistics (its gradient reaches only
  this micro-batch's inputs, and the parts sum to the global gradient), `n * micro_batches / N` for
  a mean over the global batch's N tokens of which this micro-batch holds n;
- `share`: this micro-batch's part of the term's value over the global batch, detached (the shares
  of every micro-batch and rank sum to it: what is logged as `loss/NAME`).

The step back-propagates sum(value * weight * scale) over the terms, in TERMS' order, and logs
`loss` = sum(weight * loss/NAME). A weight of 0 leaves a term out (not computed).

The weights are the training config's `loss:` section (vlm.train.loss_config.LossConfig), one per
term, so that a run continuing a checkpoint may change them as it changes its learning rate.

Adding a term (docs/design.md, "Adding a loss term"): write its function here, add it to TERMS with
the `loss:` field that holds its weight; a term that needs a sum over the global batch also gives a
`statistics` function (local sums, detached), and finds their global sums in `totals.sums[NAME]`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from configs.batch import IGNORE_INDEX, IMAGE, TEXT, PackedBatch
from vlm.model.config import ChunkConfig, ModelConfig
from vlm.model.doc_stats import document_slots
from vlm.model.output import ModelOutput
from vlm.model.ratio_loss import document_ratio_loss, ratio_loss
from vlm.model.sequence_parallel import SequenceShard, row_sum
from vlm.model.stats import lm_labels, lm_losses
from vlm.train.loss_config import LossConfig


@dataclass(frozen=True)
class Totals:
    """Sums over the whole global batch that the terms need (the step's one all-reduce)."""

    micro_batches: int  # micro-batches in the global batch: accumulation steps x ranks
    sums: dict[str, torch.Tensor] = field(default_factory=dict)  # by statistic, on the device
    labelled: float = 0.0  # labelled (LM loss) tokens in the global batch
    # this micro-batch's labelled tokens, counted on the host before its forward (None: counted
    # here, a host read where the batch is on a GPU)
    micro_labelled: float | None = None
    # sequence parallelism (vlm.train.sequence_shard): the batch is this rank's part of its rows,
    # one of `micro_batches` parts (micro x world); a term that is its row's on each of the S ranks
    # (balance, z, per-document ratio) is scaled by S and logged as 1/S on each. None: whole rows
    shard: SequenceShard | None = None

    @property
    def sequence(self) -> int:
        return 1 if self.shard is None else self.shard.size


@dataclass
class TermValue:
    value: torch.Tensor  # this micro-batch's value (0-d, with grad)
    scale: float  # its factor in the back-propagated sum (see the module docstring)
    share: torch.Tensor  # detached 0-d: its part of the term's value over the global batch
    # what else the term computed that statistics read (the LM loss per position), detached
    detail: dict[str, torch.Tensor] = field(default_factory=dict)


TermFn = Callable[[ModelOutput, PackedBatch, ModelConfig, LossConfig, Totals], TermValue]
StatisticsFn = Callable[[ModelOutput, PackedBatch, ModelConfig], torch.Tensor]


@dataclass(frozen=True)
class Term:
    name: str  # logged as loss/NAME
    fn: TermFn
    # from the model and the loss section (0: the term is left out)
    weight: Callable[[ModelConfig, LossConfig], float]
    # local sums (detached) whose totals over the global batch the term reads (totals.sums[name])
    statistics: StatisticsFn | None = None


# ---------------------------------------------------------------- the LM loss


def labelled_tokens(batch: PackedBatch) -> torch.Tensor:
    """0-d: the positions of `batch` the LM loss is on."""
    return (lm_labels(batch) != IGNORE_INDEX).sum()


def lm_term(
    out: ModelOutput, batch: PackedBatch, cfg: ModelConfig, w: LossConfig, totals: Totals
) -> TermValue:
    """Next-token cross-entropy, the mean over the global batch's labelled tokens, computed in
    tiles of tokens from the final hidden states (vlm.model.tiled_loss: no [T, V] logits)."""
    lm, _, token_loss_BT = lm_losses(out, lm_labels(batch), batch.doc_ids, batch.modality)
    n = totals.micro_labelled
    n = float(labelled_tokens(batch)) if n is None else n
    N = max(totals.labelled, 1.0)
    detail = {"token_loss_BT": token_loss_BT}  # for the statistics by kind and source
    return TermValue(lm, n * totals.micro_batches / N, lm.detach() * (n / N), detail)


# ---------------------------------------------------------------- the ratio loss (eq. 4)


def ratio_groups(
    cfg: ChunkConfig, doc_BT: torch.Tensor, modality_BT: torch.Tensor | None
) -> list[tuple[torch.Tensor, float]]:
    """Token masks [B, T] and targets of the ratio losses: one joint group, or one per modality."""
    valid_BT = doc_BT >= 0
    targets = cfg.modality_targets()
    if targets:
        names = {"text": TEXT, "image": IMAGE}
        return [(valid_BT & (modality_BT == names[m]), r) for m, r in sorted(targets.items())]
    return [(valid_BT, cfg.target_ratio)]


def _ratio_sums(chunks, doc_BT, modality_BT, cfg: ChunkConfig):
    """The ratio groups, p as float, the sum of p per group (with grad) and the local [Z, 3] sums
    (boundaries, sum of p, tokens)."""
    groups = ratio_groups(cfg, doc_BT, modality_BT)
    masks_ZBT = torch.stack([m for m, _ in groups])
    p_BT = chunks.p_BT.float()
    sum_p_Z = (masks_ZBT * p_BT).flatten(1).sum(-1)
    local_Z3 = torch.stack(
        [
            (masks_ZBT & chunks.b_BT).flatten(1).sum(-1).float(),
            sum_p_Z.detach(),
            masks_ZBT.flatten(1).sum(-1).float(),
        ],
        -1,
    )
    return groups, p_BT, sum_p_Z, local_Z3


def ratio_loss_value(
    chunks,
    doc_BT,
    modality_BT,
    cfg: ChunkConfig,
    glob_Z3: torch.Tensor | None = None,
    document_weight: float = LossConfig.document,
    shard: SequenceShard | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the ratio loss of one chunking, its batch part detached): eq. 4 per ratio group from the
    boundary fraction F and mean p G over `glob_Z3`'s sums (DLCM's global parser; None: this batch's
    own), plus with `cfg.document_slack` the per-document band (`document_ratio_loss`, weighted by
    `document_weight`: loss.document). F carries no gradient; G's gradient reaches only this
    batch's p, and summing the micro-batches' gradients gives the global one's exactly. `shard`:
    the batch is this rank's part of its rows; a document's sums are the row's (`row_sum`: each
    rank's gradient through its own tokens), so the per-document term is the row's on every rank
    of the group."""
    groups, p_BT, sum_p_Z, local_Z3 = _ratio_sums(chunks, doc_BT, modality_BT, cfg)
    glob_Z3 = local_Z3 if glob_Z3 is None else glob_Z3
    count_Z = glob_Z3[:, 2].clamp_min(1)
    F_Z = glob_Z3[:, 0] / count_Z
    G_Z = (sum_p_Z + (glob_Z3[:, 1] - local_Z3[:, 1])) / count_Z
    # a group with no tokens anywhere contributes nothing (masked on the device: no host sync)
    losses_Z = torch.stack([ratio_loss(F_Z[k], G_Z[k], r) for k, (_, r) in enumerate(groups)])
    loss = torch.where(glob_Z3[:, 2] > 0, losses_Z, torch.zeros_like(losses_Z)).sum()
    batch_part = loss.detach()
    if cfg.holds_documents:
        row_T = None if shard is None else doc_BT.shape[1] * shard.size
        slot_BT, S = document_slots(doc_BT, row_T)
        idx_N = slot_BT.flatten()
        b_N = chunks.b_BT.flatten().float()
        for k, (mask_BT, r) in enumerate(groups):  # one or two groups: not a loop over tokens
            m_N = mask_BT.flatten().float()
            n_S = row_sum(p_BT.new_zeros(S).index_add(0, idx_N, m_N), shard)
            b_S = row_sum(p_BT.new_zeros(S).index_add(0, idx_N, m_N * b_N), shard)
            p_S = row_sum(p_BT.new_zeros(S).index_add(0, idx_N, m_N * p_BT.flatten()), shard)
            loss = loss + document_weight * document_ratio_loss(
                n_S, b_S, p_S, glob_Z3[k, 2], r, cfg.document_slack
            )
    return loss, batch_part


def ratio_statistics(out: ModelOutput, batch: PackedBatch, cfg: ModelConfig) -> torch.Tensor:
    """[Z, 3] local sums of the ratio loss (boundaries, sum of p, tokens) per group."""
    return _ratio_sums(out.chunks, batch.doc_ids, batch.modality, cfg.chunk)[3]


def ratio_term(
    out: ModelOutput, batch: PackedBatch, cfg: ModelConfig, w: LossConfig, totals: Totals
) -> TermValue:
    """The ratio loss (`ratio_loss_value`), on the global batch's statistics where the run asks
    for them (`totals.sums["ratio"]`, train.global_parser)."""
    glob_Z3 = totals.sums.get("ratio")
    loss, batch_part = ratio_loss_value(
        out.chunks, batch.doc_ids, batch.modality, cfg.chunk, glob_Z3, w.document, totals.shard
    )
    K = totals.micro_batches
    if glob_Z3 is None:  # each micro-batch's own loss: a mean over micro-batches
        return TermValue(loss, 1.0, loss.detach() / K)
    # the batch term is the global one on every micro-batch (logged once); the per-document term's
    # micro-batch parts, weighted by tokens over the global count, add up (each row's is on its S
    # ranks: logged 1/S on each)
    doc_part = (loss.detach() - batch_part) / totals.sequence
    return TermValue(loss, float(K), batch_part / K + doc_part)


# ---------------------------------------------------------------- the routers' losses


def _router_mean(out: ModelOutput, w: LossConfig, term: str) -> torch.Tensor | None:
    """The mean over every MoE pass of router loss `term` ("balance", "z"), each weighted by its
    layer's weight (`LossConfig.router_weight`: the concept model's layers may have their own); a
    pass whose weight is 0 counts as 0, so the mean is over every pass."""
    if not out.moe_passes:
        return None
    parts = []
    for name, s in out.moe_passes:
        weight, x = w.router_weight(term, name.startswith("concept.")), getattr(s, term)
        parts.append(weight * x if x is not None and weight else s.load_E.new_zeros(()))
    return torch.stack(parts).mean()


def _per_micro_batch(value: torch.Tensor, totals: Totals) -> TermValue:
    """A term that is a mean over the global batch's micro-batches (its rows': with sequence
    parallelism a row's value is on each of its S ranks, each with the gradient of its tokens, so
    it is scaled by S and the S parts' gradients add up to the row's)."""
    return TermValue(value, float(totals.sequence), value.detach() / totals.micro_batches)


def balance_term(
    out: ModelOutput, batch: PackedBatch, cfg: ModelConfig, w: LossConfig, totals: Totals
) -> TermValue:
    """The Switch balance loss of each MoE pass, weighted by its layer's weight (loss.balance;
    loss.concept_balance for the concept model's), averaged over the passes and the
    micro-batches."""
    return _per_micro_batch(_router_mean(out, w, "balance"), totals)


def z_term(
    out: ModelOutput, batch: PackedBatch, cfg: ModelConfig, w: LossConfig, totals: Totals
) -> TermValue:
    """The router z-loss (ST-MoE) of each MoE pass, weighted by its layer's weight (loss.z;
    loss.concept_z for the concept model's), averaged over the passes and the micro-batches."""
    return _per_micro_batch(_router_mean(out, w, "z"), totals)


def _any_layer(w: LossConfig, term: str) -> float:
    """1 where some MoE layer's weight of router loss `term` is on (those weights are applied per
    layer, in `_router_mean`), else 0."""
    return 1.0 if w.router_weight(term, False) or w.router_weight(term, True) else 0.0


TERMS: tuple[Term, ...] = (
    Term("lm", lm_term, lambda cfg, w: 1.0),
    Term(
        "ratio",
        ratio_term,
        lambda cfg, w: w.ratio if cfg.chunk.enabled else 0.0,
        statistics=ratio_statistics,
    ),
    Term("balance", balance_term, lambda cfg, w: _any_layer(w, "balance")),
    Term("z", z_term, lambda cfg, w: _any_layer(w, "z")),
)
# the terms the MoE layers compute for (vlm.model.context.ForwardContext.router_losses)
ROUTER_TERMS = ("balance", "z")


# ---------------------------------------------------------------- the total


@dataclass
class LossResult:
    # what the step back-propagates: sum of value * weight * scale (0-d, with grad)
    backprop: torch.Tensor
    terms: dict[str, TermValue]
    weights: dict[str, float]

    @property
    def detail(self) -> dict[str, torch.Tensor]:
        return {k: v for t in self.terms.values() for k, v in t.detail.items()}

    def shares(self) -> dict[str, torch.Tensor]:
        """`loss/NAME` and the weighted total `loss`: this micro-batch's parts of their values over
        the global batch (detached; summed over micro-batches and ranks, they are the step's)."""
        out = {f"loss/{n}": t.share for n, t in self.terms.items()}
        total = None
        for n, t in self.terms.items():
            part = t.share * self.weights[n]
            total = part if total is None else total + part
        out["loss"] = total
        return out


class Loss:
    """The run's loss: the terms of TERMS whose weight is not 0, for one model config and the
    run's loss section (`weights`; None: the defaults). `global_parser`: the ratio loss reads the
    global batch's statistics (train.global_parser)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: LossConfig | None = None,
        global_parser: bool = True,
        terms=None,
        shard: SequenceShard | None = None,
    ):
        """`shard`: each batch is this rank's part of rows split over its group (sequence
        parallelism: vlm.train.sequence_shard)."""
        self.cfg = cfg
        self.loss_cfg = LossConfig() if weights is None else weights
        self.shard = shard
        terms = TERMS if terms is None else terms
        self.weights = {t.name: w for t in terms if (w := float(t.weight(cfg, self.loss_cfg)))}
        self.terms = [t for t in terms if t.name in self.weights]
        # the statistics summed over the global batch before the terms (the lm term's token
        # count always; the others' where the run asks for global statistics)
        self.global_statistics = [
            t
            for t in self.terms
            if t.statistics is not None and (global_parser or t.name != "ratio")
        ]

    @property
    def router_losses(self) -> frozenset[str]:
        """The router losses the forward must compute (ForwardContext.router_losses): those of
        the terms left in."""
        return frozenset(n for n in ROUTER_TERMS if n in self.weights)

    @property
    def needs_output_statistics(self) -> bool:
        """Whether a term needs sums over the global batch of what the forward computes (then a
        step of several micro-batches makes a statistics pass first)."""
        return bool(self.global_statistics)

    def statistics(self, out: ModelOutput, batch: PackedBatch) -> dict[str, torch.Tensor]:
        """This micro-batch's local sums, detached, by term."""
        return {t.name: t.statistics(out, batch, self.cfg).detach() for t in self.global_statistics}

    def __call__(
        self, out: ModelOutput, batch: PackedBatch, totals: Totals | None = None
    ) -> LossResult:
        """The terms of one micro-batch; without `totals`, the batch is the whole global batch
        (a model used alone: its total is the loss of this batch)."""
        if totals is None:
            totals = Totals(1, self.statistics(out, batch), float(labelled_tokens(batch)))
        if self.shard is not None:
            totals = dataclasses.replace(totals, shard=self.shard)
        values = {t.name: t.fn(out, batch, self.cfg, self.loss_cfg, totals) for t in self.terms}
        backprop = None
        for name, t in values.items():
            part = t.value * (self.weights[name] * t.scale)
            backprop = part if backprop is None else backprop + part
        return LossResult(backprop, values, self.weights)


def training_loss(
    out: ModelOutput, batch: PackedBatch, cfg: ModelConfig, weights: LossConfig | None = None
) -> torch.Tensor:
    """The training loss of one batch on its own (benchmarks, tests): every term, local statistics;
    `weights` None: the default loss section."""
    return Loss(cfg, weights)(out, batch).backprop
