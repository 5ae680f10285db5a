"""Where relaunch keeps its own state on this machine (known_hosts, last hosts, debug log)."""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs.unix import Unix


def state_dir() -> Path:
    """$RELAUNCH_HOME, else $XDG_STATE_HOME/relaunch, else ~/.local/state/relaunch (0700): the XDG
    layout on every system, macOS included, as relaunch has always kept it."""
    env = os.environ.get("RELAUNCH_HOME")
    path = Path(env).expanduser() if env else Path(Unix("relaunch").user_state_dir)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def known_hosts_file() -> Path:
    return state_dir() / "known_hosts"


def debug_log_file() -> Path:
    return state_dir() / "debug.log"
