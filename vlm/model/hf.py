"""transformers integration: a PreTrainedModel wrapper, AutoModel registration and export.

Legend: B rows, T tokens, D width.

`final/` directories written by `save_pretrained` load with
`AutoModelForCausalLM.from_pretrained(dir)` after `import vlm.model.hf` (importing this module
registers the Auto classes; every loader here imports it). The wrapper's forward takes ordinary
(left- or right-padded) `input_ids`/`attention_mask`; each row is one document. `generate(...,
use_cache=True)` (the default) runs the model's own prefill and cached steps: the concept-level
`InferenceCache` travels as generate's `cache`; `use_cache=False` re-runs the prefix. The forward
computes the logits of the positions asked for only (`logits_to_keep`; `generate` asks for the last
one), and its loss with `labels` in tiles of tokens (vlm.model.tiled_loss). What an export's other
files must agree with before it loads: vlm.model.export_checks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoProcessor,
    AutoTokenizer,
    GenerationMixin,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

from configs.batch import IGNORE_INDEX, IMAGE, TEXT, PackedBatch
from configs.config import ConfigError, from_dict, to_dict
from vision.config import VisionConfig
from vlm.model.cache import InferenceCache
from vlm.model.config import model_config_from
from vlm.model.context import ForwardContext
from vlm.model.export_checks import check_generation_config, check_processor_config
from vlm.model.layers import positions_in_doc
from vlm.model.legacy_names import KEY_MAPPING
from vlm.model.multimodal import ConceptMoEVLM
from vlm.model.processing import CHAT_TEMPLATE, ConceptMoEImageProcessor, ConceptMoEProcessor
from vlm.model.stats import lm_labels, lm_losses
from vlm.model.weights_check import check_exported_weights, read_config, write_checksums

MODEL_TYPE = "conceptmoe_vlm"
# The name `generate` carries a model's cache under between its forwards: `cache` from transformers
# 5.20 on, `past_key_values` before (the serve venv's vLLM pins transformers < 5.20). The
# concept-level `InferenceCache` travels under whichever this transformers reads.
CACHE_NAME = (
    "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
)


class ConceptMoEConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(
        self,
        model: dict | None = None,
        vision: dict | None = None,
        image_pad_id: int = -1,
        **kwargs,
    ):
        self.model = model or {}
        self.vision = vision
        self.image_pad_id = image_pad_id
        if not isinstance(self.model, dict):
            raise ConfigError(f"'model' is {type(self.model).__name__}, not a mapping")
        mc = model_config_from(self.model)
        # transformers' generate/save read these standard names; they restate the model section,
        # and one that says otherwise (edited by hand) would report a model that is not the one
        # built
        standard = {
            "vocab_size": mc.vocab_size,
            "hidden_size": mc.hidden_size,
            "num_hidden_layers": mc.encoder_layers + mc.concept_layers + mc.decoder_layers,
            "num_attention_heads": mc.num_heads,
        }
        for name, value in standard.items():
            if kwargs.get(name, value) != value:
                raise ConfigError(
                    f"{name} is {kwargs[name]!r} but the model section builds {value} "
                    f"(model.{'num_heads' if name == 'num_attention_heads' else name}"
                    f"{'' if name != 'num_hidden_layers' else ': encoder + concept + decoder layers'}"
                    "); the two must agree"
                )
            kwargs[name] = value
        kwargs["tie_word_embeddings"] = mc.tie_embeddings
        super().__init__(**kwargs)

    def build_configs(self):
        mc = model_config_from(self.model)
        vc = None
        if self.vision is not None:
            vc = from_dict(VisionConfig, _drop_legacy_vision_keys(self.vision))
        return mc, vc


def _drop_legacy_vision_keys(vision: dict) -> dict:
    """Exports written before vision.processor alone stated the patch geometry also carry
    encoder.patch_size and encoder.merge, which were then checked equal to the processor's: drop
    them so that those exports still load."""
    enc = vision.get("encoder")
    if not isinstance(enc, dict) or not {"patch_size", "merge"} & enc.keys():
        return vision
    return dict(vision, encoder={k: v for k, v in enc.items() if k not in ("patch_size", "merge")})


class ConceptMoEForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = ConceptMoEConfig
    base_model_prefix = "vlm"
    main_input_name = "input_ids"
    _supports_cache_class = False

    def __init__(self, config: ConceptMoEConfig, vlm: ConceptMoEVLM | None = None):
        super().__init__(config)
        self.vlm = vlm if vlm is not None else ConceptMoEVLM(*config.build_configs())
        # on_prefill(model output, batch): called with every forward over whole prompts (not with
        # cached steps); the project's evaluators read the prompts' compression statistics
        # through it
        self.on_prefill = None
        if config.tie_word_embeddings:
            self._tied_weights_keys = {"vlm.lm.lm_head.weight": "vlm.lm.embed.weight"}
        self.post_init()

    def _init_weights(self, module):  # the wrapped model initialises itself
        pass

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' loader, after every tensor of a local export was checked against its
        config (a missing one would otherwise come from uninitialised memory, a wrong dtype would
        be cast silently)."""
        path = Path(pretrained_model_name_or_path)
        if path.is_dir():
            config = kwargs.get("config")
            if not isinstance(config, ConceptMoEConfig):
                config = read_config(path, cls.config_class)
            check_generation_config(path, config)
            check_processor_config(path, config)
            check_exported_weights(path, config)
        # exports from before a rename (vlm.model.legacy_names): this loader skips load_state_dict
        kwargs["key_mapping"] = {**KEY_MAPPING, **(kwargs.get("key_mapping") or {})}
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' writer, then the weight files' SHA-256 in `checksums.json`, which
        `from_pretrained` verifies (an export, `vlm convert` and a fine-tune saved with this method
        all get it)."""
        out = super().save_pretrained(save_directory, *args, **kwargs)
        if (
            kwargs.get("is_main_process", args[0] if args else True)
            and Path(save_directory).is_dir()
        ):
            write_checksums(save_directory)
        return out

    def get_input_embeddings(self):
        return self.vlm.lm.embed

    def get_output_embeddings(self):
        return self.vlm.lm.lm_head

    def to_batch(
        self,
        input_ids,
        attention_mask=None,
        pixel_patches=None,
        patch_coords=None,
        image_grids=None,
        labels=None,
    ) -> PackedBatch:
        """One document per row; padding (attention_mask 0) becomes doc id -1 wherever it sits."""
        mask = (
            torch.ones_like(input_ids, dtype=torch.bool)
            if attention_mask is None
            else attention_mask.bool()
        )
        doc = torch.where(mask, torch.zeros_like(input_ids), torch.full_like(input_ids, -1))
        modality = torch.full_like(input_ids, TEXT)
        if self.config.image_pad_id >= 0:
            modality = torch.where((input_ids == self.config.image_pad_id) & mask, IMAGE, TEXT)
        if labels is None:
            labels = torch.full_like(input_ids, IGNORE_INDEX)
        else:  # HF convention: labels aligned with inputs; ours are already shifted
            labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], 1)
        return PackedBatch(
            input_ids,
            labels,
            doc,
            positions_in_doc(doc),
            modality,
            pixel_patches,
            patch_coords,
            image_grids,
        )

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate must not make a DynamicCache: the first forward returns our InferenceCache
        return False

    supports_gradient_checkpointing = True

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs) -> None:
        """Recompute the LLM blocks' activations in the backward (token and concept stacks; the
        vision encoder has its own switch, `vision.encoder.grad_checkpointing`)."""
        self.vlm.lm.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.vlm.lm.gradient_checkpointing = False

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.vlm.lm.gradient_checkpointing

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        pixel_patches=None,
        patch_coords=None,
        image_grids=None,
        labels=None,
        return_dict=True,
        cache: InferenceCache | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ):
        """`output_hidden_states`: token-level states (embeddings, each encoder layer, the decoder
        input, each decoder layer, the last one normed); the concept layers run on concepts and are
        not among them. `logits_to_keep` (transformers' convention): the logits of the last that
        many positions, or of the positions a 1-d tensor lists; 0 (the default) all of them
        (`generate` asks for the last one only). The loss with `labels` never needs them: it is
        computed in tiles of tokens (vlm.model.tiled_loss)."""
        if CACHE_NAME != "cache" and cache is None:  # an older transformers' generate
            cache = kwargs.pop(CACHE_NAME, None)
        unsupported = [
            k
            for k in ("output_attentions", "inputs_embeds", "past_key_values", "position_ids")
            if kwargs.get(k) not in (None, False)
        ]
        if unsupported or return_dict is False:
            raise ValueError(
                "ConceptMoEForCausalLM does not support "
                f"{', '.join(unsupported or ['return_dict=False'])} (attention "
                "maps are per stack and concept-level; the cache is `cache`, "
                "built by `generate`; positions follow `attention_mask`)"
            )
        if cache is not None:  # a decode step: one new token per row
            logits = self.vlm.step(input_ids[:, -1], cache)[:, None]
            return CausalLMOutputWithPast(logits=logits, **{CACHE_NAME: cache})
        batch = self.to_batch(
            input_ids, attention_mask, pixel_patches, patch_coords, image_grids, labels
        )
        T = input_ids.shape[1]
        keep_T = kept_positions(logits_to_keep, T, input_ids.device)
        if use_cache and labels is None:
            # Prefill right-aligned rows (the caches fill from position 0), then read the logits
            # of the kept positions from where they went.
            shift_B = (batch.doc_ids < 0).long().cumprod(1).sum(1)  # left padding per row
            to_right = (torch.arange(T, device=input_ids.device)[None] + shift_B[:, None]) % T
            right = PackedBatch(
                *(t.gather(1, to_right) for t in (batch.input_ids, batch.labels, batch.doc_ids)),
                positions_in_doc(batch.doc_ids.gather(1, to_right)),
                batch.modality.gather(1, to_right),
                batch.pixel_patches,
                batch.patch_coords,
                batch.image_grids,
            )
            out, new_cache = self.vlm.prefill(right)
            if self.on_prefill is not None:
                self.on_prefill(out, right)
            logits = out.logits_at((keep_T[None] - shift_B[:, None]) % T)
            return CausalLMOutputWithPast(logits=logits, **{CACHE_NAME: new_cache})
        out = self.vlm(
            batch,
            output_hidden_states=bool(output_hidden_states),
            context=ForwardContext(logits=False),
        )
        if self.on_prefill is not None:
            self.on_prefill(out, batch)
        loss = None
        if labels is not None:  # the mean next-token loss, as transformers' models report it
            loss = lm_losses(out, lm_labels(batch), batch.doc_ids, batch.modality)[0]
        if isinstance(logits_to_keep, int) and logits_to_keep == 0:
            logits = out.head(out.final_BTD)
        else:
            logits = out.logits_at(keep_T[None].expand(input_ids.shape[0], -1))
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=out.hidden_states,
        )

    def prepare_inputs_for_generation(
        self,
        input_ids,
        attention_mask=None,
        pixel_patches=None,
        patch_coords=None,
        image_grids=None,
        cache=None,
        use_cache=None,
        **kwargs,
    ):
        cache = cache if cache is not None else kwargs.get(CACHE_NAME)
        if cache is not None:  # the images were encoded at prefill; only the newest token goes in
            return {"input_ids": input_ids[:, -1:], CACHE_NAME: cache}
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "pixel_patches": pixel_patches,
            "patch_coords": patch_coords,
            "image_grids": image_grids,
            "use_cache": use_cache,
            "logits_to_keep": kwargs.get("logits_to_keep", 0),
        }


def kept_positions(logits_to_keep: int | torch.Tensor, T: int, device) -> torch.Tensor:
    """The positions whose logits a forward returns, by transformers' `logits_to_keep`: the last
    that many (0: all T), or the positions a 1-d tensor lists."""
    if isinstance(logits_to_keep, torch.Tensor):
        return logits_to_keep.to(device)
    return torch.arange(T - logits_to_keep if 0 < logits_to_keep <= T else 0, T, device=device)


def register() -> None:
    """Register the config, model, image processor and processor with transformers' Auto classes
    (idempotent; run when this module is imported, so every loader in the project, which imports it,
    finds them)."""
    for auto, args in (
        (AutoConfig, (MODEL_TYPE, ConceptMoEConfig)),
        (AutoModelForCausalLM, (ConceptMoEConfig, ConceptMoEForCausalLM)),
        (AutoImageProcessor, (ConceptMoEConfig, ConceptMoEImageProcessor)),
        (AutoProcessor, (ConceptMoEConfig, ConceptMoEProcessor)),
    ):
        try:
            auto.register(*args)
        except ValueError:  # already registered
            pass


def hf_config_for(model: ConceptMoEVLM, image_pad_id: int = -1) -> ConceptMoEConfig:
    vision = to_dict(model.vision_cfg) if model.vision_cfg is not None else None
    return ConceptMoEConfig(
        model=to_dict(model.model_cfg), vision=vision, image_pad_id=image_pad_id
    )


def save_pretrained(model: ConceptMoEVLM, out_dir: str | Path, tokenizer=None) -> Path:
    """Export the training model (and its tokenizer) as a transformers checkpoint directory."""
    out_dir = Path(out_dir)
    image_pad_id = getattr(tokenizer, "image_pad_id", -1) if tokenizer is not None else -1
    wrapper = ConceptMoEForCausalLM(hf_config_for(model, image_pad_id), vlm=model)
    if tokenizer is not None:
        from transformers import GenerationConfig

        wrapper.config.eos_token_id = tokenizer.eos_id
        wrapper.config.pad_token_id = tokenizer.pad_id
        wrapper.config.bos_token_id = tokenizer.bos_id
        wrapper.generation_config = GenerationConfig(
            eos_token_id=stop_token_ids(tokenizer),
            pad_token_id=tokenizer.pad_id,
            bos_token_id=tokenizer.bos_id,
        )
        tokenizer.save(out_dir)
    wrapper.save_pretrained(out_dir)
    if tokenizer is not None:
        save_processor(model, out_dir)
        # again, with the tokenizer's files as written last (save_processor rewrites them)
        write_checksums(out_dir, tokenizer=True)
    return out_dir


def stop_token_ids(tokenizer) -> int | list[int]:
    """The ids transformers' `generate` stops at: the eos, and the end of turn (`<|end|>`) that
    closes an answer of the project's chat format (the eos first: readers of a list take the first
    as the tokenizer's eos). A source's tokenizer (whose roles are template text) stops at its eos,
    as the source's own `generate` does."""
    end = getattr(tokenizer, "end_id", None)
    return tokenizer.eos_id if end is None or end == tokenizer.eos_id else [tokenizer.eos_id, end]


def save_processor(model: ConceptMoEVLM, out_dir: str | Path) -> None:
    """The files `AutoTokenizer` / `AutoProcessor.from_pretrained(out_dir)` read: the tokenizer gets
    the chat template and left padding (rows are generated from their right end); a VLM also gets
    its image processor."""
    # an init argument: it is saved
    tok = AutoTokenizer.from_pretrained(str(out_dir), padding_side="left")
    # a source's tokenizer (data_pipelines.tokenizer.SourceTokenizer) wrote its own template:
    # it stays
    tok.chat_template = tok.chat_template if _keeps_source_format(out_dir) else CHAT_TEMPLATE
    if model.vision_cfg is None:
        tok.save_pretrained(str(out_dir))
        return
    image_processor = ConceptMoEImageProcessor(**to_dict(model.vision_cfg.processor))
    ConceptMoEProcessor(image_processor=image_processor, tokenizer=tok).save_pretrained(
        str(out_dir)
    )


def _keeps_source_format(out_dir: str | Path) -> bool:
    from data_pipelines.tokenizer import is_source_tokenizer_dir

    return is_source_tokenizer_dir(Path(out_dir))


def checked_export_config(path: str | Path) -> ConceptMoEConfig:
    """The config of the export at `path`, after the checks `from_pretrained` makes (generation and
    processor settings, every tensor's name, shape and dtype, the checksums) except reading the
    values: a reader of its share checks those it reads (vlm.model.share_load)."""
    path = Path(path)
    config = read_config(path, ConceptMoEConfig)
    check_generation_config(path, config)
    check_processor_config(path, config)
    check_exported_weights(path, config, values=False)
    return config


def load_vlm(path: str | Path) -> ConceptMoEVLM:
    """The training-side model from an exported directory."""
    return ConceptMoEForCausalLM.from_pretrained(str(path)).vlm


register()
