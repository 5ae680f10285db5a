"""Stores and the transports that reach them, one module per kind of `checkpoint.remote`:

    a path on this machine      local.LocalPathStore   (rsync over the instance's SSH settings)
    rclone:REMOTE:PATH          rclone.RcloneStore     (any rclone remote)
    hf:OWNER/REPO[/SUBFOLDER]   hf.HfStore             (a Hugging Face Hub repo)
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from ..recipe import Recipe
from .base import Received, Store


def open_store(recipe: Recipe) -> Store:
    remote = recipe.checkpoint.remote
    if isinstance(remote, Path):
        from .local import LocalPathStore

        return LocalPathStore(remote)
    if remote.startswith("rclone:"):
        from .rclone import RcloneStore

        return RcloneStore.from_recipe(recipe)
    if remote.startswith("hf:"):
        from .hf import HfStore

        return HfStore.from_recipe(recipe)
    raise UsageError(f"{recipe.where('checkpoint.remote')}: checkpoint.remote: unknown kind {remote!r}")


__all__ = ["Received", "Store", "open_store"]
