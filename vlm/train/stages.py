"""Training stages: what model a run starts from.

- text: a fresh ConceptMoE LLM (no vision tower), trained on text.
- vl:   the VLM: a vision tower and a projector in front of the LLM, fresh or, with `train.init_from`, carried
        over from an earlier run (its final/ export, a checkpoint, or the run directory itself: its final/
        when present, else its latest checkpoint). Whatever the source holds is carried: the whole VLM
        (vision encoder, projector, LLM) from a VL run, the LLM alone from a text run.
- ct:   continual training of a pretrained MoE converted into a ConceptMoE by vlm.model.convert
        (ConceptMoE section 4.3; the converter owns the weight mapping and the reallocation).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from configs.config import ConfigError
from data_pipelines.tokenizer import Tokenizer, is_source_tokenizer_dir, load_tokenizer
from vlm.model.convert import convert_state, fit_vocab, load_source, to_conceptmoe_config
from vlm.model.hf import MODEL_TYPE, load_vlm
from vlm.model.multimodal import ConceptMoEVLM
from vlm.train.checkpoint import latest_checkpoint
from vlm.train.config import TrainConfig
from vlm.train.engine import safe_load


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
    raise ConfigError(f"train.init_from {path}: not an exported model (config.json), a checkpoint (meta.json) "
                      f"or a run directory with final/ or checkpoints/")


def read_model_state(path: Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) state dict of the VLM stored at `path` (export or checkpoint)."""
    path = resolve_weights_path(path)
    if (path / "config.json").is_file():
        return load_vlm(path).state_dict()

    ds_dir = path / "ds"
    module_file = ds_dir / "mp_rank_00_model_states.pt"
    state = safe_load(module_file, map_location="cpu") if module_file.is_file() else {}
    module = state.get("module")
    if not module:   # ZeRO 0-2 keep the whole module in that file; ZeRO-3 leaves it empty
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        module = get_fp32_state_dict_from_zero_checkpoint(str(path), tag="ds")
    return _fold_checkpoint_logit_scale(module, path.parent.parent / "config.yaml")


def _fold_checkpoint_logit_scale(state: dict, run_config: Path) -> dict:
    """A muP run's checkpoint holds lm_head without its logit multiplier (a forward hook applies it); fold it
    in so that every source reads as the function it computes, like an export does."""
    if not run_config.is_file() or "lm.lm_head.weight" not in state:
        return state
    import yaml

    run = yaml.safe_load(run_config.read_text()) or {}
    params, model = run.get("params") or {}, run.get("model") or {}
    if params.get("mup"):
        scale = params.get("mup_base_width", 128) / model.get("hidden_size", 1)
        state = dict(state, **{"lm.lm_head.weight": state["lm.lm_head.weight"] * scale})
    return state


def load_pretrained_weights(model: ConceptMoEVLM, path: Path) -> dict[str, int]:
    """Copy a stored model's tensors into `model`: the LLM (`lm.*`, required) and, when the source has them, the
    vision encoder and projector (`vision.*`). Returns how many tensors each part received."""
    state = read_model_state(Path(path))
    parts = {"lm": model.lm, "vision": model.vision}
    loaded: dict[str, int] = {}
    for part, module in parts.items():
        src = {k[len(part) + 1:]: v for k, v in state.items() if k.startswith(part + ".")}
        if not src:
            if part == "lm":
                raise ConfigError(f"train.init_from {path}: the stored model has no LLM weights (no 'lm.' tensors)")
            continue   # a text-stage source: the vision tower starts fresh
        if module is None:
            continue   # a text stage started from a VL run keeps only the LLM
        mine = module.state_dict()
        missing = sorted(set(mine) - set(src))
        shape_bad = [k for k in mine if k in src and src[k].shape != mine[k].shape]
        if missing or shape_bad:
            k = (missing or shape_bad)[0]
            what = "is missing" if missing else f"has shape {tuple(src[k].shape)}, the config needs {tuple(mine[k].shape)}"
            section = "model" if part == "lm" else "vision"
            raise ConfigError(f"train.init_from {path}: tensor {part}.{k} {what}; the {section} section must match "
                              f"the stored model's")
        module.load_state_dict({k: src[k] for k in mine}, strict=True)
        loaded[part] = len(mine)
    return loaded


def convert_pretrained(cfg: TrainConfig) -> ConceptMoEVLM:
    """Stage 'ct': a pretrained MoE converted by vlm.model.convert (or an already converted export), with a
    fresh vision tower + projector attached when the config has a vision section and the source has none."""
    import json

    path = Path(cfg.train.convert_from)
    info = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    if info.get("model_type") == MODEL_TYPE and info.get("model", {}).get("chunk", {}).get("enabled", True):
        model = load_vlm(path)                   # the output of `vlm convert`
    else:
        opt = cfg.convert
        sd, base, _ = load_source(path, opt)
        lm_sd = {k: v for k, v in sd.items() if k.startswith("lm.")}
        model = convert_state(lm_sd, to_conceptmoe_config(base, opt), None)
    if cfg.vision is not None and model.vision is None:
        model.vision = cfg.vision.build(model.model_cfg.hidden_size)
        model.vision_cfg = cfg.vision
    return model


def source_tokenizer_dir(cfg: TrainConfig) -> Path | None:
    """The folder of the pretrained model this run continues, when it carries its own tokenizer and chat template
    (a transformers checkpoint, its `vlm convert` output, or a final/ of a run that continued one)."""
    if cfg.train.stage == "ct":
        where = Path(cfg.train.convert_from)
    elif cfg.train.init_from:
        where = resolve_weights_path(Path(cfg.train.init_from))
    else:
        return None
    return where if is_source_tokenizer_dir(where) else None


def run_tokenizer(cfg: TrainConfig) -> Tokenizer:
    """The run's tokenizer. A run that continues a pretrained model with its own tokenizer files keeps them, and
    with them its chat format, special tokens and ids; `data.tokenizer` then names that folder (the saved run
    config says which tokenizer trained) and any other explicit choice is refused. Otherwise `data.tokenizer`."""
    src = source_tokenizer_dir(cfg)
    if src is None:
        return load_tokenizer(cfg.data.tokenizer_path)
    if cfg.data.tokenizer not in ("byte", str(src)) and not is_source_tokenizer_dir(Path(cfg.data.tokenizer_path)):
        raise ConfigError(f"data.tokenizer {cfg.data.tokenizer!r}: the model from {src} keeps its own tokenizer and "
                          f"chat format; drop data.tokenizer (or set it to {src})")
    cfg.data = replace(cfg.data, tokenizer=str(src) if cfg.data.tokenizer == "byte" else cfg.data.tokenizer)
    return load_tokenizer(cfg.data.tokenizer_path)


def build_model(cfg: TrainConfig, tokenizer: Tokenizer | None = None) -> tuple[nn.Module, set[str]]:
    """The model this stage trains, and which of its parts ("lm", "vision") start from fresh weights (muP init
    applies to a fresh LLM, the vision warm-up to a fresh vision tower). A pretrained model whose vocabulary is
    smaller than `tokenizer` (the image tokens a source's tokenizer gets) grows to fit it (convert.fit_vocab)."""
    stage = cfg.train.stage
    if stage == "ct":
        model = convert_pretrained(cfg)
        if tokenizer is not None and getattr(tokenizer, "kind", "") == "source":
            fit_vocab(model, tokenizer.vocab_size)
        return model, set()
    model = ConceptMoEVLM(cfg.model, cfg.vision if stage == "vl" else None)
    parts = {"lm"} | ({"vision"} if model.vision is not None else set())
    if cfg.train.init_from:
        loaded = load_pretrained_weights(model, Path(cfg.train.init_from))
        return model, parts - set(loaded)
    return model, parts
