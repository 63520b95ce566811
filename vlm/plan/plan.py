"""What one rank of a run needs, from its config and number of ranks: `make_plan`.

The model is built on the meta device (no weights, no data, no accelerator) with the run's layout
(vlm.train.layout), each parameter's share as the trainer keeps it (vlm.plan.shares), DeepSpeed's
model states for the ZeRO stage (vlm.plan.states), one micro-batch's activations measured by
running the model's code at the run's sizes (vlm.plan.activations), the communication of a step
and the checkpoint a rank writes. A layout the trainer refuses (a sequence split the model cannot
compute exactly, a degree that does not divide) is the trainer's one line; `needs` lists what a
layout would need that the trainer does not do (nothing today).

The peak is the largest of three moments of a step: the backward's peak (model states, the
forward's and backward's activations at their most with the loss's tile, the engine's backward
buffers, and the gradients: under ZeRO 0-1 those the backward has made so far, counted with the
activations, or all of them when a step accumulates micro-batches; under ZeRO 2-3 their
partitioned buffer; with one micro-batch ZeRO 1-2 allocate their reduce bucket and ZeRO-2 its
gradient partition during the backward, and they are met where they appear, not at the loss's
peak before them), the end of the backward
(the gradients whole, and stage 0's all-reduce buffer) and the optimizer step (its fp32 gradient
partition). On the CPU, where the host is the device, also the model's build: each rank builds
its share of the LLM (vlm.train.build_share) and the vision tower whole.

Fitting on a GPU of G GiB: the peak plus 10 % (the caching allocator's fragmentation: blocks
freed but not reusable for a larger request) must stay within G minus 3 GiB (the CUDA context,
NCCL's and cuBLAS's workspaces). GiB throughout: the "gb" of the JSON keys are 2^30 bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from configs.config import ConfigError
from vlm.plan.activations import measure_llm, measure_vision
from vlm.plan.config import load_plan_config
from vlm.plan.shares import rank_shares
from vlm.plan.states import model_states

GiB = 2**30
RESERVED_GIB = 3.0  # CUDA context, NCCL and cuBLAS workspaces
FRAGMENTATION = 0.10  # the caching allocator's share of the peak it cannot reuse
VARIABLE_EXCHANGE_FACTOR = 1.25  # issue 50's bound on the rows a dropless exchange moves


@dataclass
class Plan:
    config: str
    layout: dict
    device: str
    micro_batches: int  # per rank per optimizer step
    tokens: int  # per rank per micro-batch
    parameters: dict  # counts
    memory: dict  # bytes per rank, by what holds them
    peak: int
    moments: dict  # bytes at the three moments (and the CPU's build)
    activations: dict
    communication: dict  # bytes per rank per optimizer step
    checkpoint: dict  # bytes per rank
    needs: list[str]
    notes: list[str] = field(default_factory=list)
    gpu_memory_gb: float | None = None

    @property
    def per_rank_gb(self) -> float:
        return self.peak / GiB

    @property
    def fits(self) -> bool | None:
        if self.gpu_memory_gb is None:
            return None
        return self.per_rank_gb * (1 + FRAGMENTATION) <= self.gpu_memory_gb - self.reserved_gb

    @property
    def reserved_gb(self) -> float:
        return RESERVED_GIB if self.device == "cuda" else 0.0

    def as_dict(self) -> dict:
        return {
            "config": self.config,
            "per_rank_gb": round(self.per_rank_gb, 3),
            "fits": self.fits,
            "gpu_memory_gb": self.gpu_memory_gb,
            "headroom": {
                "reserved_gb": self.reserved_gb,
                "fragmentation": FRAGMENTATION,
                "rule": "per_rank_gb x (1 + fragmentation) <= gpu_memory_gb - reserved_gb",
            },
            "device": self.device,
            "layout": self.layout,
            "micro_batches_per_step": self.micro_batches,
            "tokens_per_micro_batch": self.tokens,
            "parameters": self.parameters,
            "memory_bytes": self.memory,
            "peak_bytes": self.peak,
            "moments_bytes": self.moments,
            "activations": self.activations,
            "communication_bytes_per_step": self.communication,
            "checkpoint_bytes": self.checkpoint,
            "needs": self.needs,
            "notes": self.notes,
        }


def _frozen_prefixes(cfg, vision_built: bool) -> list[str]:
    """Module prefixes whose parameters do not train, as the run freezes them: params.freeze, and
    a fresh tower that the vision warm-up freezes after it (vision_warmup.freeze_after)."""
    out = list(cfg.params.freeze)
    w = cfg.vision_warmup
    pretrained = cfg.vision is not None and bool(
        cfg.vision.timm_checkpoint
    )  # stages.pretrained_tower
    if vision_built and w.steps and w.freeze_after and not pretrained:
        out.append("vision.encoder")
    return out


def _build_meta(model_cfg, vision_cfg):
    """The VLM on the meta device (parameters with shapes, no memory). A timm checkpoint is not
    read (its architecture, where its config states it, is in the vision config already)."""
    from dataclasses import replace

    from vlm.model.multimodal import ConceptMoEVLM

    if vision_cfg is not None and vision_cfg.timm_checkpoint:
        vision_cfg = replace(vision_cfg, timm_checkpoint=None)
    with torch.device("meta"):
        return ConceptMoEVLM(model_cfg, vision_cfg)


def make_plan(
    config: str,
    ranks: int,
    overrides: list[str] = (),
    gpu_memory_gb: float | None = None,
    device: str = "cuda",
    image_share: float | None = None,
) -> Plan:
    """The plan of `config` (with `overrides`) on `ranks` ranks of `device` ("cuda" or "cpu").
    `image_share`: the share of a row's tokens that are image tokens in the worst micro-batch
    (None: all of them where the run has a vision tower). ConfigError: one line."""
    from vlm.train.param_groups import freeze_prefixes
    from vlm.train.run_config import with_global_batch

    pc = load_plan_config(config, list(overrides), ranks)
    cfg, mc, layout = pc.cfg, pc.model, pc.layout
    S, P = layout.sequence, layout.expert
    if cfg.data.row_tokens % S:
        raise ConfigError(
            f"data.row_tokens={cfg.data.row_tokens} does not split over parallel.sequence={S} "
            "ranks: use a multiple of it"
        )
    cfg = with_global_batch(cfg, layout.data, None)
    vision_cfg = cfg.vision if cfg.train.stage in ("vl", "ct") else None
    vlm = _build_meta(mc, vision_cfg)
    frozen = _frozen_prefixes(cfg, vlm.vision is not None)
    if frozen:
        try:
            freeze_prefixes(vlm, frozen)
        except ConfigError:
            pass  # a prefix of a part this model lacks: the trainer says so when it starts
    shares = rank_shares(vlm, layout)
    ds = cfg.deepspeed
    states = model_states(shares, ds.zero_stage, ds.bf16, ds.reduce_bucket_size, ds.overlap_comm)
    dtype = torch.bfloat16 if ds.bf16 else torch.float32
    needs, notes = [], list(pc.notes)
    if S > 1:
        _check_sequence_split(cfg, layout, vlm)
    factor = cfg.parallel.capacity_factor
    variable = P > 1 and cfg.parallel.exchange == "variable"
    variable_dropless = variable and factor is None
    # the rows an exchange moves: the variable dropless one at its bound for a balanced router
    moved_factor = VARIABLE_EXCHANGE_FACTOR if variable_dropless else factor
    if variable_dropless:
        notes.append(
            f"parallel.expert={P} dropless, variable exchange: planned at "
            f"{VARIABLE_EXCHANGE_FACTOR} x the balanced routed rows (a skewed router moves more)"
        )
    elif variable:
        notes.append(
            f"parallel.expert={P}, variable exchange at parallel.capacity_factor={factor}: planned "
            "at the capacity's bound (every peer fills its block for this rank's experts)"
        )
    row = cfg.data.row_tokens // S
    micro = cfg.optim.grad_accum
    # ZeRO 0-1 keep the gradients in the parameters from the backward to the step: the backward's
    # peak meets those made so far (with accumulation all of them, the last micro-batch's included)
    in_params = ds.zero_stage <= 1
    # ZeRO 1-2 allocate their reduce bucket with a step's first gradient and ZeRO-2 its gradient
    # partition at the bucket's first reduction (once its reduce_bucket_size elements are full),
    # and hold them to the step: with one micro-batch the backward's peak at the loss precedes
    # them, and the meta run meets them where the backward's gradients reach them
    during_backward = ds.zero_stage in (1, 2) and micro == 1
    gradient_buffers = []
    if during_backward:
        gradient_buffers.append((0, states.backward_buffers))
        if ds.zero_stage == 2:
            gradient_buffers.append((ds.reduce_bucket_size, states.gradients))
    act = measure_llm(
        mc,
        rows=cfg.data.rows_per_batch,
        row_tokens=row,
        dtype=dtype,
        expert=P,
        capacity_factor=factor,
        variable=variable,
        received=VARIABLE_EXCHANGE_FACTOR if variable_dropless else None,
        sequence=S,
        device=device,
        frozen=[f for f in frozen if f.startswith("lm")],
        tile_tokens=getattr(mc, "loss_tile_tokens", 0),
        keep_gradients=in_params and micro == 1,
        gradient_buffers=gradient_buffers,
    )
    notes += act.notes
    static = None
    if variable_dropless:
        static = measure_llm(
            mc,
            rows=cfg.data.rows_per_batch,
            row_tokens=row,
            dtype=dtype,
            expert=P,
            capacity_factor=None,
            sequence=S,
            device=device,
            frozen=[f for f in frozen if f.startswith("lm")],
            tile_tokens=getattr(mc, "loss_tile_tokens", 0),
            keep_gradients=in_params and micro == 1,
        )
        notes.append(
            f"the static dropless exchange (parallel.exchange: static; buffers of all {P} x the rank's slots) would "
            f"need {static.peak / GiB:.1f} GiB of activations instead of {act.peak / GiB:.1f}"
        )
    vision = _vision(vlm, vision_cfg, mc, dtype, frozen, act.tokens, image_share, device)
    row_buffers = _sequence_row_buffers(mc, cfg.data.rows_per_batch, cfg.data.row_tokens, S, dtype)
    # the gradients the backward's peak meets besides those it makes (measured with it for ZeRO 0-1
    # and one micro-batch): the earlier micro-batches' whole, or ZeRO 2-3's partition buffer; and
    # the engine's backward buffers (ZeRO 1-2 with one micro-batch: met where they appear)
    accumulated = states.gradients if micro > 1 or not in_params else 0
    engine_and_activations = act.peak + states.backward_buffers + accumulated
    if during_backward:
        engine_and_activations = act.peak_with_gradient_buffers
    backward_start = (
        states.weights
        + states.optimizer
        + states.resident_buffers
        + row_buffers
        + vision["bytes"]
        + engine_and_activations
    )
    after = states.weights + states.optimizer + states.resident_buffers + states.gradients
    moments = {
        "backward": backward_start,
        "reduction": after + states.reduce_extra,
        "step": after + states.step_extra,
    }
    # each rank builds its share of the LLM (vlm.train.build_share), plus a transient (a chunk of
    # draws, or under ZeRO-3 one module whole before zero.Init partitions it); the tower whole, fp32
    from vlm.model.shares import Sharding
    from vlm.train.build_share import build_bytes

    kept, transient = build_bytes(mc, Sharding.of(layout, ds.zero_stage, ds.bf16))
    tower = vlm.vision.parameters() if vlm.vision is not None else ()
    build = kept + transient + 4 * sum(p.numel() for p in tower)
    if device == "cpu":
        moments["build"] = build
    peak = max(moments.values())
    memory = {
        "weights": states.weights,
        "gradients": states.gradients,
        "optimizer": states.optimizer,
        "activations": act.peak,
        "sequence_row_buffers": row_buffers,
        "vision": vision["bytes"],
        "engine_buffers": states.backward_buffers + states.resident_buffers,
        "host_build": build,
    }
    plan = Plan(
        config=str(config),
        layout={**layout.as_dict(), "zero_stage": ds.zero_stage, "bf16": ds.bf16},
        device=device,
        micro_batches=micro,
        tokens=act.tokens,
        parameters=_parameters(shares, vlm),
        memory=memory,
        peak=peak,
        moments=moments,
        activations=_activations(act, mc, vision, static, cfg),
        communication=_communication(shares, act, mc, layout, ds, micro, dtype, moved_factor),
        checkpoint=_checkpoint(shares, ds.zero_stage, ds.bf16, layout),
        needs=needs,
        notes=notes + [states.path],
        gpu_memory_gb=gpu_memory_gb,
    )
    return plan


def _sequence_row_buffers(mc, rows: int, T: int, S: int, dtype) -> int:
    """What a rank of a sequence split holds of the whole row, beyond its T / S tokens'
    activations (transient, all at once at worst; docs/training.md, "Sequence parallelism"): the
    row's embeddings before it keeps its part, the row's index tensors (document ids, positions,
    the boundary mask, the concept layout: about five int64 a token) and the concept slots'
    whole-row buffers (the reduce-scatter's input, its reduced copy, the all-gathered smoothed
    concepts: M x D each)."""
    if S == 1:
        return 0
    from vlm.model.chunking import concept_capacity

    e = dtype.itemsize
    per_row = T * mc.hidden_size * e + 5 * 8 * T
    if mc.chunk.enabled:
        M = concept_capacity(T, mc.chunk.capacity_slack, mc.chunk.smallest_target)
        per_row += 3 * M * mc.c_hidden * e
    return rows * per_row


def _check_sequence_split(cfg, layout, vlm) -> None:
    """ConfigError (the trainer's one line) where the trainer would refuse to split the rows over
    parallel.sequence ranks (vlm.train.sequence_shard, ConceptMoELM.shard_sequence)."""
    from vlm.model.sequence_parallel import SequenceShard
    from vlm.train import sequence_shard

    sequence_shard.check(cfg, layout)
    try:
        vlm.lm.shard_sequence(SequenceShard(None, 0, layout.sequence))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    finally:
        vlm.lm.shard_sequence(None)


def _vision(vlm, vision_cfg, mc, dtype, frozen, tokens, image_share, device) -> dict:
    if vlm.vision is None:
        return {"bytes": 0, "images": 0}
    share = 1.0 if image_share is None else image_share
    v = measure_vision(vision_cfg, mc.hidden_size, dtype, frozen, device)
    images = math.ceil(share * tokens / v.tokens) if share else 0
    return {
        "bytes": images * v.per_image,
        "images": images,
        "per_image": v.per_image,
        "patches_per_image": v.patches,
        "image_share": share,
        "source": "measured on the CPU at the config's sizes, one and two images of max_patches",
    }


def _parameters(shares, vlm) -> dict:
    return {
        "total": sum(s.numel for s in shares),
        "experts": sum(s.numel for s in shares if s.expert),
        "this_rank": sum(s.local for s in shares),
        "trainable_this_rank": sum(s.local for s in shares if s.trainable),
        "vision": sum(p.numel() for p in vlm.vision.parameters()) if vlm.vision is not None else 0,
    }


def _activations(act, mc, vision, static, cfg) -> dict:
    per_token = {k: round(v / act.tokens, 1) for k, v in act.held.items()}
    return {
        "rows": act.rows,
        "row_tokens_per_rank": act.row_tokens,
        "checkpointing": mc.activation_checkpoint,
        "peak": act.peak,
        "held_by_part": act.held,
        "bytes_per_token_by_part": per_token,
        "loss_tile_tokens": act.loss_tile_tokens,
        "loss_untiled_bytes": act.loss_untiled,
        "static_exchange_peak": None if static is None else static.peak,
        "vision": vision,
        "source": (
            "the model's forward and backward run on the meta device at the run's sizes, every "
            "allocation counted (vlm.plan.activations); attention as flash attention keeps memory"
        ),
    }


def _ring(kind: str, payload: float, n: int) -> float:
    """Bytes one rank sends in a ring collective of `payload` bytes over `n` ranks."""
    if n <= 1:
        return 0.0
    return payload * (2 if kind == "all_reduce" else 1) * (n - 1) / n


def _communication(shares, act, mc, layout, ds, micro, dtype, factor) -> dict:
    """Bytes this rank sends per optimizer step, by collective (ring algorithms: an all-reduce
    sends 2 (n - 1) / n of its payload, a reduce-scatter or an all-gather (n - 1) / n)."""
    from vlm.model.chunking import concept_capacity
    from vlm.model.expert_parallel import capacity

    b = 2 if ds.bf16 else 4
    W, R = layout.world, layout.expert_replicas
    out = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0, "all_to_all": 0.0}
    z = ds.zero_stage
    for n, expert in ((W, False), (R, True)):
        grads = sum(s.local for s in shares if s.trainable and s.expert == expert)
        weights = sum(s.local for s in shares if s.expert == expert)
        if z == 0:
            out["all_reduce"] += _ring("all_reduce", b * grads, n)
        elif z in (1, 2):
            times = micro if z == 2 else 1  # ZeRO-2 reduces each micro-batch's gradients
            out["reduce_scatter"] += times * _ring("reduce_scatter", b * grads, n)
            out["all_gather"] += _ring("all_gather", b * grads, n)
        else:  # gathered for the forward and again for the backward, every micro-batch
            out["all_gather"] += micro * 2 * _ring("all_gather", b * weights, n)
            out["reduce_scatter"] += micro * _ring("reduce_scatter", b * grads, n)
    e = dtype.itemsize
    T = act.row_tokens
    M = T
    if mc.chunk.enabled:
        M = concept_capacity(T, mc.chunk.capacity_slack, mc.chunk.smallest_target)
    stacks = (
        (act.rows * T, mc.moe.top_k, mc.hidden_size, mc.encoder_layers + mc.decoder_layers),
        (act.rows * M, mc.c_moe.top_k, mc.c_hidden, len(mc.concept_schedule)),
    )
    if layout.expert > 1:
        P = layout.expert
        for n, k, d, passes in stacks:
            rows = P * capacity(n * k, P, factor)
            # forward: the rows out and their results back; the backward the same
            out["all_to_all"] += micro * passes * 4 * rows * d * e * (P - 1) / P
    if layout.sequence > 1:
        S = layout.sequence
        heads = (
            (2 * mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim,
            (2 * mc.c_heads + 2 * mc.c_kv_heads) * mc.head_dim,
        )
        # Ulysses: q, k, v in and the output back around every attention, forward and backward
        out["sequence_all_to_all"] = sum(
            micro * passes * 2 * n * h * e * (S - 1) / S
            for (n, _, _, passes), h in zip(stacks, heads)
        )
    return {k: int(v) for k, v in out.items()}


def _checkpoint(shares, zero_stage: int, bf16: bool, layout) -> dict:
    """Bytes rank 0 writes into one checkpoint (the largest share): the module's weights where the
    engine keeps them whole, its partition of the optimizer state (fp32 master and the two moments),
    and its expert shard."""
    b = 2 if bf16 else 4
    whole = sum(s.local for s in shares if not s.expert)
    experts = sum(s.local for s in shares if s.expert)
    train = [s for s in shares if s.trainable]
    part = sum(-(-s.local // s.group) for s in train)
    if zero_stage == 0:
        optim = (12 if bf16 else 8) * sum(s.local for s in train)
        weights = b * (whole + experts)
    elif zero_stage in (1, 2):
        optim = 12 * part
        weights = b * (whole + experts)
    else:  # the rank's partition, and the 16-bit weights gathered into rank 0's model file
        optim = 12 * part + b * part
        weights = b * sum(s.numel for s in shares)
    return {
        "rank0": weights + optim,
        "weights": weights,
        "optimizer": optim,
        "experts": b * experts,
    }
