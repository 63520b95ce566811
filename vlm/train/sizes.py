"""Sizes that cannot be allocated are refused from the config, before anything is built or written.

Every rank builds the whole model in float32 before DeepSpeed shards anything, so 4 bytes a
parameter must fit in this machine's memory (physical RAM, or a smaller cgroup limit). The count is
exact for the LLM (vlm.model.flops.count_params, in Python integers:
`model.hidden_size=99999999999999999999` is a number, not an overflow) and a lower bound for the
vision tower, so the check never refuses a model that could be built. Without it such a config fails
inside torch with a traceback (or is killed by the OOM killer) after the run folder was made.
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


def check_buildable(cfg, limit: int | None = None) -> None:
    """ConfigError (one line) when the model of `cfg` (a TrainConfig) cannot be allocated on this machine."""
    if cfg.train.stage == "ct":  # the architecture comes from the checkpoint being converted
        return
    from vlm.model.flops import count_params

    n = int(count_params(cfg.model)["total"])
    if cfg.train.stage == "vl":
        n += vision_params_lower_bound(cfg.vision, cfg.model.hidden_size)
    need = n * BYTES_PER_PARAM
    limit = memory_limit_bytes() if limit is None else limit
    if limit is not None and need > limit:
        m = cfg.model
        raise ConfigError(
            f"model: {_num(n)} parameters need {_bytes(need)} to build in float32, more than "
            f"this machine's {_bytes(limit)} of memory (model.hidden_size={m.hidden_size}, "
            f"model.vocab_size={m.vocab_size}, model.moe.num_experts={m.moe.num_experts}, "
            f"model.moe.expert_hidden={m.moe.expert_hidden}); choose smaller sizes"
        )


def _num(n: int) -> str:
    return f"{n:,}" if n < 10**15 else f"{n:.3g}"


def _bytes(n: int) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.3g} {unit}" if n < 1e18 else f"{n:.3g} bytes"
    return f"{n} bytes"
