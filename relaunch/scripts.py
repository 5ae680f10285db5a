"""The shell scripts relaunch runs on an instance, rendered from templates/.

Every value that reaches a shell goes through the `q` filter (shlex.quote); the only
unquoted text is the user's own `run.command` and `env.setup` lines, whose template
variables arrive as environment variables (see Recipe.render_shell).
"""

from __future__ import annotations

import shlex
from functools import lru_cache
from typing import Any

import jinja2

from .resources import templates_dir


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env


def render(template: str, **values: Any) -> str:
    return _env().get_template(template).render(**values)


def with_inputs(script: str, **inputs: str) -> str:
    """Prefix a plain script with quoted variable assignments (its inputs)."""
    head = "".join(f"{key}={shlex.quote(str(value))}\n" for key, value in inputs.items())
    return head + script


def export_lines(values: dict[str, str]) -> str:
    """`export NAME='value'` lines, for files a script sources (secrets, store credentials)."""
    return "".join(f"export {name}={shlex.quote(value)}\n" for name, value in values.items())


def plain(name: str) -> str:
    return (templates_dir() / name).read_text()
