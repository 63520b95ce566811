"""The config a plan is made for: the run's TrainConfig as `vlm train` reads it, the model it would
build, and the layout of its ranks, from the config alone.

A plan needs no weights and no data. A config that continues a stored model (`train.init_from`,
stage ct's `train.convert_from`) plans the model that source describes when its config is there
(an export's or a checkpoint's model section, a transformers checkpoint's config.json converted as
`vlm convert` would), and the config's own model section when the source is not on this machine
(the plan says so). A tokenizer path that is not here is not read either: the model's vocabulary is
`model.vocab_size`.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

from configs.config import ConfigError, apply_overrides, from_dict, load_yaml
from vlm.model.config import ModelConfig, model_config_from
from vlm.train.config import TrainConfig, load_train_config, migrate_run_config
from vlm.train.layout import ParallelLayout


@dataclass
class PlannedRun:
    cfg: TrainConfig  # the run's config (sources that are not here left out)
    model: ModelConfig  # the model the run builds
    layout: ParallelLayout  # rank 0 of the run's layout
    notes: list[str] = field(default_factory=list)


def _absent_sources(data: dict) -> list[str]:
    run = data.get("train") if isinstance(data.get("train"), dict) else {}
    return [k for k in ("init_from", "convert_from") if run.get(k) and not Path(run[k]).exists()]


def load_plan_config(path: str, overrides: list[str], ranks: int) -> PlannedRun:
    """ConfigError (one line) for a config `vlm train` would refuse, or a layout the ranks cannot
    have (a degree that does not divide them)."""
    if ranks < 1:
        raise ConfigError(f"--ranks must be >= 1, got {ranks}")
    data = migrate_run_config(apply_overrides(load_yaml(path), list(overrides)))
    notes: list[str] = []
    absent = _absent_sources(data)
    if not absent:
        cfg = load_train_config(path, list(overrides))
    else:
        data = copy.deepcopy(data)
        run = data["train"]
        for key in absent:
            notes.append(
                f"train.{key} {run.pop(key)} is not on this machine: the model planned is the "
                "config's model section"
            )
        if run.get("stage") == "ct" and not run.get("convert_from"):
            run["stage"] = "vl" if data.get("vision", {}) is not None else "text"
        d = data.get("data") if isinstance(data.get("data"), dict) else {}
        tok = d.get("tokenizer")
        if isinstance(tok, str) and tok not in ("byte", "default") and not Path(tok).exists():
            d["tokenizer"] = "byte"
            notes.append(f"data.tokenizer {tok} is not on this machine (not read by a plan)")
        cfg = from_dict(TrainConfig, data)
    model, more = planned_model(cfg)
    layout = ParallelLayout.of(cfg.parallel, ranks)
    for name, moe in (("moe", model.moe), ("concept_moe", model.c_moe)):
        if moe.num_experts % layout.expert:
            raise ConfigError(
                f"parallel.expert={layout.expert} does not divide model.{name}.num_experts="
                f"{moe.num_experts}: use a divisor of it"
            )
    return PlannedRun(cfg, model, layout, notes + more)


def planned_model(cfg: TrainConfig) -> tuple[ModelConfig, list[str]]:
    """The model section the run builds: a continued source's (its config only, no weights) with
    the config's permitted changes, as vlm.train.stages merges them; else the config's own."""
    run = cfg.train
    if not (run.convert_from or run.init_from):
        return cfg.model, []
    # (imports transformers: only for a config that continues a stored model)
    from vlm.train.stages import merge_model_section, stored_model_config

    if run.stage == "ct" and run.convert_from:
        src = Path(run.convert_from)
        stored = _source_model(src, cfg)
        if stored is None:
            return cfg.model, [f"train.convert_from {src}: no config.json; the config's model"]
        return merge_model_section(stored, cfg, src), [f"model: {src}'s, converted"]
    if run.init_from:
        stored = stored_model_config(Path(run.init_from))
        if stored is not None:
            return merge_model_section(stored, cfg, Path(run.init_from)), [
                f"model: train.init_from {run.init_from}'s model section"
            ]
    return cfg.model, []


def _source_model(src: Path, cfg: TrainConfig) -> ModelConfig | None:
    """A conversion source's model as `vlm convert` makes it, from its config.json alone."""
    from vlm.model.convert import hf_model_config, to_conceptmoe_config
    from vlm.model.hf import MODEL_TYPE

    cfg_file = src / "config.json"
    if not cfg_file.is_file():
        return None
    info = json.loads(cfg_file.read_text())
    if info.get("model_type") == MODEL_TYPE:
        model = model_config_from(info["model"])
        return model if model.chunk.enabled else to_conceptmoe_config(model, cfg.convert)
    from transformers import AutoConfig

    return to_conceptmoe_config(
        hf_model_config(AutoConfig.from_pretrained(str(src)), cfg.convert), cfg.convert
    )
