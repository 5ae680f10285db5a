"""The provider base recipes, `recipes/providers/NAME.yaml`, made from the catalogue.

`relaunch init --provider NAME` writes a recipe that `extends: [providers/NAME]`, so the user writes
only the command and the store. The base carries what the provider decides: the SSH user and port
(`provider:`), the disks (checkpoint.dir and env.venv on the disk that a stop keeps), the notices the
guard can hear, and the installer. It is generated from recipes/providers.yaml so that the two never
disagree: `python -m relaunch.recipe.bases` rewrites them, and a test checks that the committed files
are what it writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from relaunch.recipe.providers import Disk, Provider, load_providers
from relaunch.resources import recipes_dir

FOLDER = "providers"          # recipes/providers/NAME.yaml: a recipe name `providers/NAME`


def _fate(disk: Disk) -> str:
    said = {"kept": "keeps it", "wiped": "wipes it"}
    parts = []
    if disk.stop:
        parts.append(f"a stop {said[disk.stop]}")
    if disk.reclaim:
        parts.append(f"taking the instance back {said[disk.reclaim]}")
    return "; ".join(parts) or "fate not documented"


def _flow(value: str | list[str]) -> str:
    """A value as YAML on one line: plain where YAML reads it back as the same string, else quoted."""
    if isinstance(value, list):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    return value if yaml.safe_load(value) == value and "{" not in value else json.dumps(value)


def _line(text: str, comment: str) -> str:
    return (text.ljust(32) if len(text) < 32 else text + " ") + "# " + comment


def base_recipe(provider: Provider) -> str:
    """The YAML text of provider's base recipe."""
    name = provider.name
    lines = [
        f"# relaunch's base recipe for {name}, generated from recipes/providers.yaml (the sources are there);",
        "# regenerate with `python -m relaunch.recipe.bases`, do not edit by hand.",
        f"# Use it with `extends: [{FOLDER}/{name}]` (what `relaunch init --provider {name}` writes):",
        "# your recipe's own keys win; `relaunch check RECIPE --explain` shows where each value comes from.",
    ]
    if provider.disks:
        lines.append("# Disks of its instances, as documented:")
        lines += [f"#   {d.path} ({d.name}): {_fate(d)}; {d.what}" for d in provider.disks]
    else:
        lines.append("# Which of its disks survive a stop is not documented in the catalogue's sources: keep")
        lines.append("# checkpoints copied off (`relaunch sync`/`watch`).")
    lines += ["", f"provider: {name}", "", "env:",
              _line("  installer: uv", "provides env.python when the image lacks it")]
    if provider.venv:
        lines.append(_line(f"  venv: {_flow(provider.venv)}", "on a disk that a stop keeps: reused after a start"))
    if provider.index_url:
        lines.append(_line(f"  index_url: {_flow(provider.index_url)}", "the index its instances reach"))
    if provider.checkpoint_dir:
        lines += ["", "checkpoint:", _line(f"  dir: {_flow(provider.checkpoint_dir)}", "on a disk that a stop keeps")]
    if provider.guard_sources is not None:
        sources = list(provider.guard_sources)
        why = ("the notices its instances can get; `relaunch up` says which can fire" if sources
               else "no notice is documented: the copy-off interval bounds a loss")
        lines += ["", "guard:", _line(f"  sources: {_flow(sources)}", why)]
    return "\n".join(lines) + "\n"


def write_all(folder: Path) -> list[Path]:
    """Write every provider's base recipe into `folder`; returns the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for provider in load_providers().values():
        path = folder / f"{provider.name}.yaml"
        path.write_text(base_recipe(provider), encoding="utf-8")
        written.append(path)
    return written


def shipped_folder() -> Path:
    return recipes_dir() / FOLDER


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else shipped_folder()
    for path in write_all(target):
        print(path)
