"""Launch: the run script, an exact-name tmux session, and a watch until the command proves itself."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

from .. import scripts, train
from ..host.remote import upload_command
from ..job import Job
from ..paths import known_hosts_file
from ..plan import Action
from ..recipe import render_shell_at
from .env import exports
from .guard import guard_paths, plan_guard

WATCH_SLACK = 30.0       # seconds beyond the grace for the watch itself (python start, a slow box)
SHUTDOWN = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


SHUTDOWN_MARGIN = 15.0   # seconds torchrun waits beyond run.stop.timeout before it kills its ranks


def launcher_env(job: Job) -> dict[str, str]:
    """torchrun SIGKILLs its ranks 30 s after the stop signal reaches it (with every rank: the
    process group), however long run.stop.timeout waits: a save that takes longer (a big model's
    DCP checkpoint, a loaded box) was cut short. It waits run.stop.timeout and a margin, so that a
    save that ends as relaunch's wait does is not killed on the way, unless the recipe's env.vars says
    otherwise (a `--shutdown-timeout` in the command wins over both)."""
    if SHUTDOWN in job.recipe.env.vars:
        return {}
    return {SHUTDOWN: str(math.ceil(job.recipe.run.stop.timeout + SHUTDOWN_MARGIN))}


def render_run_script(job: Job) -> str:
    command, values = render_shell_at(job.recipe, "run.command", job.context())
    paths = job.paths
    return scripts.render("run.sh.j2", name=job.recipe.name, session=job.recipe.run.session, command=command,
                          workdir=paths.workdir, venv=paths.venv, secrets_file=paths.secrets_file,
                          exports=exports(job, {**launcher_env(job), **values}), log=paths.log,
                          status_file=paths.status_file,
                          pgid_file=paths.pgid_file, python_path=paths.python_path,
                          stop_signal=job.recipe.run.stop.signal, notice_file=guard_paths(job).notice,
                          start_mark=scripts.START_MARK,
                          templates=job.recipe.templates)


def train_module_path(job: Job) -> str:
    """Where `up` puts relaunch/train.py on the instance (a namespace portion: no __init__.py)."""
    return f"{job.paths.python_path}/relaunch/train.py"


def tail_command(path: str, lines: int = 20) -> str:
    return f"tail -n {lines} -- {shlex.quote(path)} 2>/dev/null"


def attach_command(job: Job) -> str:
    """The line `up` prints to look at training, as it works pasted into a shell: the host key
    relaunch recorded (plain ssh reads ~/.ssh/known_hosts, where it is not), the port and key
    relaunch used, a terminal (no BatchMode: the user is there), the session by its exact name."""
    target = job.target
    parts = ["ssh", "-t", "-o", f"UserKnownHostsFile={known_hosts_file()}"]
    if target.port != 22:
        parts += ["-p", str(target.port)]
    if target.key:
        parts += ["-i", str(Path(target.key).expanduser())]
        parts += ["-o", "IdentitiesOnly=yes"] if target.key_only else []
    if target.jump is not None and not target.alias:
        parts += ["-J", target.jump.endpoint]
    # an ssh config alias, so that the user's own ssh finds its HostName and ProxyJump again
    parts += [f"{target.user}@{target.alias or target.address}", "tmux", "attach", "-t", f"={job.recipe.run.session}"]
    return shlex.join(parts)


def watch_command(job: Job) -> str:
    """Watch the session start: a `run.ready` line in its log; without one, the step its log shows
    (`run.metrics.step`) going up; else `run.grace` seconds alive."""
    run, paths = job.recipe.run, job.paths
    args = [run.session, paths.log, paths.status_file, run.ready or "", f"{run.grace:g}", run.metrics.step]
    python = job.facts.host.python or "python3"
    return f"{shlex.quote(python)} -c {shlex.quote(scripts.plain('watch.py'))} {shlex.join(args)}"


def run_info(job: Job) -> dict[str, object]:
    """How this start runs training: what evacuate records with each checkpoint it saves."""
    ctx, batch = job.context(), job.recipe.run.batch
    return {"nnodes": ctx["nnodes"], "node_rank": ctx["node_rank"], "nproc_per_node": ctx["nproc_per_node"],
            "world_size": ctx["world_size"], "grad_accum": ctx["grad_accum"],
            **({"global": batch.global_, "micro": batch.micro} if batch else {})}


def plan_launch(job: Job) -> list[Action]:
    paths, run = job.paths, job.recipe.run
    session = shlex.quote(run.session)
    script = render_run_script(job)
    # new-session fails when the session exists: an atomic create, so two `up`s start one trainer
    start = (f"mkdir -p -- {shlex.quote(paths.workdir)} && "
             f"{{ tmux new-session -d -s {session} {shlex.quote('bash ' + shlex.quote(paths.run_script))} || "
             f"{{ tmux has-session -t {shlex.quote('=' + run.session)} && "
             f"echo 'the session appeared meanwhile (another up?); left alone'; }}; }}")
    waiting = (f"waiting until a log line matches run.ready {run.ready!r} (up to {run.grace:g}s)" if run.ready
               else f"watching the command for {run.grace:g}s (run.grace) to see it start, or until its log shows "
                    f"the step going up (run.metrics.step {run.metrics.step!r})")
    module = train_module_path(job)
    return [
        # the training's own `from relaunch import train`: one standard-library file, none of
        # relaunch's dependencies in the training's venv (docs/trainers.md)
        Action("launch", f"upload relaunch.train -> {module} (on the training's PYTHONPATH)",
               command=upload_command(module, 0o644), stdin=Path(train.__file__)),
        Action("launch", f"upload run.sh -> {paths.run_script} (mode 0700)",
               command=upload_command(paths.run_script, 0o700), stdin=script.encode()),
        Action("launch", f"upload run.json -> {paths.run_info} (how training runs: world size, grad_accum)",
               command=upload_command(paths.run_info, 0o600),
               stdin=(json.dumps(run_info(job), sort_keys=True) + "\n").encode()),
        Action("launch", f"start tmux session {run.session}", command=start),
        *plan_guard(job),
        Action("launch", "watch the command start", command=watch_command(job), deadline=run.grace + WATCH_SLACK,
               produces="launch", parse="json", say=waiting),
    ]
