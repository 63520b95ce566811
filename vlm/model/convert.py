"""MoE -> ConceptMoE conversion for continual training (ConceptMoE section 4.3, Figure 3).

All pretrained weights are kept: the first layers become the encoder, the last the decoder, the rest
the concept model. Added: a randomly initialised chunk module, the dechunk with the "delta" residual
(each token's own state plus the concept model's update, so a chunk's tokens still see themselves;
no new weights), and zero-initialised joint-decoding projections in the last decoder layers (or,
with `decoder_mode: cross_attention`, DLCM cross-attention sublayers whose output projection W_O
starts at zero, so they add nothing yet). With every boundary forced on (p = 1) the converted model
reproduces the source logits exactly; reallocation (more active experts, concept-layer loops) is
applied on top and checked with the FLOPs accounting.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from configs.config import ConfigError
from vlm.model.config import ChunkConfig, ConvertConfig, ModelConfig, MoEConfig
from vlm.model.hf import MODEL_TYPE, load_vlm
from vlm.model.multimodal import ConceptMoEVLM
from vlm.model.share_init import fill_, init_normal_

SUPPORTED = ("qwen3_moe", "mixtral")


def _split(n_layers: int, opt: ConvertConfig) -> tuple[range, range, range]:
    e, d = opt.encoder_layers, opt.decoder_layers
    return range(0, e), range(e, n_layers - d), range(n_layers - d, n_layers)


def hf_model_config(hf_cfg, opt: ConvertConfig) -> ModelConfig:
    """Our ModelConfig (chunking off) that is the same network as a transformers Qwen3-MoE / Mixtral config."""
    mt = hf_cfg.model_type
    if mt not in SUPPORTED:
        raise ConfigError(
            f"model_type {mt!r} is not supported for conversion; supported: {', '.join(SUPPORTED)}"
        )
    n = hf_cfg.num_hidden_layers
    opt.check_split(n)
    if mt == "qwen3_moe":
        if (
            getattr(hf_cfg, "mlp_only_layers", None)
            or getattr(hf_cfg, "decoder_sparse_step", 1) != 1
        ):
            raise ConfigError(
                "qwen3_moe with dense (mlp_only) layers is not supported: every layer must be MoE"
            )
        moe = MoEConfig(
            num_experts=hf_cfg.num_experts,
            top_k=hf_cfg.num_experts_per_tok,
            expert_hidden=hf_cfg.moe_intermediate_size,
            norm_topk_prob=hf_cfg.norm_topk_prob,
            loss_free_balancing=False,
        )
        qk_norm = True
    else:
        moe = MoEConfig(
            num_experts=hf_cfg.num_local_experts,
            top_k=hf_cfg.num_experts_per_tok,
            expert_hidden=hf_cfg.intermediate_size,
            norm_topk_prob=True,
            loss_free_balancing=False,
        )
        qk_norm = False
    rope = getattr(hf_cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0))
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    enc, con, dec = _split(n, opt)
    return ModelConfig(
        vocab_size=hf_cfg.vocab_size,
        hidden_size=hf_cfg.hidden_size,
        num_heads=hf_cfg.num_attention_heads,
        num_kv_heads=hf_cfg.num_key_value_heads,
        head_dim=head_dim,
        qk_norm=qk_norm,
        rope_theta=float(theta),
        norm_eps=hf_cfg.rms_norm_eps,
        encoder_layers=len(enc),
        concept_layers=len(con),
        decoder_layers=len(dec),
        moe=moe,
        chunk=ChunkConfig(enabled=False),
        tie_embeddings=bool(hf_cfg.tie_word_embeddings),
    )


def hf_state_dict_to_ours(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename/reshape a transformers MoE state dict into ConceptMoEVLM keys (`lm.` prefix)."""
    n = cfg.encoder_layers + cfg.concept_layers + cfg.decoder_layers
    stacks = (
        [("encoder", i) for i in range(cfg.encoder_layers)]
        + [("concept", i) for i in range(cfg.concept_layers)]
        + [("decoder", i) for i in range(cfg.decoder_layers)]
    )
    out = {
        "lm.embed.weight": sd["model.embed_tokens.weight"],
        "lm.norm.weight": sd["model.norm.weight"],
        "lm.lm_head.weight": sd.get("lm_head.weight", sd["model.embed_tokens.weight"]),
    }
    H = cfg.moe.expert_hidden
    for j in range(n):
        stack, i = stacks[j]
        src, dst = f"model.layers.{j}.", f"lm.{stack}.{i}."
        for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            if f"{src}self_attn.{p}.weight" in sd:
                out[f"{dst}attn.{p}.weight"] = sd[f"{src}self_attn.{p}.weight"]
        out[f"{dst}attn_norm.weight"] = sd[f"{src}input_layernorm.weight"]
        out[f"{dst}ffn_norm.weight"] = sd[f"{src}post_attention_layernorm.weight"]
        out[f"{dst}moe.router.weight"] = sd[f"{src}mlp.gate.weight"]
        gate_up = sd[f"{src}mlp.experts.gate_up_proj"]  # [E, 2H, D], gate first
        out[f"{dst}moe.w_gate_EDF"] = gate_up[:, :H].transpose(1, 2).contiguous()
        out[f"{dst}moe.w_up_EDF"] = gate_up[:, H:].transpose(1, 2).contiguous()
        # [E, D, H]
        out[f"{dst}moe.w_down_EFD"] = sd[f"{src}mlp.experts.down_proj"].transpose(1, 2).contiguous()
    return out


def to_conceptmoe_config(base: ModelConfig, opt: ConvertConfig) -> ModelConfig:
    """Enable chunking the conversion way ("delta" residual, zero joint decoding) and apply reallocation."""
    chunk = ChunkConfig(
        enabled=True,
        target_ratio=opt.target_ratio,
        merge="last",
        residual="delta",
        joint_decoding_layers=opt.joint_decoding_layers,
        joint_decoding_zero_init=True,
    )
    cfg = dataclasses.replace(base, chunk=chunk, decoder_mode=opt.decoder_mode)
    # upcycling: every MoE layer (token and concept stacks) gets adjugate experts
    if opt.grove_groups:
        # Grove 3.3: when upcycling, an adjugate's weight (the group's chosen rho summed, times
        # lambda) should not exceed an expert's own: lambda <= g / n
        bound = opt.grove_groups / base.moe.num_experts
        if not 0 < opt.grove_lambda <= bound:
            raise ConfigError(
                f"grove_lambda={opt.grove_lambda} must be in (0, grove_groups / num_experts = "
                f"{opt.grove_groups}/{base.moe.num_experts} = {bound:g}] when upcycling (Grove 3.3)"
            )
        grove = dict(
            grove_groups=opt.grove_groups,
            grove_hidden=opt.grove_hidden,
            grove_lambda=opt.grove_lambda,
        )
        cfg = dataclasses.replace(
            cfg,
            moe=dataclasses.replace(base.moe, **grove),
            concept_moe=dataclasses.replace(base.c_moe, **grove),
        )
    if opt.concept_top_k is not None:
        cfg = dataclasses.replace(
            cfg, concept_moe=dataclasses.replace(base.c_moe, top_k=opt.concept_top_k)
        )
    if opt.loop is not None:
        s, e, t = opt.loop
        cfg = dataclasses.replace(cfg, loop_start=s, loop_end=e, loop_times=t)
    return cfg


# the tensors a converted model adds to its source: they keep their conversion init
NEW_PARTS = (
    "lm.chunker.",
    "lm.dechunk.",
    ".attn.cq_proj",
    ".attn.ck_proj",
    ".attn.cv_proj",
    # cross-attention decoder layers (W_O zeroed by conversion_init_)
    ".attn.concept_norm",
    ".cross.",
    ".cross_norm.",
    ".moe.expert_bias",
    ".moe.load_accum",  # balancing state starts fresh
    ".moe.adj_",  # Grove upcycling's adjugate experts
)


def conversion_init_(model: ConceptMoEVLM) -> None:
    """The new parts' conversion init, after the source's tensors are in: zero joint-decoding
    projections, and Grove 3.4's adjugates (N(0, 0.006), down-projections zero). Each rank
    initialises its share (vlm.model.share_init)."""
    with torch.no_grad():
        model.lm.zero_joint_projections()
        for name, p in model.named_parameters():
            if ".moe.adj_down" in name:
                fill_(p, 0.0)
            elif ".moe.adj_" in name:
                init_normal_(p, 0.006)


def convert_state(
    source: ConceptMoEVLM | dict[str, torch.Tensor], cfg: ModelConfig, vision_cfg=None
) -> ConceptMoEVLM:
    """Build the ConceptMoE and load every pretrained tensor; new parts get their conversion init."""
    model = ConceptMoEVLM(cfg, vision_cfg)
    sd = source.state_dict() if isinstance(source, torch.nn.Module) else source
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected:
        raise ValueError(f"source tensors with no place in the ConceptMoE: {unexpected[:5]}")
    lost = [k for k in missing if not any(p in k for p in NEW_PARTS)]
    if lost:
        raise ValueError(f"pretrained tensors missing from the source: {lost[:5]}")
    conversion_init_(model)
    return model


def fit_vocab(model: ConceptMoEVLM, vocab_size: int) -> int:
    """Grow the embedding (and untied lm_head) to `vocab_size` rows, as transformers'
    resize_token_embeddings does for tokens added to a pretrained tokenizer; returns how many rows
    were added (0: it already fits).

    Every new row starts at the mean of the source's rows (embedding and output alike): a new
    token reads as an average token and its logit as the average logit, so the source's own
    tokens are predicted as before up to the softmax's one extra term per new row. The source's
    rows are not touched."""
    lm, old = model.lm, model.lm.embed.weight.shape[0]
    if vocab_size <= old:
        return 0
    with torch.no_grad():

        def grown(w: torch.Tensor) -> torch.nn.Parameter:
            extra = w.mean(0, keepdim=True).expand(vocab_size - old, -1)
            return torch.nn.Parameter(torch.cat([w, extra]), requires_grad=w.requires_grad)

        lm.embed.weight = grown(lm.embed.weight)
        lm.embed.num_embeddings = vocab_size
        if model.model_cfg.tie_embeddings:
            lm.lm_head.weight = lm.embed.weight
        else:
            lm.lm_head.weight = grown(lm.lm_head.weight)
        lm.lm_head.out_features = vocab_size
    cfg = dataclasses.replace(model.model_cfg, vocab_size=vocab_size)
    model.model_cfg = lm.cfg = cfg
    return vocab_size - old


# The tokenizer and chat-format files a transformers checkpoint may carry: `vlm convert` copies them
# as they are, so that the converted model speaks the source's chat format (see
# data_pipelines.tokenizer.SourceTokenizer).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "byte_tokenizer.json",
    "vlm_tokenizer.json",
)


def source_token_ids(path: str | Path) -> dict[str, int]:
    """eos / bos / pad ids from a transformers checkpoint's config.json and generation_config.json
    (the latter wins: chat models state the eos that ends an answer there)."""
    from vlm.model.weights_check import WeightsError, read_json_object

    path, out = Path(path), {}
    for name in ("config.json", "generation_config.json"):
        f = path / name
        if f.is_file():
            info = read_json_object(f, "source config")  # WeightsError naming a garbage file
            for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
                v = info.get(key)
                # several eos ids: the first is the one the tokenizer names
                if isinstance(v, list):
                    v = v[0] if v else None
                if v is not None:
                    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                        raise WeightsError(f"{f}: {key} {v!r} is not a token id")
                    out[key] = v
    return out


def load_source(path: str | Path, opt: ConvertConfig):
    """A local directory: our own exported baseline, or a transformers Qwen3-MoE / Mixtral checkpoint."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{path}: no config.json; expected a transformers checkpoint directory")
    model_type = json.loads(cfg_file.read_text()).get("model_type")
    if model_type == MODEL_TYPE:
        src = load_vlm(path)
        if src.model_cfg.chunk.enabled:
            raise ConfigError(f"{path} is already a ConceptMoE (chunk.enabled=true)")
        return src.state_dict(), src.model_cfg, src.vision_cfg
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.from_pretrained(str(path))
    base = hf_model_config(hf_cfg, opt)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return hf_state_dict_to_ours(hf.state_dict(), base), base, None


def source_tensors(path: str | Path, opt: ConvertConfig):
    """(the ConceptMoE config a source converts to, its LLM's tensors by this model's names, read
    by rows: vlm.model.share_load): our own exported baseline (its safetensors, after the export's
    checks) or a transformers Qwen3-MoE / Mixtral checkpoint (its safetensors, per expert),
    without loading either whole."""
    from vlm.model.hf import checked_export_config
    from vlm.model.share_load import TransformersMoE, export_tensors

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{path}: no config.json; expected a transformers checkpoint directory")
    model_type = json.loads(cfg_file.read_text()).get("model_type")
    if model_type == MODEL_TYPE:
        base, _ = checked_export_config(path).build_configs()
        if base.chunk.enabled:
            raise ConfigError(f"{path} is already a ConceptMoE (chunk.enabled=true)")
        return to_conceptmoe_config(base, opt), export_tensors(path)
    from transformers import AutoConfig

    base = hf_model_config(AutoConfig.from_pretrained(str(path)), opt)
    return to_conceptmoe_config(base, opt), TransformersMoE(path, base)


def convert(path: str | Path, opt: ConvertConfig) -> tuple[ConceptMoEVLM, ModelConfig]:
    """Returns the converted model and the source's (baseline) config."""
    sd, base, vision_cfg = load_source(path, opt)
    # our own baseline may put every layer in the middle
    if base.encoder_layers == 0 or base.decoder_layers == 0:
        raise ConfigError("the source baseline needs encoder_layers >= 1 and decoder_layers >= 1")
    return convert_state(sd, to_conceptmoe_config(base, opt), vision_cfg), base
