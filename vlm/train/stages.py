"""Training stages: what model a run starts from.

- text: a fresh ConceptMoE LLM (no vision tower), trained on text.
- vl:   the VLM: a vision tower and a projector in front of the LLM, fresh or, with
  `train.init_from`, carried
        over from an earlier run (its final/ export, a checkpoint, or the run directory itself: its final/
        when present, else its latest checkpoint). Whatever the source holds is carried: the whole VLM
        (vision encoder, projector, LLM) from a VL run, the LLM alone from a text run.
- ct:   continual training of a pretrained MoE converted into a ConceptMoE by vlm.model.convert
        (ConceptMoE section 4.3; the converter owns the weight mapping and the reallocation).

Every rank builds and loads only its share (vlm.model.shares: its expert shard, its ZeRO-3
partitions, in the training dtype; vlm.train.build_share), reading from the source only the rows
of each tensor that cover it (vlm.model.share_load, vlm.train.checkpoint_tensors), with the weights
of a whole build and load for the same seed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from configs.config import ConfigError, flatten, to_dict
from data_pipelines.tokenizer import (
    Tokenizer,
    TokenizerError,
    is_source_tokenizer_dir,
    load_tokenizer,
)
from vlm.model.config import ModelConfig, model_config_from
from vlm.model.convert import NEW_PARTS, conversion_init_, source_tensors
from vlm.model.hf import MODEL_TYPE, checked_export_config
from vlm.model.multimodal import ConceptMoEVLM
from vlm.model.share_init import whole_shape
from vlm.model.share_load import Stored, export_tensors, load_share_, state_targets, whole_shapes
from vlm.model.shares import WHOLE, Sharding
from vlm.model.weights_check import SKIP_HINT, checksums_skipped
from vlm.train.build_share import build_vlm, consume_build, fill_grown_rows_, grow_vocab_
from vlm.train.checkpoint import damaged_file, latest_checkpoint
from vlm.train.checkpoint_tensors import checkpoint_tensors
from vlm.train.config import MAY_CHANGE_FROM_CHECKPOINT, TrainConfig
from vlm.train.run_config import evolve


def resolve_weights_path(path: Path) -> Path:
    """A run dir -> its final/ (or latest checkpoint); a final/ or checkpoint dir stays as it is."""
    path = Path(path)
    if (path / "config.json").is_file() or (path / "meta.json").is_file():
        return path
    if (path / "final" / "config.json").is_file():
        return path / "final"

    ckpt = latest_checkpoint(path / "checkpoints")
    if ckpt is not None:
        return ckpt
    raise ConfigError(
        f"train.init_from {path}: not an exported model (config.json), a "
        "checkpoint (meta.json) or a run directory with final/ or checkpoints/"
    )


def stored_tensors(path: Path) -> Stored:
    """The tensors of the VLM stored at `path` (an export, a checkpoint or a run directory), by the
    model's names, read by rows (vlm.model.share_load): an export's safetensors after its checks,
    a checkpoint's module memory-mapped after its checksums (vlm.train.checkpoint_tensors)."""
    path = resolve_weights_path(path)
    if (path / "config.json").is_file():
        checked_export_config(path)
        return export_tensors(path)

    bad = None if checksums_skipped() else damaged_file(path)
    if bad is not None:  # the checksums the checkpoint recorded, as a resume checks them
        raise ConfigError(
            f"train.init_from {path}: a damaged checkpoint, {bad} "
            f"against the checksums in its meta.json; {SKIP_HINT}"
        )
    scale = _checkpoint_logit_scale(path.parent.parent / "config.yaml")
    fold = None
    if scale is not None:

        def fold(name: str, t: torch.Tensor) -> torch.Tensor:
            return t * scale if name == "lm.lm_head.weight" else t

    return checkpoint_tensors(path, fold)


def read_model_state(path: Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) state dict of the VLM stored at `path` (export or checkpoint)."""
    stored = stored_tensors(Path(path))
    return {k: stored.whole(k) for k in stored.shapes()}


def _checkpoint_logit_scale(run_config: Path) -> float | None:
    """A muP run's checkpoint holds lm_head without its logit multiplier (a forward hook applies
    it): the multiplier to fold in so that every source reads as the function it computes, like an
    export does (None: not a muP run)."""
    if not run_config.is_file():
        return None
    import yaml

    run = yaml.safe_load(run_config.read_text()) or {}
    params, model = run.get("params") or {}, run.get("model") or {}
    if params.get("mup"):
        return params.get("mup_base_width", 128) / model.get("hidden_size", 1)
    return None


def load_pretrained_weights(
    model: ConceptMoEVLM, path: Path, grow: list[int] | None = None, sharding: Sharding = WHOLE
) -> dict[str, int]:
    """Copy a stored model's tensors into `model`, each rank its share (`sharding`): the LLM
    (`lm.*`, required) and, when the source has them, the vision encoder and projector
    (`vision.*`). `grow`: vocabulary sizes the embedding (and head) grow through after the stored
    rows (vlm.model.convert.fit_vocab's rule, kept at the share: build_share.fill_grown_rows_).
    Returns how many tensors each part received."""
    stored = stored_tensors(Path(path))
    have = stored.shapes()
    parts = {"lm": model.lm, "vision": model.vision}
    loaded: dict[str, int] = {}
    plan: list[tuple[str, dict]] = []
    for part, module in parts.items():
        src = {k[len(part) + 1 :]: v for k, v in have.items() if k.startswith(part + ".")}
        if not src:
            if part == "lm":
                raise ConfigError(
                    f"train.init_from {path}: the stored model "
                    "has no LLM weights (no 'lm.' tensors)"
                )
            continue  # a text-stage source: the vision tower starts fresh
        if module is None:
            continue  # a text stage started from a VL run keeps only the LLM
        targets = state_targets(module)
        mine = whole_shapes(targets)
        missing = sorted(set(mine) - set(src))
        shape_bad = [k for k in mine if k in src and src[k] != mine[k]]
        extra = sorted(set(src) - set(mine))  # e.g. qk_norm=false would drop the stored q/k norms
        if missing or shape_bad or extra:
            k = (missing or shape_bad or extra)[0]
            what = (
                "is missing"
                if missing
                else f"has shape {tuple(src[k])}, the config needs {tuple(mine[k])}"
                if shape_bad
                else "is stored but has no place in the model"
            )
            section = "model" if part == "lm" else "vision"
            raise ConfigError(
                f"train.init_from {path}: tensor {part}.{k} {what}; "
                f"the {section} section must match the stored model's"
            )
        plan.append((part, targets))
    old = whole_shape(model.lm.embed.weight)[0]
    grown = grow_vocab_(model, max(grow or [0]), sharding)
    for part, targets in plan:
        if grown and part == "lm":  # the targets grown since: the model's tensors now
            targets = {**targets, **state_targets(model.lm)}
        load_share_(
            {f"{part}.{k}": t for k, t in targets.items()},
            stored,
            sharding=sharding,
            rows_of=lambda name: old if name in _VOCAB_ROWS else 1 << 62,
        )
        loaded[part] = len(targets)
    if grown:
        fill_grown_rows_(model, stored.whole, old, sorted(grow or []), sharding)
    return loaded


_VOCAB_ROWS = ("lm.embed.weight", "lm.lm_head.weight")


def _model_dict(mc: ModelConfig) -> dict:
    """to_dict with the concept model's MoE spelled out (null there means "as moe"), so that a
    config that sets concept_moe.top_k compares with what the stored model runs."""
    d = to_dict(mc)
    d["concept_moe"] = to_dict(mc.c_moe)
    return d


def _set(d: dict, key: str, value) -> None:
    *path, last = key.split(".")
    for k in path:
        if not isinstance(d.get(k), dict):
            d[k] = {}
        d = d[k]
    d[last] = value


def merge_model_section(stored: ModelConfig, cfg: TrainConfig, where: Path) -> ModelConfig:
    """The checkpoint's model section with the config's permitted changes
    (MAY_CHANGE_FROM_CHECKPOINT) on top. A stated key whose value differs from the stored one and
    may not change is refused in one line. The keys stated are those the config file and overrides
    name (load_train_config); a config built otherwise states every key whose value is not the
    project default."""
    mine, base = flatten(_model_dict(cfg.model)), flatten(_model_dict(stored))
    stated = getattr(cfg, "model_stated", None)
    if stated is None:
        default = flatten(_model_dict(ModelConfig()))
        stated = {k for k, v in mine.items() if k not in default or default[k] != v}
    else:  # a section stated as a whole (modality_target_ratios: {...}) compares key by key
        stated = {k for k in mine if any(k == s or k.startswith(s + ".") for s in stated)}
    out = _model_dict(stored)
    for key in sorted(stated):
        value, old = mine.get(key), base.get(key)
        if value == old:
            continue
        if key == "vocab_size" and old is not None and value > old:
            _set(out, key, value)  # grown by fit_vocab below: the stored rows stay
            continue
        if key.startswith(MAY_CHANGE_FROM_CHECKPOINT):
            _set(out, key, value)
            continue
        raise ConfigError(
            f"model.{key}: the checkpoint {where} has {old!r}, this config {value!r}; it may "
            "not change when continuing a checkpoint (drop it to keep the stored value)"
        )
    if out["concept_moe"] == to_dict(stored.moe) and stored.concept_moe is None:
        out["concept_moe"] = None
    vocab = out.pop("vocab_size")
    merged = model_config_from(dict(out, vocab_size=stored.vocab_size))
    return dataclasses.replace(merged, vocab_size=vocab) if vocab != stored.vocab_size else merged


def stored_model_config(path: Path) -> ModelConfig | None:
    """The model section a checkpoint was made with: an export's config.json, or the run config a
    checkpoint's run directory holds (RUN_DIR/config.yaml); None when neither says."""
    path = resolve_weights_path(path)
    import json

    if (path / "config.json").is_file():
        info = json.loads((path / "config.json").read_text())
        if info.get("model_type") == MODEL_TYPE and isinstance(info.get("model"), dict):
            return model_config_from(info["model"])
        return None
    run_config = path.parent.parent / "config.yaml"
    if run_config.is_file():
        import yaml

        model = (yaml.safe_load(run_config.read_text()) or {}).get("model")
        return model_config_from(model) if isinstance(model, dict) else None
    return None


def convert_pretrained(
    cfg: TrainConfig,
    sharding: Sharding = WHOLE,
    ds_json: dict | None = None,
    grow: list[int] | None = None,
) -> ConceptMoEVLM:
    """Stage 'ct': a pretrained MoE converted by vlm.model.convert (or an already converted export),
    each rank building and loading its share (`sharding`), with a fresh vision tower + projector
    attached when the config has a vision section and the source has none. `grow`: vocabulary
    sizes the embedding grows through after the model section's (a source tokenizer's added
    ids). The weights are a whole conversion's with the same seed: the export is read without
    drawing (as transformers' loader builds on the meta device), a source is converted into a
    fresh build, and the generator advances past a second build where the model section differs
    from the stored one (the model was once rebuilt from it)."""
    import json

    path = Path(cfg.train.convert_from)
    info = (
        json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    )
    converted = info.get("model_type") == MODEL_TYPE and info.get("model", {}).get("chunk", {}).get(
        "enabled", True
    )
    if converted:  # the output of `vlm convert`
        stored_mc, vision_cfg = checked_export_config(path).build_configs()
        stored = export_tensors(path)
    else:
        stored_mc, stored = source_tensors(path, cfg.convert)
        vision_cfg = None
    merged = merge_model_section(stored_mc, cfg, path)
    mc = dataclasses.replace(merged, vocab_size=stored_mc.vocab_size)
    if converted:
        with torch.random.fork_rng(devices=[]):
            model = build_vlm(mc, vision_cfg, sharding, ds_json)
    else:
        model = build_vlm(mc, None, sharding, ds_json)
    have = {k: v for k, v in stored.shapes().items() if converted or k.startswith("lm.")}
    targets = state_targets(model)
    mine = whole_shapes(targets)
    unexpected = sorted(set(have) - set(mine))
    lost = [k for k in mine if k not in have and (converted or not any(p in k for p in NEW_PARTS))]
    wrong = [k for k in mine if k in have and have[k] != mine[k]]
    if unexpected:
        raise ValueError(f"source tensors with no place in the ConceptMoE: {unexpected[:5]}")
    if lost:
        raise ValueError(f"pretrained tensors missing from the source: {lost[:5]}")
    if wrong:
        raise ValueError(
            f"{path}: tensor {wrong[0]} has shape {list(have[wrong[0]])}, "
            f"the converted model needs {list(mine[wrong[0]])}"
        )
    old = stored_mc.vocab_size
    sizes = [merged.vocab_size, *(grow or [])]
    grown = grow_vocab_(model, max(sizes), sharding)
    load_share_(
        {k: t for k, t in state_targets(model).items() if k in have},
        stored,
        sharding=sharding,
        rows_of=lambda name: old if name in _VOCAB_ROWS else 1 << 62,
    )
    if not converted:
        conversion_init_(model)
    if mc != stored_mc:
        consume_build(mc, vision_cfg)
    if grown:
        fill_grown_rows_(model, stored.whole, old, sizes, sharding)
    if cfg.vision is not None and model.vision is None:
        model.vision = cfg.vision.build(model.model_cfg.hidden_size)
        model.vision_cfg = cfg.vision
    return model


def source_tokenizer_dir(cfg: TrainConfig) -> Path | None:
    """The folder of the pretrained model this run continues, when it carries its own tokenizer and
    chat template (a transformers checkpoint, its `vlm convert` output, or a final/ of a run that
    continued one)."""
    if cfg.train.stage == "ct":
        where = Path(cfg.train.convert_from)
    elif cfg.train.init_from:
        where = resolve_weights_path(Path(cfg.train.init_from))
    else:
        return None
    return where if is_source_tokenizer_dir(where) else None


def resolve_tokenizer(cfg: TrainConfig) -> TrainConfig:
    """`cfg` naming the tokenizer the run uses (a new object; `cfg` stays as it is). A run that
    continues a pretrained model with its own tokenizer files keeps them, and with them its chat
    format, special tokens and ids: `data.tokenizer` then names that folder (the saved run config
    says which tokenizer trained); a path to a tokenizer of the project's own format is refused.
    Otherwise `data.tokenizer` as it is."""
    src = source_tokenizer_dir(cfg)
    if src is None:
        return cfg
    # "byte" and "default" (the dataclass's and configs/default.yaml's choice) are the project's own
    # tokenizers, which the source never saw: the source's wins over them; a path to another
    # tokenizer is a conflict
    if cfg.data.tokenizer in ("byte", "default"):
        return evolve(cfg, data=replace(cfg.data, tokenizer=str(src)))
    if not is_source_tokenizer_dir(Path(cfg.data.tokenizer_path)):
        raise ConfigError(
            f"data.tokenizer {cfg.data.tokenizer!r}: the model from {src} keeps its "
            f"own tokenizer and chat format; drop data.tokenizer (or set it to {src})"
        )
    return cfg


def load_run_tokenizer(cfg: TrainConfig) -> Tokenizer:
    """The tokenizer a resolved config (resolve_tokenizer) names; a source's chat
    template must split a conversation into prompt and answer (checked now rather than by
    the data loader mid-run)."""
    if source_tokenizer_dir(cfg) is None:
        tok = load_tokenizer(cfg.data.tokenizer_path)
        if cfg.train.init_from:
            check_init_tokenizer(cfg, tok)
        return tok
    try:
        tok = load_tokenizer(cfg.data.tokenizer_path)
        tok.chat_segments(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}] * 2
        )
    except TokenizerError as e:
        raise ConfigError(str(e)) from None
    return tok


# text whose ids tell two tokenizers apart (merges, bytes, specials)
_PROBE_TEXT = "The red square, left of 2 blue circles: é 漢 <|end|> <image>\n  tabs\tand spaces"


def _same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    return (
        type(a).__name__ == type(b).__name__
        and a.vocab_size == b.vocab_size
        and (a.eos_id, a.pad_id, a.bos_id) == (b.eos_id, b.pad_id, b.bos_id)
        and a.encode(_PROBE_TEXT) == b.encode(_PROBE_TEXT)
    )


def _trained_tokenizer(where: Path) -> tuple[Tokenizer | None, str, str]:
    """The tokenizer the model stored at `where` was trained with, where it was found, and the
    data.tokenizer that names it: an export carries its own; a checkpoint's run names it in its
    config.yaml. (None, "", "") when that cannot be told (an export without tokenizer files, a run
    config naming a tokenizer that is gone)."""
    import yaml

    try:
        if (where / "config.json").is_file():
            if (where / "vlm_tokenizer.json").is_file() or (where / "tokenizer.json").is_file():
                return load_tokenizer(where), str(where), str(where)
            return None, "", ""
        run_cfg = where.parent.parent / "config.yaml"
        data = yaml.safe_load(run_cfg.read_text()) if run_cfg.is_file() else None
        d = data.get("data") if isinstance(data, dict) else None
        if not isinstance(d, dict) or not isinstance(d.get("tokenizer"), str):
            return None, "", ""
        kind = d["tokenizer"]
        path = (
            str(Path(str(d.get("default_dir", "data/default"))) / "tokenizer")
            if kind == "default"
            else kind
        )
        if path != "byte" and not Path(path).exists():
            return None, "", ""
        return load_tokenizer(path), f"{run_cfg}", path
    except (TokenizerError, OSError, ValueError, yaml.YAMLError):
        return None, "", ""


def check_init_tokenizer(cfg: TrainConfig, tok: Tokenizer) -> None:
    """ConfigError when `train.init_from` names a model trained with another tokenizer than the one
    this run reads its data with: its embeddings would be read at ids that meant other text
    (training goes on at a loss of 16 instead of where the model left off)."""
    where = resolve_weights_path(Path(cfg.train.init_from))
    theirs, found, setting = _trained_tokenizer(where)
    if theirs is None or _same_tokenizer(theirs, tok):
        return
    raise ConfigError(
        f"data.tokenizer {cfg.data.tokenizer!r} ({type(tok).__name__}, {tok.vocab_size} ids) is "
        f"not the tokenizer the model in train.init_from {cfg.train.init_from} was trained with "
        f"({type(theirs).__name__}, {theirs.vocab_size} ids, from {found}): its embeddings would "
        f"be read at ids that meant other text; set data.tokenizer={setting} (the model's own)"
    )


def pretrained_tower(cfg: TrainConfig) -> bool:
    """The vision encoder comes from a pretrained checkpoint (vision.timm_checkpoint): no warm-up
    for a fresh encoder runs on it, and nothing freezes it but the config's own
    vision.freeze_encoder / params.freeze."""
    return cfg.vision is not None and bool(cfg.vision.timm_checkpoint)


def vision_load_report(model: nn.Module) -> str | None:
    """What a pretrained vision checkpoint gave the encoder (printed at start, written to RUN_DIR)."""
    enc = getattr(getattr(model, "vision", None), "encoder", None)
    report = getattr(enc, "load_report", None)
    return None if report is None else str(report)


def build_stage_model(
    cfg: TrainConfig,
    tokenizer: Tokenizer | None = None,
    sharding: Sharding = WHOLE,
    ds_json: dict | None = None,
) -> tuple[nn.Module, set[str]]:
    """The model this stage trains, built and loaded at this rank's share (`sharding`, vlm.model.
    shares; `ds_json`: the run's DeepSpeed JSON, for ZeRO-3), and which of its parts ("lm",
    "vision") start from fresh weights (muP init applies to a fresh LLM, the vision warm-up to a
    fresh vision tower). A pretrained model whose vocabulary is smaller than `tokenizer` (the image
    tokens a source's tokenizer gets) grows to fit it (convert.fit_vocab's rule). `cfg` is left as
    it is: `with_built_model` says what the model runs."""
    stage = cfg.train.stage
    source = tokenizer.vocab_size if getattr(tokenizer, "kind", "") == "source" else 0
    if stage == "ct":
        return convert_pretrained(cfg, sharding, ds_json, [source] if source else []), set()
    grow, mc = 0, cfg.model
    # the model section is the checkpoint's, with the config's permitted changes
    if cfg.train.init_from:
        where = Path(cfg.train.init_from)
        stored = stored_model_config(where)
        if stored is not None:
            mc = merge_model_section(stored, cfg, where)
            grow, mc = mc.vocab_size, dataclasses.replace(mc, vocab_size=stored.vocab_size)
    model = build_vlm(mc, cfg.vision if stage == "vl" else None, sharding, ds_json)
    parts = {"lm"} | (
        {"vision"} if model.vision is not None and not pretrained_tower(cfg) else set()
    )
    if cfg.train.init_from:
        where = Path(cfg.train.init_from)
        loaded = load_pretrained_weights(model, where, [max(grow, source)], sharding)
        return model, parts - set(loaded)
    return model, parts


def with_built_model(cfg: TrainConfig, model: ConceptMoEVLM) -> TrainConfig:
    """`cfg` naming the model build_stage_model built (a new object; `cfg` stays as it is): a
    converted model's model and vision sections (stage ct), a continued checkpoint's model section
    (train.init_from); a fresh model is `cfg`'s own."""
    if cfg.train.stage == "ct":
        vision = model.vision_cfg  # a converted VLM's own tower patchifies with its own processor
        data = cfg.data if vision is None else replace(cfg.data, processor=vision.processor)
        return evolve(cfg, model=model.model_cfg, vision=vision, data=data)
    if cfg.train.init_from:
        return evolve(cfg, model=model.model_cfg)
    return cfg
