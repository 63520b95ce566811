"""Analytic accounting of a ConceptMoE config: parameters, per-token FLOPs, attention map, KV cache.

Everything is computed from `ModelConfig` alone (no model is built), so it works for 300B configs on
a laptop. The counts follow the model's structure exactly (see `count_params` for the list of
tensors); FLOPs follow the paper's convention (section 3.5): 2 x multiply-accumulates of every
matmul a token goes through with its activated parameters, attention map excluded. Norms,
activations, softmaxes, the cosine similarity and the dechunk EMA are elementwise (O(D) per token)
and not counted.

Compression. With ratio R the concept model sees N/R positions on average, so everything it does per
position (its layers, every loop pass, the up/down projections) costs 1/R per token. A config with
chunking disabled is the MoE baseline: R = 1 whatever is passed.

Assumptions worth knowing:
- Grove adjugate experts run once per token per *hit* group. We count the expected number of
  distinct groups hit by `top_k` picks drawn uniformly without replacement from `num_experts`
  experts in `grove_groups` equal groups: g * (1 - C(E - E/g, k) / C(E, k)). Balanced routing
  makes the marginal loads uniform; the within-token correlation of picks is what the uniform
  draw assumes away.
- Joint decoding's concept projections (c W^c_q, c W^c_k, c W^c_v, eq. 11) are counted per token, as
  a straightforward implementation computes them; computing them once per concept would divide them
  by R.
- DLCM's cross-attention decoder (`decoder_mode: cross_attention`, part `cross_attention`): W_Q and
  W_O per token, W_K and W_V once per concept (1/R per token), as the model computes them. Its
  attention map is counted as the replicated L x L causal kernel computes it (DLCM eq. 17: every
  token pair of the sequence, R times the L x M pairs an irregular kernel would visit, never
  windowed); its KV cache holds one entry per concept.
- Attention map (QK^T and AV): 2 MACs x heads x head_dim per (query, key) pair, i.e. 4 Hq hd FLOPs
  per pair. `causal=True` counts the N(N+1)/2 pairs a causal kernel visits, `causal=False` all N^2.
  A sequence is one document; packed rows of several documents cost less (block-diagonal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vlm.model.config import ModelConfig, MoEConfig

PARAM_PARTS = (
    "embedding",
    "encoder",
    "chunk",
    "residual",
    "concept_proj",
    "concept",
    "decoder",
    "joint_decoding",
    "cross_attention",
    "final_norm",
    "lm_head",
)
FLOP_PARTS = (
    "encoder",
    "chunk",
    "residual",
    "concept_proj",
    "concept",
    "decoder",
    "joint_decoding",
    "cross_attention",
    "lm_head",
)
STAGES = ("encoder", "concept", "decoder")


@dataclass(frozen=True)
class Stage:
    """One transformer stack as the accounting sees it."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    qk_norm: bool
    moe: MoEConfig
    layers: int  # distinct layers (parameters)
    passes: int  # layer applications per position (loops included)
    positions: float  # positions per token: 1 for E and D, 1/R for the concept model


def effective_ratio(cfg: ModelConfig, ratio: float | None = None) -> float:
    """R used for the concept model: 1 for the baseline (chunking off), else `ratio` or the config's target."""
    if not cfg.chunk.enabled:
        return 1.0
    r = cfg.chunk.target_ratio if ratio is None else float(ratio)
    if not r >= 1.0:
        raise ValueError(f"compression ratio R must be >= 1 (R = N/M), got {r}")
    return r


def stages(cfg: ModelConfig, ratio: float | None = None) -> list[Stage]:
    """Encoder, concept model and decoder of `cfg`, with their per-token position factors."""
    r = effective_ratio(cfg, ratio)
    hd, qkn = cfg.head_dim, cfg.qk_norm
    return [
        Stage(
            "encoder",
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            hd,
            qkn,
            cfg.moe,
            cfg.encoder_layers,
            cfg.encoder_layers,
            1.0,
        ),
        Stage(
            "concept",
            cfg.c_hidden,
            cfg.c_heads,
            cfg.c_kv_heads,
            hd,
            qkn,
            cfg.c_moe,
            cfg.concept_layers,
            len(cfg.concept_schedule),
            1.0 / r,
        ),
        Stage(
            "decoder",
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            hd,
            qkn,
            cfg.moe,
            cfg.decoder_layers,
            cfg.decoder_layers,
            1.0,
        ),
    ]


# ---------------------------------------------------------------- per-layer building blocks


def attn_params(hidden: int, heads: int, kv_heads: int, head_dim: int, qk_norm: bool) -> int:
    """q, k, v, o projections (no biases) and the optional per-head q/k RMSNorms."""
    proj = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    return proj + (2 * head_dim if qk_norm else 0)


def attn_macs(hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Multiply-accumulates of the four attention projections for one position."""
    return hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden


def expected_groups_hit(moe: MoEConfig) -> float:
    """Expected distinct Grove groups hit by top_k uniform picks without replacement (see module doc)."""
    g, e, k = moe.grove_groups, moe.num_experts, moe.top_k
    if g <= 0:
        return 0.0
    miss = math.comb(e - e // g, k) / math.comb(e, k)  # all k picks avoid one given group
    return g * (1.0 - miss)


def moe_params(hidden: int, moe: MoEConfig) -> int:
    """Router (no bias), routed SwiGLU experts, shared experts, Grove adjugate experts."""
    router = hidden * moe.num_experts
    routed = moe.num_experts * 3 * hidden * moe.expert_hidden
    shared = 3 * hidden * moe.num_shared_experts * moe.shared_hidden
    grove = moe.grove_groups * 3 * hidden * moe.grove_hidden
    return router + routed + shared + grove


def moe_activated_params(hidden: int, moe: MoEConfig) -> float:
    """Parameters one token touches in a MoE layer (expected, for Grove)."""
    return (
        hidden * moe.num_experts
        + moe.top_k * 3 * hidden * moe.expert_hidden
        + 3 * hidden * moe.num_shared_experts * moe.shared_hidden
        + expected_groups_hit(moe) * 3 * hidden * moe.grove_hidden
    )


def moe_macs(hidden: int, moe: MoEConfig) -> float:
    """MACs of one position through a MoE layer: router, top_k experts, shared, expected adjugates."""
    return moe_activated_params(hidden, moe)  # every activated weight is one MAC per position


def layer_params(st: Stage) -> int:
    """One transformer layer: attention RMSNorm + attention + FFN RMSNorm + MoE."""
    return (
        2 * st.hidden
        + attn_params(st.hidden, st.heads, st.kv_heads, st.head_dim, st.qk_norm)
        + moe_params(st.hidden, st.moe)
    )


def layer_activated_params(st: Stage) -> float:
    return (
        2 * st.hidden
        + attn_params(st.hidden, st.heads, st.kv_heads, st.head_dim, st.qk_norm)
        + moe_activated_params(st.hidden, st.moe)
    )


def layer_macs(st: Stage) -> float:
    return attn_macs(st.hidden, st.heads, st.kv_heads, st.head_dim) + moe_macs(st.hidden, st.moe)


def joint_layer_params(cfg: ModelConfig) -> int:
    """Extra concept Q/K/V projections (eq. 11) plus the RMSNorm on the concept input of one decoder layer."""
    d = cfg.hidden_size
    return d * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + d


def joint_layers(cfg: ModelConfig) -> int:
    """Decoder layers with eq. 11's concept projections (none in cross-attention mode)."""
    return cfg.num_joint_layers if cfg.decoder_mode == "joint" else 0


def cross_layers(cfg: ModelConfig) -> int:
    """Decoder layers with a cross-attention sublayer (DLCM eq. 12-14)."""
    return cfg.num_joint_layers if cfg.decoder_mode == "cross_attention" else 0


def cross_layer_params(cfg: ModelConfig) -> int:
    """One cross-attention sublayer: its pre-norm, the concepts' RMSNorm, W_Q, W_K, W_V, W_O (eq.
    12-14) and the optional per-head q/k RMSNorms (eq. 16)."""
    d = cfg.hidden_size
    return 2 * d + attn_params(d, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qk_norm)


def cross_layer_macs(cfg: ModelConfig, r: float) -> float:
    """Per token: W_Q and W_O on the token, W_K and W_V on its 1/R share of a concept."""
    d, hd = cfg.hidden_size, cfg.head_dim
    return 2 * d * cfg.num_heads * hd + 2 * d * cfg.num_kv_heads * hd / r


def chunk_params(cfg: ModelConfig) -> int:
    """Boundary router: cosine (W_q, W_k, eq. 2), linear (2D weights + bias) or fixed (none)."""
    if not cfg.chunk.enabled or cfg.chunk.router == "fixed":
        return 0
    d = cfg.hidden_size
    return {"cosine": 2 * d * d, "linear": 2 * d + 1, "topk": d + 1}[cfg.chunk.router]


def residual_params(cfg: ModelConfig) -> int:
    """H-Net's residual projection of eq. 10's h-hat (identity: none)."""
    return cfg.hidden_size**2 if cfg.chunk.enabled and cfg.chunk.residual == "linear" else 0


def concept_proj_params(cfg: ModelConfig) -> int:
    """Up (D -> Dc) and down (Dc -> D) projections around a wider/narrower concept model (strategy 3)."""
    return 0 if cfg.c_hidden == cfg.hidden_size else 2 * cfg.hidden_size * cfg.c_hidden


# ---------------------------------------------------------------- public API


def count_params(cfg: ModelConfig) -> dict[str, float]:
    """Parameter counts by part, `total`, `activated` and `activated_non_embedding`.

    `total` equals `sum(p.numel() for p in model.parameters())` (buffers such as the expert bias
    excluded). `activated` counts what one token's forward touches: all but the unselected routed
    experts (and the expected unhit Grove adjugates); the embedding table is included whole, as
    usual for "A..B" names.
    """
    d, v = cfg.hidden_size, cfg.vocab_size
    enc, con, dec = stages(cfg)
    parts = {
        "embedding": v * d,
        "encoder": enc.layers * layer_params(enc),
        "chunk": chunk_params(cfg),
        "residual": residual_params(cfg),
        "concept_proj": concept_proj_params(cfg),
        "concept": con.layers * layer_params(con),
        "decoder": dec.layers * layer_params(dec),
        "joint_decoding": joint_layers(cfg) * joint_layer_params(cfg),
        "cross_attention": cross_layers(cfg) * cross_layer_params(cfg),
        "final_norm": d,
        "lm_head": 0 if cfg.tie_embeddings else d * v,
    }
    total = sum(parts.values())
    inactive = sum(
        s.layers * (layer_params(s) - layer_activated_params(s)) for s in (enc, con, dec)
    )
    out: dict[str, float] = dict(parts)
    out["total"] = total
    out["activated"] = total - inactive
    out["activated_non_embedding"] = out["activated"] - parts["embedding"] - parts["lm_head"]
    return out


def flops_per_token(cfg: ModelConfig, ratio: float | None = None) -> dict[str, float]:
    """Forward FLOPs per input token by part and `total` (attention map excluded; section 3.5).

    The concept model's layers (every loop pass) and its up/down projections are divided by R.
    """
    r = effective_ratio(cfg, ratio)
    d = cfg.hidden_size
    enc, con, dec = stages(cfg, r)
    router = 0
    if cfg.chunk.enabled and cfg.chunk.router != "fixed":
        router = {"cosine": 2 * d * d, "linear": 2 * d, "topk": d}[cfg.chunk.router]
    macs = {
        "encoder": enc.passes * layer_macs(enc),
        "chunk": router,
        "residual": residual_params(cfg),
        "concept_proj": concept_proj_params(cfg) / r,
        "concept": con.passes * layer_macs(con) / r,
        "decoder": dec.passes * layer_macs(dec),
        "joint_decoding": joint_layers(cfg) * (joint_layer_params(cfg) - d),
        "cross_attention": cross_layers(cfg) * cross_layer_macs(cfg, r),
        "lm_head": d * cfg.vocab_size,
    }
    out = {k: 2.0 * v for k, v in macs.items()}
    out["total"] = sum(out.values())
    return out


def _pairs(n: float, causal: bool, window: int = 0) -> float:
    """Query-key pairs of n positions; a causal sliding window of W keeps min(i + 1, W) keys for query i."""
    if window and causal and n > window:
        return window * (window + 1) / 2 + (n - window) * window
    return n * (n + 1) / 2 if causal else n * n


def attention_map_flops(
    cfg: ModelConfig, seq_len: int, ratio: float | None = None, causal: bool = True
) -> dict[str, float]:
    """FLOPs of QK^T and AV for one sequence of `seq_len` tokens, by stage and `total`.

    The concept model attends over seq_len / R concepts, once per pass (loops included); encoder and
    decoder layers over at most `model.attention_window` keys per query when it is set.
    `cross_attention`: the decoder's cross-attention layers over the replicated concepts (every pair
    of the sequence, see the module doc).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    out = {}
    for st in stages(cfg, ratio):
        window = 0 if st.name == "concept" else cfg.attention_window
        out[st.name] = (
            st.passes
            * 4.0
            * st.heads
            * st.head_dim
            * _pairs(seq_len * st.positions, causal, window)
        )
    out["cross_attention"] = (
        cross_layers(cfg) * 4.0 * cfg.num_heads * cfg.head_dim * _pairs(seq_len, causal)
    )
    out["total"] = sum(out[s] for s in STAGES) + out["cross_attention"]
    return out


def kv_cache_bytes(
    cfg: ModelConfig, seq_len: int, ratio: float | None = None, bytes_per_el: int = 2
) -> dict[str, float]:
    """KV-cache bytes after `seq_len` tokens, by stage and `total`.

    Per layer application 2 * Hkv * hd * bytes per cached position; the concept model caches
    seq_len / R positions, and each loop pass keeps its own cache (its inputs differ), as in Table
    1. `cross_attention`: the decoder's cross-attention layers cache the seq_len / R concepts'
    keys and values.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    out = {}
    for st in stages(cfg, ratio):
        out[st.name] = (
            st.passes * 2.0 * st.kv_heads * st.head_dim * bytes_per_el * seq_len * st.positions
        )
    r = effective_ratio(cfg, ratio)
    out["cross_attention"] = (
        cross_layers(cfg) * 2.0 * cfg.num_kv_heads * cfg.head_dim * bytes_per_el * seq_len / r
    )
    out["total"] = sum(out[s] for s in STAGES) + out["cross_attention"]
    return out


def summary(
    cfg: ModelConfig,
    ratio: float | None = None,
    seq_len: int = 32768,
    bytes_per_el: int = 2,
    causal: bool = True,
) -> dict[str, float]:
    """The headline numbers of one config in one flat dict."""
    p = count_params(cfg)
    f = flops_per_token(cfg, ratio)
    a = attention_map_flops(cfg, seq_len, ratio, causal)
    kv = kv_cache_bytes(cfg, seq_len, ratio, bytes_per_el)
    return {
        "ratio": effective_ratio(cfg, ratio),
        "total_params": p["total"],
        "activated_params": p["activated"],
        "activated_non_embedding": p["activated_non_embedding"],
        "flops_per_token": f["total"],
        "attn_map_flops_concept": a["concept"],
        "attn_map_flops": a["total"],
        "kv_cache_bytes_concept": kv["concept"],
        "kv_cache_bytes": kv["total"],
    }


__all__ = [
    "PARAM_PARTS",
    "FLOP_PARTS",
    "STAGES",
    "Stage",
    "effective_ratio",
    "stages",
    "count_params",
    "flops_per_token",
    "attention_map_flops",
    "kv_cache_bytes",
    "summary",
    "expected_groups_hit",
]
