"""Config inheritance: a YAML file with a top-level `base: OTHER.yaml` states only what
differs from OTHER.

Mappings merge key by key (the child wins, the rest of the base stays), anything else (lists,
scalars, null) replaces; `base` is relative to the file naming it; cycles and missing bases are one
clear ConfigError. And the dataclasses are the one source of defaults: no YAML key restates what
it inherits, and docs/configuration.md lists the dataclass defaults. How each config dataclass is
validated (once, however it is made): tests/test_config_validation.py.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from configs.config import ConfigError, _coerce, deep_merge, flatten, from_dict, load_yaml, to_dict


def _write(path, data: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_child_overrides_nested_keys_and_keeps_the_rest(tmp_path):
    _write(
        tmp_path / "base.yaml",
        {
            "model": {
                "hidden_size": 32,
                "moe": {"num_experts": 4, "top_k": 2},
                "chunk": {"enabled": True},
            },
            "optim": {"lr": 0.1, "betas": [0.9, 0.95]},
            "vision": {"encoder": {"hidden_size": 16}},
            "train": {"max_steps": 10},
        },
    )
    child = _write(
        tmp_path / "child.yaml",
        {
            "base": "base.yaml",
            "model": {"moe": {"top_k": 1}},  # one nested key
            "optim": {"betas": [0.8]},  # a list replaces the base's list
            "vision": None,  # null replaces a whole section
            "logging": {"log_every": 5},  # a section the base lacks
        },
    )
    got = load_yaml(child)
    assert got == {
        "model": {
            "hidden_size": 32,
            "moe": {"num_experts": 4, "top_k": 1},
            "chunk": {"enabled": True},
        },
        "optim": {"lr": 0.1, "betas": [0.8]},
        "vision": None,
        "train": {"max_steps": 10},
        "logging": {"log_every": 5},
    }
    assert "base" not in got


def test_bases_chain_and_the_nearest_file_wins(tmp_path):
    _write(tmp_path / "a.yaml", {"train": {"max_steps": 1, "seed": 1}, "optim": {"lr": 0.1}})
    _write(tmp_path / "b.yaml", {"base": "a.yaml", "train": {"max_steps": 2}})
    c = _write(tmp_path / "c.yaml", {"base": "b.yaml", "train": {"seed": 3}})
    assert load_yaml(c) == {"train": {"max_steps": 2, "seed": 3}, "optim": {"lr": 0.1}}


def test_deep_merge_leaves_its_inputs_alone():
    base = {"a": {"b": 1, "c": {"d": 2}}, "l": [1, 2]}
    over = {"a": {"c": {"d": 3}}, "l": [9]}
    before_base, before_over = copy.deepcopy(base), copy.deepcopy(over)
    assert deep_merge(base, over) == {"a": {"b": 1, "c": {"d": 3}}, "l": [9]}
    assert base == before_base and over == before_over


def test_base_path_is_relative_to_the_child_file_not_the_cwd(tmp_path, monkeypatch):
    _write(tmp_path / "recipes" / "common" / "base.yaml", {"train": {"max_steps": 7, "seed": 5}})
    child = _write(
        tmp_path / "recipes" / "stages" / "s1.yaml",
        {"base": "../common/base.yaml", "train": {"max_steps": 3}},
    )
    # a decoy next to the cwd with the same relative name must not be read
    _write(
        tmp_path / "elsewhere" / "common" / "base.yaml", {"train": {"max_steps": 99, "seed": 99}}
    )
    (tmp_path / "elsewhere" / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere" / "sub")
    assert load_yaml(child) == {"train": {"max_steps": 3, "seed": 5}}
    # the same through a relative path to the child
    assert load_yaml("../../recipes/stages/s1.yaml") == {"train": {"max_steps": 3, "seed": 5}}


def test_base_cycle_is_a_config_error_naming_the_files(tmp_path):
    _write(tmp_path / "a.yaml", {"base": "b.yaml", "train": {"max_steps": 1}})
    _write(tmp_path / "b.yaml", {"base": "c.yaml"})
    _write(tmp_path / "c.yaml", {"base": "a.yaml"})
    with pytest.raises(ConfigError, match="cycle") as e:
        load_yaml(tmp_path / "a.yaml")
    for name in ("a.yaml", "b.yaml", "c.yaml"):
        assert name in str(e.value), str(e.value)

    _write(tmp_path / "self.yaml", {"base": "self.yaml"})
    with pytest.raises(ConfigError, match="cycle.*self.yaml"):
        load_yaml(tmp_path / "self.yaml")


def test_diamond_is_not_a_cycle(tmp_path):
    """Two files may share a base through different routes as long as no file is its own ancestor."""
    _write(tmp_path / "root.yaml", {"train": {"seed": 1}})
    _write(tmp_path / "mid.yaml", {"base": "root.yaml", "train": {"max_steps": 2}})
    leaf = _write(tmp_path / "leaf.yaml", {"base": "mid.yaml"})
    other = _write(tmp_path / "other.yaml", {"base": "root.yaml"})
    assert load_yaml(leaf) == {"train": {"seed": 1, "max_steps": 2}}
    assert load_yaml(other) == {"train": {"seed": 1}}


def test_missing_base_is_a_clear_config_error(tmp_path):
    child = _write(
        tmp_path / "child.yaml", {"base": "nope/missing.yaml", "train": {"max_steps": 1}}
    )
    with pytest.raises(ConfigError) as e:
        load_yaml(child)
    msg = str(e.value)
    assert "child.yaml" in msg and "missing.yaml" in msg and "does not exist" in msg, msg


def test_base_must_be_a_path(tmp_path):
    child = _write(tmp_path / "child.yaml", {"base": ["a.yaml", "b.yaml"]})
    with pytest.raises(ConfigError, match="base must be a path"):
        load_yaml(child)


def test_train_config_loader_reads_bases_and_validates_the_merge(tmp_path, TINY):
    """Through the trainer's loader: the merged mapping is what gets validated, and CLI overrides apply last."""
    from vlm.train.config import load_train_config

    _write(tmp_path / "tiny.yaml", TINY)
    child = _write(
        tmp_path / "child.yaml",
        {"base": "tiny.yaml", "model": {"moe": {"top_k": 1}}, "train": {"max_steps": 3}},
    )
    cfg = load_train_config(child, ["train.seed=4"])
    assert (
        cfg.model.moe.top_k == 1
        and cfg.model.moe.num_experts == TINY["model"]["moe"]["num_experts"]
    )
    assert cfg.model.hidden_size == TINY["model"]["hidden_size"]
    assert (
        cfg.train.max_steps == 3
        and cfg.train.seed == 4
        and cfg.train.stage == TINY["train"]["stage"]
    )
    bad = _write(tmp_path / "bad.yaml", {"base": "tiny.yaml", "model": {"moe": {"top_k": 9}}})
    with pytest.raises(ConfigError, match="top_k"):
        load_train_config(bad)


def test_llava_recipe_configs_load_and_validate(tmp_path, monkeypatch, ROOT):
    from vlm.train.config import load_train_config

    # `base: default.yaml` is found next to the stage file, wherever we run from
    monkeypatch.chdir(tmp_path)
    default = load_train_config(ROOT / "configs" / "default.yaml")
    text = load_train_config(ROOT / "configs" / "llava_text.yaml")
    align = load_train_config(ROOT / "configs" / "llava_align.yaml")
    full = load_train_config(ROOT / "configs" / "llava_full.yaml")

    # stage 1: the LLM alone on text
    assert text.train.stage == "text" and text.vision is None
    assert text.data.default_parts == ["text"] and not text.data.sources
    # stage 2: captions, LLM frozen, vision tower and projector learn
    assert align.train.stage == "vl" and align.vision is not None
    assert align.data.default_parts == ["caption"] and align.params.freeze == ["lm"]
    assert not align.vision_warmup.freeze_after
    # stage 3: the full mix; the encoder as stage 2 left it
    assert full.train.stage == "vl" and full.data.default_parts == [] and full.params.freeze == []
    assert full.vision_warmup.freeze_after == default.vision_warmup.freeze_after
    for cfg in (text, align, full):
        # inherited, so every stage can load the previous one's LLM
        assert cfg.model == default.model
        assert cfg.train.init_from is None  # the chain sets it
        assert cfg.train.max_steps != default.train.max_steps
    assert align.vision == full.vision == default.vision


def test_byte_level_recipe_loads_on_the_byte_tokenizer(ROOT):
    from data_pipelines.tokenizer import load_tokenizer
    from vlm.train.config import load_train_config

    cfg = load_train_config(ROOT / "configs" / "byte_level.yaml")
    assert (
        cfg.data.tokenizer == "byte" and cfg.model.vocab_size >= load_tokenizer("byte").vocab_size
    )
    assert cfg.model.chunk.modality_target_ratios == {"text": 4.0, "image": 2.0}
    assert cfg.data.row_tokens * cfg.data.rows_per_batch == 2048 and cfg.vision_warmup.steps == 1000


# --- one source of defaults
# -------------------------------------------------------------------------------------


def _dataclass_of(tp):
    """The dataclass in a field's type hint (`X` or `X | None`), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _restated(own: dict, ref, cls, path: str = "") -> list[str]:
    """Keys of the YAML mapping `own` whose value equals what `ref` (an instance of config class
    `cls`, the value the file would inherit: its base's effective config, or the dataclass default)
    already has there."""
    hints = typing.get_type_hints(cls)
    out = []
    for key, value in own.items():
        where = f"{path}{key}"
        tp = hints[key]
        sub = _dataclass_of(tp)
        inherited = getattr(ref, key)
        if sub is not None and isinstance(value, dict):
            out += _restated(value, inherited if inherited is not None else sub(), sub, where + ".")
        elif _coerce(value, tp, where) == inherited:
            out.append(f"{where}: {value!r}")
    return out


def _yaml_files():
    return sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: p.name)
def test_no_yaml_key_states_what_it_inherits(path):
    """The dataclasses hold the defaults; a YAML states only what differs from them (or, with
    `base:`, from its base's effective config). A key that restates its inherited value is a second
    source of that default."""
    from vlm.train.config import TrainConfig

    own = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    base = own.pop("base", None)
    ref = from_dict(TrainConfig, load_yaml(path.parent / base)) if base else TrainConfig()
    assert _restated(own, ref, TrainConfig) == [], f"{path.name} restates inherited values"


def test_default_yaml_is_the_dataclass_defaults_where_it_says_nothing(ROOT):
    """`vlm train` (configs/default.yaml) and TrainConfig() differ only in the keys default.yaml states."""
    from vlm.train.config import TrainConfig

    stated = flatten(
        yaml.safe_load((ROOT / "configs" / "default.yaml").read_text(encoding="utf-8")) or {}
    )
    run = flatten(to_dict(from_dict(TrainConfig, load_yaml(ROOT / "configs" / "default.yaml"))))
    default = flatten(to_dict(TrainConfig()))
    # data.processor follows vision.processor (TrainConfig.__post_init__), stated once under vision
    differ = {
        k for k in set(run) | set(default) if run.get(k, "<absent>") != default.get(k, "<absent>")
    }
    unexplained = sorted(
        k
        for k in differ
        if not k.startswith("data.processor.")
        and not any(k == s or k.startswith(s + ".") or s.startswith(k + ".") for s in stated)
    )
    assert unexplained == []


def test_configuration_docs_list_the_dataclass_defaults(ROOT):
    """docs/configuration.md's `default` column is each key's dataclass default (TrainConfig())."""
    import re

    from configs.config import _FLOAT_RE
    from vlm.train.config import TrainConfig

    tree = to_dict(TrainConfig())
    rows = re.findall(
        r"^\| `([a-z_]+\.[a-z_.]+)` \| [^|]* \| `?([^|]*?)`? \| ",
        (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8"),
        re.M,
    )
    assert len(rows) > 100
    wrong = []
    for key, cell in rows:
        node = tree
        for part in key.split("."):
            node = node[part]
        value = yaml.safe_load(cell)
        if isinstance(value, str) and _FLOAT_RE.fullmatch(value):
            value = float(value)
        if value != node:
            wrong.append(f"{key}: docs {cell}, dataclass {node!r}")
    assert wrong == []
