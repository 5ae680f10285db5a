"""`relaunch demo`, the README's first command, run as a user runs it: real sandboxes, real sshd.
The command is the README's own "Try it" line, after its venv and `pip install -e .` (this test
session's own)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from e2e import REPO, run_cli
from relaunch import sandbox as sb

pytestmark = pytest.mark.sandbox  # the demo makes sandbox instances


def readme_demo() -> list[str]:
    """The arguments of the `relaunch` that ends the first line of the README's "Try it" block."""
    block = (REPO / "README.md").read_text().split("## Try it without renting anything", 1)[1].split("```", 2)[1]
    command = shlex.split(block.strip().splitlines()[0].rsplit(" && ", 1)[1])
    assert command[0] == "relaunch", command
    return command[1:]


def test_demo_evacuates_destroys_and_resumes_on_a_new_instance(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    proc = run_cli(*readme_demo(), "--workdir", str(workdir), home=tmp_path / "state", timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "$ relaunch evacuate recipe.yaml root@" in out
    assert "safe to destroy" in out
    resumed = re.search(r"resumed from \S+ at step (\d+)", out)
    assert resumed and int(resumed.group(1)) >= 20, out
    assert "done step 60" in out
    assert (workdir / "store" / "example" / ".relaunch" / "manifest.json").is_file()
    assert not {inst.name for inst in sb.list_instances()} & {"demo-a", "demo-b"}


def test_demo_refuses_a_folder_it_did_not_make(tmp_path: Path) -> None:
    workdir = tmp_path / "mine"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("not the demo's\n")
    proc = run_cli("demo", "--workdir", str(workdir), home=tmp_path / "state", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "not an earlier demo's folder" in proc.stderr
    assert (workdir / "notes.txt").read_text() == "not the demo's\n"
