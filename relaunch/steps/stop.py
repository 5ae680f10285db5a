"""Ask training to save and exit (`evacuate --stop`): run.stop.signal to the command's process
group, then wait up to run.stop.timeout for the tmux session to end; then stop the guard."""

from __future__ import annotations

import shlex

from ..job import Job
from ..plan import Action
from .guard import stop_guard

STOPPED = "stopped"
STILL_RUNNING = "still running"


def signal_command(job: Job) -> str:
    """run.stop.signal to the training's process group (torchrun and every rank it started)."""
    q = shlex.quote
    return f"pgid=$(cat -- {q(job.paths.pgid_file)}) && kill -s {q(job.recipe.run.stop.signal)} -- -\"$pgid\""


def end_command(job: Job) -> str:
    """End the training at once, no save: its tmux session and its guard's, then SIGKILL to its
    process group while the command has not finished (no exit status yet, so the group is still
    its own: a launcher that outlives its session, torchrun waiting on a lost node, is ended too),
    waiting up to 10 s for the group to be gone."""
    q, paths, session = shlex.quote, job.paths, job.recipe.run.session
    return (f"pg=$(cat -- {q(paths.pgid_file)} 2>/dev/null); tmux kill-session -t {q('=' + session)} 2>/dev/null; "
            f"tmux kill-session -t {q('=' + session + '-guard')} 2>/dev/null; "
            f"if [ -n \"$pg\" ] && [ ! -s {q(paths.status_file)} ]; then kill -KILL -- \"-$pg\" 2>/dev/null; "
            "i=0; while kill -0 -- \"-$pg\" 2>/dev/null && [ $i -lt 50 ]; do sleep 0.2; i=$((i+1)); done; fi; true")


def plan_stop(job: Job) -> list[Action]:
    stop, session = job.recipe.run.stop, job.recipe.run.session
    if not job.facts.host.session_alive:
        return [Action("stop", "stop the training", skip=f"tmux session {session} is not running; nothing to stop")]
    q = shlex.quote
    signal = signal_command(job)
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
