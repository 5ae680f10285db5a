"""Where a recipe puts its checkpoints and venv, against what the provider does to its disks.

A checkpoint.dir on a disk that a stop wipes comes back empty (RunPod's container disk), and a venv
there is built again after every start; a disk smaller than two checkpoints cannot hold the one being
written beside the last complete one. `relaunch check` warns from the catalogue alone (the home
folder guessed from ssh.user); `relaunch up` warns with the instance's real home and disk size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relaunch.recipe.providers import Disk, Provider, load_providers

if TYPE_CHECKING:
    from relaunch.recipe.model import Recipe


def _preset(recipe: Recipe) -> Provider | None:
    return load_providers().get(recipe.provider) if recipe.provider else None


def _kept_disk(preset: Provider, home: str) -> Disk | None:
    """The disk to suggest instead: the provider's own choice, else the most specific one a stop keeps."""
    if preset.checkpoint_dir:
        return preset.disk_of(preset.checkpoint_dir.split("{", 1)[0], home)
    kept = [d for d in preset.disks if d.stop == "kept"]
    return max(kept, key=lambda d: len(d.path), default=None)


def wiped_by_stop(recipe: Recipe, key: str, path: str, home: str, consequence: str) -> str | None:
    """Why `path` (the rendered value of `key`) is on a disk the recipe's provider wipes at a stop,
    what that means (`consequence`), and where it would be kept."""
    preset = _preset(recipe)
    disk = preset.disk_of(path, home) if preset else None
    if preset is None or disk is None or disk.stop != "wiped":
        return None
    better = _kept_disk(preset, home)
    if better is None:
        return None             # nowhere better to put it (the sandbox's default image): no advice to give
    message = (f"{recipe.where(key)}: {key} {path} is on {preset.name}'s {disk.name} ({disk.path}), which a stop "
               f"wipes: {consequence}")
    if better is not disk:
        message += f"; its {better.name} ({better.path}) is kept through a stop"
        if not any(f.endswith(f"providers/{preset.name}.yaml") for f in recipe.files):
            message += f" (`extends: [providers/{preset.name}]` puts it there)"
    return message


def recipe_disk_warnings(recipe: Recipe, home: str, paths: dict[str, str]) -> tuple[list[str], list[str]]:
    """(warnings, notes) for checkpoint.dir and env.venv, given their rendered `paths` on an instance
    whose home is `home`: checkpoints on a disk a stop wipes are a warning (a stopped instance comes
    back without them), a venv there a note (it is built again after each start)."""
    warnings, notes = [], []
    ckpt = wiped_by_stop(recipe, "checkpoint.dir", paths["checkpoint.dir"], home,
                         "a stopped instance comes back without its checkpoints")
    if ckpt:
        warnings.append(ckpt)
    venv = wiped_by_stop(recipe, "env.venv", paths["env.venv"], home, "the venv is built again after every start")
    if venv:
        notes.append(venv)
    return warnings, notes


def too_small(path: str, disk_bytes: int, newest_bytes: int) -> str | None:
    """A disk that cannot hold two checkpoints: the one being written beside the newest complete one."""
    if not disk_bytes or not newest_bytes or disk_bytes >= 2 * newest_bytes:
        return None
    from relaunch.ui import human

    return (f"checkpoint.dir {path} is on a disk of {human(disk_bytes)}, less than twice the newest checkpoint "
            f"({human(newest_bytes)}): the next save may not fit beside the last complete one")
