"""Sequence parallelism, the trainer's side (the model's: vlm.model.sequence_parallel).

`parallel.sequence: S` splits every row of a micro-batch over S consecutive ranks (the layout's
sequence group, vlm.train.layout). The S ranks read the same micro-batches; each forwards the whole
batch to the model, which computes its own tokens (and its share of the concept slots), and the loss
and metrics read this rank's part of the batch (`local_batch`). Every loss term is exact: the step
counts each rank's part of a row as one of `micro x world` parts of the global batch, and the terms
that are the row's on every rank (the MoE balance and z losses, the per-document ratio loss) carry
their gradient through this rank's tokens only (vlm.train.losses).

Refused, one line each (`check`): ZeRO-3 with sequence parallelism, the global parser switched off
(its ratio statistics would be a shard's), rows that S does not divide, and what the model cannot
split (`ConceptMoELM.shard_sequence`: the top-k router, the cross-attention decoder, grid-aware
boundaries, sliding-window attention, heads that S does not divide).

Checkpoints carry no sequence dimension: every rank of a group holds the same whole weights (ZeRO 1-2
partitions the optimizer over the world, as without sequence parallelism), so a run resumes on
another sequence degree.
"""

from __future__ import annotations

import dataclasses

from configs.batch import PackedBatch
from configs.config import ConfigError
from vlm.model.sequence_parallel import SequenceShard

# the PackedBatch fields laid out along the row ([B, T]); the images stay whole (the model encodes
# them on every rank of the group and keeps its tokens' vision features)
ROW_FIELDS = ("input_ids", "labels", "doc_ids", "position_ids", "modality", "kind", "source")


def check(cfg, layout) -> None:
    """ConfigError (one line) for a sequence-parallel run the trainer cannot run exactly."""
    S = layout.sequence
    if S == 1:
        return
    T = cfg.data.row_tokens
    if T % S:
        raise ConfigError(
            f"parallel.sequence={S} does not divide data.row_tokens={T}: use a row length that "
            "it divides"
        )
    if cfg.deepspeed.zero_stage == 3:
        raise ConfigError(
            f"parallel.sequence={S} with deepspeed.zero_stage=3 is not supported: use ZeRO 1 or 2"
        )
    if not cfg.train.global_parser:
        raise ConfigError(
            f"parallel.sequence={S} needs train.global_parser: true (the ratio loss's statistics "
            "are the global batch's, not one shard's)"
        )


def set_up(model, layout, groups) -> SequenceShard | None:
    """Split the model's rows over this rank's sequence group (None, nothing done, for S = 1).
    ConfigError (one line) for a model the split cannot compute exactly."""
    if layout.sequence == 1:
        return None
    from vlm.train.collectives import SequenceGroup

    comm = SequenceGroup(groups.sequence)
    shard = SequenceShard(comm, layout.sequence_rank, layout.sequence)
    lm = getattr(model, "lm", model)
    try:
        lm.shard_sequence(shard)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return shard


def local_batch(batch: PackedBatch, shard: SequenceShard | None) -> PackedBatch:
    """This rank's part of `batch`: its tokens of every row-laid field (what the loss and the
    metrics read); the images as they are."""
    if shard is None:
        return batch
    return dataclasses.replace(
        batch,
        **{f: shard.local(getattr(batch, f)) for f in ROW_FIELDS if getattr(batch, f) is not None},
    )
