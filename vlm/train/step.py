"""One optimizer step over a window of micro-batches: loss weighting, global
parser, non-finite skip.

Loss weighting. DeepSpeed divides each micro-batch's loss by the accumulation steps (`micro`) and
averages gradients over the `ranks`. Weighting the LM loss of micro-batch (r, k) by n_rk micro ranks
/ N (n labelled tokens in it, N in the whole global batch) makes the gradient that of the mean over
the global batch's tokens, whatever the row split. The ratio loss of the global parser is a function
of global F and G whose gradient reaches only the local p, so it is weighted by micro ranks to sum,
not average, those parts.

Non-finite loss or gradient. Finiteness of the loss is agreed over ranks after each forward. A bad
micro-batch makes the whole step a no-op: the optimizer receives NaN gradients, which its overflow
check turns into a skipped step (no update, gradients cleared, counted by DeepSpeed): DeepSpeed's
own check for ZeRO / bf16, and on the plain fp32 path (stage 0), where DeepSpeed checks nothing, the
optimizer's (engine.SkipNonFiniteAdamW, which also catches a finite loss whose gradient is not). The
LR schedule and the balancing biases move only on applied steps; so does the top-k router's
inference threshold, once per step, from the statistics of the step's real (gradient) passes on
every rank: not once per micro-batch, and never from the statistics pass. The step talks to the
model only through vlm.model.training_controls, and to the other ranks only through
vlm.train.collectives.
"""

from __future__ import annotations

import torch

from configs.batch import PackedBatch
from vlm.model.training_controls import TrainingControls
from vlm.train import collectives
from vlm.train.device_feed import prepare
from vlm.train.global_parser import GlobalParser
from vlm.train.metrics import StepAccumulator, StepRecord, group_names, labelled_counts


def boundary_seed(seed: int, step: int, index: int) -> int:
    """Seed of the boundary sampler for global micro-batch `index` of optimizer step `step`.

    Keyed by position in the global batch, not by rank, so sampling does not depend on how the
    global batch is split over ranks and micro-batches (and is reproduced exactly on resume)."""
    return (seed * 0x9E3779B1 + (step + 1) * 0x85EBCA77 + index * 0xC2B2AE3D) % (2**63 - 1)


def poison_backward(engine) -> None:
    """Backward a NaN through every trainable tensor: DeepSpeed's overflow check then skips the step."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    loss = torch.stack([p.sum().float() for p in params]).sum() * float("nan")
    engine.backward(loss)


@torch.no_grad()
def statistics_pass(
    model,
    window: list[PackedBatch],
    parser: GlobalParser,
    step: int,
    *,
    seed: int,
    rank: int,
    world_size: int,
    device: torch.device,
    float_dtype: torch.dtype,
    controls: TrainingControls | None = None,
) -> None:
    """Forward every micro-batch without gradients, with the boundary samples its real pass will
    draw, so that the parser knows the global batch's statistics before the first backward. The MoE
    loads and the top-k score quantiles these forwards count are put back: the step's updates must
    see each token once."""
    controls = controls or TrainingControls(model)
    kept = controls.save_statistics()
    parser.collect()
    for k, batch in enumerate(window):
        controls.seed_boundaries(boundary_seed(seed, step, k * world_size + rank))
        model(prepare(batch, device, float_dtype))
    parser.settle()
    controls.restore_statistics(kept)


def train_step(
    engine,
    window: list[PackedBatch],
    step: int,
    *,
    seed: int,
    rank: int,
    world_size: int,
    parser: GlobalParser | None,
    device: torch.device,
    float_dtype: torch.dtype = torch.float32,
    loss_hook=None,
    bytes_per_id: torch.Tensor | None = None,
    sources: list[str] = (),
    controls: TrainingControls | None = None,
) -> StepRecord:
    """Forward/backward every micro-batch of `window` and take (or skip) one optimizer step; after
    an applied one the model's accumulated statistics move its balancing biases and top-k thresholds
    (`controls`: the model's training interface, built from `engine.module` when not given).

    Returns the step's record (`StepRecord`, numbered `step + 1`): the global means of what the step
    saw, or a skipped step's mark. `loss_hook(out, k)` may replace a micro-batch's output (used by
    tests to inject a non-finite loss). On the plain fp32 path the engine's optimizer must skip a
    non-finite step itself (engine.build_engine's does).
    """
    micro, ranks = len(window), world_size
    if micro != engine.gradient_accumulation_steps():
        raise ValueError(
            f"window of {micro} micro-batches but the engine "
            f"accumulates {engine.gradient_accumulation_steps()}"
        )
    controls = controls or TrainingControls(engine.module)
    controls.move_thresholds_per_step()
    n_local = [float(labelled_counts(b)[0]) for b in window]
    N = collectives.labelled_tokens(sum(n_local), device)
    if parser is not None:
        parser.start_step()
        if micro > 1:
            statistics_pass(
                engine.module,
                window,
                parser,
                step,
                seed=seed,
                rank=rank,
                world_size=ranks,
                device=device,
                float_dtype=float_dtype,
                controls=controls,
            )
    acc = StepAccumulator(device, bytes_per_id, len(sources))
    bad = False
    chunking = None
    for k, batch in enumerate(window):
        if not bad:
            batch = prepare(batch, device, float_dtype)
            controls.seed_boundaries(boundary_seed(seed, step, k * ranks + rank))
            out = engine(batch)
            if loss_hook is not None:
                out = loss_hook(out, k)
            bad = not collectives.all_finite(
                torch.isfinite(out.loss.detach().float()).all(), device
            )
            if not bad:
                w = n_local[k] * micro * ranks / max(N, 1.0)
                # the global parser's ratio loss is this micro-batch's share of the global one (the
                # engine averages the micro-batches and ranks); without it each micro-batch's own
                # loss is averaged
                share = micro * ranks if parser is not None else 1
                loss = out.total(lm_scale=w, ratio_scale=share)
                engine.backward(loss)
                acc.add(out, batch)
                if out.chunks is not None:
                    chunking = (out.chunks.p_BT.detach(), out.chunks.b_BT.detach(), batch.modality)
            del out
        if bad:
            poison_backward(engine)
        engine.step()
    applied = not bad and engine.was_step_applied()
    if not applied:
        controls.drop_statistics()
        return StepRecord(step + 1, False, chunking=chunking)
    controls.apply_statistics(collectives.model_statistics)
    record = acc.record(step + 1, collectives.step_metrics, groups=group_names(sources))
    record.chunking = chunking
    return record
