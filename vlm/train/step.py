"""One optimizer step over a window of micro-batches: the loss terms with the statistics of the
whole global batch, the non-finite skip, and the step's record.

Legend: B rows, T tokens.

The loss (vlm.train.losses) is a sum of named terms; the step gives them `Totals`, the sums over
the global batch (every micro-batch of every rank) they need, in one all-reduce before the first
backward: the labelled tokens (known from the batches) and, with DLCM's global parser, the ratio
loss's statistics, which only a forward knows. With several micro-batches per rank a statistics
pass forwards each of them first, without gradients, drawing the boundaries its real pass will draw
(the noise is seeded by the micro-batch's place in the global batch) and counting no routing
statistics (`ForwardContext(statistics="off")`); no forward of a step computes `[B, T, V]` logits
(the LM term makes them in tiles of tokens: vlm.model.tiled_loss); one micro-batch needs no extra pass: its forward's
statistics are all-reduced before its backward.

Non-finite loss or gradient. Finiteness of the loss is agreed over ranks after each forward. A bad
micro-batch makes the whole step a no-op: the optimizer receives NaN gradients, which its overflow
check turns into a skipped step (no update, gradients cleared, counted by DeepSpeed): DeepSpeed's
own check for ZeRO / bf16, and on the plain fp32 path (stage 0), where DeepSpeed checks nothing, the
optimizer's (engine.SkipNonFiniteAdamW, which also catches a finite loss whose gradient is not). The
LR schedule and the balancing biases move only on applied steps; so does the top-k router's
inference threshold, once per step, from the statistics of the step's real passes on every rank.
The step talks to the model through its forward's arguments and vlm.model.training_controls, and to
the other ranks only through vlm.train.collectives.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from configs.batch import PackedBatch
from vlm.model.context import ForwardContext, Statistics
from vlm.model.sequence_parallel import SequenceShard
from vlm.model.training_controls import TrainingControls
from vlm.train import collectives
from vlm.train.device_feed import prepare
from vlm.train.layout import ParallelLayout
from vlm.train.losses import Loss, Totals, labelled_tokens
from vlm.train.metrics import StepAccumulator, StepRecord
from vlm.train.sequence_shard import local_batch


@dataclass(frozen=True)
class StepSettings:
    """What a step needs from its run, fixed for the run."""

    loss: Loss
    controls: TrainingControls
    seed: int  # train.seed: the boundary noise's
    layout: ParallelLayout  # how the ranks share the work
    device: torch.device
    float_dtype: torch.dtype = torch.float32
    bytes_per_id: torch.Tensor | None = None  # the tokenizer's, for bits per byte
    groups: tuple[str, ...] = ()  # the statistics groups' names (kinds of sample, then sources)
    # sequence parallelism: this rank's part of each row (the model computes it; the loss and the
    # metrics read it: vlm.train.sequence_shard); None: whole rows
    shard: SequenceShard | None = None

    @property
    def n_sources(self) -> int:
        return sum(g.startswith("source:") for g in self.groups)


def boundary_seed(seed: int, step: int, index: int) -> int:
    """Seed of the boundary sampler for global micro-batch `index` of optimizer step `step`.

    Keyed by position in the global batch, not by rank, so sampling does not depend on how the
    global batch is split over ranks and micro-batches (and is reproduced exactly on resume)."""
    return (seed * 0x9E3779B1 + (step + 1) * 0x85EBCA77 + index * 0xC2B2AE3D) % (2**63 - 1)


def forward_context(
    s: StepSettings, step: int, k: int, statistics: Statistics = "per_step"
) -> ForwardContext:
    """What the forward of micro-batch k of this rank needs: its boundary seed (its global
    micro-batch: ParallelLayout.global_micro_batch), what it does with the routing statistics it
    counts, no logits (the loss makes them from the final hidden states, a tile of tokens at a
    time) and the router losses the run's loss weighs."""
    seed = boundary_seed(s.seed, step, s.layout.global_micro_batch(k))
    seed_t = torch.tensor(seed, dtype=torch.long, device=s.device)
    # the statistics pass's forwards make no loss: no router losses either
    router_losses = frozenset() if statistics == "off" else s.loss.router_losses
    return ForwardContext(seed_t, statistics, logits=False, router_losses=router_losses)


def poison_backward(engine) -> None:
    """Backward a NaN through every trainable tensor: DeepSpeed's overflow check then skips the step."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    loss = torch.stack([p.sum().float() for p in params]).sum() * float("nan")
    engine.backward(loss)


@torch.no_grad()
def statistics_pass(model, window: list[PackedBatch], step: int, s: StepSettings) -> dict:
    """The loss terms' statistics of every micro-batch of `window`, summed (this rank's part of
    the totals), from forwards without gradients that count no routing statistics."""
    sums: dict[str, torch.Tensor] = {}
    for k, batch in enumerate(window):
        batch = prepare(batch, s.device, s.float_dtype)
        out = model(batch, context=forward_context(s, step, k, statistics="off"))
        for name, t in s.loss.statistics(out, local_batch(batch, s.shard)).items():
            sums[name] = sums[name] + t if name in sums else t
    return sums


def global_totals(sums: dict, labelled: float, micro_batches: int, device) -> Totals:
    """This rank's sums over the global batch (one collective)."""
    summed, N = collectives.loss_statistics(sums, labelled, device)
    return Totals(micro_batches, summed, N)


def train_step(
    engine, window: list[PackedBatch], step: int, s: StepSettings, loss_hook=None
) -> StepRecord:
    """Forward/backward every micro-batch of `window` and take (or skip) one optimizer step; after
    an applied one the routing statistics the forwards counted move the balancing biases and top-k
    thresholds (`s.controls`).

    Returns the step's record (`StepRecord`, numbered `step + 1`): the global sums and means of what
    the step saw, or a skipped step's mark. `loss_hook(out, k)` may replace a micro-batch's output
    (used by tests to inject a non-finite loss). On the plain fp32 path the engine's optimizer must
    skip a non-finite step itself (engine.build_engine's does).
    """
    micro = len(window)
    if micro != engine.gradient_accumulation_steps():
        raise ValueError(
            f"window of {micro} micro-batches but the engine accumulates "
            f"{engine.gradient_accumulation_steps()}"
        )
    # the parts of the global batch the terms' scales count (vlm.train.losses): with sequence
    # parallelism each rank's part of a row is one, so K = micro x world (DeepSpeed's divisor)
    K = micro * s.layout.world
    # every micro-batch's labelled tokens (this rank's part) in one host read
    n_local = (
        torch.stack([labelled_tokens(local_batch(b, s.shard)) for b in window]).double().tolist()
    )
    labelled = sum(n_local)
    totals = None
    if not s.loss.needs_output_statistics:
        totals = global_totals({}, labelled, K, s.device)
    elif micro > 1:
        totals = global_totals(
            statistics_pass(engine.module, window, step, s), labelled, K, s.device
        )
    acc = StepAccumulator(s.device, s.bytes_per_id, s.n_sources)
    bad = False
    chunking = None
    for k, batch in enumerate(window):
        if not bad:
            batch = prepare(batch, s.device, s.float_dtype)
            out = engine(batch, context=forward_context(s, step, k))
            row = None
            if s.shard is not None:  # the whole rows, for the per-document statistics
                row = (batch, out.chunks.row_b_BT if out.chunks is not None else None, s.shard)
            batch = local_batch(batch, s.shard)  # what this rank's output is of
            if loss_hook is not None:
                out = loss_hook(out, k)
            if totals is None:  # one micro-batch: its statistics are the rank's
                totals = global_totals(s.loss.statistics(out, batch), labelled, K, s.device)
            loss = s.loss(out, batch, dataclasses.replace(totals, micro_labelled=n_local[k]))
            finite = torch.isfinite(loss.backprop.detach().float()).all()
            bad = not collectives.all_finite(finite, s.device)
            if not bad:
                engine.backward(loss.backprop)
                acc.add_output(out, batch, loss, row=row)
                if out.chunks is not None:
                    chunking = (out.chunks.p_BT.detach(), out.chunks.b_BT.detach(), batch.modality)
            del out, loss
        if bad:
            poison_backward(engine)
        engine.step()
    applied = not bad and engine.was_step_applied()
    if not applied:
        s.controls.drop_statistics()
        return StepRecord(step + 1, False, chunking=chunking)
    s.controls.apply_statistics(collectives.model_statistics)
    record = acc.record(step + 1, collectives.step_metrics, groups=list(s.groups))
    record.chunking = chunking
    return record
