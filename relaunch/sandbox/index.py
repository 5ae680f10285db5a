"""A local PEP 503 package index for sandbox instances, which reach no package registry.

`build_index` downloads on this machine what an instance will install and writes the simple
pages; `sandbox.create(index_dir=...)` serves the folder inside the instance.
"""

from __future__ import annotations

import hashlib
import html
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

from relaunch.errors import RelaunchError, UsageError


def _normalize(project: str) -> str:
    return re.sub(r"[-_.]+", "-", project).lower()


def _project_of(filename: str) -> str | None:
    """Project name from a wheel or sdist file name (PEP 427 / PEP 625), normalized."""
    if filename.endswith(".whl"):
        return _normalize(filename.split("-", 1)[0])
    for ext in (".tar.gz", ".zip", ".tar.bz2", ".tgz"):
        if filename.endswith(ext):
            stem = filename[: -len(ext)]
            return _normalize(stem.rsplit("-", 1)[0]) if "-" in stem else None
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _write_simple_index(dest: Path) -> None:
    """PEP 503 pages under dest/simple/ for every file in dest/files/, with #sha256= fragments."""
    hashes_file = dest / ".sha256.json"  # hashing torch every time would cost seconds
    try:
        known: dict[str, list[object]] = json.loads(hashes_file.read_text())
    except (OSError, ValueError):
        known = {}
    projects: dict[str, list[tuple[str, str]]] = {}
    hashes: dict[str, list[object]] = {}
    for f in sorted((dest / "files").iterdir()):
        project = _project_of(f.name)
        if project is None or not f.is_file():
            continue
        st = f.stat()
        entry = known.get(f.name)
        if entry and entry[0] == st.st_size and entry[1] == st.st_mtime_ns:
            digest = str(entry[2])
        else:
            digest = _sha256(f)
        hashes[f.name] = [st.st_size, st.st_mtime_ns, digest]
        projects.setdefault(project, []).append((f.name, digest))

    new = dest / "simple.new"
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir()
    links = "".join(f'<a href="{p}/">{p}</a><br>\n' for p in sorted(projects))
    (new / "index.html").write_text(_page("Simple index", links))
    for project, files in projects.items():
        (new / project).mkdir()
        anchors = "".join(
            f'<a href="../../files/{html.escape(fn)}#sha256={d}">{html.escape(fn)}</a><br>\n'
            for fn, d in files
        )
        (new / project / "index.html").write_text(_page(f"Links for {project}", anchors))
    old = dest / "simple.old"
    shutil.rmtree(old, ignore_errors=True)
    if (dest / "simple").exists():
        os.replace(dest / "simple", old)
    os.replace(new, dest / "simple")
    shutil.rmtree(old, ignore_errors=True)
    hashes_file.write_text(json.dumps(hashes))


def _page(title: str, body: str) -> str:
    return (
        '<!DOCTYPE html>\n<html><head><meta name="pypi:repository-version" content="1.0">'
        f"<title>{title}</title></head>\n<body><h1>{title}</h1>\n{body}</body></html>\n"
    )


def build_index(
    requirements: list[Path], dest: Path | None = None, extra: list[str] | tuple[str, ...] = ()
) -> Path:
    """Download the requirement files (+ extra requirement strings, + uv and pip) on this machine
    into dest/files and write a PEP 503 simple index to dest/simple/. Returns dest. relaunch's own
    tools (hf's dependencies hold compiled wheels) come for every sandbox image's Python too, as an
    instance of any image finds them on PyPI.

    Cached: a call with the same inputs as an earlier one downloads nothing.
    Default dest: ~/.cache/relaunch/index.
    """
    dest = Path(dest).expanduser() if dest is not None else Path.home() / ".cache" / "relaunch" / "index"
    reqs = [Path(r).expanduser().resolve() for r in requirements]
    from relaunch.sandbox.images import PROFILES
    from relaunch.transports.tools import TOOL_PACKAGES

    wanted = [*extra, "pip", *TOOL_PACKAGES.values()]  # the tools relaunch installs on an instance
    here = "{}.{}".format(*sys.version_info[:2])
    pythons = sorted({image.python for image in PROFILES.values() if image.python and image.python != here})
    key = hashlib.sha256()
    for r in reqs:
        try:
            key.update(r.read_bytes() + b"\0")
        except OSError as e:
            raise UsageError(f"cannot read requirements file {r}: {e.strerror}") from None
    key.update(json.dumps([sorted(wanted), list(sys.version_info[:2]), sys.platform, pythons]).encode())
    marker = dest / ".built" / key.hexdigest()

    if importlib.util.find_spec("pip") is None:
        raise UsageError(f"pip is not in relaunch's environment ({sys.prefix}): the index is made with pip download",
                         hint="install relaunch with pipx, or with: uv tool install --with pip .")
    dest.mkdir(parents=True, exist_ok=True)
    # two test sessions building at once must not interleave
    with FileLock(dest / ".lock"):
        if marker.exists() and (dest / "simple" / "index.html").exists():
            return dest
        (dest / "files").mkdir(exist_ok=True)
        argv = [sys.executable, "-m", "pip", "download", "--progress-bar", "off"]
        argv += ["--dest", str(dest / "files")]
        for r in reqs:
            argv += ["-r", str(r)]
        argv += wanted
        tools = [sys.executable, "-m", "pip", "download", "--progress-bar", "off", "--dest", str(dest / "files"),
                 "--only-binary=:all:", *TOOL_PACKAGES.values()]
        for download in [argv, *([*tools, "--python-version", python] for python in pythons)]:
            proc = subprocess.run(download, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = "\n".join("  | " + ln for ln in proc.stderr.strip().splitlines()[-15:])
                raise RelaunchError(f"build_index: pip download failed (exit {proc.returncode})\n{tail}")
        _write_simple_index(dest)
        marker.parent.mkdir(exist_ok=True)
        marker.write_text(json.dumps({"requirements": [str(r) for r in reqs], "extra": wanted}) + "\n")
    return dest
