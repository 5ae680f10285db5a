"""What every command shares: the `cli` group, the common options (--set, --json, -v, --yes),
loading a recipe, and the one JSON document a command prints."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import click
from click.shell_completion import CompletionItem

from ..ui import redact


def complete_keys(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """`--set <TAB>`: the recipe's dotted keys, each ready for its value (`checkpoint.keep=`)."""
    from ..recipe.loader import recipe_keys

    if "=" in incomplete:
        return []
    return [CompletionItem(f"{key}=") for key in recipe_keys() if key.startswith(incomplete)]


def complete_providers(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    from ..recipe import load_providers

    return [CompletionItem(name) for name in load_providers() if name.startswith(incomplete)]


def common(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", shell_complete=complete_keys,
                        help="Override a recipe value (repeatable), e.g. --set checkpoint.keep=3.")(func)
    func = click.option("--json", "as_json", is_flag=True,
                        help="One JSON document on stdout: the result, and on failure the same with error, hint, "
                             "exit and refused; progress stays on stderr.")(func)
    func = click.option("-v", "--verbose", is_flag=True, help="Show the instance's output live.")(func)
    func = click.option("--yes", is_flag=True, help="Do not prompt.")(func)
    return func


def load(recipe_path: str, overrides: tuple[str, ...], lock_needed: bool = True) -> Any:
    """The recipe, checked (exit 2 before any host is contacted); `lock_needed` False for the commands
    that install nothing and so can do without env.lock's file (freeze writes it)."""
    from ..recipe import check_recipe, load_recipe, variables

    recipe = load_recipe(recipe_path, list(overrides))
    check_recipe(recipe, lock_needed)   # templates too: a typo is exit 2 before any host is contacted
    # secret values never reach the screen or the debug log, whatever prints them
    redact.add(os.environ.get(name, "") for name in recipe.env.secrets)
    urls, taken = variables.secrets(recipe)
    redact.add_urls(urls)
    redact.add(taken)
    return recipe


# The one JSON document a command prints with --json: its result, set by emit() (the last call
# wins) and printed when the command ends; when it fails, the same document with the error as its
# fields (error, hint, exit, refused), never a second one.
document: list[Any] = []


def emit(as_json: bool, data: Any) -> None:
    if as_json:
        document[:] = [data]


def print_document(error: dict[str, Any] | None = None) -> None:
    if not document and error is None:
        return
    doc: Any = document[0] if document else {}
    if error is not None:
        doc = {**doc, **error} if isinstance(doc, dict) else {"results": doc, **error}
    click.echo(redact(json.dumps(doc, indent=2)))


def show_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from ..versions import versions

    found = versions()
    width = max(map(len, found))
    for name, version in found.items():
        click.echo(f"{name:<{width}}  {version}")
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=show_version,
              help="Show relaunch's version and those of the tools it drives (ssh, rsync, tmux, rclone, hf, uv).")
def cli() -> None:
    """Make a rented cloud GPU disposable: evacuate before you destroy, `up` on the next one."""
