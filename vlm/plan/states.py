"""The model states one rank holds under DeepSpeed's ZeRO stages: weights, gradients, optimizer
state, and the engine's own buffers, from each parameter's share (vlm.plan.shares).

As DeepSpeed 0.19 allocates them (read in its source and checked against a CPU run's allocations,
tests/test_plan.py), with b the bytes of the training dtype (2 with `deepspeed.bf16`, else 4), L a
parameter's elements on this rank (its expert shard) and p = ceil(L / group) its ZeRO partition:

- stage 0, fp32 (the client AdamW): weights 4 L, gradients 4 L, moments 8 L; the all-reduce
  flattens the gradients into one buffer (at most 5e8 elements);
- stage 0, bf16 (FP16_Optimizer): weights 2 L and an fp32 master 4 L, gradients 2 L, moments 8 L;
  the step's fp32 gradients 4 L;
- stage 1 (DeepSpeedZeroOptimizer): weights b L (one flat buffer) and an fp32 master 4 p,
  gradients b L, moments 8 p; `reduce_bucket_size` elements of reduce bucket during the backward
  (two with `overlap_comm`); the step's fp32 gradient partition 4 p;
- stage 2: as stage 1, the gradients b p (the partition's buffer);
- stage 3 (DeepSpeedZeroOptimizer_Stage3): weights b p (b L for a parameter of at most 1e5
  elements: persistent) and an fp32 master 4 p, gradients b p, moments 8 p; a reduce bucket of
  `reduce_bucket_size` elements from the start; the gathered parameters during forward and
  backward, up to `stage3_max_live_parameters` (1e9) plus a `stage3_prefetch_bucket_size` (5e7).

Frozen parameters keep only their weights (b L; ZeRO-3 b p). The optimizer's moments are made at
the first step; gradients exist from the backward to the step (accumulated over micro-batches).
"""

from __future__ import annotations

from dataclasses import dataclass

from vlm.plan.shares import PERSISTENCE_THRESHOLD, Share

ALLREDUCE_BUFFER = 500_000_000  # deepspeed.runtime.engine.MEMORY_OPT_ALLREDUCE_SIZE (elements)
MAX_LIVE_PARAMETERS = 1_000_000_000  # stage3_max_live_parameters' default
PREFETCH_BUCKET = 50_000_000  # stage3_prefetch_bucket_size's default


@dataclass
class ModelStates:
    weights: int  # bytes, resident
    gradients: int  # from the backward to the step
    optimizer: int  # AdamW's moments (from the first step) and the fp32 master weights
    backward_buffers: (
        int  # the engine's buffers while the backward runs (reduce buckets, gathered params)
    )
    resident_buffers: int  # buffers the engine keeps from its start (ZeRO-3's reduce bucket)
    step_extra: int  # what the optimizer step adds for its duration
    reduce_extra: int  # what the gradients' reduction adds after the backward (stage 0)
    trainable: int  # elements this rank trains (its expert shards counted once)
    path: str  # the DeepSpeed optimizer this is


def model_states(
    shares: list[Share],
    zero_stage: int,
    bf16: bool,
    reduce_bucket_size: int,
    overlap_comm: bool,
    threshold: int = PERSISTENCE_THRESHOLD,
) -> ModelStates:
    b = 2 if bf16 else 4
    local_all = sum(s.local for s in shares)
    train = [s for s in shares if s.trainable]
    local_t = sum(s.local for s in train)
    # ZeRO partitions the optimizer state of every trainable parameter, persistent ones included
    opt_part = sum(-(-s.local // s.group) for s in train)
    bucket = reduce_bucket_size * b * (2 if overlap_comm else 1)
    if zero_stage == 0:
        if not bf16:
            return ModelStates(
                4 * local_all,
                4 * local_t,
                8 * local_t,
                0,
                0,
                0,
                4 * min(local_t, ALLREDUCE_BUFFER),
                local_t,
                "ZeRO 0, fp32: the client AdamW",
            )
        return ModelStates(
            2 * local_all + 4 * local_t,
            2 * local_t,
            8 * local_t,
            0,
            0,
            4 * local_t,
            0,
            local_t,
            "ZeRO 0, bf16: DeepSpeed's FP16_Optimizer (fp32 master weights)",
        )
    if zero_stage in (1, 2):
        grads = b * local_t if zero_stage == 1 else b * opt_part
        return ModelStates(
            b * local_all + 4 * opt_part,
            grads,
            8 * opt_part,
            bucket,
            0,
            4 * opt_part,
            0,
            local_t,
            f"ZeRO {zero_stage}: DeepSpeedZeroOptimizer",
        )
    persistent = sum(s.local for s in shares if s.local <= threshold)
    partitioned = sum(s.partition(3, threshold) for s in shares if s.local > threshold)
    gathered_from = sum(s.local for s in shares if s.local > threshold)
    gathered = b * (min(gathered_from, MAX_LIVE_PARAMETERS) + min(gathered_from, PREFETCH_BUCKET))
    return ModelStates(
        b * (partitioned + persistent) + 4 * opt_part,
        b * opt_part,
        8 * opt_part,
        gathered,
        reduce_bucket_size * b,
        4 * opt_part if bf16 else 0,
        0,
        local_t,
        "ZeRO 3: DeepSpeedZeroOptimizer_Stage3",
    )
