"""`${NAME}` in the recipe's URL keys (env.index_url, env.extra_index_urls, env.python_mirror), taken
from this machine's environment when relaunch hands the URL to the instance.

A package index or a Python mirror may need a token, in its userinfo, a path segment or a query
parameter. The recipe file (shared, committed) then names a variable instead: `index_url:
${TEAM_INDEX_URL}`, or only the secret part, `https://me:${TEAM_TOKEN}@pypi.team.example/simple`.
The recipe keeps the text as written (what `plan`, `check` and every message show); the value
reaches the instance only in the environment of a script fed on stdin, never on a command line
(transports/tools.py, steps/env.py), and every value taken here is redacted wherever it is shown.
"""

from __future__ import annotations

import os
import re
import urllib.parse

from ..errors import RecipeError
from .model import MIRROR_RE, Recipe

REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def names(text: str | None) -> list[str]:
    return REFERENCE.findall(text or "")


def _set_here(text: str) -> str | None:
    """`text` with each `${NAME}` replaced by this machine's $NAME; None when one is not set."""
    if not all(os.environ.get(n) for n in names(text)):
        return None
    return REFERENCE.sub(lambda m: os.environ[m[1]], text)


def _written(recipe: Recipe) -> list[tuple[str, str]]:
    """(key, text) of every URL key (env.index_url, env.extra_index_urls, env.python_mirror) the recipe holds."""
    env = recipe.env
    found = [("env.index_url", env.index_url), ("env.python_mirror", env.python_mirror)]
    found += [(f"env.extra_index_urls.{i}", url) for i, url in enumerate(env.extra_index_urls)]
    return [(key, text) for key, text in found if text]


def unset(recipe: Recipe) -> list[tuple[str, str]]:
    """(key, NAME) of every `${NAME}` in the URL keys that this machine's environment lacks."""
    return [(key, name) for key, text in _written(recipe) for name in names(text) if not os.environ.get(name)]


def check(recipe: Recipe) -> None:
    """Every `${NAME}` of the URL keys is set here (before a host is contacted: a missing one is a recipe
    error)."""
    for key, _ in unset(recipe):
        expand(recipe, key, str(recipe.value(key)))


def expand(recipe: Recipe, key: str, text: str) -> str:
    """`text`, the value at `key`, with each `${NAME}` replaced by this machine's $NAME."""
    expanded = _set_here(text)
    if expanded is None:
        missing = next(n for n in names(text) if not os.environ.get(n))
        file, line = recipe.locate(key)
        raise RecipeError(f"names ${{{missing}}}, which is not set on this machine", file, line, key,
                          hint=f"export {missing}=... (the value the recipe leaves out: the URL or its token) "
                               "before running relaunch; it reaches the instance through a script's environment, "
                               "never a command line or a log")
    return expanded


def index_urls(recipe: Recipe) -> tuple[str | None, list[str]]:
    """env.index_url and env.extra_index_urls, expanded."""
    env = recipe.env
    index_url = expand(recipe, "env.index_url", env.index_url) if env.index_url else None
    return index_url, [expand(recipe, f"env.extra_index_urls.{i}", u) for i, u in enumerate(env.extra_index_urls)]


def python_mirror(recipe: Recipe) -> str | None:
    """env.python_mirror, expanded; a URL the model could not check before is checked now."""
    text = recipe.env.python_mirror
    if not text:
        return None
    url = expand(recipe, "env.python_mirror", text)
    if not MIRROR_RE.match(url):
        file, line = recipe.locate("env.python_mirror")
        raise RecipeError(f"{text} must be an http://, https:// or file:// URL once its variables are set",
                          file, line, "env.python_mirror")
    return url


def as_set(recipe: Recipe) -> list[str]:
    """env.index_url (when set) and env.extra_index_urls, each expanded where every variable it names
    is set here, else as written: what the recipe's indexes are on this machine."""
    env = recipe.env
    return [_set_here(text) or text for text in (env.index_url, *env.extra_index_urls) if text]


def name_for(url: str, taken: set[str]) -> str:
    """The variable a recipe names a URL with a credential by: INDEX_URL_<ITS HOST>
    (https://me:t@pypi.team.example/simple -> INDEX_URL_PYPI_TEAM_EXAMPLE), numbered past `taken`."""
    host = urllib.parse.urlsplit(url).hostname or ""
    base = "_".join(["INDEX_URL", *re.findall(r"[A-Za-z0-9]+", host)]).upper()
    name, n = base, 2
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    return name


def secrets(recipe: Recipe) -> tuple[list[str], list[str]]:
    """(the URL keys' values, expanded where every variable they name is set; the values of those
    variables): what the redactor hides. A variable's value is hidden whole wherever it shows (one
    that holds a whole URL hides that URL), since only the user knows which part of it is secret."""
    urls: list[str] = []
    taken: list[str] = []
    for _, text in _written(recipe):
        expanded = _set_here(text)
        if expanded is not None:
            urls.append(expanded)
            taken += [os.environ[n] for n in names(text)]
    return urls, taken
