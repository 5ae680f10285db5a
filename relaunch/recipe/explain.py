"""What `relaunch check` shows: every value beside where it came from, and the guesses a recipe
file still marks (`relaunch adopt` writes them; recipe/guesses.py reads them).

Where a value came from is one of `file:line` (the YAML that wrote it, after `extends`),
`--set`, `preset NAME` (the provider preset filled it in) or `default`. Plain `check` lists the
values the recipe sets (`values_text`), `--explain` the merged recipe with every value, defaults
included (`explain_text`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from relaunch.recipe.model import Recipe, recipe_keys_of

KeyPath = tuple[str, ...]


@dataclass(frozen=True)
class Explained:
    key: KeyPath
    value: Any
    origin: str
    guess: str | None = None          # what its GUESS comment says, while the file marks it

    @property
    def written(self) -> bool:
        """A file, --set or the provider preset gave this value (not a default)."""
        return self.origin != "default"

    @property
    def dotted(self) -> str:
        return ".".join(self.key)

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.dotted, "value": plain(self.value), "from": self.origin}

    def guess_dict(self) -> dict[str, Any]:
        return {"key": self.dotted, "from": self.origin, "guess": self.guess}


def plain(value: Any) -> Any:
    """A recipe value as YAML/JSON data (paths as text)."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, BaseModel):
        return {k: plain(getattr(value, n)) for k, n in recipe_keys_of(type(value)).items()}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)  # `wait: 60` reads back as 60, not 60.0
    return value


def explain(recipe: Recipe) -> list[Explained]:
    """Every value of the recipe (a list counts as one value; a mapping's entries each count)."""
    found: list[Explained] = []

    def walk(node: BaseModel, path: KeyPath) -> None:
        for written, name in recipe_keys_of(type(node)).items():
            value, key = getattr(node, name), (*path, written)
            if isinstance(value, BaseModel):
                walk(value, key)
            elif isinstance(value, dict) and value:
                found.extend(Explained((*key, str(k)), v, recipe.origin((*key, str(k))), recipe.guess((*key, str(k))))
                             for k, v in value.items())
            else:
                found.append(Explained(key, value, recipe.origin(key), recipe.guess(key)))

    walk(recipe, ())
    return found


def _scalar(value: Any) -> str:
    text = yaml.safe_dump(plain(value), default_flow_style=True, width=10**9, allow_unicode=True)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def explain_text(recipe: Recipe) -> str:
    """The merged recipe as YAML, each value followed by `# where it came from`."""
    entries = explain(recipe)
    rows: list[tuple[str, str]] = []  # (YAML text, origin or "" for a section line)
    opened: KeyPath = ()
    for entry in entries:
        parents = entry.key[:-1]
        common = 0
        while common < min(len(parents), len(opened)) and parents[common] == opened[common]:
            common += 1
        for depth in range(common, len(parents)):
            rows.append(("  " * depth + f"{_scalar(parents[depth])}:", ""))
        opened = parents
        rows.append(("  " * len(parents) + f"{_scalar(entry.key[-1])}: {_scalar(entry.value)}",
                     entry.origin + (", GUESS" if entry.guess else "")))
    width = min(max(len(text) for text, origin in rows if origin) + 2, 64)
    head = ["# merged from " + ", then ".join(recipe.files),
            "# after each value, where it came from: file:line, --set, preset PROVIDER or default; GUESS: a guess "
            "its file marks",
            "# {{ ... }} is rendered per host: `relaunch plan RECIPE HOST` shows it rendered"]
    body = [text if not origin else f"{(text + ' ').ljust(width)}# {origin}" for text, origin in rows]
    return "\n".join(head + body) + "\n"


def values_text(recipe: Recipe, shown: str) -> str:
    """The values the recipe sets (files, --set, the provider preset), one `key: value  # origin` line
    each, GUESS after a guess's origin; then how many keep their defaults (`shown`: the recipe as the
    user typed it, for the --explain hint)."""
    entries = explain(recipe)
    rows = [(f"{entry.dotted}: {_scalar(entry.value)}", entry.origin + (", GUESS" if entry.guess else ""))
            for entry in entries if entry.written]
    width = min(max((len(text) for text, _ in rows), default=0) + 2, 64)
    lines = [f"  {(text + ' ').ljust(width)}# {origin}" for text, origin in rows]
    defaults = len(entries) - len(rows)
    if defaults:
        lines.append(f"  ({defaults} more keys keep their defaults: `relaunch check {shown} --explain` shows every "
                     "value)")
    return "\n".join(lines) + "\n"


def guesses_text(recipe: Recipe) -> str:
    """The guesses left to check, each with where it is and what its comment says; "" when none."""
    guesses = [entry for entry in explain(recipe) if entry.guess]
    if not guesses:
        return ""
    width = max(len(f"{entry.dotted} ({entry.origin})") for entry in guesses)
    lines = [f"{len(guesses)} guess(es) left: check each, then delete `GUESS:` from the comment above its key"]
    lines += [f"  {f'{entry.dotted} ({entry.origin})':<{width}}  {entry.guess}" for entry in guesses]
    return "\n".join(lines) + "\n"
