"""Every setting of the plugin, the collector, the trainer, the loop and the object store in one Markdown table, from the code.

docs/settings.md embeds the table between `<!-- settings -->` markers; a test (tests/test_readme.py) fails
when the two differ, so the table cannot drift from the settings classes. `python -m eagle_tap.settings_table`
prints it: paste its output between the markers in docs/settings.md.
Names, defaults and meanings come from the classes themselves (the meaning is each field's docstring).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any

from capture_format.tables import markdown_table

__all__ = ["attribute_docstrings", "settings_table"]


def attribute_docstrings(cls: type) -> dict[str, str]:
    """{field: first paragraph of the string literal under its annotated assignment} in cls's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split("\n\n")[0].split())
    return docs


def _default_text(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 30} GiB" if value % (1 << 30) == 0 else f"{value >> 20} MiB"
    if isinstance(value, tuple):
        return ", ".join(str(item) for item in value)
    return str(value)


def _pydantic_rows(settings: type, where: str, env_prefix: str, flags: dict[str, str]) -> list[tuple[str, ...]]:
    docs = attribute_docstrings(settings)
    rows = []
    for name, field in settings.model_fields.items():
        default = "required" if field.is_required() else _default_text(field.get_default(call_default_factory=True))
        aliases = getattr(field.validation_alias, "choices", None)  # variables other than the prefixed name
        names = [str(alias) for alias in aliases] if aliases else [f"{env_prefix}{name.upper()}"]
        setting = " or ".join(f"`{variable}`" for variable in names) + (f" / `{flags[name]}`" if name in flags else "")
        rows.append((where, setting, default, docs.get(name, "")))
    return rows


def _dataclass_rows(config: type, where: str, prefix: str = "") -> list[tuple[str, ...]]:
    docs, hints = attribute_docstrings(config), typing.get_type_hints(config)
    rows = []
    for field in dataclasses.fields(config):
        if dataclasses.is_dataclass(hints[field.name]):
            rows += _dataclass_rows(hints[field.name], where, f"{prefix}{field.name}.")
            continue
        if field.default is not dataclasses.MISSING:
            default = _default_text(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            default = _default_text(field.default_factory())
        else:
            default = "required"
        rows.append((where, f"`{prefix}{field.name}`", default, docs.get(field.name, "")))
    return rows


def _collector_flags() -> dict[str, str]:
    """{setting name: its `eagle-tap collect` flag}, read from the real parser."""
    import argparse

    from collector_service.cli import add_commands

    commands = argparse.ArgumentParser().add_subparsers()
    add_commands(commands)
    collect = commands.choices["collect"]
    return {action.dest: action.option_strings[0] for action in collect._actions
            if action.option_strings and action.option_strings[0].startswith("--")}


def settings_table() -> str:
    from capture_format.object_store import ENVIRONMENT as OBJECT_STORE_ENVIRONMENT
    from collector_service.settings import CollectorSettings
    from sglang_patch.settings import CaptureSettings
    from eagle_tap.loop.agent import AgentConfig
    from eagle_tap.loop.config import LoopConfig
    from trainer.config import Config as TrainConfig

    rows = _pydantic_rows(CaptureSettings, "plugin (SGLang server env)", "EAGLE_TAP_", {})
    rows += _pydantic_rows(CollectorSettings, "collector (env / flag)", "EAGLE_TAP_COLLECTOR_", _collector_flags())
    rows += _dataclass_rows(TrainConfig, "trainer (`train --config` key)")
    rows += _dataclass_rows(LoopConfig, "loop (`loop --config` key, or `--set key=value`)")
    rows += _dataclass_rows(AgentConfig, "agent (`loop agent --config` key, or `--set key=value`)")
    rows += [("object store (env of collector and readers)", f"`{name}`", default, meaning)
             for name, default, meaning in OBJECT_STORE_ENVIRONMENT]
    return markdown_table(["part", "setting", "default", "meaning"], rows)


if __name__ == "__main__":
    print(settings_table())
