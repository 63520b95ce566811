"""The concept model's per-request state, declared to vLLM as a Mamba-style state.

One request owns one slot for its whole life: the concept model's keys and values (one entry per
realized concept, each pass's cut into state layers of one page each: layout.py's `plan_state`) and
the chunk state (vlm/model/cache.py's `ChunkState`: the router's last key, the pending merge, the
dechunk's EMA, the counters; each field's place computed from the class: layout.py's `CHUNK`).
vLLM's hybrid KV cache manager allocates the slots beside the paged token-level KV cache and hands
each step every request's slot (`state_indices_tensor_*`), so what a request holds scales with its
concepts, not its tokens.

Only imported inside vLLM's processes (it imports vllm).
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from vlm.model.config import ModelConfig
from vlm.serve.layout import StatePlan, state_dtypes, state_shapes


def copy_funcs(mc: ModelConfig) -> tuple:
    """How vLLM copies a slot's states (prefix caching's "align" mode, speculative decoding):
    each whole. Neither is enabled for this model (model.py refuses both)."""
    return (get_temporal_copy_spec,) * len(state_shapes(mc, StatePlan(1, 1, 1)))


class ConceptState(MambaBase):
    """Holds no weights: it declares the state and receives vLLM's views of it
    (`kv_cache`). The SHORT_CONV backend builds the metadata this needs (slots,
    prefill/decode split, initial states)."""

    def __init__(self, mc: ModelConfig, plan: StatePlan, dtype: torch.dtype, prefix: str):
        super().__init__()
        self.mc, self.plan, self.dtype, self.prefix = mc, plan, dtype, prefix
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"Duplicate layer name: {prefix}")
        ctx[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    def get_state_shape(self):
        return state_shapes(self.mc, self.plan)

    def get_state_dtype(self):
        return state_dtypes(self.mc, self.dtype)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.SHORT_CONV
