"""Ask training to save and exit (`evacuate --stop`): run.stop.signal to the command's process
group, then wait up to run.stop.timeout for the tmux session to end; then stop the guard."""

from __future__ import annotations

import shlex

from ..job import Job
from ..plan import Action
from .guard import stop_guard

STOPPED = "stopped"
STILL_RUNNING = "still running"


# The start time of a process, as the kernel counts it (field 22 of /proc/PID/stat; the command name
# before it may hold spaces): with the pid and the boot it names one process, never a later reuse.
START_OF = "sed 's/.*) //' /proc/{pid}/stat 2>/dev/null | cut -d' ' -f20"


def group_script(job: Job) -> str:
    """Shell that sets `pg` to the training's process group, or leaves it empty: the group run.sh
    recorded (`PGID START BOOT_ID`), only while its leader is that same process of this boot (after a
    reboot, or once it exited, the number may be another group's); else, for a run relaunch did not
    start (`relaunch adopt`), the foreground group of the training's tmux pane. When that group is
    the pane's own shell's (`tmux new -d 'cd dir && python train.py > log'`: bash runs the command
    as its child), `keep` is set to the shell's pid: a stop must not reach it, for once it exits the
    kernel hangs up the pane's processes, and training dies of the SIGHUP in the middle of its save."""
    return group_script_for(job.recipe.run.session, job.paths.pgid_file)


def group_script_for(session: str, pgid_path: str) -> str:
    """group_script from the tmux session's name and the pgid file's path alone (no facts read)."""
    q = shlex.quote
    pane = q("=" + session + ":")
    return (
        f"pg=; keep=; boot=$(cat /proc/sys/kernel/random/boot_id 2>/dev/null); "
        f"if read -r g s b 2>/dev/null < {q(pgid_path)} && [ -n \"$g\" ]; then "
        f"if [ -n \"$b\" ]; then "
        f"if [ \"$b\" = \"$boot\" ] && [ \"$({START_OF.format(pid='$g')})\" = \"$s\" ]; then pg=$g; fi; "
        # a pgid file of an earlier relaunch (the group alone): trusted only while its session runs
        f"elif tmux has-session -t {q('=' + session)} 2>/dev/null; then pg=$g; fi; "
        f"elif p=$(tmux display-message -p -t {pane} '#{{pane_pid}}' 2>/dev/null) && [ -n \"$p\" ]; then "
        "t=$(ps -o tpgid= -p \"$p\" 2>/dev/null | tr -d ' '); "
        # the pane's foreground group, unless that is a shell idle at its prompt (the command ended)
        "c=$(ps -o comm= -p \"$p\" 2>/dev/null); idle=; case \"$c\" in bash|sh|dash|zsh|fish|ksh|tcsh|csh) "
        "[ \"$t\" = \"$p\" ] && [ -z \"$(ps -o pid= --ppid \"$p\")\" ] && idle=1;; esac; "
        "if [ -n \"$t\" ] && [ \"$t\" != -1 ] && [ -z \"$idle\" ]; then pg=$t; "
        "case \"$c\" in bash|sh|dash|zsh|fish|ksh|tcsh|csh) [ \"$t\" = \"$p\" ] && keep=$p;; esac; fi; fi"
    )


def signal_command(job: Job) -> str:
    """run.stop.signal to the training's process group (torchrun and every rank it started), but
    not to the pane's shell that group_script keeps."""
    sig = shlex.quote(job.recipe.run.stop.signal)
    return (f"{group_script(job)}; if [ -z \"$pg\" ]; then echo 'relaunch: no training process to signal (no pgid "
            f"file of this boot, no command in the tmux pane): it has ended'; exit 0; fi; "
            # the shell's children in its group; none there (each in a group of its own): the group, as ever
            f"m=; [ -n \"$keep\" ] && m=$(ps -eo pid=,pgid= | awk -v g=\"$pg\" -v k=\"$keep\" '$2 == g && $1 != k "
            f"{{print $1}}'); if [ -n \"$m\" ]; then kill -s {sig} $m; else kill -s {sig} -- -\"$pg\"; fi")


def end_command(job: Job) -> str:
    """End the training at once, no save: its tmux session and its guard's, then SIGKILL to its
    process group while the command has not finished (no exit status yet, so the group is still
    its own: a launcher that outlives its session, torchrun waiting on a lost node, is ended too),
    waiting up to 10 s for the group to be gone. A group that is no longer the training's (a pgid
    file from before a reboot) is left alone."""
    q, paths, session = shlex.quote, job.paths, job.recipe.run.session
    return (f"{group_script(job)}; tmux kill-session -t {q('=' + session)} 2>/dev/null; "
            f"tmux kill-session -t {q('=' + session + '-guard')} 2>/dev/null; "
            f"if [ -n \"$pg\" ] && [ ! -s {q(paths.status_file)} ]; then kill -KILL -- \"-$pg\" 2>/dev/null; "
            "i=0; while kill -0 -- \"-$pg\" 2>/dev/null && [ $i -lt 50 ]; do sleep 0.2; i=$((i+1)); done; fi; true")


def running_test(job: Job) -> str:
    """Shell test, true while the training runs (after group_script has set `pg`). A run relaunch
    started ends with its tmux session (run.sh writes the exit status, then exits); in the session
    of a run started by hand a shell stays when the command ends: its group is what ends."""
    q = shlex.quote
    return (f"{{ [ -s {q(job.paths.pgid_file)} ] && tmux has-session -t {q('=' + job.recipe.run.session)} "
            "2>/dev/null; } || { [ -n \"$pg\" ] && kill -0 -- \"-$pg\" 2>/dev/null; }")


def ended_command(job: Job) -> str:
    """Prints `ended` once the training runs no more, `running` while it does."""
    return f"{group_script(job)}; if {running_test(job)}; then echo running; else echo ended; fi"


def plan_stop(job: Job) -> list[Action]:
    stop, session = job.recipe.run.stop, job.recipe.run.session
    if not job.facts.host.session_alive:
        return [Action("stop", "stop the training", skip=f"tmux session {session} is not running; nothing to stop")]
    q = shlex.quote
    signal = signal_command(job)
    timeout = int(stop.timeout + 0.999)
    running = running_test(job)
    wait = (f"{group_script(job)}; end=$((SECONDS + {timeout})); while {running}; do "
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
