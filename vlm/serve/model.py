"""The project's model as a vLLM model: token-level layers on vLLM's paged attention, the concept
model on a per-request concept-only state (state.py, middle.py).

Legend: B rows, D width, N flat tokens or patches, I images.

`ConceptMoEForVllm` serves a ConceptMoE export (`IsHybrid`: vLLM's hybrid KV cache manager
keeps the paged token cache and the concept state side by side); `MoEBaselineForVllm` serves
the plain MoE baseline (`model.chunk.enabled: false`), whose concept layers run on every token
and so are token layers on the paged cache. `vlm.serve.engine.engine_kwargs` picks the class
from the export's config.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsMultiModal
from vllm.multimodal import MULTIMODAL_REGISTRY

from configs.config import ConfigError
from data_pipelines.schema import IMAGE_TOKEN
from vlm.model.layers import rope_cos_sin
from vlm.model.multimodal import ConceptMoEVLM
from vlm.serve.layout import (
    ConceptStates,
    StatePlan,
    concept_capacity,
    plan_state,
    state_dtypes,
    state_shapes,
    token_page_bytes,
)
from vlm.serve.middle import Middle
from vlm.serve.processor import (
    ConceptMoEDummyInputsBuilder,
    ConceptMoEMultiModalProcessor,
    ConceptMoEProcessingInfo,
)
from vlm.serve.state import ConceptState, copy_funcs
from vlm.serve.token_attention import PagedBlock

# under vLLM's logger: its handler, format and level (INFO) apply
log = logging.getLogger("vllm." + __name__)

# vLLM reads a layer's index from its name (one integer, unique): encoder, then the concept state
# layers (or the baseline's concept passes), then decoder
STATE_PREFIX = "serve.layers.{}.concept_state"


def _configs(vllm_config: VllmConfig):
    return vllm_config.model_config.hf_config.build_configs()


def _plan(vllm_config: VllmConfig) -> StatePlan:
    """The concept state's layout: the capacity asked for (`--concept-capacity`, else the model's
    eval rule) cut to the token cache's page (vLLM's block size, the same in every process that
    asks)."""
    mc, _ = _configs(vllm_config)
    hf, model = vllm_config.model_config.hf_config, vllm_config.model_config
    capacity = concept_capacity(mc, model.max_model_len, getattr(hf, "concept_capacity", None))
    block = vllm_config.cache_config.block_size
    page = token_page_bytes(mc, block, model.dtype) if block else None
    return plan_state(mc, capacity, model.dtype, page, mc.encoder_layers + mc.decoder_layers)


_register_processor = MULTIMODAL_REGISTRY.register_processor(
    ConceptMoEMultiModalProcessor,
    info=ConceptMoEProcessingInfo,
    dummy_inputs=ConceptMoEDummyInputsBuilder,
)


class _ServedModel(nn.Module, SupportsMultiModal):
    """What both classes share: the project's model (its weights under their checkpoint names,
    `vlm.…`), the paged encoder and decoder blocks, images, logits and weight loading."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        mc, vc = _configs(vllm_config)
        unsupported = [
            name
            for name, on in (
                ("decoder_mode: cross_attention", mc.decoder_mode != "joint"),
                ("chunk.grid_aware_boundaries", mc.chunk.grid_aware_boundaries),
            )
            if on
        ]
        if unsupported:
            raise ConfigError(
                f"vLLM serving does not support {', '.join(unsupported)} yet (docs/serving.md)"
            )
        self.mc = mc
        self.vlm = ConceptMoEVLM(mc, vc).eval()
        lm, cache = self.vlm.lm, vllm_config.cache_config
        w = mc.attention_window
        # the ConceptMoE's state layers, or the baseline's concept passes (paged token layers)
        C = _plan(vllm_config).layers if lm.chunker is not None else len(mc.concept_schedule)
        E = len(lm.encoder)
        self.paged_encoder = nn.ModuleList(
            PagedBlock(b, cache, w, f"serve.layers.{i}.attn") for i, b in enumerate(lm.encoder)
        )
        self.paged_decoder = nn.ModuleList(
            PagedBlock(b, cache, w, f"serve.layers.{E + C + i}.attn")
            for i, b in enumerate(lm.decoder)
        )

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality.startswith("image"):
            return IMAGE_TOKEN
        raise ValueError(f"only images are supported, not {modality}")

    def embed_multimodal(self, **kwargs):
        """Each image's vision tokens ([tokens of image i, D]), as
        `ConceptMoEVLM.embed` makes them."""
        grids = kwargs.get("image_grids")
        if grids is None or self.vlm.vision is None:
            return []
        cat = lambda t: torch.cat(list(t)) if isinstance(t, (list, tuple)) else t  # noqa: E731
        if isinstance(grids, (list, tuple)):
            grids = [g.reshape(-1, 2) for g in grids]
        grids_I2 = cat(grids).long()
        patches, coords = cat(kwargs["pixel_patches"]), cat(kwargs["patch_coords"]).long()
        dtype = self.vlm.lm.embed.weight.dtype
        feats_ND = self.vlm.vision(patches.to(dtype), coords, grids_I2)
        merge = self.vlm.vision.merge
        sizes = ((grids_I2[:, 0] // merge) * (grids_I2[:, 1] // merge)).tolist()
        return tuple(feats_ND.split(sizes))

    def embed_input_ids(
        self, input_ids: torch.Tensor, multimodal_embeddings=None, *, is_multimodal=None, **kwargs
    ) -> torch.Tensor:
        x_ND = self.vlm.lm.embed(input_ids)
        if multimodal_embeddings is None or len(multimodal_embeddings) == 0:
            return x_ND
        from vllm.model_executor.models.utils import _merge_multimodal_embeddings

        return _merge_multimodal_embeddings(
            inputs_embeds=x_ND,
            multimodal_embeddings=multimodal_embeddings,
            is_multimodal=is_multimodal,
        )

    def rope(self, positions_N: torch.Tensor, dtype):
        return rope_cos_sin(positions_N[None], self.mc.head_dim, self.mc.rope_theta, dtype)

    def forward(
        self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs
    ):
        x_ND = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        rope = self.rope(positions, x_ND.dtype)
        for blk in self.paged_encoder:
            x_ND = blk(x_ND, rope)
        z_ND, c_ND = self.middle(x_ND, positions, rope)
        lm = self.vlm.lm
        for i, blk in enumerate(self.paged_decoder):
            z_ND = blk(z_ND, rope, c_ND if i >= lm.joint_from else None)
        return z_ND

    def middle(self, h_ND, positions_N, rope) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        lm = self.vlm.lm
        return lm.lm_head(lm.norm(hidden_states))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The export's tensors by their names (`vlm.…`, as `ConceptMoEForCausalLM` saves them),
        through `load_state_dict`, so that the model's renames of older names apply; every tensor
        must come."""
        sd = {name[len("vlm.") :]: w for name, w in weights if name.startswith("vlm.")}
        missing, _ = self.vlm.load_state_dict(sd, strict=False)
        tied = {"lm.lm_head.weight"} if self.mc.tie_embeddings else set()
        persistent = {n for n, _ in self.vlm.named_parameters()} | set(self.vlm.state_dict())
        missing = sorted((set(missing) & persistent) - tied)
        if missing:
            raise ValueError(f"the export lacks {len(missing)} tensors, e.g. {missing[:3]}")
        return {name for name, _ in self.named_parameters()}


@_register_processor
class MoEBaselineForVllm(_ServedModel):
    """The MoE baseline: every layer is a token layer on the paged cache."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        lm, cache = self.vlm.lm, vllm_config.cache_config
        if lm.chunker is not None:
            raise ConfigError("this export has chunking: serve it as ConceptMoEForCausalLM")
        E = len(lm.encoder)
        self.paged_concept = nn.ModuleList(
            PagedBlock(lm.concept[i], cache, 0, f"serve.layers.{E + n}.attn")
            for n, i in enumerate(self.mc.concept_schedule)
        )

    def middle(self, h_ND, positions_N, rope):
        lm = self.vlm.lm
        c_ND = lm.concept_up(h_ND) if lm.concept_up is not None else h_ND
        crope = rope if self.mc.concept_pos == "rope" else None
        for blk in self.paged_concept:
            c_ND = blk(c_ND, crope)
        return (lm.concept_down(c_ND) if lm.concept_down is not None else c_ND), None


@_register_processor
class ConceptMoEForVllm(_ServedModel, HasInnerState, IsHybrid):
    """ConceptMoE: chunk module, concept model and dechunk run on the request's concept state."""

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return state_shapes(_configs(vllm_config)[0], _plan(vllm_config))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return state_dtypes(_configs(vllm_config)[0], vllm_config.model_config.dtype)

    @classmethod
    def get_mamba_state_copy_func(cls):
        raise NotImplementedError("the states follow the config: get_mamba_state_copy_funcs")

    def get_mamba_state_copy_funcs(self, mamba_types):  # vLLM calls it on the model
        return {t: copy_funcs(self.mc) for t in mamba_types}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if self.vlm.lm.chunker is None:
            raise ConfigError(
                "this export is the MoE baseline (no chunking): serve it "
                "as ConceptMoEBaselineForCausalLM (`vlm serve` picks it)"
            )
        # both would hand the model states it does not keep (docs/serving.md): refused, not
        # served wrong
        if vllm_config.speculative_config is not None:
            raise ConfigError(
                "speculative decoding is not supported for ConceptMoE (docs/serving.md)"
            )
        if vllm_config.cache_config.enable_prefix_caching:
            raise ConfigError(
                "prefix caching is not supported for ConceptMoE: pass "
                "--no-enable-prefix-caching (`vlm serve` does; docs/serving.md)"
            )
        E, plan = len(self.vlm.lm.encoder), _plan(vllm_config)
        dtype = vllm_config.model_config.dtype
        # a plain list: vLLM finds the layers by their names (they hold no weights)
        self.concept_states = [
            ConceptState(self.mc, plan, dtype, STATE_PREFIX.format(E + n))
            for n in range(plan.layers)
        ]
        log.info(
            "concept state: %d layers of %d concepts (%d per pass and request, %d asked for)",
            plan.layers,
            plan.entries,
            plan.capacity,
            concept_capacity(
                self.mc,
                vllm_config.model_config.max_model_len,
                getattr(vllm_config.model_config.hf_config, "concept_capacity", None),
            ),
        )
        # every state layer gets the same metadata: the first one's is read
        self.state_prefix = self.concept_states[0].prefix
        self._middle = Middle(self.vlm.lm, ConceptStates(self.concept_states, plan))

    def middle(self, h_ND, positions_N, rope):
        meta = get_forward_context().attn_metadata
        m = meta.get(self.state_prefix) if isinstance(meta, dict) else None
        if m is None:  # vLLM's profiling run: no request owns a slot
            return h_ND, torch.zeros_like(h_ND)
        z_ND, c_ND = torch.empty_like(h_ND), torch.empty_like(h_ND)
        nd = m.num_decode_tokens
        if nd:
            slots_B = m.state_indices_tensor_d[:nd, 0].long()
            # a one-token prompt counts as a decode: it starts its slot
            first_B = positions_N[:nd] == 0
            for i in first_B.nonzero().flatten().tolist():
                z_ND[i : i + 1], c_ND[i : i + 1] = self._middle.prefill(
                    h_ND[None, i : i + 1], int(slots_B[i])
                )
            rest = (~first_B).nonzero().flatten()
            if len(rest):
                z_ND[rest], c_ND[rest] = self._middle.step(h_ND[rest], slots_B[rest])
        if m.num_prefills:
            qsl = (m.query_start_loc_p + nd).tolist()
            slots = m.state_indices_tensor_p.long().tolist()
            for i in range(m.num_prefills):
                s, e, slot = qsl[i], qsl[i + 1], slots[i]
                if bool(m.has_initial_states_p[i]):  # a later chunk of a prompt: token by token
                    for t in range(s, e):
                        z_ND[t : t + 1], c_ND[t : t + 1] = self._middle.step(
                            h_ND[t : t + 1], torch.tensor([slot], device=h_ND.device)
                        )
                else:
                    z_ND[s:e], c_ND[s:e] = self._middle.prefill(h_ND[None, s:e], slot)
        return z_ND, c_ND
