"""One validation scheme for every config dataclass: each is a ValidatedOnInit, which checks its
field types and runs its validate() when it is made, exactly once, whether from_dict, a direct call
in Python or dataclasses.replace made it; from_dict adds no second path. Every *Config class of the
project is listed here with one value it refuses, and refuses it however it is built (nested ones
through TrainConfig too). YAML inheritance and the defaults' single source:
tests/test_config_base.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import pytest

from configs.config import ConfigError, ValidatedOnInit, check, from_dict

# ---- validation runs once per config, however it is made
# ----------------------------------------------------

_CALLS: list[str] = []


@dataclasses.dataclass
class _Plain:
    n: int = 1

    def validate(self) -> None:
        _CALLS.append("plain")
        check(self.n >= 1, f"n must be >= 1, got {self.n}")


@dataclasses.dataclass
class _SelfChecked(ValidatedOnInit):
    n: int = 1
    mode: Literal["a", "b"] = "a"

    def validate(self) -> None:
        _CALLS.append("self")
        check(self.n >= 1, f"n must be >= 1, got {self.n}")


@dataclasses.dataclass
class _Outer(ValidatedOnInit):
    own: _SelfChecked = dataclasses.field(default_factory=_SelfChecked)


def test_each_config_is_validated_once_however_it_is_made():
    """One scheme: a ValidatedOnInit checks its types and validates itself when it is made (through
    from_dict, a direct call or dataclasses.replace), once; from_dict adds no second path and
    refuses a plain dataclass with a validate(). Errors name the field."""
    _CALLS.clear()
    cfg = from_dict(_Outer, {"own": {"n": 3}})
    assert cfg.own.n == 3 and _CALLS == ["self"]
    _CALLS.clear()
    dataclasses.replace(_SelfChecked(n=4), n=5)
    assert _CALLS == ["self", "self"]
    with pytest.raises(ConfigError, match="n must be >= 1, got 0"):
        _SelfChecked(n=0)  # made in Python: still checked
    with pytest.raises(ConfigError, match=r"^mode: got 'c', allowed values: 'a', 'b'$"):
        # and its types too, as from_dict checks them
        _SelfChecked(mode="c")
    with pytest.raises(ConfigError, match=r"^n: got '2', expected an integer$"):
        _SelfChecked(n="2")
    # a mapping for a nested config becomes that config
    assert _Outer(own={"n": 2}).own == _SelfChecked(n=2)
    with pytest.raises(ConfigError, match=r"^own: n must be >= 1, got 0$"):
        from_dict(_Outer, {"own": {"n": 0}})
    with pytest.raises(TypeError, match="not a ValidatedOnInit"):
        from_dict(_Plain, {"n": 2})  # a second validation path is refused
    assert _CALLS.count("plain") == 0


# --- one validation scheme
# ---------------------------------------------------------------------------------------

# One value each class's validate() refuses, given to a direct call (the nested ones through
# TrainConfig too).
_INVALID = {
    "MoEConfig": {"top_k": 9},
    "LossConfig": {"balance": -1.0},
    "ChunkConfig": {"target_ratio": 0.5},
    "ModelConfig": {"num_heads": 3},
    "ConvertConfig": {"target_ratio": 1.0},
    "OptimConfig": {"lr": 0.0},
    "DeepSpeedConfig": {"offload_param": "cpu"},
    "ParallelConfig": {"expert": 0},
    "ParamsConfig": {"vision_lr_mult": -1.0},
    "LoggingConfig": {"log_every": 0},
    "CheckpointConfig": {"keep_last": 0},
    "RunConfig": {"max_steps": 0},
    "VisionWarmupConfig": {"lr": 0.0},
    "TrainConfig": {"vision": None},  # stage 'vl' needs a vision section
    "SourceConfig": {"path": "/nonexistent/shards-*.tar"},
    "DataConfig": {"row_tokens": 4},
    "DefaultDatasetConfig": {"max_objects": 10},
    "LongCtxConfig": {"num_samples": 0},
    "VisionConfig": {"backbone": "timm"},  # needs timm_model
    "ProjectorConfig": {"hidden_mult": 0.0},
    "NaViTConfig": {"num_heads": 5},
    "ImageProcessorConfig": {"min_patches": 0},
}


def _config_classes() -> dict[str, type]:
    """Every dataclass named *Config in the project's packages (transformers' PretrainedConfig subclass aside)."""
    import importlib
    import pkgutil

    root = Path(__file__).resolve().parents[1]
    found = {}
    for pkg in ("configs", "vlm", "vision", "data_pipelines", "eval"):
        for info in pkgutil.walk_packages([str(root / pkg)], prefix=f"{pkg}."):
            text = (
                root / (info.name.replace(".", "/") + ("/__init__.py" if info.ispkg else ".py"))
            ).read_text()
            if "Config" not in text or "@dataclass" not in text:
                continue
            module = importlib.import_module(info.name)
            for name, obj in vars(module).items():
                if (
                    name.endswith("Config")
                    and dataclasses.is_dataclass(obj)
                    and isinstance(obj, type)
                    and obj.__module__ == info.name
                ):
                    found[name] = obj
    return found


def test_every_config_class_is_validated_on_init_and_listed_here():
    classes = _config_classes()
    assert sorted(classes) == sorted(_INVALID)
    assert [n for n, c in classes.items() if not issubclass(c, ValidatedOnInit)] == []


@pytest.mark.parametrize("name", sorted(_INVALID))
def test_a_config_built_in_python_with_a_bad_value_is_refused(name):
    cls = _config_classes()[name]
    kwargs = {"path": "/nonexistent"} if name == "SourceConfig" else {}
    if name != "SourceConfig":
        cls(**kwargs)  # its defaults are valid
    with pytest.raises(ConfigError):
        cls(**{**kwargs, **_INVALID[name]})
    if name not in ("SourceConfig",):
        # dataclasses.replace makes it again: checked again
        with pytest.raises(ConfigError):
            dataclasses.replace(cls(), **_INVALID[name])


def test_train_config_refuses_a_bad_nested_value_given_in_python():
    from vlm.model.config import ChunkConfig, ModelConfig
    from vlm.train.config import TrainConfig

    with pytest.raises(ConfigError, match="target_ratio must be > 1"):
        TrainConfig(model=ModelConfig(chunk=ChunkConfig(target_ratio=0.5)))
    with pytest.raises(ConfigError, match="target_ratio must be > 1"):
        TrainConfig(model={"chunk": {"target_ratio": 0.5}})
    with pytest.raises(ConfigError, match=r"^merge: got 'first'"):
        ChunkConfig(merge="first")
