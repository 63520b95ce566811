"""One config system: YAML -> validated dataclasses, with dotted CLI overrides.

Every config in the project is a dataclass whose fields carry type hints; `from_dict` builds it
recursively and rejects unknown keys, wrong types and values outside a `Literal`, naming the dotted
path of the offending field and what would have been allowed.

One validation scheme: every config dataclass subclasses `ValidatedOnInit`, which checks its fields'
types (the same checks `from_dict` makes) and runs its `validate()` (cross-field checks raising
`ConfigError`) in `__post_init__`, so a config is valid however it is made: `from_dict`, a direct
call or `dataclasses.replace`. `from_dict` only builds; it refuses a dataclass with a `validate()`
that is not a `ValidatedOnInit`.

One source of defaults: the dataclasses' field defaults. A YAML file states only what differs from
them (or, with `base: OTHER.yaml`, from its base); tests/test_config_base.py fails on a key that
restates what it would inherit.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config problem, reported as one line naming the field and what is allowed."""


class ValidatedOnInit:
    """Base of every config dataclass: in `__post_init__`, however it is made (`from_dict`,
    `dataclasses.replace` or a direct call), each field is checked against its type hint (as
    `from_dict` checks YAML values: a `Literal`'s values, int / float / bool / str, finite numbers;
    an int becomes a float, a list a tuple, a mapping for a nested config that config) and then
    `validate()` runs. A subclass with a `__post_init__` of its own calls `super().__post_init__()`
    at its end."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            if f.init and f.name in hints:
                value = getattr(self, f.name)
                coerced = _coerce(value, hints[f.name], f.name)
                if coerced is not value:
                    object.__setattr__(self, f.name, coerced)
        self.validate()

    def validate(self) -> None:
        """Cross-field checks; raise `ConfigError` (see `check`)."""


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        real = [a for a in args if a is not type(None)]
        if len(real) == 1:  # Optional[X]: X's own error names the field that is wrong
            return _coerce(value, real[0], path)
        for arg in real:
            try:
                return _coerce(value, arg, path)
            except ConfigError:
                pass
        raise ConfigError(f"{path}: got {value!r}, expected {_type_name(tp)}")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(
                f"{path}: got {value!r}, allowed values: {', '.join(repr(a) for a in allowed)}"
            )
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping for {tp.__name__}, got {value!r}")
        return from_dict(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        args = get_args(tp)
        # tuple[X, Y]: exactly that many items
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(
                    f"{path}: expected {len(args)} items, got {len(value)}: {list(value)!r}"
                )
            return tuple(_coerce(v, t, f"{path}[{i}]") for i, (v, t) in enumerate(zip(value, args)))
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        kt, vt = get_args(tp) or (Any, Any)
        return {
            _coerce(k, kt, f"{path}.<key>"): _coerce(v, vt, f"{path}.{k}") for k, v in value.items()
        }
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: got {value!r}, expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: got {value!r}, expected an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # e.g. optim.lr=.inf would train to non-finite weights and exit 0
            if not math.isfinite(value):
                raise ConfigError(f"{path}: got {value!r}, expected a finite number")
            return float(value)
        raise ConfigError(f"{path}: got {value!r}, expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):  # a Path given in Python
            return os.fspath(value)
        raise ConfigError(f"{path}: got {value!r}, expected a string")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{path}: got {value!r}, expected {_type_name(tp)}")


def from_dict(cls: type[T], data: dict, path: str = "") -> T:
    """Build dataclass `cls` from a (nested) mapping, checking every field (a `ValidatedOnInit` then
    validates itself when it is made)."""
    if callable(getattr(cls, "validate", None)) and not issubclass(cls, ValidatedOnInit):
        raise TypeError(
            f"{cls.__name__} has a validate() but is not a ValidatedOnInit: a config dataclass "
            "subclasses configs.config.ValidatedOnInit so that it is validated however it is made"
        )
    if data is None:
        data = {}
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(
            f"unknown key {where}{unknown[0]}; allowed "
            f"keys{' in ' + path if path else ''}: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, hints[name], f"{path}.{name}" if path else name)
    try:
        obj = cls(**kwargs)  # a ValidatedOnInit validates itself here
    except ConfigError as e:
        raise ConfigError(
            f"{path}: {e}" if path and not str(e).startswith(path) else str(e)
        ) from None
    return obj


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain nested dict (YAML-safe)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested dict -> {"a.b.c": value}; an empty mapping is a value of its own (a section set to {})."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a','b','c'], value parsed as YAML scalar)."""
    if "=" not in text:
        raise ConfigError(
            f"override {text!r}: expected KEY=VALUE with a "
            "dotted KEY, e.g. model.chunk.target_ratio=2"
        )
    key, raw = text.split("=", 1)
    value = parse_yaml(raw, f"override {text!r}") if raw.strip() else None
    if isinstance(value, str):
        try:  # YAML 1.1 reads "1e-3" as a string; on the command line it means a number
            value = float(value) if _FLOAT_RE.fullmatch(value) else value
        except ValueError:
            pass
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply dotted overrides to a nested mapping (validation happens in `from_dict`)."""
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            child = node.get(k)
            if child is None:
                child = node[k] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {k} is not a section")
            node = child
        node[keys[-1]] = value
    return data


def check_unique_overrides(overrides: list[str]) -> None:
    """ConfigError (one line) when the same dotted key is given twice on one command line: the
    last would silently win, as a key written twice in a YAML mapping would (refused too)."""
    seen: dict[str, str] = {}
    for text in overrides:
        if "=" not in text:
            continue
        key = ".".join(k.strip() for k in text.split("=", 1)[0].split("."))
        if key in seen:
            raise ConfigError(
                f"override {key} is given twice ({seen[key]} and {text}); the second would "
                "silently replace the first: give it once"
            )
        seen[key] = text


def parse_args_anywhere(parser, argv: list[str] | None):
    """`parser.parse_args`, except that `key=value` overrides may also follow options (`vlm train
    a=1 --max-steps 1 b=2`): argparse stops collecting a positional list at the first option. The
    same key twice among them is one line (`config error: ...`), exit 2."""
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray or (extra and vars(args).get("overrides") is None):  # a subcommand without overrides
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        check_unique_overrides(list(vars(args).get("overrides") or []))
    except ConfigError as e:
        parser.exit(2, f"config error: {e}\n")
    return args


def deep_merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`: mappings merge key by key, anything else (lists, scalars, null) replaces."""
    out = dict(base)
    for k, v in over.items():
        out[k] = (
            deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first: int, again: int):
        super().__init__(key)
        self.key, self.first, self.again = key, first, again


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key written twice in one mapping (at any depth) is an
    error: PyYAML keeps the last one silently, so a section written twice (`optim:` at the top and
    again at the bottom) would drop the first one's settings."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges on purpose
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in seen:
                        raise _DuplicateKey(key, seen[key], key_node.start_mark.line + 1)
                    seen[key] = key_node.start_mark.line + 1
                except TypeError:  # an unhashable key: PyYAML's own error follows
                    pass
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, where: str) -> Any:
    """YAML text -> data, with a key written twice in one mapping an error (ConfigError naming
    `where`, the key and both lines)."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no Python objects
    except _DuplicateKey as e:
        raise ConfigError(
            f"{where}: key {e.key!r} is written twice in the same mapping (lines {e.first} "
            f"and {e.again}); the second would silently replace the first: merge them"
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {e}") from None


def load_yaml(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict:
    """A YAML mapping. A top-level `base: OTHER.yaml` (relative to this file) is loaded first and
    this file's keys are merged over it, so that a recipe stage states only what differs from the
    config it builds on. A key written twice in one mapping and an empty file are errors (not the
    last key's value, not the default run)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} {_not_a_file(path)}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {e.start}: {e.reason})"
        ) from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror or e})") from None
    data = parse_yaml(text, f"config file {path}")
    if data is None:
        raise ConfigError(
            f"config file {path} is empty (no settings in it); write the settings that differ "
            "from the defaults, or leave --config out to run configs/default.yaml"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(
            f"config file {path}: base must be a path to another YAML file, got {base!r}"
        )
    base_path = (path.parent / base).resolve()
    # the files whose bases are being loaded, outermost first
    chain = _chain + (path.resolve(),)
    if base_path in chain:
        cycle = " -> ".join(str(p) for p in chain[chain.index(base_path) :] + (base_path,))
        raise ConfigError(f"config file {path}: base {base} makes a cycle: {cycle}")
    if not base_path.is_file():
        raise ConfigError(
            f"config file {path}: base {base} {_not_a_file(base_path)} (looked for {base_path})"
        )
    return deep_merge(load_yaml(base_path, chain), data)


def _not_a_file(path: Path) -> str:
    """What a config path that is no file is, as the refusal says it."""
    if path.is_dir():
        return "is a folder, not a YAML file: name the .yaml file in it"
    if path.exists():
        return "is not a regular file (a FIFO or a device?): name a YAML file"
    return "does not exist"


def load_config(
    cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None
) -> T:
    data = load_yaml(path) if path else {}
    apply_overrides(data, overrides or [])
    return from_dict(cls, data)


def check(cond: bool, message: str) -> None:
    """Raise a ConfigError with `message` unless `cond` holds (used by `validate()` methods)."""
    if not cond:
        raise ConfigError(message)
