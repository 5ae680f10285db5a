"""Files shipped with relaunch: provider presets, the examples, instance-side templates."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def _root(package: str) -> Path:
    return Path(str(files(package)))


def recipes_dir() -> Path:
    return _root("relaunch.recipes")


def examples_dir() -> Path:
    return _root("relaunch.examples")


def templates_dir() -> Path:
    return _root("relaunch.templates")
