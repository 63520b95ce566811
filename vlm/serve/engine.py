"""The engine arguments an export needs (`vlm serve`, the offline runner and the benchmark)."""

from __future__ import annotations

import json
from pathlib import Path

from vlm.model.config import model_config_from
from vlm.serve.layout import padded_head_size
from vlm.serve.names import BASELINE_ARCH


def engine_kwargs(
    final_dir: str | Path,
    max_model_len: int = 2048,
    max_num_seqs: int = 8,
    concept_capacity: int | None = None,
    cache_gib: float = 1.0,
    **extra,
) -> dict:
    """vLLM's `LLM(...)` / `AsyncEngineArgs` settings for an exported `final/`.

    float32 (the exports' dtype, as `vlm chat` runs them); eager (the plugin reads the batch's
    layout on the host between the stacks); no prefix caching (a prefix's concept state would have
    to be kept per block: docs/serving.md); the MoE baseline under its own architecture (a plain,
    non-hybrid model). `cache_gib`: the memory for the KV cache and the concept states (on CPU vLLM
    otherwise reserves 92 % of the machine's memory). `extra`: any other engine argument, as is."""
    final_dir = Path(final_dir)
    mc = model_config_from(json.loads((final_dir / "config.json").read_text())["model"])
    # the token layers' cache geometry as the paged layers hold it (token_attention.py), which
    # vLLM sizes its pages and the concept state's by (layout.py); it would guess hidden / heads
    # and every head a key-value head
    overrides: dict = {
        "head_dim": padded_head_size(mc.head_dim),
        "num_key_value_heads": mc.num_kv_heads,
    }
    if not mc.chunk.enabled:
        overrides["architectures"] = [BASELINE_ARCH]
    if concept_capacity:
        overrides["concept_capacity"] = int(concept_capacity)
    out = dict(
        model=str(final_dir),
        tokenizer=str(final_dir),
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        trust_remote_code=False,
        seed=0,
        kv_cache_memory_bytes=int(cache_gib * 2**30),
        gpu_memory_utilization=0.05,
    )
    out["hf_overrides"] = overrides
    return {**out, **extra}
