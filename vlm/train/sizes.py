"""Sizes that cannot be allocated are refused from the config, before anything is built or written.

Each rank builds only its share of the model (vlm.train.build_share): its expert shard, its ZeRO-3
partitions, in the training dtype, plus a transient (one module under ZeRO-3, a chunk of draws
otherwise), and the vision tower whole in fp32. What the ranks of this node build together must fit
in its memory (physical RAM, or a smaller cgroup limit). The share is counted from the LLM built on
the meta device with vlm.model.shares' rules (exact); the vision tower's from a lower bound, so the
check never refuses a model that could be built. A model too large to describe at all (the whole
count, vlm.model.flops.count_params, in Python integers: `model.hidden_size=99999999999999999999` is
a number, not an overflow) is refused from that count. Without the check such a config fails inside
torch with a traceback (or is killed by the OOM killer) after the run folder was made.
"""

from __future__ import annotations

import os
from pathlib import Path

from configs.config import ConfigError

BYTES_PER_PARAM = 4  # float32, as built


def memory_limit_bytes() -> int | None:
    """Physical memory, or the cgroup's limit when it is smaller (None when neither can be read)."""
    try:
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        limit = None
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(f).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = int(text) if limit is None else min(limit, int(text))
    return limit


def vision_params_lower_bound(vision, llm_hidden: int) -> int:
    """Parameters the vision tower has at least (NaViT: attention and MLP weights, patch embedding,
    the projection into the LLM); 0 for a timm backbone, whose size the config does not state."""
    if vision is None or vision.backbone != "navit":
        return 0
    enc, p, m = vision.encoder, vision.processor.patch_size, vision.processor.merge
    h = enc.hidden_size
    mlp = enc.mlp_width
    out_dim = enc.out_dim or h * m * m
    return enc.num_layers * (4 * h * h + 2 * h * mlp) + 3 * p * p * h + out_dim * llm_hidden


def launch_env() -> tuple[int, int, int]:
    """(ranks in the job, this rank, ranks on this node) as the launcher states them (1, 0, 1
    without one)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    rank = int(os.environ.get("RANK", "0") or 0)
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or "1"
    return world, rank, int(local) if local.isdigit() else 1


def rank_share_bytes(cfg, world: int, rank: int) -> tuple[int, str]:
    """Bytes one rank of `world` holds at the peak of building the model of `cfg` (a TrainConfig):
    its share of the LLM and the transient (build_share.build_bytes), the vision tower whole in
    fp32 (a lower bound); and the dtype its LLM is built in."""
    from vlm.model.shares import Sharding
    from vlm.train.build_share import build_bytes
    from vlm.train.engine import deepspeed_config, effective_settings
    from vlm.train.layout import ParallelLayout

    layout = ParallelLayout.of(cfg.parallel, world, rank)
    ds = effective_settings(cfg.deepspeed, deepspeed_config(cfg.deepspeed, cfg.optim, layout.data))
    sharding = Sharding.of(layout, ds.zero_stage, ds.bf16)
    kept, transient = build_bytes(cfg.model, sharding)
    vision = (
        vision_params_lower_bound(cfg.vision, cfg.model.hidden_size)
        if cfg.train.stage == "vl"
        else 0
    )
    return kept + transient + vision * BYTES_PER_PARAM, str(sharding.dtype).removeprefix("torch.")


def check_buildable(cfg, limit: int | None = None, env: tuple[int, int, int] | None = None) -> None:
    """ConfigError (one line) when the ranks of this node cannot build their shares of the model of
    `cfg` (a TrainConfig) in this machine's memory (`limit`; `env`: launch_env())."""
    if cfg.train.stage == "ct":  # the architecture comes from the checkpoint being converted
        return
    from vlm.model.flops import count_params

    limit = memory_limit_bytes() if limit is None else limit
    if limit is None:
        return
    world, rank, local = launch_env() if env is None else env
    n = int(count_params(cfg.model)["total"])
    if cfg.train.stage == "vl":
        n += vision_params_lower_bound(cfg.vision, cfg.model.hidden_size)
    whole = n * BYTES_PER_PARAM
    if whole <= limit // max(local, 1):  # every rank could build the whole model in fp32
        return
    try:
        need, dtype = rank_share_bytes(cfg, world, rank)
    except (RuntimeError, OverflowError, ValueError, TypeError, MemoryError):
        need, dtype = whole, "float32"  # too large to build even on the meta device
    if need * local > limit:
        m = cfg.model
        share = "the whole model" if need >= whole else "this rank's share"
        on = f" x {local} ranks on this node" if local > 1 else ""
        raise ConfigError(
            f"model: {_num(n)} parameters need {_bytes(need * local)} to build in {dtype}, more "
            f"than this machine's {_bytes(limit)} of memory ({share}: {_bytes(need)}{on}; "
            f"model.hidden_size={m.hidden_size}, model.vocab_size={m.vocab_size}, "
            f"model.moe.num_experts={m.moe.num_experts}, model.moe.expert_hidden="
            f"{m.moe.expert_hidden}); choose smaller sizes, or share the model over more ranks "
            "(deepspeed.zero_stage 3, parallel.expert)"
        )


def _num(n: int) -> str:
    return f"{n:,}" if n < 10**15 else f"{n:.3g}"


def _bytes(n: int) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.3g} {unit}" if n < 1e18 else f"{n:.3g} bytes"
    return f"{n} bytes"
