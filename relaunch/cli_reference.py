"""The command reference (docs/cli.md), generated from the click commands so that no flag goes
undocumented and none is documented that does not exist.

    python -m relaunch.cli_reference > docs/cli.md

A test fails when the committed file differs from what this prints, and when a command or an
option has no help text.
"""

from __future__ import annotations

import click

from relaunch.cli import cli

HEADER = """\
# Command reference

<!-- Generated from relaunch/cli/: edit the commands, then run
     `python -m relaunch.cli_reference > docs/cli.md`. A test fails when they differ. -->

Every command and every option, as `relaunch COMMAND --help` prints them. What the commands do
together, the exit codes and the conventions every command follows: [Commands and exit
codes](commands.md).
"""


def commands(group: click.Group = cli, prefix: str = "relaunch") -> list[tuple[str, click.Command]]:
    """(`relaunch sandbox create`, the command) for every command, groups' commands after the group."""
    found: list[tuple[str, click.Command]] = []
    for name in sorted(group.commands):
        command = group.commands[name]
        if command.hidden:
            continue
        path = f"{prefix} {name}"
        found.append((path, command))
        if isinstance(command, click.Group):
            found += commands(command, path)
    return found


def _usage(path: str, command: click.Command) -> str:
    with click.Context(command, info_name=path) as ctx:
        pieces = command.collect_usage_pieces(ctx)
    return " ".join([path, *pieces])


_UNSET = getattr(click.core, "UNSET", object())     # click 8.3+: no default given


def _option_row(param: click.Option) -> str:
    names = ", ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])
    if not param.is_flag and not param.count:
        metavar = param.metavar or (param.type.name.upper() if not isinstance(param.type, click.Choice) else
                                    "[" + "|".join(str(c) for c in param.type.choices) + "]")
        names += f" `{metavar}`"
    given = param.default not in (None, False, (), _UNSET) and not param.is_flag and not param.multiple
    default = f" (default: `{param.default}`)" if given else ""
    text = " ".join((param.help or "").split())
    return f"| {_cell(names)} | {_cell(text + default)} |"


def _cell(text: str) -> str:
    """A table cell's text: a `|` would end the cell, even inside backticks."""
    return text.replace("|", "\\|")


def section(path: str, command: click.Command) -> str:
    lines = [f"## `{path}`", "", f"`{_usage(path, command)}`", ""]
    help_text = (command.help or "").strip()
    if help_text:
        lines += [" ".join(paragraph.split()) for paragraph in help_text.split("\n\n")]
        lines.append("")
    options = [p for p in command.params if isinstance(p, click.Option) and not p.hidden]
    if options:
        lines += ["| option | what it does |", "|---|---|", *(_option_row(p) for p in options), ""]
    if isinstance(command, click.Group):
        subs = [name for name, sub in sorted(command.commands.items()) if not sub.hidden]
        lines += ["Subcommands: " + ", ".join(f"`{path} {name}`" for name in subs) + ".", ""]
    return "\n".join(lines)


def reference() -> str:
    return HEADER + "\n" + "\n".join(section(path, command) for path, command in commands())


if __name__ == "__main__":
    print(reference(), end="")
