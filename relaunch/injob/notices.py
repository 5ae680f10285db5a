"""A cloud's reclaim notice inside a job: the guard's own sources (templates/guard.py: aws, gcp,
azure, file:, url:), looked at by the guard script run as a child of `relaunch run`, with no tmux
session in its config. It only writes the notice record (notice.json); relaunch run asks the
training to save. The `sigterm` source is relaunch run's own SIGTERM here: no guard for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..job import Job
from ..resources import templates_dir
from ..steps.guard import SCRIPT, guard_config, guard_paths, sources


def looked_for(job: Job) -> list[str]:
    """The guard's sources this node looks at (none when the guard is off)."""
    if not job.recipe.guard.enabled:
        return []
    return [s for s in sources(job) if s != "sigterm"]


def start_guard(job: Job) -> subprocess.Popen[bytes] | None:
    wanted = looked_for(job)
    if not wanted:
        return None
    where = guard_paths(job)
    Path(where.folder).mkdir(parents=True, exist_ok=True, mode=0o700)
    config = {**guard_config(job), "session": "", "sources": wanted}
    fd = os.open(where.config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return subprocess.Popen([sys.executable, str(templates_dir() / SCRIPT), where.config],
                            stdin=subprocess.DEVNULL, start_new_session=True)


def notice_since(job: Job, started: float) -> dict[str, Any] | None:
    """The guard's notice record, when one was seen after `started` (an older one is another run's)."""
    try:
        data = json.loads(Path(guard_paths(job).notice).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("seen_at"), (int, float)) or data["seen_at"] < started:
        return None
    return data


def stop_guard(guard: subprocess.Popen[bytes] | None) -> None:
    if guard is None or guard.poll() is not None:
        return
    guard.send_signal(signal.SIGINT)          # the guard leaves on SIGINT (on_stop)
    try:
        guard.wait(timeout=10)
    except subprocess.TimeoutExpired:
        guard.kill()
        guard.wait()
