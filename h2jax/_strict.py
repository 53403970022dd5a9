"""Strict construction of frozen dataclasses from YAML data, and the error every bad input becomes.

Pure Python (no JAX), below both ``h2jax.plan`` and ``h2jax.config`` in the import graph, so
that the planner and the experiment config parse the same files with the same rules:
unknown keys and wrong types fail naming the dotted key (:func:`build_dataclass`); a file
that is not UTF-8 or not valid YAML fails naming the file, line and column (:func:`read_yaml`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad input: names the dotted key, the value and what was expected (the CLI exits 2)."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        # ValueError would re-create the error from its one formatted argument
        return (type(self), (self.key, self.message))


class _DuplicateKey(Exception):
    def __init__(self, name: Any, line: int):
        self.name, self.line = name, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's safe loader, except that a key given twice in one mapping is an error (PyYAML
    keeps the last: a config with the same section twice would lose the first, silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            name = self.construct_object(key_node, deep=deep)
            if not isinstance(name, (str, int, float, bool)):
                continue  # an unhashable key: the base class says what is wrong with it
            if name in seen:
                raise _DuplicateKey(name, key_node.start_mark.line + 1)
            seen.add(name)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path, *, key: str) -> Any:
    """The YAML data of file ``path``; ConfigError under ``key`` when the file cannot be read,
    is not UTF-8 (with the byte offset) or is not valid YAML (with its line and column)."""
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(key, f"{p} is not UTF-8 text (byte {e.start}: {e.reason}); expected a YAML file") from None
    except OSError as e:
        raise ConfigError(key, f"{p} cannot be read ({e.strerror or e}); expected a readable YAML file") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except _DuplicateKey as e:
        raise ConfigError(key, f"{p}:{e.line}: {e.name!r} is given twice in one mapping; expected it once") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(key, f"{where}: not valid YAML ({problem})") from None


# PyYAML (YAML 1.1) reads an exponent without a dot (1e-3, 5e4) as a string; only those
# strings become floats -- not "nan", "inf" or "1_0", which Python's float() would accept.
_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)[eE][-+]?\d+")

_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}

# dataclass -> check of its field values, run before its constructor so that the message
# names the dotted key (its __post_init__ would fail with a less precise one)
VALUE_CHECKS: dict[type, Callable[[dict[str, Any], str], None]] = {}
# type -> its reader from one YAML value and its dotted key (e.g. a pipeline schedule from its
# name or file), raising ConfigError naming the key
PARSERS: dict[type, Callable[[Any, str], Any]] = {}


def _type_name(tp: Any) -> str:
    if tp in _TYPE_WORDS:
        return _TYPE_WORDS[tp]
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def field_values(cls: type, given: dict[str, Any]) -> dict[str, Any]:
    """Every init field of ``cls``: its default (or factory's value) unless ``given``."""
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in given:
            out[f.name] = given[f.name]
        elif f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def check_value(tp: Any, value: Any, key: str) -> Any:
    """Check (and lightly coerce: int -> float) ``value`` against annotation ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and (typing.get_origin(inner[0]) in (list, tuple, dict) or inner[0] in PARSERS):
            return check_value(inner[0], value, key)  # a container (or a parsed type) or null: its own message
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return check_value(a, value, key)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(key, f"got {value!r}; expected {' or '.join(_type_name(a) for a in args)}")
    if isinstance(tp, type) and tp in PARSERS:
        return PARSERS[tp](value, key)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return build_dataclass(tp, value, key)
    if origin is dict:
        kt, vt = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(key, f"got {value!r}; expected a mapping")
        return {check_value(kt, k, f"{key}"): check_value(vt, v, f"{key}.{k}") for k, v in value.items()}
    if origin in (list, tuple):
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"got {value!r}; expected a list")
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return tuple(check_value(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
        if origin is tuple:
            if len(value) != len(args):
                raise ConfigError(key, f"got {value!r}; expected {len(args)} items")
            return tuple(check_value(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        return [check_value(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"got {value!r}; expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"got {value!r}; expected an integer")
        return value
    if tp is float:
        if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"got {value!r}; expected a number")
        if not math.isfinite(value):
            raise ConfigError(key, f"got {value!r}; expected a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"got {value!r}; expected a string")
        return value
    if tp is Any:
        return value
    raise TypeError(f"{key}: unsupported annotation {tp!r}")


def build_dataclass(cls: type, raw: Any, key: str) -> Any:
    """``cls(**raw)`` with every key known and every value of its declared type."""
    if not isinstance(raw, dict):
        raise ConfigError(
            key, f"got {raw!r}; expected a mapping with keys {sorted(f.name for f in dataclasses.fields(cls))}"
        )
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(raw) - names, key=str)  # YAML keys may be ints
    if unknown:
        where = f"{key}.{unknown[0]}" if key else str(unknown[0])
        raise ConfigError(where, f"unknown key; {_type_name(cls)} has keys {sorted(names)}")
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.init and required and f.name not in raw:
            raise ConfigError(f"{key}.{f.name}" if key else f.name, "required key is missing")
    kwargs = {}
    for name, value in raw.items():
        sub = f"{key}.{name}" if key else name
        kwargs[name] = check_value(hints[name], value, sub)
    if cls in VALUE_CHECKS:
        VALUE_CHECKS[cls](field_values(cls, kwargs), key)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # a dataclass's own __post_init__ checks
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(key or _type_name(cls), str(e)) from e


def to_raw(obj: Any) -> Any:
    """A dataclass tree as plain YAML-able data (the inverse of build_dataclass)."""
    if hasattr(obj, "to_dict") and dataclasses.is_dataclass(obj):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj):
        return {f.name: to_raw(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, dict):
        return {k: to_raw(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_raw(v) for v in obj]
    return obj
