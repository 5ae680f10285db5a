"""Launch: the run script, an exact-name tmux session, and a look a few seconds later."""

from __future__ import annotations

import shlex
import time

from .. import scripts
from ..errors import EnvError
from ..plan import Action
from .common import Job
from .env import exports

GRACE_SECONDS = 3.0


def render_run_script(job: Job) -> str:
    command, values = job.recipe.render_shell("run.command", job.context())
    paths = job.paths
    return scripts.render("run.sh.j2", name=job.recipe.name, session=job.recipe.run.session, command=command,
                          workdir=paths.workdir, venv=paths.venv, secrets_file=paths.secrets_file,
                          exports=exports(job, values), log=paths.log, status_file=paths.status_file,
                          pgid_file=paths.pgid_file, templates=job.recipe.templates)


def tail_command(path: str, lines: int = 20) -> str:
    return f"tail -n {lines} {shlex.quote(path)} 2>/dev/null"


def attach_command(job: Job) -> str:
    target = job.target
    parts = ["ssh", "-t"]
    if target.port != 22:
        parts += ["-p", str(target.port)]
    if target.key:
        parts += ["-i", target.key]
    parts += [f"{target.user}@{target.address}", "tmux", "attach", "-t", f"={job.recipe.run.session}"]
    return shlex.join(parts)


def plan_launch(job: Job) -> list[Action]:
    paths, session = job.paths, job.recipe.run.session
    script = render_run_script(job)
    start = (f"mkdir -p {shlex.quote(paths.workdir)} && "
             f"tmux new-session -d -s {shlex.quote(session)} {shlex.quote('bash ' + shlex.quote(paths.run_script))}")

    def launch() -> None:
        job.remote.put_bytes(paths.run_script, script.encode(), 0o700)
        result = job.remote.exec(start)
        if not result.ok and "duplicate session" in result.output:
            job.say("launch", f"tmux session {session} appeared meanwhile (another `up`?); leaving it alone")
            return
        if not result.ok:
            raise EnvError(f"{job.host}: launch: tmux failed: {result.output.strip()}")
        time.sleep(GRACE_SECONDS)
        alive = job.remote.exec(f"tmux has-session -t {shlex.quote('=' + session)}").ok
        if alive:
            job.ui.ok(f"[{job.host}] training is running in tmux session {session} "
                      f"({'resumed from ' + job.checkpoint if job.checkpoint else 'fresh start'})")
            job.ui.say(f"  attach: {attach_command(job)}\n  log:    {paths.log}")
            return
        status = job.remote.exec(f"cat {shlex.quote(paths.status_file)} 2>/dev/null").text.strip()
        tail = job.remote.exec(tail_command(paths.log)).text
        if status == "0":
            job.ui.ok(f"[{job.host}] the command already finished (exit 0); log: {paths.log}")
            return
        lines = "\n".join("  | " + ln for ln in tail.rstrip().splitlines())
        raise EnvError(f"{job.host}: launch: the command died at start (exit {status or '?'}); last lines of "
                       f"{paths.log}:\n{lines}", "fix run.command (try it by hand in the venv) and rerun `up`")

    shown = f"upload run.sh -> {paths.run_script} (mode 0700):\n{script}\n{start}\nsleep {GRACE_SECONDS:g}; " \
            f"tmux has-session -t ={session}"
    return [Action("launch", f"start tmux session {session}", shown, launch)]
