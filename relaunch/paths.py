"""Where relaunch keeps its own state on this machine (known_hosts, last hosts, debug log)."""

from __future__ import annotations

import os
from pathlib import Path


def state_dir() -> Path:
    """$RELAUNCH_HOME, else $XDG_STATE_HOME/relaunch, else ~/.local/state/relaunch (0700)."""
    env = os.environ.get("RELAUNCH_HOME")
    if env:
        path = Path(env).expanduser()
    else:
        base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        path = Path(base) / "relaunch"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def known_hosts_file() -> Path:
    return state_dir() / "known_hosts"


def debug_log_file() -> Path:
    return state_dir() / "debug.log"
