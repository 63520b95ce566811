"""Each rank builds only its share of the model, from construction on (issue 48 item 2).

The weights are those of a whole build with the same seed (the CPU generator's draws in construction
order, vlm.model.share_init), kept at the rank's share (vlm.model.shares):
- expert parallelism: every MoE layer allocates its E/P routed experts only and keeps its rows of
  each whole draw (drawn a chunk at a time);
- deepspeed.bf16: parameters are allocated in bf16 as they are registered and every draw is made in
  fp32 and cast, what the engine's cast of a whole fp32 build gives (DeepSpeed's bf16 optimizer and
  ZeRO 1/2 make their fp32 master copies of each partition from the bf16 weights themselves, so the
  fp32 whole copy is not needed); buffers stay fp32, as the engine leaves them;
- ZeRO-3: the LLM is constructed inside DeepSpeed's `zero.Init`, which partitions each module's
  parameters as soon as its __init__ returns; the model's own re-inits after that (its `_init` pass,
  a MoE layer's reset of its router, the dechunk's identity) write each rank's partition directly
  (share_init), without gathering. Construction stays on the CPU and its generator (no device or
  dtype override), so the draws are a whole build's on any accelerator.
The vision tower is small and replicated: it is built whole in fp32 after the LLM, as today (the
vision warm-up trains it before the engine casts or partitions it).

Transient peak per rank on top of its share (`build_bytes`): one chunk of draws (16 MiB) with
expert parallelism or bf16; under ZeRO-3 one module's own parameters, whole, between its
construction and its partition (the largest: a MoE layer's routed experts, 3 E D F, or the
embedding / head, V D), in the build's dtype. Growing a pretrained vocabulary holds the stored
embedding whole in fp32 once more, for the mean of its rows (convert.fit_vocab's rule).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from configs.config import ConfigError
from vlm.model.conceptmoe import ConceptMoELM
from vlm.model.config import ModelConfig
from vlm.model.multimodal import ConceptMoEVLM
from vlm.model.share_init import (
    CHUNK,
    assign_rows_,
    draw_normal_into,
    mark_partition,
    partitioned,
    whole_shape,
)
from vlm.model.shares import WHOLE, Sharding, building

# draws whose values a low-precision tensor gets from an fp32 draw cast (torch's normal_ on bf16
# draws other numbers and, for n not a multiple of 16, another count of them)
_FP32_DRAWS = {"normal_", "uniform_"}
_OTHER_DRAWS = {"bernoulli_", "exponential_", "random_", "cauchy_", "log_normal_", "geometric_"}


class _Fp32Draws(TorchDispatchMode):
    """Every in-place draw into a CPU tensor of another float dtype made in fp32 and cast, a chunk
    at a time (vlm.model.share_init): the values and the generator's advance of a whole fp32 build
    cast afterwards."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        t = args[0] if args else None
        low = (
            isinstance(t, torch.Tensor)
            and t.is_floating_point()
            and t.dtype != torch.float32
            and t.device.type == "cpu"
            and t.is_contiguous()
        )
        if low and name == "normal_":
            mean = kwargs.get("mean", args[1] if len(args) > 1 else 0.0)
            std = kwargs.get("std", args[2] if len(args) > 2 else 1.0)
            draw_normal_into(t.view(-1), t.numel(), mean, std, 0)
            return t
        if low and name == "uniform_":  # one draw per element: any chunks make the same values
            low_, high = (
                kwargs.get("from", args[1] if len(args) > 1 else 0.0),
                kwargs.get("to", args[2] if len(args) > 2 else 1.0),
            )
            flat = t.view(-1)
            for a in range(0, flat.numel(), CHUNK):
                piece = flat[a : a + CHUNK]
                piece.copy_(torch.empty(piece.numel()).uniform_(low_, high))
            return t
        if low and name in _OTHER_DRAWS:
            raise RuntimeError(
                f"build_share: a {name} draw into a {t.dtype} tensor has no fp32 rule"
            )
        return func(*args, **kwargs)


class _ConsumeDraws(TorchDispatchMode):
    """Draws into meta tensors made from torch's CPU generator and thrown away: the generator
    advances as the same ops on real fp32 tensors would advance it, nothing is held."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        t = args[0] if args else None
        if isinstance(t, torch.Tensor) and t.is_meta and name in _FP32_DRAWS | _OTHER_DRAWS:
            n = t.numel()
            if name == "normal_":
                mean = kwargs.get("mean", args[1] if len(args) > 1 else 0.0)
                std = kwargs.get("std", args[2] if len(args) > 2 else 1.0)
                draw_normal_into(torch.empty(0), n, mean, std, 0)
            elif name == "uniform_":  # one draw per element, whatever the chunks
                for a in range(0, n, CHUNK):
                    torch.empty(min(CHUNK, n - a)).uniform_()
            else:
                raise RuntimeError(f"build_share: no rule to advance the generator past {name}")
        return func(*args, **kwargs)


def consume_build(mc: ModelConfig, vision_cfg=None) -> None:
    """Advance torch's CPU generator as a whole build of ConceptMoEVLM(mc, vision_cfg) would,
    holding none of it (the LLM is built on the meta device; the small vision tower is built and
    dropped). For a path whose earlier code built a model only to copy tensors into another."""
    with torch.device("meta"), _ConsumeDraws():
        ConceptMoELM(mc)
    if vision_cfg is not None:
        vision_cfg.build(mc.hidden_size)


@contextlib.contextmanager
def params_in(dtype: torch.dtype):
    """Inside: every parameter a module registers is held in `dtype` (its placeholder from
    torch.empty is never written, so it costs no memory), and draws into it are fp32 draws cast."""
    if dtype == torch.float32:
        yield
        return

    def hook(module, name, param):
        if param is None or not param.is_floating_point() or param.dtype == dtype:
            return None  # None keeps the object registered (a tied weight stays tied)
        return nn.Parameter(param.data.to(dtype), requires_grad=param.requires_grad)

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(hook)
    try:
        with _Fp32Draws():
            yield
    finally:
        handle.remove()


@contextlib.contextmanager
def zero3_construction(sharding: Sharding, ds_json: dict | None):
    """Inside, with ZeRO-3: modules partition their parameters as their __init__ returns
    (deepspeed.zero.Init over the world, on the CPU, no dtype override; `Module.apply` not wrapped:
    the model's re-inits write the partitions themselves). Nothing without ZeRO-3."""
    if sharding.zero_stage != 3:
        yield
        return
    import deepspeed

    default = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
    cfg = copy.deepcopy(ds_json or default)
    cfg.setdefault("zero_optimization", {})["override_module_apply"] = False
    with deepspeed.zero.Init(config_dict_or_path=cfg, dtype=sharding.dtype, tensor_overrides=[]):
        yield


@contextlib.contextmanager
def transients_returned():
    """Inside (glibc): host allocations of 1 MiB and more are mapped on their own, so that a build's
    transients (whole tensors before their partition, chunks of draws, rows read) go back to the
    system when freed instead of staying in the heap between the shares kept (a ZeRO-3 build on 2
    ranks held 45 % more than its share so); after, glibc's own ceiling for its dynamic threshold
    (32 MiB: what a long-running process reaches anyway) and the heap trimmed."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator as it is
        yield
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mallopt(M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        mallopt(M_MMAP_THRESHOLD, 32 << 20)
        mallopt(M_TRIM_THRESHOLD, 64 << 20)
        trim(0)


def check_experts_divide(mc: ModelConfig, expert: int) -> None:
    """ConfigError (one line) where `parallel.expert` does not divide a MoE layer's experts."""
    if expert == 1:
        return
    for E in sorted({mc.moe.num_experts, mc.c_moe.num_experts}):
        if E % expert:
            raise ConfigError(
                f"parallel.expert={expert} does not divide a MoE layer's {E} experts "
                "(model.moe.num_experts / model.concept_moe.num_experts): use a divisor of it"
            )


def build_lm(mc: ModelConfig, sharding: Sharding = WHOLE, ds_json: dict | None = None):
    """The LLM at this rank's share of `sharding` (ds_json: the run's DeepSpeed JSON, for ZeRO-3's
    construction)."""
    check_experts_divide(mc, sharding.expert)
    with building(sharding), params_in(sharding.dtype), zero3_construction(sharding, ds_json):
        lm = ConceptMoELM(mc)
    for p in lm.parameters():  # for what writes its partition later (init_from, muP)
        if partitioned(p):
            mark_partition(p, sharding.world, sharding.rank)
    return lm


def build_vlm(
    mc: ModelConfig, vision_cfg=None, sharding: Sharding = WHOLE, ds_json: dict | None = None
) -> ConceptMoEVLM:
    """The VLM at this rank's share: the LLM (build_lm), then the vision tower whole in fp32."""
    return ConceptMoEVLM(mc, vision_cfg, lm=build_lm(mc, sharding, ds_json))


@torch.no_grad()
def prepare_for_engine(model: nn.Module, sharding: Sharding, device: torch.device) -> None:
    """What DeepSpeed's engine does to a model it did not see partitioned, for one built under
    ZeRO-3's construction (the engine then leaves it alone): the parameters it has not partitioned
    (the vision tower) cast to bf16 under deepspeed.bf16, and they and the buffers moved to the
    device."""
    if sharding.zero_stage != 3:
        return
    for p in model.parameters():
        if partitioned(p) or hasattr(p, "ds_id"):
            continue
        dtype = sharding.dtype if p.is_floating_point() else p.dtype
        p.data = p.data.to(device=device, dtype=dtype)
    for m in model.modules():
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = b.to(device)


def grow_vocab_(model: ConceptMoEVLM, vocab_size: int, sharding: Sharding = WHOLE) -> int:
    """The embedding (and an untied head) grown to `vocab_size` rows at this rank's share, their
    values not set (the caller loads the stored rows and fills the new ones: fill_grown_rows_);
    returns the rows added (0: it fits). Under ZeRO-3 the grown tensors are partitioned as
    DeepSpeed's engine converts a parameter (the whole tensor held once, transiently)."""
    lm = model.lm
    old = whole_shape(lm.embed.weight)[0]
    if vocab_size <= old:
        return 0

    def grown(p: torch.Tensor) -> nn.Parameter:
        shape = (vocab_size, *whole_shape(p)[1:])
        new = nn.Parameter(torch.empty(shape, dtype=p.dtype), requires_grad=p.requires_grad)
        if partitioned(p) or hasattr(p, "ds_id"):
            p.convert_to_zero_parameters([new])
            mark_partition(new, sharding.world, sharding.rank)
        return new

    with torch.no_grad():
        lm.embed.weight = grown(lm.embed.weight)
        lm.embed.num_embeddings = vocab_size
        lm.lm_head.weight = (
            lm.embed.weight if model.model_cfg.tie_embeddings else grown(lm.lm_head.weight)
        )
        lm.lm_head.out_features = vocab_size
    cfg = dataclasses.replace(model.model_cfg, vocab_size=vocab_size)
    model.model_cfg = lm.cfg = cfg
    return vocab_size - old


@torch.no_grad()
def fill_grown_rows_(
    model: ConceptMoEVLM, whole_of, old: int, sizes: list[int], sharding: Sharding = WHOLE
) -> None:
    """The rows past `old` of the embedding (and an untied head), grown through `sizes` in turn as
    vlm.model.convert.fit_vocab grows a whole model: each new row is the mean of the rows before it
    (`whole_of(name)`: the stored [old, D] tensor, read whole in fp32 for the mean; transient)."""
    names = ["lm.embed.weight"] + ([] if model.model_cfg.tie_embeddings else ["lm.lm_head.weight"])
    params = dict(model.named_parameters())
    for name in names:
        w = whole_of(name).float()
        for v in sizes:
            if v > w.shape[0]:
                w = torch.cat([w, w.mean(0, keepdim=True).expand(v - w.shape[0], -1)])
        assign_rows_(params[name], old, w[old:], sharding)


def build_bytes(mc: ModelConfig, sharding: Sharding = WHOLE) -> tuple[int, int]:
    """(bytes of LLM weights this rank of `sharding` keeps, bytes it holds transiently while it
    builds them), from the LLM built on the meta device (its real parameter names and shapes) and
    vlm.model.shares.share_of."""
    from vlm.model.share_init import CHUNK
    from vlm.model.shares import share_of

    with torch.device("meta"):
        lm = ConceptMoELM(mc)
    kept = sum(share_of(sharding, n, p.shape).numel for n, p in lm.named_parameters())
    if sharding.zero_stage == 3:  # one module whole between its __init__ and its partition
        transient = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in lm.modules())
    elif sharding.whole:
        transient = 0
    else:
        transient = CHUNK * 4 // sharding.bytes_per_param
    return kept * sharding.bytes_per_param, transient * sharding.bytes_per_param
