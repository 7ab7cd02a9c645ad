"""Configs from YAML and dotted overrides, built into the dataclasses strictly; and back to YAML."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from .checks import validate
from .sections import (
    BUILTIN_OPTIMIZER_FIELDS,
    Config,
    ConfigError,
)

# ---------------------------------------------------------------------------------------------
# Building dataclasses from plain data, strictly.


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _describe(tp: Any) -> str:
    """How an error names the values of one alternative of a union."""
    if tp is bool:
        return "true, false"
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is Literal:
        return ", ".join(repr(a) for a in typing.get_args(tp))
    return f"a {_type_name(tp)}"


def build_dataclass(tp: Any, value: Any, key: str = "") -> Any:
    """Build `tp` (a dataclass, Literal, scalar, Optional or tuple type) from plain data, strictly:
    unknown keys and disallowed values raise `ConfigError` naming the dotted `key`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"config '{key}' must be a mapping, got {value!r}")
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp)}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            where = f"'{key}'" if key else "the top level"
            raise ConfigError(
                f"unknown config key '{_join(key, unknown[0])}'; allowed keys in {where}: "
                f"{', '.join(fields)}"
            )
        kwargs = {}
        for name, f in fields.items():
            if name in value:
                kwargs[name] = build_dataclass(hints[name], value[name], _join(key, name))
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"config '{_join(key, name)}' is required")
        return tp(**kwargs)
    if origin is Literal:
        if value not in args:
            raise ConfigError(
                f"config '{key}' = {value!r} is not allowed; allowed values: "
                f"{', '.join(repr(a) for a in args)}"
            )
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return build_dataclass(inner[0], value, key)
        for alternative in inner:  # e.g. `true | false | "auto"`: the first that takes it
            try:
                return build_dataclass(alternative, value, key)
            except ConfigError:
                pass
        allowed = [_describe(a) for a in args]
        raise ConfigError(f"config '{key}' = {value!r} is not allowed; allowed values: "
                          f"{', '.join(allowed)}")
    if origin is tuple:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            if args and args[-1] is Ellipsis and not isinstance(value, (str, bytes)):
                value = [value]  # a single id where a list is expected: `devices: 3`
            else:
                raise ConfigError(f"config '{key}' must be a list, got {value!r}")
        return tuple(build_dataclass(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config '{key}' must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config '{key}' must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads `1e9` (no sign, no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config '{key}' must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"config '{key}' must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config field type {_type_name(tp)} at '{key}'")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def to_dict(cfg: Any) -> Any:
    """Plain YAML-able data (tuples become lists)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [to_dict(v) for v in cfg]
    return cfg


class _DuplicateKey(yaml.constructor.ConstructorError):
    pass


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping (YAML keeps the last
    silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: YAML's own error follows
                continue
            if first is not key_node.start_mark:
                raise _DuplicateKey(
                    None, None, f"key {key!r} given twice (first at line {first.line + 1}); "
                    "allowed: each key once", key_node.start_mark)
        return super().construct_mapping(node, deep)


def read_yaml(text: str, where: str) -> Any:
    """`text` parsed as YAML, keys unique; a syntax error or a repeated key is a `ConfigError`
    naming `where` (a file, or the `--set` override), the line and the column."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except _DuplicateKey as e:
        mark = e.problem_mark
        raise ConfigError(f"{where}: line {mark.line + 1}, column {mark.column + 1}: "
                          f"{e.problem}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = " ".join(x for x in (e.context, e.problem) if x)
        raise ConfigError(f"{where}: {at}not valid YAML: {what}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from None


def read_config_file(path: str | Path) -> dict:
    """A config file's top-level mapping (`read_yaml`); a path that is not a readable file is
    a `ConfigError` naming it."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{path}: is a directory; allowed: a YAML config file "
                          "(e.g. configs/demo.yaml)")
    if not p.exists():
        raise ConfigError(f"{path}: no such file; allowed: a YAML config file "
                          "(e.g. configs/demo.yaml)")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read as a text file ({e})") from None
    raw = read_yaml(text, str(path)) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return raw


def apply_override(raw: dict, assignment: str) -> dict:
    """Apply one `a.b.c=value` override to raw config data; the value is parsed as YAML."""
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like key.path=value")
    path, text = assignment.split("=", 1)
    keys = path.strip().split(".")
    if not all(keys):
        raise ConfigError(f"override key {path!r} is not a dotted key path")
    value = read_yaml(text, f"--set {assignment}") if text.strip() else None
    node = raw
    for i, k in enumerate(keys[:-1]):
        child = node.get(k)
        if child is None:
            child = node[k] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{path}': '{'.'.join(keys[: i + 1])}' is not a section")
        node = child
    node[keys[-1]] = value
    return raw


def from_dict(raw: Mapping[str, Any] | None) -> Config:
    cfg = build_dataclass(Config, dict(raw or {}), "")
    validate(cfg)
    return cfg


def load(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load a YAML config (or the defaults when `path` is None) and apply dotted overrides."""
    raw = read_config_file(path) if path is not None else {}
    for o in overrides:
        apply_override(raw, o)
    return from_dict(raw)


def dump(cfg: Config, optimizer: str | None = None) -> str:
    """YAML of `cfg`, as the run's `config.yaml`. With a custom optimizer (`train.optimizer`, or
    `optimizer`: the label of one passed to `run` in Python, written as `train.optimizer`) the
    built-in optimizer's fields it leaves unused are left out, so the file says only what ran;
    a label that is not MODULE:ATTR makes the file refuse to load, rather than train AdamW."""
    d = to_dict(cfg)
    if optimizer is not None:
        d["train"]["optimizer"] = optimizer
    if d["train"]["optimizer"]:
        for name in BUILTIN_OPTIMIZER_FIELDS:
            if not (name == "grad_clip" and cfg.deterministic):
                del d["train"][name]
    return yaml.safe_dump(d, sort_keys=False)
