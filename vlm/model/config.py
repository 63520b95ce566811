"""Model configuration dataclasses (each validates itself when made; see configs/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from configs.config import ValidatedOnInit, check, from_dict

# The loss weights a model config held before they moved to the training config's `loss:` section
# (vlm.train.loss_config.LossConfig), by their old key in the model section and their new one: an
# older config, run directory, checkpoint or export still states them
MOVED_LOSS_KEYS = {
    "chunk.ratio_loss_weight": "loss.ratio",
    "chunk.document_weight": "loss.document",
    "moe.balance_loss_weight": "loss.balance",
    "moe.z_loss_weight": "loss.z",
    "concept_moe.balance_loss_weight": "loss.concept_balance",
    "concept_moe.z_loss_weight": "loss.concept_z",
}


def pop_moved_loss_keys(model: dict) -> dict[str, object]:
    """Takes the loss weights of MOVED_LOSS_KEYS out of a model mapping (a config's model
    section, an export's config.json "model"), in place; returns them by their old dotted key."""
    found = {}
    if not isinstance(model, dict):
        return found
    for key in MOVED_LOSS_KEYS:
        section, name = key.split(".")
        sub = model.get(section)
        if isinstance(sub, dict) and name in sub:
            found[key] = sub.pop(name)
    return found


def model_config_from(data: dict, path: str = "") -> "ModelConfig":
    """A ModelConfig from a stored model mapping (an export's config.json, a run's config.yaml):
    loss weights it holds from before they moved to the training config are not the model's and
    are left out (a training run reads them: vlm.train.loss_config.move_loss_keys)."""
    import copy

    data = copy.deepcopy(data)
    pop_moved_loss_keys(data)
    return from_dict(ModelConfig, data, path)


@dataclass
class MoEConfig(ValidatedOnInit):
    """A mixture-of-experts feed-forward layer (SwiGLU experts)."""

    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 96  # intermediate size of one routed expert
    num_shared_experts: int = 0  # always-on experts (DeepSeek style)
    shared_hidden: int = 128  # intermediate size of one shared expert
    # softmax / sigmoid: one score per expert chooses (with the balancing bias) and weighs;
    # grove (Grove eq. 9): sigmoid scores plus the bias choose, the softmax scores rho^(h) weigh
    # (see grove_weights)
    router: Literal["softmax", "sigmoid", "grove"] = "softmax"
    # softmax / sigmoid routers: renormalise the chosen weights (Qwen3-MoE, Mixtral)
    norm_topk_prob: bool = True
    # grove router's combine weights: "softmax" is eq. 9-10's rho^(h) over all n experts (the chosen
    # ones sum to less than 1); "renormalised" rescales them to sum to 1 (= a softmax over the
    # chosen logits; not the paper)
    grove_weights: Literal["softmax", "renormalised"] = "softmax"
    loss_free_balancing: bool = True  # Grove eq. 6-10 / DeepSeek-V3 bias, selection only
    bias_update_rate: float = 1e-3
    # loss-free bias step: "sign" (DeepSeek-V3, torchtitan: rate * sign(mean load - load)) or "rms"
    # (Grove eq. 8: rate * (Q - F) / RMS(F - Q), the imbalance normalised by its root mean square)
    bias_update: Literal["sign", "rms"] = "sign"
    # 0: no adjugate experts; else experts split into this many groups
    grove_groups: int = 0
    grove_hidden: int = 32  # intermediate size of an adjugate expert
    grove_lambda: float = 0.05
    # how the experts run: "auto" is torch._grouped_mm where it can run this dtype and these
    # sizes (vlm.model.moe_dispatch.grouped_mm_available), else a loop over the experts; the
    # others force one (benchmarks, tests). A kernel choice: the numbers are the same.
    dispatch: Literal["auto", "grouped_mm", "loop"] = "auto"

    def validate(self) -> None:
        check(
            self.dispatch in ("auto", "grouped_mm", "loop"),
            f"dispatch: got {self.dispatch!r}, allowed values: 'auto', 'grouped_mm', 'loop'",
        )
        check(self.num_experts >= 1, f"num_experts must be >= 1, got {self.num_experts}")
        check(
            1 <= self.top_k <= self.num_experts,
            f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}",
        )
        check(self.expert_hidden >= 1, f"expert_hidden must be >= 1, got {self.expert_hidden}")
        check(self.num_shared_experts >= 0, "num_shared_experts must be >= 0")
        check(self.bias_update_rate >= 0, "bias_update_rate must be >= 0")
        check(
            self.router in ("softmax", "sigmoid", "grove"),
            f"router: got {self.router!r}, allowed values: 'softmax', 'sigmoid', 'grove'",
        )
        check(
            self.grove_weights in ("softmax", "renormalised"),
            f"grove_weights: got {self.grove_weights!r}, allowed values: 'softmax', 'renormalised'",
        )
        if self.grove_groups:
            check(
                self.num_experts % self.grove_groups == 0,
                f"grove_groups={self.grove_groups} must divide num_experts={self.num_experts}",
            )
            # Grove 3.2: an adjugate's weight lambda * (sum of its group's chosen rho) must not
            # exceed the experts' own, which holds for every routing only when lambda <= 1 / (n / g)
            bound = self.grove_groups / self.num_experts
            check(
                0 < self.grove_lambda <= bound,
                f"grove_lambda={self.grove_lambda} must be in (0, grove_groups / num_experts "
                f"= {self.grove_groups}/{self.num_experts} = {bound:g}] (Grove 3.2)",
            )


def resolve_targets(
    target_ratio: float | None, modality_target_ratios: dict[str, float | None] | None
) -> dict[str, float] | None:
    """The null-target rule: each modality's own target, a null one following `target_ratio`; None
    when there are no per-modality targets (one joint target). `ChunkConfig.modality_targets`, and
    what reads a config as a dict (a run's saved config, a resumed run's comparison), apply it here."""
    if not modality_target_ratios:
        return None
    return {m: target_ratio if r is None else r for m, r in modality_target_ratios.items()}


@dataclass
class ChunkConfig(ValidatedOnInit):
    """Chunk / dechunk / joint decoding (ConceptMoE sections 3.2-3.4)."""

    enabled: bool = True  # False: the plain MoE baseline (same code path otherwise)
    # cosine (eq. 2) or linear learn the boundaries; fixed puts one every round(target_ratio) tokens
    # of each document (ConceptMoE 4.5.2's fixed-chunking ablation; nothing to learn, the ratio loss
    # is a constant); topk (Synergy eq. 1-2, MoD): the n/R best-scoring tokens of each document in
    # training, a learned score threshold at inference (causal)
    router: Literal["cosine", "linear", "fixed", "topk"] = "cosine"
    target_ratio: float = 2.0  # R in eq. 4
    tau: float = 6.0  # sharpening temperature, eq. 5
    # how training draws boundaries from p (section 4.6): eq. 5-6's Bernoulli on the sharpened p; p
    # plus N(0, noise_sigma) thresholded at 0.5; or none (the eval-mode threshold in training too)
    boundary_noise: Literal["bernoulli", "gaussian", "none"] = "bernoulli"
    noise_sigma: float = 0.1
    merge: Literal["last", "sum", "mean"] = "sum"
    # eq. 10's z = h + c STE(sel) ("identity"), H-Net's projection of h ("linear"), or "delta": z =
    # h + (c - c_in) STE(sel) with c_in the same EMA over the concept model's inputs, i.e. each
    # token's own state plus the concept model's update; exactly the concept model's output when
    # every token is a boundary (MoE -> ConceptMoE conversion is lossless with it, and a chunk's
    # tokens still see themselves)
    residual: Literal["identity", "linear", "delta"] = "identity"
    # decoder layers (counted from the last) that read the concepts: with eq. 11 (model.decoder_mode
    # joint) or through DLCM's cross-attention (cross_attention); -1 = all
    joint_decoding_layers: int = -1
    # start those reads at zero (W^c of eq. 11, or the cross-attention's W_O)
    joint_decoding_zero_init: bool = False
    # Beyond the paper: one ratio loss per modality (e.g. {"text": 2.0, "image": 4.0}) instead of a
    # joint one; a modality given as null has its own loss at target_ratio ({text: null, image:
    # null}: both follow it)
    modality_target_ratios: dict[str, float | None] | None = None
    # image tokens also compare with the token above in the patch grid
    grid_aware_boundaries: bool = False
    # How far one document's ratio may move from its target R (per ratio group). null: the paper's
    # batch statistics alone, which let the router meet R with all-or-nothing documents; s >= 1:
    # each document's ratio may lie anywhere in [R/s, R*s] (content-adaptive allocation within that
    # band) and a per-document ratio loss pulls it back from outside (s = 1: every document at R).
    # See `document_ratio_loss`. The fixed and topk routers place R-spaced / n/R boundaries in every
    # document themselves: the band holds by construction and adds nothing.
    document_slack: float | None = None
    # (its weight, like every loss term's, is the training config's: loss.document)
    # Static concept capacity (the model runs without host synchronisation: docs/design.md, "Static
    # shapes, no host synchronisation"): in training each row's concept model gets
    # ceil(T * capacity_slack / R) positions (R the smallest target; rounded up to a multiple of 16,
    # at most T) instead of as many as its boundaries; concepts past it are not computed, the
    # tokens that would read them read none (their decoder input is the residual alone), and they
    # are counted (`Chunks.overflow`, logged as chunk/overflow). null: capacity T, which never
    # overflows.
    capacity_slack: float | None = 1.25
    # the same in eval mode (held-out loss, prefill, generation); null (T) keeps inference exact
    # whatever a prompt's ratio, at the cost of computing the unused capacity's dense projections in
    # the concept model
    eval_capacity_slack: float | None = None

    def modality_targets(self) -> dict[str, float] | None:
        """The target of each modality's own ratio loss (null entries follow target_ratio), or None:
        one joint loss at target_ratio. Everything that reads a target reads it here (or, from a
        config as a dict, through `resolve_targets`)."""
        return resolve_targets(self.target_ratio, self.modality_target_ratios)

    @property
    def smallest_target(self) -> float:
        """The smallest target ratio (of the per-modality ones, else the joint one): the one that
        asks for the most concepts, so the one a static concept capacity is sized for."""
        # a list, not min(..., default=): torch.compile traces this (chunking's capacity) and
        # dynamo handles no `default`
        return min(list((self.modality_targets() or {}).values()) or [self.target_ratio])

    @property
    def holds_documents(self) -> bool:
        """The per-document band applies: `document_slack` set and a learned router (fixed and top-k
        place their boundaries per document already)."""
        return self.document_slack is not None and self.router in ("cosine", "linear")

    def validate(self) -> None:
        check(
            self.target_ratio > 1.0, f"target_ratio must be > 1 (R = N/M), got {self.target_ratio}"
        )
        check(self.tau >= 1.0, f"tau must be >= 1, got {self.tau}")
        check(self.noise_sigma > 0, f"noise_sigma must be > 0, got {self.noise_sigma}")
        if self.router == "fixed":
            check(
                round(self.target_ratio) >= 2,
                "router 'fixed' puts a boundary every round(target_ratio) "
                f"tokens; target_ratio={self.target_ratio} rounds below 2",
            )
            check(
                not self.modality_target_ratios,
                "router 'fixed' has one spacing (target_ratio); "
                "modality_target_ratios needs a learned router",
            )
            check(not self.grid_aware_boundaries, "grid_aware_boundaries needs the cosine router")
        if self.router == "topk":
            check(
                not self.modality_target_ratios,
                "router 'topk' keeps n / target_ratio tokens per document; "
                "modality_target_ratios needs the cosine or linear router",
            )
            check(not self.grid_aware_boundaries, "grid_aware_boundaries needs the cosine router")
        for name in ("capacity_slack", "eval_capacity_slack"):
            v = getattr(self, name)
            check(
                v is None or v >= 1.0,
                f"{name} must be >= 1 (concepts per row: T * slack / R) or null (T), got {v}",
            )
        if self.document_slack is not None:
            check(
                self.document_slack >= 1.0,
                "document_slack must be >= 1 (a document's ratio "
                f"lies in [R/s, R*s]), got {self.document_slack}",
            )
            low = self.smallest_target
            check(
                low / self.document_slack > 1.0,
                f"document_slack={self.document_slack} lets a document's ratio fall to R/s = "
                f"{low / self.document_slack:.3g} <= 1 for target {low}; use document_slack < {low}",
            )
        if self.modality_target_ratios:
            for k, v in self.modality_target_ratios.items():
                check(
                    k in ("text", "image"),
                    f"modality_target_ratios: unknown modality {k!r}; allowed: 'text', 'image'",
                )
                check(
                    v is None or v > 1.0,
                    f"modality_target_ratios.{k} must be > 1 or null (target_ratio), got {v}",
                )


@dataclass
class ModelConfig(ValidatedOnInit):
    """A ConceptMoE language model: encoder E, chunk, concept model C, dechunk, decoder D."""

    vocab_size: int = 768  # the default dataset's BPE tokenizer (686 ids) fits
    hidden_size: int = 96
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 24
    qk_norm: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    encoder_layers: int = 1
    concept_layers: int = 2
    decoder_layers: int = 1
    moe: MoEConfig = field(default_factory=MoEConfig)
    chunk: ChunkConfig = field(default_factory=ChunkConfig)
    # Concept model options (section 3.5). None = same as the token stacks.
    concept_hidden_size: int | None = None
    concept_num_heads: int | None = None
    concept_num_kv_heads: int | None = None
    concept_moe: MoEConfig | None = None
    concept_pos: Literal["rope", "none"] = "rope"
    # concept layers [loop_start, loop_end) are repeated loop_times extra times
    loop_start: int = 0
    loop_end: int = 0
    loop_times: int = 0
    tie_embeddings: bool = False
    init_std: float = 0.02
    # auto: flash-attn on CUDA when installed, else FlexAttention with a document block mask
    # (compiled; fused, no host synchronisation); on CPU docs, one SDPA per document (no T x T mask:
    # memory linear in the row length, faster for long rows, see `vlm bench attention`), or sdpa
    # under torch.compile; varlen: PyTorch's own varlen flash kernel (CUDA); sdpa / eager: the
    # packed [B, 1, T, T] mask (the fallback)
    attn_backend: Literal["auto", "sdpa", "eager", "flash", "varlen", "flex", "docs"] = "auto"
    # sliding-window (local) attention in the encoder and decoder layers: a token sees itself and
    # the window - 1 tokens before it in its document; 0 = the whole document. The concept model
    # always sees all.
    attention_window: int = 0
    # How the decoder layers chosen by chunk.joint_decoding_layers read the concepts: joint
    # (ConceptMoE eq. 11, the token's own EMA concept added into q, k, v) or cross_attention (DLCM
    # eq. 12-14: a causal cross-attention sublayer over every concept of the document up to the
    # token's own; see cross_attention.py)
    decoder_mode: Literal["joint", "cross_attention"] = "joint"
    # torch.compile each transformer block in training (vlm.model.compile, torchtitan's per-block
    # compile); null: on for CUDA, off for CPU
    compile: bool | None = None
    # activation checkpointing per block in training: none; selective (keep the matmul, attention
    # and expert outputs, recompute the elementwise work between them: torch's selective
    # checkpointing); full (keep only the block's input, recompute the whole block)
    activation_checkpoint: Literal["none", "selective", "full"] = "none"
    # tokens per tile of the LM loss's logits (vlm.model.tiled_loss: no [T, V] logits for a row);
    # 0: as many as keep a tile's fp32 logits within 256 MiB on an accelerator, 64 MiB on the CPU
    loss_tile_tokens: int = 0

    def validate(self) -> None:
        check(
            self.attention_window >= 0,
            f"attention_window must be >= 0 (0: whole document), got {self.attention_window}",
        )
        check(self.vocab_size >= 2, "vocab_size must be >= 2")
        check(
            self.loss_tile_tokens >= 0,
            f"loss_tile_tokens must be >= 0 (0: sized from the vocabulary), got "
            f"{self.loss_tile_tokens}",
        )
        check(self.init_std > 0, f"init_std must be > 0, got {self.init_std}")
        check(
            self.num_heads % self.num_kv_heads == 0,
            f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}",
        )
        check(self.head_dim % 2 == 0, "head_dim must be even (RoPE)")
        check(
            self.encoder_layers >= 0 and self.decoder_layers >= 0 and self.concept_layers >= 0,
            "layer counts must be >= 0",
        )
        if self.chunk.enabled:
            check(self.decoder_layers >= 0, "decoder_layers must be >= 0")
        ch, cq, ckv = self.c_hidden, self.c_heads, self.c_kv_heads
        check(
            cq % ckv == 0,
            f"concept_num_heads={cq} must be a multiple of concept_num_kv_heads={ckv}",
        )
        check(ch >= 1, "concept_hidden_size must be >= 1")
        if self.loop_times:
            check(
                0 <= self.loop_start < self.loop_end <= self.concept_layers,
                f"loop range [{self.loop_start}, {self.loop_end}) must "
                f"lie within the {self.concept_layers} concept layers",
            )
        jd = self.chunk.joint_decoding_layers
        check(
            jd == -1 or 0 <= jd <= self.decoder_layers,
            "chunk.joint_decoding_layers must be -1 or in [0, "
            f"decoder_layers={self.decoder_layers}], got {jd}",
        )
        check(
            self.decoder_mode in ("joint", "cross_attention"),
            f"decoder_mode: got {self.decoder_mode!r}, allowed values: 'joint', 'cross_attention'",
        )
        if self.decoder_mode == "cross_attention":
            check(
                self.chunk.enabled,
                "decoder_mode 'cross_attention' attends over concepts: it needs chunking "
                "(chunk.enabled: true); the MoE baseline has none (use decoder_mode 'joint')",
            )
            check(
                self.num_joint_layers >= 1,
                f"decoder_mode 'cross_attention' with decoder_layers={self.decoder_layers} and "
                f"chunk.joint_decoding_layers={jd} gives no decoder layer a cross-attention; "
                "use decoder_layers >= 1 and joint_decoding_layers -1 (all) or >= 1",
            )

    # Resolved concept-model sizes.
    @property
    def c_hidden(self) -> int:
        return self.concept_hidden_size or self.hidden_size

    @property
    def c_heads(self) -> int:
        return self.concept_num_heads or self.num_heads

    @property
    def c_kv_heads(self) -> int:
        return self.concept_num_kv_heads or self.num_kv_heads

    @property
    def c_moe(self) -> MoEConfig:
        return self.concept_moe or self.moe

    @property
    def concept_schedule(self) -> list[int]:
        """Order in which concept layers run, loops included (shared weights)."""
        order = list(range(self.concept_layers))
        if self.loop_times:
            loop = list(range(self.loop_start, self.loop_end))
            order = order[: self.loop_end] + loop * self.loop_times + order[self.loop_end :]
        return order

    @property
    def num_joint_layers(self) -> int:
        """Decoder layers that read the concepts (eq. 11, or cross-attention per `decoder_mode`)."""
        if not self.chunk.enabled:
            return 0
        jd = self.chunk.joint_decoding_layers
        return self.decoder_layers if jd == -1 else jd

    def baseline(self) -> "ModelConfig":
        """The same model with chunking disabled (the MoE baseline; it has no concepts to cross-attend to)."""
        return replace(self, chunk=replace(self.chunk, enabled=False), decoder_mode="joint")


@dataclass
class ConvertConfig(ValidatedOnInit):
    """How a pretrained MoE becomes a ConceptMoE (vlm.model.convert): the options of `vlm
    convert` and the training config's `convert` section (stage 'ct'). The source checkpoint
    defines the LLM architecture."""

    encoder_layers: int = 2
    decoder_layers: int = 2
    joint_decoding_layers: int = -1
    # how the converted decoder reads the concepts (model.decoder_mode); either way the new read
    # starts at zero (eq. 11's W^c, or the cross-attention's W_O), so the conversion stays lossless
    # with all boundaries on
    decoder_mode: Literal["joint", "cross_attention"] = "joint"
    target_ratio: float = 2.0
    # reallocation strategy 1: more activated experts in the concept model
    concept_top_k: int | None = None
    loop: tuple[int, int, int] | None = None  # strategy 2: (start, end, times) concept-layer loops
    # Grove upcycling (section 3.4): every MoE layer gets this many adjugate experts,
    # down-projections at zero so the converted model still computes the source; 0 keeps the
    # source's experts as they are
    grove_groups: int = 0
    grove_hidden: int = 128
    grove_lambda: float = 0.05

    def validate(self) -> None:
        check(
            self.encoder_layers >= 1 and self.decoder_layers >= 1,
            "convert.encoder_layers and convert.decoder_layers must be "
            f">= 1, got {self.encoder_layers}, {self.decoder_layers}",
        )
        check(self.target_ratio > 1, f"convert.target_ratio must be > 1, got {self.target_ratio}")
        check(
            self.decoder_mode in ("joint", "cross_attention"),
            f"convert.decoder_mode: got {self.decoder_mode!r}, "
            "allowed values: 'joint', 'cross_attention'",
        )
        check(
            self.decoder_mode == "joint" or self.joint_decoding_layers != 0,
            "convert.decoder_mode 'cross_attention' with joint_decoding_layers=0 "
            "gives no decoder layer a cross-attention; use -1 (all) or >= 1",
        )
        check(
            self.loop is None or len(self.loop) == 3,
            f"convert.loop must be [start, end, times], got {self.loop}",
        )
        check(
            self.concept_top_k is None or self.concept_top_k >= 1,
            "convert.concept_top_k must be >= 1 or null",
        )
        check(
            self.grove_groups >= 0 and self.grove_hidden >= 1,
            "convert.grove_groups must be >= 0 and convert.grove_hidden >= 1",
        )

    def check_split(self, total_layers: int) -> None:
        """The source's layers must leave at least one concept layer between the encoder and the decoder."""
        check(
            self.encoder_layers + self.decoder_layers < total_layers,
            f"encoder_layers={self.encoder_layers} + decoder_layers={self.decoder_layers} "
            f"must leave at least one concept layer of the source's {total_layers}",
        )
