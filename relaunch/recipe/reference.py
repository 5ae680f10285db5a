"""The key reference (docs/recipe-keys.md), generated from the recipe model so that it cannot drift.

    python -m relaunch.recipe.reference > docs/recipe-keys.md

A test fails when the committed file differs from what this prints, or when a key of the
model has no description or example.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from relaunch.recipe.model import Recipe

HEADER = """\
# Every recipe key

<!-- Generated from relaunch/recipe/model.py: edit the model, then run
     `python -m relaunch.recipe.reference > docs/recipe-keys.md`. A test fails when they differ. -->

Every key a recipe may have. Only the keys marked *required* must be written (`name`,
`env.python`, `checkpoint.remote`, `run.command`); `relaunch init` writes a starter with the
others commented out, and `relaunch check RECIPE --explain` shows every value of a recipe with
where it came from (a file and line, a provider preset, `--set`, or the default).

Every string may use Jinja2 variables: `name`, `host`, `user`, `home`, `checkpoint` (instance path
of the restored checkpoint, empty on a fresh start), `step`, `gpus` (on this node), `nnodes`,
`node_rank`, `master_addr`, `world_size`, `checkpoint_dir` (checkpoint.dir as rendered, `~`
expanded: a command that names it works on every provider's disks), and any `env.vars`. Local
paths are relative to the file that wrote them; paths starting with `~` are on the instance.
"""


def _flow(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, allow_unicode=True, sort_keys=False)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _sub_model(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


_NAMES = {str: "text", int: "whole number", float: "number", bool: "true or false", Path: "local path"}


def type_name(annotation: Any) -> str:
    """How the reference spells a field's type."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"mapping of {type_name(args[0])} to {type_name(args[1])}"
    if origin is typing.Union or isinstance(annotation, types.UnionType):
        named = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(named) + (", or empty" if type(None) in args else "")
    if _sub_model(annotation) is not None:
        return "section"
    return _NAMES.get(annotation, str(annotation))


def default_text(field: FieldInfo) -> str:
    extra = field.json_schema_extra
    if isinstance(extra, dict) and "shown_default" in extra:
        return str(extra["shown_default"])
    if field.is_required():
        return "*required*"
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        return "its keys' defaults" if isinstance(value, BaseModel) else f"`{_flow(value)}`"
    if field.default is PydanticUndefined or field.default is None:
        return "empty"
    return f"`{_flow(field.default)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def fields(model: type[BaseModel] = Recipe, prefix: str = "") -> list[tuple[str, FieldInfo]]:
    """(dotted key, field) of every key, depth first in the model's order."""
    found: list[tuple[str, FieldInfo]] = []
    for name, field in ((field.alias or n, field) for n, field in model.model_fields.items()):
        found.append((prefix + name, field))
        sub = _sub_model(field.annotation)
        if sub is not None:
            found += fields(sub, f"{prefix}{name}.")
    return found


def _example_yaml(model: type[BaseModel], depth: int = 0) -> list[str]:
    lines = []
    for name, field in ((field.alias or n, field) for n, field in model.model_fields.items()):
        sub = _sub_model(field.annotation)
        required = "  # required" if field.is_required() and sub is None else ""
        if sub is not None:
            lines.append("  " * depth + f"{name}:")
            lines += _example_yaml(sub, depth + 1)
        else:
            example = (field.examples or [None])[0]
            lines.append("  " * depth + f"{name}: {_flow(example)}{required}")
    return lines


def _table(model: type[BaseModel], prefix: str) -> list[str]:
    rows = ["| key | type | default | description | example |", "|---|---|---|---|---|"]
    for name, field in ((field.alias or n, field) for n, field in model.model_fields.items()):
        example = (field.examples or [None])[0]
        rows.append(f"| `{prefix}{name}` | {_cell(type_name(field.annotation))} | {_cell(default_text(field))} "
                    f"| {_cell(field.description or '')} | `{_cell(_flow(example))}` |")
    return rows


def reference() -> str:
    """The whole of docs/recipe-keys.md."""
    out = [HEADER, "## At a glance", "", "Every key with an example value:", "", "```yaml",
           *_example_yaml(Recipe), "```", ""]
    sections: list[tuple[str, type[BaseModel]]] = [("", Recipe)]
    sections += [(key + ".", sub) for key, field in fields() if (sub := _sub_model(field.annotation)) is not None]
    for prefix, model in sections:
        title = f"`{prefix.rstrip('.')}`" if prefix else "Top level"
        about = (model.__doc__ or "").strip().splitlines()[0] if prefix else "The keys at the top of a recipe."
        out += [f"## {title}", "", about, "", *_table(model, prefix), ""]
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(reference(), end="")
