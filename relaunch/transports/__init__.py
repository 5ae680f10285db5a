"""Stores and the transports that reach them, one module per kind of `checkpoint.remote`:

    a path on this machine      local.LocalPathStore   (rsync over the instance's SSH settings)
    rclone:REMOTE:PATH          rclone.RcloneStore     (any rclone remote; the `rclone` extra)
    hf:OWNER/REPO[/SUBFOLDER]   hf.HfStore             (a Hugging Face Hub repo; the `hf` extra)

With `via: local`, an rclone or hf store is wrapped in relay.Relay: the bytes pass through a
cache on this machine and the instance never holds the remote's credentials.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from ..errors import UsageError
from ..paths import state_dir
from ..recipe import Recipe
from .base import Damaged, Mismatch, Store, Vanished

KINDS = ("rclone", "hf")


def open_store(recipe: Recipe) -> Store:
    remote = recipe.checkpoint.remote
    if isinstance(remote, Path):
        from .local import LocalPathStore

        return LocalPathStore(remote, recipe.name)
    kind = remote.split(":", 1)[0]
    if kind not in KINDS:
        raise UsageError(f"{recipe.where('checkpoint.remote')}: checkpoint.remote: unknown kind {remote!r}")
    _require_extra(recipe, kind)
    store: Store
    if kind == "rclone":
        from .rclone import RcloneStore

        store = RcloneStore.from_recipe(recipe)
        via = recipe.checkpoint.via
    else:
        from .hf import HfStore

        store = HfStore.from_recipe(recipe)
        # the recipe model's default is "local"; for hf the instance uploads itself unless the
        # recipe (or an extended file, or --set) says otherwise
        via = recipe.checkpoint.via if "via" in recipe.checkpoint.model_fields_set else "instance"
    if via == "instance":
        return store
    from .relay import Relay

    key = hashlib.sha256(store.label.encode()).hexdigest()[:12]
    return Relay(store, state_dir() / "cache" / f"{recipe.name}-{kind}-{key}")  # type: ignore[arg-type]


def _require_extra(recipe: Recipe, kind: str) -> None:
    """hf: needs huggingface_hub here (rclone's binary is looked for when it is first run)."""
    if kind == "hf" and importlib.util.find_spec("huggingface_hub") is None:
        raise UsageError(f"{recipe.where('checkpoint.remote')}: checkpoint.remote {recipe.checkpoint.remote} "
                         "needs huggingface_hub on this machine", "pip install 'relaunch[hf]'")


__all__ = ["Damaged", "Mismatch", "Store", "Vanished", "open_store"]
