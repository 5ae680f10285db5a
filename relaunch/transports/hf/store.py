"""HfStore: the rooms of the Hub store composed (__init__.py lists them), made from a recipe."""

from __future__ import annotations

import os

from ...errors import UsageError
from ...manifest import CheckpointRecord, check_relpath
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

    def set_aside(self, record: CheckpointRecord, paths: list[str], into: str | None = None) -> str:
        """Nothing moves in a Hub repo: its history keeps every commit, so an abandoned branch's files
        (`into`) stay reachable at the commit read last when a new save replaces them at the head."""
        if into is None or not paths or not self._revision:
            return ""
        return (f"kept in the history of {self.repo_id} at commit {self._revision[:12]} (the new save replaces "
                "them at the head)")
