"""The shell scripts relaunch runs on an instance, rendered from templates/.

Every value that reaches a shell goes through the `q` filter (shlex.quote); the only
unquoted text is the user's own `run.command` and `env.setup` lines, whose template
variables arrive as environment variables (see recipe.render.render_shell).

A recipe's `templates:` folder replaces shipped scripts by file name: it is searched first,
also by `{% include %}`. Its templates can reach the shipped version of any script as
`shipped/NAME` (a team's run.sh.j2 that adds a line and includes `shipped/run.sh.j2`).
"""

from __future__ import annotations

import shlex
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import meta

from .resources import templates_dir

SHIPPED = "shipped"  # the prefix under which an override reaches the shipped scripts
START_MARK = "=== relaunch: start "     # the line run.sh writes into the log at each start


def whole_lines(text: str) -> list[str]:
    """The lines of a log read while training writes it, without the last one when nothing ends it
    yet: that one is still being written (an append lands in pieces for a reader: a write that
    crosses a page, a trainer's print cut by a pause), and half of `step 150` reads as `step 1`.
    A carriage return ends a line too (a progress bar redrawn in place)."""
    return text[:max(text.rfind("\n"), text.rfind("\r")) + 1].splitlines()


def this_run(lines: list[str]) -> list[str]:
    """The log's lines since the last start (a run resumed elsewhere, or before a shrink, printed
    steps of its own that this one may never reach)."""
    starts = [n for n, line in enumerate(lines) if line.startswith(START_MARK)]
    return lines[starts[-1] + 1:] if starts else lines


@lru_cache(maxsize=8)
def environment(templates: Path | None = None) -> jinja2.Environment:
    """The Jinja environment for shipped scripts, with `templates` (a folder) in front when given."""
    shipped = jinja2.FileSystemLoader(str(templates_dir()))
    loaders: list[jinja2.BaseLoader] = [shipped, jinja2.PrefixLoader({SHIPPED: shipped})]
    if templates is not None:
        loaders.insert(0, jinja2.FileSystemLoader(str(templates)))
    env = jinja2.Environment(
        loader=jinja2.ChoiceLoader(loaders),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env


def render(template: str, *, templates: Path | None = None, **values: Any) -> str:
    return environment(templates).get_template(template).render(**values)


def with_inputs(script: str, **inputs: str) -> str:
    """Prefix a plain script with quoted variable assignments (its inputs)."""
    head = "".join(f"{key}={shlex.quote(str(value))}\n" for key, value in inputs.items())
    return head + script


def export_lines(values: dict[str, str]) -> str:
    """`export NAME='value'` lines, for files a script sources (secrets, store credentials)."""
    return "".join(f"export {name}={shlex.quote(value)}\n" for name, value in values.items())


def plain(name: str, templates: Path | None = None) -> str:
    """A script that is not a template (facts.sh), from the override folder when it has one."""
    override = templates / name if templates is not None else None
    return (override if override is not None and override.is_file() else templates_dir() / name).read_text()


def shipped_names() -> list[str]:
    """The instance scripts a `templates:` folder may replace."""
    return sorted(p.name for p in templates_dir().iterdir() if p.suffix in (".j2", ".sh"))


def _variables(name: str) -> set[str]:
    """The values a shipped template is rendered with: what it and the templates it includes use."""
    env = environment(None)
    tree = env.parse(env.loader.get_source(env, name)[0])  # type: ignore[union-attr]
    found = set(meta.find_undeclared_variables(tree))
    for included in meta.find_referenced_templates(tree):
        if included:
            found |= _variables(included)
    return found


def given_variables(name: str) -> set[str]:
    """The variables an override of shipped template `name` may use. A template that others include
    (prelude.sh.j2) is rendered with each includer's values: only those all of them have."""
    env = environment(None)
    includers = [
        top for top in shipped_names() if top.endswith(".j2") and top != name
        and name in meta.find_referenced_templates(env.parse(env.loader.get_source(env, top)[0]))  # type: ignore[union-attr]
    ]
    if not includers:
        return _variables(name)
    return set.intersection(*(_variables(top) for top in includers))
