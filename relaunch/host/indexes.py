"""The package indexes an instance's pip and uv are configured with: read by templates/indexes.py
(one round trip, read-only), parsed here (pure), for `relaunch freeze`.

A freeze records versions, not where they came from: a `torch==2.x+cu124` pin installs only from
the index that served it. pip reads pip.conf files and PIP_* variables; uv reads uv.toml files and
UV_* variables (never pip's files). Each tool's settings are resolved the way that tool resolves
them (its variables over its files, a command's section over [global], the user's file over the
system's), then the recipe's installer's view goes first.
"""

from __future__ import annotations

import ast
import configparser
import shlex
import tomllib
from dataclasses import dataclass, field
from typing import Any

from ..scripts import plain

READ_DEADLINE = 120.0
# what pip and uv read when no file or variable says otherwise
DEFAULT_INDEX = "https://pypi.org/simple"
# the variables that name indexes, read below
VARIABLES = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "UV_INDEX_URL", "UV_DEFAULT_INDEX", "UV_EXTRA_INDEX_URL",
             "UV_INDEX")


@dataclass
class Indexes:
    """One tool's (or the combined) view: its default index and its extra ones, and where each was read."""

    index_url: str | None = None
    extra: list[str] = field(default_factory=list)
    where: dict[str, str] = field(default_factory=dict)      # URL -> where it was read

    def found(self, urls: list[str], where: str) -> None:
        for url in urls:
            self.where[url] = where

    def shown(self) -> str:
        return ", ".join(f"{url} ({self.where.get(url, '?')})" for url in self.urls)

    @property
    def urls(self) -> list[str]:
        return [u for u in (self.index_url, *self.extra) if u]


def indexes_command(venv: str) -> str:
    """Read the configuration with the venv's python (freeze needs the venv: it is there)."""
    return f"{shlex.quote(venv + '/bin/python')} -c {shlex.quote(plain('indexes.py'))} {shlex.quote(venv)}"


def _words(value: str) -> list[str]:
    return value.split()


def _pip_config_list(text: str) -> dict[str, str]:
    """`pip config list` lines (`global.index-url='https://...'`, `:env:.index-url=...`) -> key: value."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, raw = line.partition("=")
        if not sep:
            continue
        try:
            value = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            value = raw.strip().strip("'\"")
        if isinstance(value, str):
            values[key.strip()] = value
    return values


def _pip_files(files: list[list[str]]) -> tuple[dict[str, str], dict[str, str]]:
    """The pip.conf files, lowest precedence first -> (key: value, key: file it came from)."""
    values: dict[str, str] = {}
    origin: dict[str, str] = {}
    for path, text in files:
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read_string(text)
        except configparser.Error:
            continue
        for section in ("global", "install"):
            for option in ("index-url", "extra-index-url"):
                if parser.has_option(section, option):
                    values[f"{section}.{option}"] = parser.get(section, option)
                    origin[f"{section}.{option}"] = path
    return values, origin


def _env_from(doc: dict[str, Any]) -> str:
    """Whose variables `env` holds: the login's (freeze), or the training process's (adopt)."""
    return str(doc.get("env_from") or "the login environment")


def pip_indexes(doc: dict[str, Any]) -> Indexes:
    """pip's indexes: PIP_* in the login environment over its files ([install] over [global])."""
    found = Indexes()
    listed = doc.get("pip_config")
    origin: dict[str, str] = {}
    if isinstance(listed, str):
        values, source = _pip_config_list(listed), "pip config list"
    else:
        values, origin = _pip_files(doc.get("pip_files") or [])
        source = ""
    env = doc.get("env") or {}
    for option, variable in (("index-url", "PIP_INDEX_URL"), ("extra-index-url", "PIP_EXTRA_INDEX_URL")):
        key = next((k for k in (f":env:.{option}", f"install.{option}", f"global.{option}") if values.get(k)), None)
        if env.get(variable):
            value, where = env[variable], f"{variable} in {_env_from(doc)}"
        elif key is not None:
            value = values[key]
            where = f"{source}: {key}" if source else f"{origin[key]} [{key.split('.')[0]}] {option}"
        else:
            continue
        if option == "index-url":
            found.index_url = _words(value)[0] if _words(value) else None
        else:
            found.extra = _words(value)
        found.found(_words(value), where)
    return found


def _uv_table(table: dict[str, Any], path: str, found: Indexes) -> None:
    """One uv.toml's settings (top level or its [pip] table) into `found`, later files winning."""
    pip = table.get("pip")
    for scope in (table, pip if isinstance(pip, dict) else {}):
        if isinstance(scope.get("index-url"), str):
            found.index_url = scope["index-url"]
            found.found([scope["index-url"]], f"{path} index-url")
        extra = scope.get("extra-index-url")
        if isinstance(extra, list) and extra:
            found.extra = [str(u) for u in extra] + [u for u in found.extra if u not in extra]
            found.found([str(u) for u in extra], f"{path} extra-index-url")
    for entry in table.get("index") or []:
        if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
            continue
        if entry.get("default") is True:
            found.index_url = entry["url"]
        elif entry["url"] not in found.extra:
            found.extra.append(entry["url"])
        found.found([entry["url"]], f"{path} [[index]] {entry.get('name') or entry['url']}")


def uv_indexes(doc: dict[str, Any]) -> Indexes:
    """uv's indexes: UV_* in the login environment over uv.toml (the user's over the system's)."""
    found = Indexes()
    for path, text in doc.get("uv_files") or []:
        try:
            table = tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            continue
        _uv_table(table, path, found)
    env = doc.get("env") or {}
    for variable in ("UV_INDEX_URL", "UV_DEFAULT_INDEX"):
        if env.get(variable):
            found.index_url = _words(env[variable])[0]
            found.found([found.index_url], f"{variable} in {_env_from(doc)}")
    for variable in ("UV_EXTRA_INDEX_URL", "UV_INDEX"):
        if env.get(variable):
            # UV_INDEX entries may be named: `name=https://...`
            urls = [w.split("=", 1)[1] if "=" in w.split("://")[0] else w for w in _words(env[variable])]
            found.extra = urls + [u for u in found.extra if u not in urls]
            found.found(urls, f"{variable} in {_env_from(doc)}")
    return found


def combined(doc: dict[str, Any], installer: str) -> Indexes:
    """Both tools' indexes, the recipe's installer's first: its default index is the default; the
    other tool's default, when it differs, is one more extra index (each pin is found on whichever
    index has it, with either installer)."""
    pip, uv = pip_indexes(doc), uv_indexes(doc)
    first, second = (uv, pip) if installer == "uv" else (pip, uv)
    index_url = first.index_url or second.index_url
    extra: list[str] = []
    for url in (*first.extra, second.index_url, *second.extra):
        if url and url != index_url and url not in extra:
            extra.append(url)
    return Indexes(index_url, extra, {**second.where, **first.where})
