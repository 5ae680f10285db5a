"""`relaunch freeze`: the instance venv's packages into the recipe's lock file."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from .cycle import open_host
from .errors import EnvError, UsageError
from .gather import gather
from .host.spec import HostSpec
from .job import normalize
from .recipe import Recipe
from .ui import UI

# what `pip freeze` leaves out by default
_TOOLING = {"pip", "setuptools", "wheel", "distribute"}


def instance_freeze(recipe: Recipe, spec: HostSpec, ui: UI) -> list[str]:
    node, remote = open_host(recipe, spec, ui)
    with remote:
        job = gather(remote, recipe, node, listing=False)
        if job.facts.host.venv_freeze is None:
            raise EnvError(f"{job.host}: freeze: there is no venv at {job.paths.venv}",
                           "run `relaunch up` first, or fix env.venv")
        return [line for line in job.facts.host.venv_freeze
                if normalize(line.split("==", 1)[0]) not in _TOOLING and line.strip()]


def lock_diff(old: list[str], new: list[str], path: Path) -> list[str]:
    return list(difflib.unified_diff(old, new, fromfile=f"{path} (now)", tofile=f"{path} (instance)", lineterm=""))


def write_lock(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


def local_version_warning(recipe: Recipe, lines: list[str]) -> str | None:
    tagged = [line for line in lines if "+" in line.partition("==")[2]]
    if tagged and not recipe.env.index_url:
        return (f"{len(tagged)} package(s) carry a local version tag ({tagged[0]}, ...): they are only on the "
                "index they came from; set env.index_url (e.g. https://download.pytorch.org/whl/cu124)")
    return None


def lock_path(recipe: Recipe) -> Path:
    if recipe.env.lock is None:
        raise UsageError(f"{recipe.where('env')}: env.lock is not set; freeze needs a file to write",
                         "add `lock: requirements.lock` under env:")
    return Path(recipe.env.lock)
