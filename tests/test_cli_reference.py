"""docs/cli.md is generated from the click commands: every command and option there, none missing,
each with help text; and the contract's commands all exist."""

from __future__ import annotations

import re

import click

from e2e import REPO, run_cli
from relaunch.cli_reference import commands, reference

CONTRACT_COMMANDS = ["up", "evacuate", "sync", "status", "plan", "check", "freeze", "init", "providers", "interval",
                     "sandbox create", "sandbox destroy", "sandbox list", "watch", "drill", "adopt"]


def test_the_committed_reference_is_what_the_commands_generate() -> None:
    assert (REPO / "docs" / "cli.md").read_text() == reference(), (
        "docs/cli.md is stale: run `python -m relaunch.cli_reference > docs/cli.md`")


def test_every_command_and_option_has_help() -> None:
    missing = []
    for path, command in commands():
        if not (command.help or "").strip():
            missing.append(path)
        missing += [f"{path} {p.opts[0]}" for p in command.params
                    if isinstance(p, click.Option) and not p.hidden and not (p.help or "").strip()]
    assert not missing, f"without help text: {missing}"


def test_the_contracts_commands_exist_and_the_overview_names_every_command() -> None:
    paths = {path.removeprefix("relaunch ") for path, _ in commands()}
    assert set(CONTRACT_COMMANDS) <= paths
    overview = (REPO / "docs" / "commands.md").read_text()
    for path in sorted(p for p in paths if " " not in p):
        assert re.search(rf"`relaunch {path}\b", overview), f"docs/commands.md does not mention `relaunch {path}`"


def test_help_lists_every_command_with_its_whole_summary(tmp_path) -> None:
    """`relaunch --help` (and `relaunch sandbox --help`) show each command's one-line summary whole:
    click cuts a summary it makes from the help text with "...", one given as short_help never."""
    for path, command in commands():
        group = path.rsplit(" ", 1)[0].split()[1:]
        listing = run_cli(*group, "--help", home=tmp_path, env={"COLUMNS": "80"})
        assert listing.returncode == 0, listing.stderr
        summary = " ".join((command.short_help or "").split())
        assert summary, f"{path} has no short_help: click would cut its help text with '...'"
        shown = " ".join(listing.stdout.split())
        assert f"{path.rsplit(' ', 1)[1]} {summary}" in shown, f"{path}: {summary!r} not whole in:\n{listing.stdout}"
        assert "..." not in listing.stdout.split("Commands:")[1], listing.stdout
