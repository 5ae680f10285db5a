"""The documentation site builds with `mkdocs build --strict`, offline, and the README leads to it.

mkdocs.yml turns every problem it can see into a warning, which fails the strict build: a link to
a page or an anchor that does not exist, a page that no nav entry names, a nav entry whose file
is missing. The tests
below check the rest: the README links every page, the pages are all in the nav, the README's
"Try it" commands are the ones .ci/run runs, every command and option the pages write exists, and
nothing of the site is fetched from the network.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from html import unescape
from pathlib import Path
from typing import Any

import pytest

from e2e import REPO

DOCS = REPO / "docs"
README = (REPO / "README.md").read_text()
VENV = "python3 -m venv .venv && . .venv/bin/activate && "
TRY_IT = [VENV + "pip install -e . && relaunch demo", VENV + "pip install -e '.[test]' && python -m pytest"]


def nav_pages(nav: list[Any]) -> list[str]:
    pages: list[str] = []
    for entry in nav:
        target = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(target) if isinstance(target, list) else [target]
    return pages


def written_pages() -> set[str]:
    return {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}


def build(root: Path, site: Path) -> dict[str, str]:
    """`mkdocs build --strict` of root/mkdocs.yml into site: {path: html} of every page built."""
    argv = [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)]
    if os.geteuid() == 0 and shutil.which("unshare"):
        argv = ["unshare", "--net", *argv]  # a network namespace with no route: whatever fetches fails
    out = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    return {p.relative_to(site).as_posix(): unescape(p.read_text()) for p in site.rglob("*.html")}


@pytest.mark.sandbox  # unshare: the build runs without a network
def test_the_site_builds_with_strict_offline(tmp_path: Path) -> None:
    site = tmp_path / "site"
    html = build(REPO, site)
    for page in written_pages() | {"index.md"}:
        name = "index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html"
        assert name in html, f"{page} is not in the built site"
    for name, text in html.items():
        assert not re.search(r"fonts\.(googleapis|gstatic)\.com", text), f"{name} loads Google Fonts"
        assert "\\|" not in "".join(re.findall(r"<code>.*?</code>", text)), f"{name}: a table shows `\\|`"
    assert all(command in html["index.html"] for command in TRY_IT), "the home page is not the README"
    assert (site / "repo" / "benchmarks" / "speed.png").read_bytes() == (REPO / "benchmarks" / "speed.png").read_bytes()


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    from mkdocs.config import load_config

    nav = nav_pages(load_config(str(REPO / "mkdocs.yml")).nav or [])
    assert not (DOCS / "index.md").exists(), "the home page is README.md (docs/hooks.py); no docs/index.md"
    assert len(nav) == len(set(nav))
    assert set(nav) == written_pages() | {"index.md"}


def test_the_readme_links_every_page_and_each_link_resolves() -> None:
    linked = re.findall(r"\]\(docs/([^)#\s]+)(?:#[^)\s]*)?\)", README)
    for page in linked:
        assert (DOCS / page).is_file(), f"README links docs/{page}, which does not exist"
    assert set(linked) == written_pages(), "a page the README's Documentation list does not link"
    assert "## Documentation" in README


def test_the_readme_try_it_commands_are_what_ci_runs() -> None:
    block = README.split("## Try it without renting anything", 1)[1].split("```", 2)[1]
    assert block.strip().splitlines() == TRY_IT
    assert (REPO / ".ci" / "run").read_text().rstrip().splitlines()[-1] == TRY_IT[1]




def relaunch_lines() -> list[tuple[str, str]]:
    """Each `relaunch ...` the README and the docs write, in a code block or inline: (where, text),
    cut at the shell's separators and comments."""
    found = []
    for path in [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = path.read_text()
        spans = re.findall(r"`(relaunch [^`]+)`", text)
        spans += [ln for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M) for ln in block.splitlines()]
        for span in spans:
            for part in re.split(r"&&|\|\||;|\||\$\(|\n", span.split(" #")[0]):
                part = part.strip().removeprefix("$ ").strip()
                if part.startswith("relaunch "):
                    found.append((path.relative_to(REPO).as_posix(), part))
    return found


def test_every_command_and_option_the_docs_write_exists() -> None:
    """What the README and docs tell a user to type names commands and options relaunch has: a
    renamed or dropped option fails here, not in a user's shell (placeholders such as HOST, [...]
    and synopses are fine; only the names are checked)."""
    import click

    from relaunch.cli.main import cli

    lines = relaunch_lines()
    assert len(lines) > 100, len(lines)      # the scan reads the docs' blocks and inline commands
    wrong = []
    for where, text in lines:
        cmd: click.Command = cli
        for word in text.split()[1:]:
            word = word.strip("[]()'\",.:")
            if word.startswith("-"):
                name = word.split("=")[0].split("[")[0]
                names = {n for p in cmd.params for n in (*p.opts, *p.secondary_opts)} | {"-h", "--help"}
                if name not in names and name not in ("-", "--"):
                    wrong.append(f"{where}: {text!r}: {cmd.name} has no option {name}")
            elif isinstance(cmd, click.Group) and word and word[0].islower():
                sub = cmd.get_command(click.Context(cmd), word)
                if sub is None:
                    wrong.append(f"{where}: {text!r}: no command {word}")
                    break
                cmd = sub
            elif isinstance(cmd, click.Group):
                break                                 # COMMAND, <cmd>: a placeholder for any
    assert not wrong, "\n".join(wrong)
