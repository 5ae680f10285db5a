"""The mkdocs hooks of relaunch's documentation site (mkdocs.yml names this file).

- The home page is README.md itself: its links to `docs/PAGE` point at PAGE in the site, so the
  README on GitHub and the site's home page are one text.
- A page's relative link to a file of the repository outside docs/ (`../benchmarks/speed.png`)
  works as it is on GitHub; the site publishes that file under `repo/` and points the link there
  (`../README.md` points at the home page; another .md file outside docs/ fails the build).
- In a table row, a `|` inside backticks must be written `\\|` for GitHub; Python-Markdown would
  show the backslash, so the site gets a plain `|`.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.pages import Page

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_CODE = re.compile(r"`[^`]*`")


def _relative(url: str) -> bool:
    return not (url.startswith(("#", "/", "mailto:")) or "://" in url)


def home_page(readme: str, docs: Path) -> str:
    """README.md as docs/index.md: `docs/PAGE` -> PAGE, another relative link -> ../PATH."""
    def link(m: re.Match[str]) -> str:
        url = m.group(1)
        if not _relative(url):
            return m.group(0)
        return f"]({url.removeprefix('docs/') if url.startswith('docs/') else '../' + url})"

    return "\n".join(_LINK.sub(link, line) for line in readme.splitlines()) + "\n"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    readme = (Path(config.config_file_path).parent / "README.md").read_text()
    files.append(File.generated(config, "index.md", content=home_page(readme, Path(config.docs_dir))))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    root = Path(config.config_file_path).parent.resolve()
    docs = Path(config.docs_dir).resolve()
    here = posixpath.dirname(page.file.src_uri)

    def link(m: re.Match[str]) -> str:
        url, _, anchor = m.group(1).partition("#")
        target = (docs / here / url).resolve()
        if _relative(m.group(1)) and target == root / "README.md":  # the README is the home page
            return f"]({posixpath.relpath('index.md', here or '.')}{'#' + anchor if anchor else ''})"
        if (not _relative(m.group(1)) or target.is_relative_to(docs) or not target.is_relative_to(root)
                or not target.is_file() or target.suffix == ".md"):
            return m.group(0)
        uri = "repo/" + target.relative_to(root).as_posix()
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, abs_src_path=str(target), inclusion=InclusionLevel.INCLUDED))
        return f"]({posixpath.relpath(uri, here or '.')}{'#' + anchor if anchor else ''})"

    lines = []
    for line in _LINK.sub(link, markdown).split("\n"):
        if line.startswith("|"):
            line = _CODE.sub(lambda c: c.group(0).replace("\\|", "|"), line)
        lines.append(line)
    return "\n".join(lines)
