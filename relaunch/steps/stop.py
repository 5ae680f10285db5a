"""Ask training to save and exit (`evacuate --stop`): run.stop.signal to the command's process group."""

from __future__ import annotations

import shlex
import time

from ..errors import EvacuationError
from .common import Job


def session_alive(job: Job) -> bool:
    return job.remote.exec(f"tmux has-session -t {shlex.quote('=' + job.recipe.run.session)}").ok


def stop_training(job: Job) -> bool:
    """Signal the trainer and wait for it to end (up to run.stop.timeout). True if it ended."""
    stop = job.recipe.run.stop
    if not session_alive(job):
        job.say("stop", f"tmux session {job.recipe.run.session} is not running; nothing to stop")
        return True
    pgid_file = shlex.quote(job.paths.pgid_file)
    command = f"pgid=$(cat {pgid_file}) && kill -s {shlex.quote(stop.signal)} -- -\"$pgid\""
    result = job.remote.exec(command)
    if not result.ok:
        raise EvacuationError(f"{job.host}: stop: could not signal the training ({result.output.strip()})",
                              "stop it by hand (tmux attach), then run `relaunch evacuate` without --stop")
    job.say("stop", f"sent SIG{stop.signal} to the training; waiting up to {stop.timeout:g}s for it to save and exit")
    deadline = time.monotonic() + stop.timeout
    while time.monotonic() < deadline:
        if not session_alive(job):
            status = job.remote.exec(f"cat {shlex.quote(job.paths.status_file)} 2>/dev/null").text.strip()
            job.say("stop", f"training stopped (exit {status or '?'})")
            return True
        time.sleep(1)
    job.ui.warn(f"{job.host}: training still running after {stop.timeout:g}s (run.stop.timeout); "
                "evacuating what is there")
    return False
