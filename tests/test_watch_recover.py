"""recover.command run for real (bash, on this machine, no instance): what its answer allows when
it is ended at recover.timeout. It may have rented an instance already, so it is never run again:
the HOST it printed is used, or what it printed is quoted."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e import plain_recipe
from relaunch.host.spec import HostSpec
from relaunch.recipe.loader import load_recipe
from relaunch.ui import UI
from relaunch.watch.recover import RecoverStopped, rent


def recipe_with(tmp_path: Path, command: str):
    return load_recipe(str(plain_recipe(tmp_path, name="renting", key=tmp_path / "key",
                                        recover={"command": command, "timeout": 2})))


def test_a_command_ended_at_its_timeout_after_printing_a_host_gives_that_host(tmp_path: Path) -> None:
    found = rent(recipe_with(tmp_path, "echo renting >&2; echo ubuntu@203.0.113.7; sleep 30"), UI(quiet=True), 1,
                 "root@10.0.0.9:22", "lost")
    assert found.spec == HostSpec.parse("ubuntu@203.0.113.7") and found.pin is None
    assert "did not finish within recover.timeout=2s" in found.note and "that instance is used" in found.note


def test_a_command_ended_at_its_timeout_without_a_host_stops_the_renting(tmp_path: Path) -> None:
    with pytest.raises(RecoverStopped) as caught:
        rent(recipe_with(tmp_path, "echo 'instance i-0abc requested, waiting for it to boot'; sleep 30"),
             UI(quiet=True), 1, "root@10.0.0.9:22", "lost")
    error = caught.value
    assert error.refused and "it may have rented an instance meanwhile" in error.message
    assert "instance i-0abc requested" in error.message and "nothing more is rented" in (error.hint or "")
