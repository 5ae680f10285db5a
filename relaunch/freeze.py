"""`relaunch freeze`: the instance venv's packages into the recipe's lock file, and the package indexes
the instance's pip and uv use into the recipe (env.index_url, env.extra_index_urls).

A recipe that names no lock gets one: requirements.lock beside it, and `lock: requirements.lock`
under its env:. What freeze writes is decided before anything is written (`plan_freeze`, pure):
writing what did not exist (a new lock file, a key the recipe lacks) replaces nothing and needs no
prompt; changing what exists (a lock with other lines, a value the recipe had) shows the diff and
asks, or needs --yes."""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cycle import open_host
from .errors import EnvError, UsageError
from .gather import gather, read_indexes
from .host.facts import unseen_run
from .host.indexes import Indexes, combined
from .host.spec import HostSpec
from .job import normalize
from .recipe import Recipe, load_recipe, variables
from .recipe.edit import Edit, apply
from .ui import UI, has_credentials, redact

# what `pip freeze` leaves out by default
_TOOLING = {"pip", "setuptools", "wheel", "distribute"}


def instance_freeze(recipe: Recipe, spec: HostSpec, ui: UI) -> tuple[list[str], dict[str, Any]]:
    """(the venv's packages, what templates/indexes.py read of the instance's pip and uv configuration)."""
    node, remote = open_host(recipe, spec, ui)
    with remote:
        job = gather(remote, recipe, node, listing=False)
        host = job.facts.host
        if host.venv_freeze is None:
            unseen = None if host.session_alive else unseen_run(host, recipe.run.session)
            if unseen is not None:
                raise EnvError(f"{job.host}: freeze: there is no venv at {job.paths.venv}, and {unseen.why}",
                               unseen.hint("freeze", job.target))
            raise EnvError(f"{job.host}: freeze: there is no venv at {job.paths.venv}",
                           "run `relaunch up` first, or fix env.venv")
        lines = [line for line in host.venv_freeze
                 if normalize(line.split("==", 1)[0]) not in _TOOLING and line.strip()]
        doc = read_indexes(remote, job)
        # the URLs may hold tokens: never on screen from here on
        redact.add_urls(combined(doc, recipe.env.installer).urls)
        return lines, doc


DEFAULT_LOCK = "requirements.lock"     # beside the recipe, when it names none


@dataclass
class IndexChange:
    """What freeze writes into the recipe file: the indexes the instance's pip and uv use, and
    env.lock when the recipe named no lock."""

    path: Path                        # the top recipe file
    old: str
    new: str
    index_url: str | None             # the recipe's values once written
    extra: list[str]
    found: Indexes                    # what the instance's pip and uv use, and where each was read
    lock: str | None = None           # env.lock added (the recipe named no lock)
    indexes: bool = True              # it writes env.index_url / env.extra_index_urls
    replaces: bool = False            # it changes a value the recipe had (else it only adds keys)

    def diff(self) -> list[str]:
        return list(difflib.unified_diff(self.old.splitlines(), self.new.splitlines(), fromfile=f"{self.path} (now)",
                                         tofile=f"{self.path} (as freeze writes it)", lineterm=""))


def _line_in_top(recipe: Recipe, key: str) -> int | None:
    """The line of `key` in the top recipe file when that file writes it, else None (a base file or a
    preset wrote it, or nothing did: the edit then adds it to the top file, which wins)."""
    if not recipe.wrote(key):
        return None
    file, line = recipe.locate(key)
    return line if recipe.files and file == recipe.files[-1] else None


def index_change(recipe: Recipe, doc: dict[str, Any], lock: str | None = None) -> tuple[IndexChange | None, list[str]]:
    """(the edit of the recipe file that records the instance's indexes, and `lock` as env.lock when
    given, or None when the recipe already says the same; warnings). Additive: what the recipe names
    stays (it served the lock); an index the instance uses and the recipe lacks is added. A URL with a
    credential is never written: the recipe names it as `${NAME}`, and a warning says which variable
    to set here."""
    found = combined(doc, recipe.env.installer)
    warnings = [f"{key} names ${{{name}}}, which is not set on this machine: the instance's indexes were compared "
                "with it as written" for key, name in variables.unset(recipe) if not key.endswith("python_mirror")]
    current, extra = recipe.env.index_url, list(recipe.env.extra_index_urls)
    # what the recipe's values are here (expanded), and the text each is written as
    now = variables.as_set(recipe)
    written = dict(zip(now, [u for u in (current, *extra) if u], strict=True))
    taken = {n for text in written.values() for n in variables.names(text)}

    def text(url: str) -> str:
        if url in written:
            return written[url]
        if has_credentials(url):
            name = variables.name_for(url, taken)
            taken.add(name)
            written[url] = f"${{{name}}}"
            warnings.append(f"the instance's index {redact(url)} ({found.where.get(url)}) carries a credential: "
                            f"{recipe.source} names it as ${{{name}}}, never the URL; set {name} to that URL "
                            f"on this machine (export {name}='...') before `relaunch up`")
        return written[url] if url in written else url

    index_url = current
    if found.index_url and found.index_url not in now:
        if current is None:
            index_url = text(found.index_url)
        else:
            extra.append(text(found.index_url))
    for url in found.extra:
        if url not in now and text(url) not in (index_url, *extra):
            extra.append(text(url))
    edits = []
    if index_url != current and index_url is not None:
        edits.append(Edit("index_url", index_url, _line_in_top(recipe, "env.index_url")))
    if extra != recipe.env.extra_index_urls:
        edits.append(Edit("extra_index_urls", extra, _line_in_top(recipe, "env.extra_index_urls")))
    indexes = bool(edits)
    if lock is not None:
        edits.append(Edit("lock", lock))
    if not edits:
        return None, warnings
    path = recipe.source
    old = path.read_text()
    new = apply(old, recipe.files[-1] if recipe.files else str(path), edits)
    _check_edit(path, new, index_url, extra, lock)
    # index_url is only ever set where the recipe had none; a list it had is extended
    replaces = bool(recipe.env.extra_index_urls) and extra != recipe.env.extra_index_urls
    return IndexChange(path, old, new, index_url, extra, found, lock, indexes, replaces), warnings


def _check_edit(path: Path, text: str, index_url: str | None, extra: list[str], lock: str | None) -> None:
    """The edited file loads and says what was meant (checked from a copy beside it, before anything
    is written: `extends:` paths are relative to the file)."""
    copy = path.with_name(f".{path.stem}.relaunch-freeze{os.getpid()}{path.suffix}")
    try:
        copy.write_text(text)
        loaded = load_recipe(copy, [])
    finally:
        copy.unlink(missing_ok=True)
    if (loaded.env.index_url, loaded.env.extra_index_urls) != (index_url, extra):
        raise UsageError(f"{path}: editing env.index_url / env.extra_index_urls in place did not give the "
                         "values meant", f"set env.index_url: {index_url} and env.extra_index_urls: {extra} "
                         "yourself, then rerun `relaunch freeze`")
    if lock is not None and loaded.env.lock != path.parent / lock:
        raise UsageError(f"{path}: adding env.lock in place did not give the value meant",
                         f"write `lock: {lock}` under env: yourself, then rerun `relaunch freeze`")


def write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.chmod(path.stat().st_mode & 0o7777)
    os.replace(tmp, path)


def lock_diff(old: list[str], new: list[str], path: Path) -> list[str]:
    return list(difflib.unified_diff(old, new, fromfile=f"{path} (now)", tofile=f"{path} (instance)", lineterm=""))


def write_lock(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)


def local_version_warning(recipe: Recipe, lines: list[str], index_url: str | None = None) -> str | None:
    tagged = [line for line in lines if "+" in line.partition("==")[2]]
    if tagged and not (index_url or recipe.env.index_url):
        return (f"{len(tagged)} package(s) carry a local version tag ({tagged[0]}, ...): they are only on the "
                "index they came from; set env.index_url (e.g. https://download.pytorch.org/whl/cu124)")
    return None


def lock_target(recipe: Recipe) -> tuple[Path, str | None]:
    """(the lock file freeze writes; the env.lock it adds to the recipe, None when the recipe names one)."""
    if recipe.env.lock is not None:
        return Path(recipe.env.lock), None
    return recipe.source.parent / DEFAULT_LOCK, DEFAULT_LOCK


@dataclass
class Freeze:
    """What `relaunch freeze` writes, decided before anything is written."""

    lock: Path
    lines: list[str]                  # the instance venv's packages
    old: list[str] | None             # the lock's lines now; None: the file does not exist yet
    change: IndexChange | None        # the recipe file's edit (indexes, env.lock)
    warnings: list[str]

    @property
    def writes_lock(self) -> bool:
        return self.old != self.lines

    @property
    def asks(self) -> bool:
        """It changes what exists (a lock with other lines, a value the recipe had): diff, then a prompt."""
        return (self.old is not None and self.writes_lock) or (self.change is not None and self.change.replaces)

    def diff(self) -> list[str]:
        """The lock's diff when it replaces one (a new lock is said in one line), then the recipe's."""
        shown = lock_diff(self.old, self.lines, self.lock) if self.old is not None and self.writes_lock else []
        return shown + (self.change.diff() if self.change else [])

    def lock_words(self) -> str:
        """What goes into the lock file, in words ("" when nothing)."""
        if not self.writes_lock:
            return ""
        return f"{len(self.lines)} packages to {self.lock}" + (" (a new file)" if self.old is None else "")

    def recipe_words(self) -> str:
        """What goes into the recipe file, in words ("" when nothing)."""
        if self.change is None:
            return ""
        keys = (["env.lock"] if self.change.lock else []) + (["the indexes"] if self.change.indexes else [])
        return f"{' and '.join(keys)} to {self.change.path}"

    def what(self) -> str:
        return "; ".join(w for w in (self.lock_words(), self.recipe_words()) if w)


def plan_freeze(recipe: Recipe, lines: list[str], doc: dict[str, Any]) -> Freeze:
    """What freeze writes for the instance's packages `lines` and what its pip and uv use (`doc`)."""
    path, added = lock_target(recipe)
    old = [line for line in path.read_text().splitlines() if line.strip()] if path.is_file() else None
    change, warnings = index_change(recipe, doc, added)
    warning = local_version_warning(recipe, lines, change.index_url if change else None)
    return Freeze(path, lines, old, change, warnings + ([warning] if warning else []))
