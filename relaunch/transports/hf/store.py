"""HfStore: the rooms of the Hub store composed (__init__.py lists them), made from a recipe."""

from __future__ import annotations

import os

from ...errors import UsageError
from ...manifest import check_relpath
from ...recipe import Recipe
from ...ui import redact
from .client import hub_token
from .instance import ViaInstance
from .local import ViaLocal
from .meta import MetaFiles
from .pruning import Pruning


class HfStore(Pruning, MetaFiles, ViaInstance, ViaLocal):
    """A store in a Hugging Face Hub repo (the package's docstring says how it is kept)."""

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> HfStore:
        where = recipe.where("checkpoint.remote")
        owner, _, rest = str(recipe.checkpoint.remote)[len("hf:"):].partition("/")
        name, _, subfolder = rest.partition("/")
        subfolder = subfolder.strip("/")
        if not owner or not name:
            raise UsageError(f"{where}: checkpoint.remote: expected hf:OWNER/REPO[/SUBFOLDER]")
        if subfolder:
            try:
                check_relpath(subfolder, "subfolder")
            except ValueError as exc:
                raise UsageError(f"{where}: checkpoint.remote: {exc}") from None
        token = hub_token()
        if token:
            redact.add([token])
        return cls(f"{owner}/{name}", subfolder, recipe.name, token, os.environ.get("HF_ENDPOINT") or None)
