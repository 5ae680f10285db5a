"""The key reference is generated from the model, every key is described, every shipped recipe checks.

Pure: no hosts. The reference (docs/recipe-keys.md) is regenerated with
`python -m relaunch.recipe.reference > docs/recipe-keys.md`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from e2e import REPO, run_cli
from relaunch.recipe import load_providers, load_recipe
from relaunch.recipe.reference import fields, reference


def test_every_recipe_key_has_a_description_and_an_example() -> None:
    keys = fields()
    assert {"name", "extends", "env.python", "checkpoint.remote", "run.stop.signal", "templates"} <= dict(keys).keys()
    for key, field in keys:
        assert field.description and field.description.strip().endswith("."), f"{key}: no description"
        assert field.examples, f"{key}: no example"


def test_the_committed_reference_is_what_the_model_generates() -> None:
    committed = (REPO / "docs" / "recipe-keys.md").read_text()
    assert committed == reference(), (
        "docs/recipe-keys.md is stale: run `python -m relaunch.recipe.reference > docs/recipe-keys.md`")
    for key, _ in fields():
        assert f"| `{key}` |" in committed


SHIPPED = sorted(p for folder in ("recipes", "examples") for p in (REPO / folder).rglob("*.yaml")
                 if p.name != "providers.yaml")
# a file with a name is a recipe; one without (a team base) is merged into one that is
RECIPES = [p for p in SHIPPED if "name" in (yaml.safe_load(p.read_text()) or {})]


@pytest.mark.parametrize("path", RECIPES, ids=[str(p.relative_to(REPO)) for p in RECIPES])
def test_every_recipe_under_recipes_and_examples_passes_check(path: Path, tmp_path: Path) -> None:
    out = run_cli("check", str(path), home=tmp_path)
    assert out.returncode == 0, f"{path}: {out.stderr}"


def test_every_base_recipe_is_extended_by_a_recipe_or_by_init(tmp_path: Path) -> None:
    """A base is checked through the recipes that extend it: one that none extends is never checked."""
    assert len(RECIPES) >= 9  # examples/pytorch (4), the three trainers and the team's two projects
    merged: set[Path] = set()
    for path in RECIPES:
        merged |= {Path(f).resolve() for f in load_recipe(path).files}
    # the provider bases are what `relaunch init --provider NAME` extends
    for provider in load_providers():
        path = tmp_path / f"init-{provider}.yaml"
        assert run_cli("init", str(path), "--provider", provider, home=tmp_path).returncode == 0
        merged |= {Path(f).resolve() for f in load_recipe(path).files}
    bases = [p for p in SHIPPED if p not in RECIPES]
    assert bases and all(p.resolve() in merged for p in bases), "a base recipe no recipe extends"
