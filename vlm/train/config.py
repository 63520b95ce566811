"""TrainConfig: the one YAML of a training run (model, vision, data,
optimisation, DeepSpeed, logging).

Every section is a validated dataclass (configs/config.py): a wrong key or value stops the run at
once with one line naming the dotted field and what is allowed.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from configs.config import (
    ConfigError,
    ValidatedOnInit,
    apply_overrides,
    check,
    flatten,
    from_dict,
    load_yaml,
)
from data_pipelines.config import DataConfig, SourceConfig
from data_pipelines.default_dataset import IMAGE_PARTS
from vision.config import VisionConfig
from vision.image_processor import ImageProcessorConfig
from vlm.model.config import ConvertConfig, ModelConfig
from vlm.train.loss_config import LossConfig, move_loss_keys, stderr_line


@dataclass
class OptimConfig(ValidatedOnInit):
    """AdamW and its schedule. `lr` is the peak rate of the LLM's hidden matrices (muP: at base width)."""

    lr: float = 3e-3
    min_lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = 50
    decay_fraction: float = 0.2  # WSD: share of the post-warm-up steps spent decaying
    clip: float = 1.0  # global gradient-norm clip; 0 disables
    # Rows per optimizer step over every rank: the global batch. The micro-batches per rank follow
    # from it and the number of ranks, global_batch_rows / (data.rows_per_batch x ranks), so a run
    # trains the same steps on 1 or on 8 processes. null: data.rows_per_batch x grad_accum x the
    # ranks the run starts on, recorded in RUN_DIR/config.yaml (a resume on other ranks keeps it).
    global_batch_rows: int | None = None
    # micro-batches per optimizer step per rank: where global_batch_rows is null, what the global
    # batch is made of on the ranks the run starts on; else derived from it (config.yaml shows it)
    grad_accum: int = 1

    def validate(self) -> None:
        check(self.lr > 0, f"optim.lr must be > 0, got {self.lr}")
        check(
            0 <= self.min_lr <= self.lr,
            f"optim.min_lr must be in [0, lr={self.lr}], got {self.min_lr}",
        )
        check(self.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        check(
            all(0 <= b < 1 for b in self.betas),
            f"optim.betas must lie in [0, 1), got {list(self.betas)}",
        )
        check(self.eps > 0, f"optim.eps must be > 0, got {self.eps}")
        check(self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        check(
            0 < self.decay_fraction <= 1,
            f"optim.decay_fraction must be in (0, 1], got {self.decay_fraction}",
        )
        check(self.clip >= 0, f"optim.clip must be >= 0 (0 disables), got {self.clip}")
        check(self.grad_accum >= 1, f"optim.grad_accum must be >= 1, got {self.grad_accum}")
        check(
            self.global_batch_rows is None or self.global_batch_rows >= 1,
            f"optim.global_batch_rows must be >= 1 or null, got {self.global_batch_rows}",
        )


@dataclass
class DeepSpeedConfig(ValidatedOnInit):
    """The DeepSpeed engine. The same code runs on CPU (gloo) and GPU (nccl)."""

    zero_stage: Literal[0, 1, 2, 3] = 0
    bf16: bool = False
    offload_optimizer: Literal["none", "cpu"] = "none"
    offload_param: Literal["none", "cpu"] = "none"  # ZeRO-3 only
    overlap_comm: bool = False
    reduce_bucket_size: int = 50_000_000
    # a DeepSpeed JSON merged over the generated config (e.g. configs/ds_zero2.json)
    config_file: str | None = None
    # merged last; for keys this dataclass does not name
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        check(
            self.offload_param == "none" or self.zero_stage == 3,
            f"deepspeed.offload_param={self.offload_param!r} "
            f"needs zero_stage 3, got {self.zero_stage}",
        )
        check(
            self.offload_optimizer == "none" or self.zero_stage >= 1,
            f"deepspeed.offload_optimizer={self.offload_optimizer!r} needs zero_stage >= 1",
        )
        check(self.reduce_bucket_size >= 1, "deepspeed.reduce_bucket_size must be >= 1")
        if self.config_file:
            check(
                Path(self.config_file).is_file(),
                f"deepspeed.config_file {self.config_file} does not exist",
            )


EXCHANGES = ("variable", "static")


@dataclass
class ParallelConfig(ValidatedOnInit):
    """How the ranks share the work beyond data parallelism (vlm.train.layout; docs/training.md,
    "Expert parallelism")."""

    # Each MoE layer's routed experts split over this many ranks (tokens exchanged with
    # all-to-all); the ranks holding the same shard are its ZeRO data-parallel replicas. Divides the
    # number of ranks and every MoE layer's expert count. 1: every rank holds every expert.
    expert: int = 1
    # Rows one rank sends to one expert rank per MoE layer, as a multiple of its token slots / expert
    # (N x top_k / expert): 1.25 leaves 25 % room over a perfect balance; slots past it are computed
    # by no expert and counted (moe/overflow). null: every slot fits (dropless, exact).
    capacity_factor: float | None = None
    # How a MoE layer's tokens travel to their experts' ranks (vlm.model.expert_parallel): variable,
    # each block at its real size (the counts exchanged first and read on the host once per layer;
    # a compiled block breaks its graph there); static, every block in a buffer of the capacity's
    # rows (no host read: fullgraph compilation; dropless, it sends and computes P x the tokens).
    exchange: str = "variable"
    # Each row of a micro-batch split over this many consecutive ranks (sequence parallelism; the
    # world / sequence data-parallel replicas read micro-batches of their own). Divides the number
    # of ranks (docs/training.md, "Sequence parallelism"; vlm.train.sequence_shard says what it
    # refuses).
    sequence: int = 1
    # Seconds any rank waits for the others: at start-up (a rank that never started) and in every
    # collective after it (a stalled rank: a hung GPU, a dead mount). Past it the job ends on every
    # rank with one line naming the timeout and, where it can be told, the rank that fell behind.
    # DeepSpeed's own default; a stretch only rank 0 works through (building the default data, the
    # vision warm-up) must fit in it.
    timeout_s: float = 1800.0

    @property
    def variable_exchange(self) -> bool:
        """Whether MoE layers exchange blocks at their real sizes (then a compiled block is not one
        graph: vlm.train.engine.compile_model)."""
        return self.expert > 1 and self.exchange == "variable"

    def validate(self) -> None:
        check(self.expert >= 1, f"parallel.expert must be >= 1, got {self.expert}")
        check(self.sequence >= 1, f"parallel.sequence must be >= 1, got {self.sequence}")
        check(self.timeout_s > 0, f"parallel.timeout_s must be > 0 seconds, got {self.timeout_s}")
        check(
            self.exchange in EXCHANGES,
            f"parallel.exchange must be one of {', '.join(EXCHANGES)}, got {self.exchange!r}",
        )
        check(
            self.capacity_factor is None or self.capacity_factor > 0,
            f"parallel.capacity_factor must be > 0 or null (dropless), got {self.capacity_factor}",
        )


@dataclass
class ParamsConfig(ValidatedOnInit):
    """How parameters are grouped: DLCM's decoupled muP, per-part learning-rate multipliers, freezing."""

    mup: bool = False
    mup_base_width: int = 128  # d_base of DLCM eq. 18
    mup_token_lr: float | None = None  # eta_token^base (eq. 19); None = optim.lr
    mup_concept_lr: float | None = None  # eta_concept^base (eq. 20); None = optim.lr
    concept_lr_mult: float = 1.0  # without muP: concept model rate = lr * this
    # vision encoder rate = lr * this (read when the encoder trains)
    vision_lr_mult: float = 0.5
    projector_lr_mult: float = 0.5  # projector (and patch merger) rate = lr * this
    # module prefixes, e.g. ["vision.encoder", "lm.embed"]
    freeze: list[str] = field(default_factory=list)

    def validate(self) -> None:
        check(
            self.mup_base_width >= 1,
            f"params.mup_base_width must be >= 1, got {self.mup_base_width}",
        )
        for name in ("concept_lr_mult", "vision_lr_mult", "projector_lr_mult"):
            check(
                getattr(self, name) >= 0, f"params.{name} must be >= 0, got {getattr(self, name)}"
            )
        for name in ("mup_token_lr", "mup_concept_lr"):
            v = getattr(self, name)
            check(v is None or v > 0, f"params.{name} must be > 0 or null, got {v}")


REPORTERS = ("tensorboard", "wandb")


@dataclass
class LoggingConfig(ValidatedOnInit):
    # optimizer steps between metrics.jsonl lines / TensorBoard scalars
    log_every: int = 1
    eval_every: int = 100  # steps between held-out evals and dashboard images; 0 disables
    eval_batches: int = 2  # held-out batches per eval
    # where metrics go besides metrics.jsonl: "tensorboard" (RUN_DIR/tb, the dashboard) and/or
    # "wandb" (RUN_DIR/wandb; the `track` extra). wandb_mode "offline" needs no network: `wandb
    # sync` uploads later.
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    wandb_project: str = "conceptmoe-vlm"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    histogram_every: int = 25  # steps between p / expert-load histograms; 0 disables
    progress: bool = True  # tqdm bar on rank 0
    # Held-out data for evals; empty = the default dataset's val split when data.sources is empty
    # (else no held-out loss: the dashboard pictures then come from the current training batch).
    eval_sources: list[SourceConfig] = field(default_factory=list)

    def validate(self) -> None:
        check(self.log_every >= 1, f"logging.log_every must be >= 1, got {self.log_every}")
        check(self.eval_every >= 0, f"logging.eval_every must be >= 0, got {self.eval_every}")
        check(self.eval_batches >= 1, f"logging.eval_batches must be >= 1, got {self.eval_batches}")
        check(
            self.histogram_every >= 0,
            f"logging.histogram_every must be >= 0, got {self.histogram_every}",
        )
        for name in self.report_to:
            check(
                name in REPORTERS,
                f"logging.report_to entry {name!r}: allowed "
                f"values {', '.join(map(repr, REPORTERS))}",
            )
        check(
            "wandb" not in self.report_to or importlib.util.find_spec("wandb") is not None,
            "logging.report_to includes 'wandb' but wandb is not installed: pip install -e "
            '".[track]"',
        )


@dataclass
class CheckpointConfig(ValidatedOnInit):
    save_every: int = 500  # optimizer steps between checkpoints; 0 = only at the end
    keep_last: int = 2
    # write each checkpoint in a background thread per rank (the step waits only while the state
    # is copied to host memory); false: the step waits for the write (vlm.train.ckpt_save)
    background: bool = True

    def validate(self) -> None:
        check(self.save_every >= 0, f"checkpoint.save_every must be >= 0, got {self.save_every}")
        check(self.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {self.keep_last}")


@dataclass
class RunConfig(ValidatedOnInit):
    """What this run is: its stage, length, seed and fault handling."""

    stage: Literal["text", "vl", "ct"] = "vl"
    max_steps: int = 3000
    seed: int = 0
    deterministic: bool = True  # torch deterministic algorithms (bitwise resume on CPU)
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    max_nonfinite_in_row: int = 5  # this many skipped (non-finite) steps in a row stop the run
    # the share of the samples read that the loader may skip (bad, too long for a row, ...) before
    # the run stops, at the first log past it once 50 samples were read (the importers'
    # --max-skip-share); 1 = never stop
    max_skip_share: float = 0.1
    # vl/text: weights (whole VLM, or LLM only) from a run dir, its final/ or a checkpoint
    init_from: str | None = None
    # ct: a pretrained MoE folder (ours, Qwen3-MoE, Mixtral) or a `vlm convert` output
    convert_from: str | None = None
    # DLCM's global parser: the ratio loss sees the statistics of the whole global batch (every
    # micro-batch and rank); false = each micro-batch's own statistics (DLCM Table 4's ablation)
    global_parser: bool = True
    vqa_eval: bool = True  # run the built-in VQA eval at the end when available
    vqa_max_samples: int = 1000  # every question of the default dataset's test split (~900)

    def validate(self) -> None:
        check(self.max_steps >= 1, f"train.max_steps must be >= 1, got {self.max_steps}")
        check(self.threads >= 0, f"train.threads must be >= 0, got {self.threads}")
        check(
            self.max_nonfinite_in_row >= 1,
            f"train.max_nonfinite_in_row must be >= 1, got {self.max_nonfinite_in_row}",
        )
        check(
            self.vqa_max_samples >= 1,
            f"train.vqa_max_samples must be >= 1, got {self.vqa_max_samples}",
        )
        check(
            0 <= self.max_skip_share <= 1,
            f"train.max_skip_share must be in [0, 1], got {self.max_skip_share}",
        )
        if self.stage == "ct":
            check(
                bool(self.convert_from),
                "train.stage 'ct' needs train.convert_from (a pretrained MoE folder)",
            )
        if self.init_from:
            check(Path(self.init_from).exists(), f"train.init_from {self.init_from} does not exist")
        if self.convert_from:
            check(
                Path(self.convert_from).exists(),
                f"train.convert_from {self.convert_from} does not exist",
            )


@dataclass
class VisionWarmupConfig(ValidatedOnInit):
    """Before step 0, a fresh vision encoder learns the words of the training data's captions from
    their images (vlm/train/vision_warmup.py). Skipped when the encoder comes from
    `train.init_from`, a pretrained vision.timm_checkpoint or a resumed run."""

    steps: int = 1000  # 0: no warm-up
    images_per_step: int = 32
    lr: float = 2e-3  # AdamW, linear warm-up then cosine to 0
    weight_decay: float = 0.05
    min_word_count: int = 20  # words in fewer captions than this are not predicted
    # caption samples read from the training sources (in shard order)
    max_captions: int = 4000
    # captions scored after the warm-up (the default data's val split)
    held_out: int = 300
    # Keep the encoder as the warm-up left it for the whole run (LLaVA-style: the LLM learns to read
    # a fixed, pretrained encoder). Applies on resume and after init_from too, so the optimizer's
    # groups depend on the config alone. No backward through the tower: 1.35x the tokens/s of the
    # CPU default.
    freeze_after: bool = True

    def validate(self) -> None:
        check(self.steps >= 0, f"vision_warmup.steps must be >= 0, got {self.steps}")
        for name in ("images_per_step", "min_word_count", "max_captions"):
            check(
                getattr(self, name) >= 1,
                f"vision_warmup.{name} must be >= 1, got {getattr(self, name)}",
            )
        check(
            self.max_captions >= self.images_per_step,
            f"vision_warmup.max_captions={self.max_captions} "
            f"must be >= images_per_step={self.images_per_step}",
        )
        check(self.lr > 0, f"vision_warmup.lr must be > 0, got {self.lr}")
        check(
            self.weight_decay >= 0,
            f"vision_warmup.weight_decay must be >= 0, got {self.weight_decay}",
        )
        check(self.held_out >= 0, f"vision_warmup.held_out must be >= 0, got {self.held_out}")


@dataclass
class TrainConfig(ValidatedOnInit):
    model: ModelConfig = field(default_factory=ModelConfig)
    vision: VisionConfig | None = field(default_factory=VisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    # the loss terms' weights (vlm.train.losses): the run's, not the model's
    loss: LossConfig = field(default_factory=LossConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    params: ParamsConfig = field(default_factory=ParamsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: RunConfig = field(default_factory=RunConfig)
    # stage 'ct' (defined with vlm.model.convert)
    convert: ConvertConfig = field(default_factory=ConvertConfig)
    vision_warmup: VisionWarmupConfig = field(default_factory=VisionWarmupConfig)

    def __post_init__(self) -> None:
        """With a vision section the loader patchifies with vision.processor (what the encoder
        reads), so that the patch geometry is stated once; `data.processor` is for configs without
        one. A saved run config repeats it under data (to_dict writes both), which is accepted when
        it equals vision.processor."""
        if self.vision is not None and self.data.processor is not self.vision.processor:
            check(
                self.data.processor in (ImageProcessorConfig(), self.vision.processor),
                "data.processor is set, but with a vision section the "
                "loader uses vision.processor: state the image processor "
                "there only (data.processor is for configs without vision)",
            )
            self.data = replace(self.data, processor=self.vision.processor)
        super().__post_init__()

    def validate(self) -> None:
        stage = self.train.stage
        if stage == "text":
            check(
                self.vision is None,
                "train.stage 'text' trains the LLM alone: set vision: null (or use stage 'vl')",
            )
        if stage == "vl":
            check(
                self.vision is not None, "train.stage 'vl' needs a vision section (vision: {...})"
            )
        # vision_warmup applies to a fresh tower in stage 'vl' only; elsewhere (no tower, stage
        # 'text' or 'ct', a pretrained tower: vlm.train.stages.pretrained_tower) it has nothing to
        # warm and is not run, so a config on `base: default.yaml` need not reset it
        if (
            self.vision_warmup.steps
            and stage == "vl"
            and self.vision is not None
            and not self.vision.timm_checkpoint
        ):
            check(
                not self.vision.freeze_encoder
                and not any(p in ("vision", "vision.encoder") for p in self.params.freeze),
                "vision_warmup.steps > 0 trains the vision encoder, which this config "
                "freezes (vision.freeze_encoder / params.freeze): set vision_warmup.steps: 0",
            )
        ep = self.parallel.expert
        # a continued model's expert counts are the checkpoint's: checked once it is built
        # (vlm.train.expert_parallel.set_up)
        if ep > 1 and not (self.train.init_from or self.train.convert_from):
            for name, moe in (("moe", self.model.moe), ("concept_moe", self.model.concept_moe)):
                check(
                    moe is None or moe.num_experts % ep == 0,
                    f"parallel.expert={ep} does not divide model.{name}.num_experts="
                    f"{moe.num_experts if moe else 0}: use a divisor of it",
                )
        if self.params.mup:
            check(
                not self.model.tie_embeddings,
                "params.mup needs model.tie_embeddings: false (the "
                "output layer gets its own rate and logit scale)",
            )
        if self.vision is None:
            image_parts = [
                p
                for p in IMAGE_PARTS
                if not self.data.default_parts or p in self.data.default_parts
            ]
            check(
                bool(self.data.sources) or not image_parts,
                f"vision: null, but the default dataset's parts {image_parts} carry "
                "images: set data.default_parts: [text] (or give a vision section)",
            )
            # params.vision_lr_mult / projector_lr_mult have no parameters to scale then: they are
            # not read
        for prefix in self.params.freeze:
            check(
                prefix.split(".")[0] in ("lm", "vision"),
                f"params.freeze entry {prefix!r} must start with "
                "'lm.' or 'vision.' (a module prefix of the model)",
            )
            check(
                not (prefix.startswith("vision") and self.vision is None),
                f"params.freeze entry {prefix!r} names the vision "
                "tower but the config has no vision section",
            )


# Model keys a run that continues a checkpoint (train.init_from, train.convert_from) may set to a
# value other than the checkpoint's: they change how the model trains, not what its stored tensors
# compute with every boundary on (the loss weights are no model keys but the run's `loss:` section;
# conversion sets the lossless start: ratio target, concept top-k
# and loops go through `convert:` on a raw source, see vlm.model.convert.to_conceptmoe_config). A
# model key not listed here must equal the stored value. `vocab_size` may only grow (rows added for
# tokens added to the tokenizer, vlm.model.convert.fit_vocab).
MAY_CHANGE_FROM_CHECKPOINT = (
    "chunk.target_ratio",
    "chunk.modality_target_ratios",
    "chunk.document_slack",
    "chunk.tau",
    "chunk.boundary_noise",
    "chunk.noise_sigma",
    "moe.bias_update_rate",
    # its selection bias starts at zero: the routing is the stored one at start
    "moe.bias_update",
    "moe.loss_free_balancing",
    "concept_moe.top_k",
    "concept_moe.bias_update_rate",
    "concept_moe.bias_update",
    "concept_moe.loss_free_balancing",
    "moe.dispatch",
    "concept_moe.dispatch",
    "loop_start",
    "loop_end",
    "loop_times",
    "attn_backend",
    "init_std",
    "compile",
    "activation_checkpoint",
    "loss_tile_tokens",
    "chunk.capacity_slack",
    "chunk.eval_capacity_slack",
)


def load_train_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML file (or none: the defaults), apply dotted overrides,
    validate. Raises ConfigError.

    A config that continues a checkpoint (train.init_from / train.convert_from) takes its model
    section from the checkpoint: only the model keys this file itself and the overrides state
    count (its `base:` files' model section describes another model), and `model_stated` records
    them for vlm.train.stages.merge_model_section. Loss weights stated the way older versions did,
    in the model section, are moved to the loss section with a one-line note each
    (vlm.train.loss_config.move_loss_keys)."""
    data = load_yaml(path) if path else {}
    apply_overrides(data, overrides or [])
    data = migrate_run_config(data, say=stderr_line)
    run = data.get("train") or {}
    stated = None
    if isinstance(run, dict) and (run.get("init_from") or run.get("convert_from")):
        own = _own_yaml(path) if path else {}
        apply_overrides(own, [o for o in overrides or [] if o.strip().startswith("model.")])
        own = migrate_run_config(own)
        model = own.get("model") or {}
        data["model"] = model
        stated = set(flatten(model)) if isinstance(model, dict) else set()
    check_not_shadowed(data)
    cfg = from_dict(TrainConfig, data)
    cfg.model_stated = stated
    return cfg


def check_not_shadowed(data: dict) -> None:
    """A key the config states must act: `model.chunk.target_ratio` does nothing where every
    modality has a stated target of its own, so a target_ratio that is none of theirs is refused in
    one line naming both (a modality set to null follows target_ratio; a target_ratio equal to one
    of theirs, as every saved config.yaml states it, is taken as restating it). `data`: the merged
    YAML chain and overrides, before defaults."""
    chunk = (data.get("model") or {}).get("chunk") if isinstance(data.get("model"), dict) else None
    if not isinstance(chunk, dict) or "target_ratio" not in chunk:
        return
    per = chunk.get("modality_target_ratios")
    if (
        isinstance(per, dict)
        and per
        and all(v is not None for v in per.values())
        and not any(_same_number(v, chunk["target_ratio"]) for v in per.values())
    ):
        raise ConfigError(
            f"model.chunk.target_ratio={chunk['target_ratio']} is shadowed by "
            f"model.chunk.modality_target_ratios={per}: every modality has its own target; "
            "set a modality to null to follow target_ratio, or state only one of the two"
        )


def _same_number(a, b) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return False


def _own_yaml(path: str | Path) -> dict:
    """The file's own mapping, without what its `base:` brings."""
    import yaml

    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    return data if isinstance(data, dict) else {}


def migrate_run_config(data: dict, say=None) -> dict:
    """Keys that earlier versions wrote into RUN_DIR/config.yaml (or a config stated), in today's
    form, so that old runs still resume and serve as `init_from`: `logging.tensorboard: bool`
    became `logging.report_to`; the loss weights moved from the model section to `loss:`
    (`say(line)`: told of each, None: quiet)."""
    move_loss_keys(data, say)
    logging_ = data.get("logging")
    if isinstance(logging_, dict) and "tensorboard" in logging_:
        on = logging_.pop("tensorboard")
        logging_.setdefault("report_to", ["tensorboard"] if on else [])
    return data


__all__ = [
    "TrainConfig",
    "OptimConfig",
    "LossConfig",
    "DeepSpeedConfig",
    "ParallelConfig",
    "ParamsConfig",
    "LoggingConfig",
    "CheckpointConfig",
    "RunConfig",
    "ConvertConfig",
    "load_train_config",
    "ConfigError",
]
