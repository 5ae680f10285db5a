"""What a user copies names no local index: the examples take theirs from the sandbox's base recipe.

examples/ holds the sandbox examples (the demo's job, the trainers, a team; schedulers/ is a job's
recipe, no provider); recipes/ holds what a user extends (the provider base recipes and their
catalogue). Only the sandbox's base recipe may name the index a sandbox instance serves itself, so a
copied example that moves to another provider by changing `extends` carries no address that means
nothing there.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import yaml

from e2e import REPO, run_cli
from relaunch.resources import recipes_dir

LOCAL = re.compile(r"127\.0\.0\.1|localhost|\[::1\]")
SANDBOX_BASE = REPO / "recipes" / "providers" / "sandbox.yaml"
CATALOGUE = REPO / "recipes" / "providers.yaml"


def copied_files() -> list[Path]:
    return sorted(p for folder in ("examples", "recipes") for p in (REPO / folder).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and "store" not in p.parts)


def sandbox_block(lines: list[str]) -> range:
    """The line numbers (1-based) of the catalogue's `sandbox:` entry."""
    start = lines.index("sandbox:") + 1
    end = next((n for n in range(start, len(lines)) if re.match(r"[A-Za-z0-9_-]+:", lines[n])), len(lines))
    return range(start, end + 1)


def test_no_file_a_user_copies_names_a_local_index() -> None:
    found = []
    for path in copied_files():
        if path == SANDBOX_BASE:
            continue
        lines = path.read_text(errors="replace").splitlines()
        allowed = sandbox_block(lines) if path == CATALOGUE else range(0)
        found += [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for n, line in enumerate(lines, 1)
                  if LOCAL.search(line) and n not in allowed]
    assert not found, "a local address outside the sandbox's base recipe:\n" + "\n".join(found)
    assert LOCAL.search(SANDBOX_BASE.read_text()), "the sandbox base recipe no longer names its index"


def test_each_example_copied_elsewhere_checks_with_the_index_of_the_sandbox_base(tmp_path: Path) -> None:
    """A user's copy, outside the repository: `providers/sandbox` is found among the shipped recipes."""
    copy = tmp_path / "mine"
    shutil.copytree(REPO / "examples", copy, ignore=shutil.ignore_patterns("store", "__pycache__"))
    recipes = sorted(p for p in copy.rglob("*.yaml") if "name" in (yaml.safe_load(p.read_text()) or {}))
    assert len(recipes) >= 9, recipes  # examples/pytorch (4), the three trainers, the team's two projects
    shipped = str(recipes_dir() / "providers" / "sandbox.yaml")
    for recipe in recipes:
        out = run_cli("check", str(recipe), "--explain", "--json", home=tmp_path / "home")
        assert out.returncode == 0, f"{recipe}: {out.stdout}{out.stderr}"
        if recipe.parent.name == "schedulers":
            continue        # the job's own recipe under a scheduler (`relaunch run`): no provider, no SSH, no index
        result = json.loads(out.stdout)
        values = {v["key"]: v for v in result["values"]}
        assert shipped in result["files"], (recipe, result["files"])
        assert values["env.index_url"]["from"].startswith(f"{shipped}:"), (recipe, values["env.index_url"])
        assert values["provider"]["value"] == "sandbox", recipe
