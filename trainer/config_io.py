"""Typed configs from a file (TOML or JSON) plus dotted overrides such as `optimizer.learning_rate=3e-4`.

What must hold: every key names a field (a typo is a ValueError listing the accepted keys), every
value has its field's type (ints stay ints, a bool is never a number), nested dataclasses nest,
and `config_from_dict(type(c), config_to_dict(c)) == c`.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def _convert(value: Any, hint: Any, where: str) -> Any:
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in arguments:
            return None
        (inner,) = [argument for argument in arguments if argument is not type(None)]
        return _convert(value, inner, where)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, Mapping):
            raise ValueError(f"{where} must be a table of settings; got {value!r}")
        return config_from_dict(hint, value, where)
    if origin is tuple:
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise ValueError(f"{where} must be a list; got {value!r}")
        return tuple(_convert(item, arguments[0], f"{where}[{i}]") for i, item in enumerate(value))
    if origin is dict or hint is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"{where} must be a table; got {value!r}")
        return dict(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and type(value) is not hint:
        raise ValueError(f"{where} must be of type {hint.__name__}; got {type(value).__name__} {value!r}")
    return value


def config_from_dict(cls: type[T], data: Mapping[str, Any], where: str = "config") -> T:
    """An instance of the dataclass cls from a mapping, checked key by key (see the module docstring)."""
    fields = {field.name: field for field in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(f'{where}.{k}' for k in unknown)}; "
                         f"accepted in {where}: {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, field in fields.items():
        if name in data:
            values[name] = _convert(data[name], hints[name], f"{where}.{name}")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ValueError(f"{where}.{name} is required")
    return cls(**values)


def config_to_dict(config: Any) -> dict[str, Any]:
    """Plain JSON-able dict of a config dataclass (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """data with each `dotted.key=value` set; values are read as JSON when they parse, else as text."""
    data = json.loads(json.dumps(data))
    for override in overrides:
        key, separator, text = override.partition("=")
        if not separator or not key:
            raise ValueError(f"override {override!r} must look like section.key=value")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        *parents, leaf = key.split(".")
        node = data
        for parent in parents:
            node = node.setdefault(parent, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {override!r}: {parent} is not a section")
        node[leaf] = value
    return data


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A TOML (.toml) or JSON (anything else) config file as a dict."""
    path = Path(path)
    try:
        if path.suffix == ".toml":
            return tomllib.loads(path.read_text(encoding="utf-8"))
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read config file {path}: {error}") from None


def load_config(cls: type[T], path: str | Path | None, overrides: Sequence[str] = ()) -> T:
    return config_from_dict(cls, apply_overrides(read_config_file(path) if path else {}, overrides))
