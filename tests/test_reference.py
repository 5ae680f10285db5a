"""The key reference is generated from the model, every key is described, every shipped recipe checks.

Pure: no hosts. The reference (docs/recipe-keys.md) is regenerated with
`python -m relaunch.recipe.reference > docs/recipe-keys.md`.
"""

from __future__ import annotations

from pathlib import Path

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


def test_every_recipe_under_recipes_and_examples_passes_check(tmp_path: Path) -> None:
    """A file with a name is a recipe and must pass `relaunch check`; one without (a team base) must
    be merged into one that does, so that it is checked too."""
    shipped = sorted(p for folder in ("recipes", "examples") for p in (REPO / folder).rglob("*.yaml")
                     if p.name != "providers.yaml")
    recipes = [p for p in shipped if "name" in (yaml.safe_load(p.read_text()) or {})]
    assert len(recipes) >= 9  # examples/pytorch (4), the three trainers and the team's two projects
    merged: set[Path] = set()
    for path in recipes:
        out = run_cli("check", str(path), home=tmp_path)
        assert out.returncode == 0, f"{path}: {out.stderr}"
        merged |= {Path(f).resolve() for f in load_recipe(path).files}
    # the provider bases are what `relaunch init --provider NAME` extends
    for provider in load_providers():
        path = tmp_path / f"init-{provider}.yaml"
        assert run_cli("init", str(path), "--provider", provider, home=tmp_path).returncode == 0
        merged |= {Path(f).resolve() for f in load_recipe(path).files}
    bases = [p for p in shipped if p not in recipes]
    assert bases and all(p.resolve() in merged for p in bases), "a base recipe no recipe extends"
