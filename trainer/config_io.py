"""Typed configs from a file (TOML or JSON) plus dotted overrides such as `optimizer.learning_rate=3e-4`.

The configs are plain dataclasses; pydantic checks a file against them. What must hold: every key
names a field (a typo is a ConfigError naming the key and the accepted ones), every value has its
field's type as JSON writes it (an int is never read from 2.0 or "2", a bool never from 1; an int
is a fine float, a list a fine tuple), nested dataclasses nest, and
`config_from_dict(type(c), config_to_dict(c)) == c`. The config.json a run writes is this dict, so
run folders of earlier versions load as long as no field is renamed or removed.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import tomllib
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pydantic

__all__ = ["ConfigError", "apply_overrides", "config_from_dict", "config_to_dict", "load_config", "read_config_file"]

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that does not fit the config: names the key, what is wrong and what fits."""


@functools.cache
def _file_model(cls: type) -> type[pydantic.BaseModel]:
    # pydantic passes a model's rules on to the stdlib dataclasses inside it, so the configs stay plain dataclasses.
    rules = pydantic.ConfigDict(extra="forbid", strict=True)
    return pydantic.create_model(f"{cls.__name__}File", __config__=rules, config=(cls, ...))


def _section(cls: type, path: Sequence[str | int]) -> type:
    """The dataclass a key path leads into, e.g. (data,) -> data.Config."""
    for name in path:
        cls = typing.get_type_hints(cls)[name]
    return cls


def _problem(cls: type, error: Mapping[str, Any]) -> str:
    path = error["loc"][1:]  # after the wrapper's `config` field
    key = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".")
    if error["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        fields = ", ".join(field.name for field in dataclasses.fields(_section(cls, path[:-1])))
        section = ".".join(str(part) for part in path[:-1])
        return f"unknown setting {key}; accepted {f'in {section}' if section else 'at the top level'}: {fields}"
    if error["type"] == "missing":
        return f"{key} is required"
    value = error["input"]
    message = error["msg"][:1].lower() + error["msg"][1:]
    return f"{key or 'the config'}: {message}; got {type(value).__name__} {value!r}"


def config_from_dict(cls: type[T], data: Mapping[str, Any], where: str = "config") -> T:
    """An instance of the dataclass cls from a JSON-like mapping, checked key by key (see the module docstring).

    Raises ConfigError: one line that starts with where (e.g. the file's name) and names each bad key."""
    try:
        text = json.dumps({"config": data})
    except (TypeError, ValueError) as error:  # e.g. a TOML date
        raise ConfigError(f"{where}: {error}") from None
    try:
        return _file_model(cls).model_validate_json(text).config
    except pydantic.ValidationError as error:
        raise ConfigError(f"{where}: " + "; ".join(_problem(cls, item) for item in error.errors())) from None


def config_to_dict(config: Any) -> dict[str, Any]:
    """Plain JSON-able dict of a config dataclass (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """data with each `dotted.key=value` set; values are read as JSON when they parse, else as text."""
    data = copy.deepcopy(data)
    for override in overrides:
        key, separator, text = override.partition("=")
        if not separator or not key:
            raise ConfigError(f"override {override!r} must look like section.key=value")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        *parents, leaf = key.split(".")
        node = data
        for parent in parents:
            node = node.setdefault(parent, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {override!r}: {parent} is not a section")
        node[leaf] = value
    return data


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A TOML (.toml) or JSON (anything else) config file as a dict."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read config file {path}: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table of settings; it holds a {type(data).__name__}")
    return data


def load_config(cls: type[T], path: str | Path | None, overrides: Sequence[str] = ()) -> T:
    """cls from a config file (or nothing) with the overrides applied; problems name the file."""
    where = str(path) if path else "config"
    return config_from_dict(cls, apply_overrides(read_config_file(path) if path else {}, overrides), where)
