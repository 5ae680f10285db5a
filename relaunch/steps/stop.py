"""Ask training to save and exit (`evacuate --stop`): run.stop.signal to the command's process
group, then wait up to run.stop.timeout for the tmux session to end; then stop the guard."""

from __future__ import annotations

import shlex

from ..job import Job
from ..plan import Action
from .guard import stop_guard

STOPPED = "stopped"
STILL_RUNNING = "still running"


def plan_stop(job: Job) -> list[Action]:
    stop, session = job.recipe.run.stop, job.recipe.run.session
    if not job.facts.host.session_alive:
        return [Action("stop", "stop the training", skip=f"tmux session {session} is not running; nothing to stop")]
    q = shlex.quote
    signal = f"pgid=$(cat -- {q(job.paths.pgid_file)}) && kill -s {q(stop.signal)} -- -\"$pgid\""
    timeout = int(stop.timeout + 0.999)
    wait = (f"end=$((SECONDS + {timeout})); while tmux has-session -t {q('=' + session)} 2>/dev/null; do "
            f"if [ \"$SECONDS\" -ge \"$end\" ]; then echo {q(STILL_RUNNING)}; exit 0; fi; sleep 1; done; "
            f"echo \"{STOPPED} $(cat -- {q(job.paths.status_file)} 2>/dev/null)\"")
    return [
        Action("stop", f"send SIG{stop.signal} to the training's process group", command=signal, fails_as="evacuate",
               say=f"sent SIG{stop.signal} to the training; waiting up to {stop.timeout:g}s for it to save and exit",
               hint="stop it by hand (tmux attach), then run `relaunch evacuate` without --stop"),
        Action("stop", f"wait up to {stop.timeout:g}s (run.stop.timeout) for the session to end", command=wait,
               deadline=stop.timeout + 30, produces="stop", parse="text", fails_as="evacuate"),
        stop_guard(job),
    ]
