"""Env: the venv from the pinned lock, the recipe's files, secrets and setup; then a drift check."""

from __future__ import annotations

import hashlib
import shlex

from .. import scripts
from ..errors import EnvError
from ..plan import Action
from ..host.facts import FREEZE_PY
from .common import Job, drift, read_lock
from .tools import index_args


def exports(job: Job, extra: dict[str, str] | None = None) -> dict[str, str]:
    values = {k: str(v) for k, v in job.recipe.env.vars.items()}
    values.update(extra or {})
    return values


def plan_env(job: Job) -> list[Action]:
    recipe, paths, facts = job.recipe, job.paths, job.facts
    lock_path = recipe.env.lock
    lock = read_lock(lock_path)
    actions: list[Action] = []

    mkdir = f"mkdir -p {shlex.quote(paths.state)} && chmod 700 {shlex.quote(paths.state)}"
    def make_state_dir() -> None:
        job.remote.check(mkdir, "env (mkdir)", EnvError)

    actions.append(Action("env", "relaunch's folder on the instance", mkdir, make_state_dir))

    script = scripts.render("env.sh.j2", name=recipe.name, venv=paths.venv, python=facts.python,
                            lock=paths.lock if lock else "", installer=recipe.env.installer,
                            index_args=index_args(job), system_site_packages=recipe.env.system_site_packages,
                            templates=recipe.templates)
    installed = facts.venv_freeze
    if installed is not None and lock and not drift(lock, installed):
        actions.append(Action("env", "venv", skip=f"venv {paths.venv} already matches the lock "
                              f"({len(lock)} lines)"))
    elif installed is not None and not lock:
        actions.append(Action("env", "venv", skip=f"venv {paths.venv} exists and there is no env.lock"))
    else:
        def install() -> None:
            if lock_path:
                job.remote.put_file(lock_path, paths.lock, 0o600)
            job.say("env", f"installing {len(lock)} pinned packages with {recipe.env.installer}" if lock
                    else "creating the venv")
            job.remote.check("bash -s", "env (install)", EnvError, stdin=script.encode(),
                             display="bash -s < env.sh", timeout=3600,
                             on_output=lambda b: job.ui.detail(b.decode(errors="replace").rstrip()),
                             hint="the full output is in the debug log (relaunch -v shows it live)")

        title = f"create {paths.venv} and install {lock_path}" if lock else f"create {paths.venv}"
        actions.append(Action("env", title, f"upload {lock_path} -> {paths.lock}\n{script}", install))

    for local, remote_path in recipe.env.files.items():
        dest = job.remote.expand(str(remote_path))

        def upload(local=local, dest=dest) -> None:
            job.remote.check(f"mkdir -p {shlex.quote(dest.rsplit('/', 1)[0] or '/')}", "env (files)", EnvError)
            job.remote.put_file(local, dest)
            job.say("env", f"uploaded {local.name} -> {dest}")

        actions.append(Action("env", f"upload {local} -> {dest}", run=upload))

    if job.secrets:
        names = ", ".join(sorted(job.secrets))
        actions.append(Action("env", f"secrets {names} -> {paths.secrets_file} (mode 0600)",
                              run=lambda: job.remote.put_bytes(paths.secrets_file,
                                                               scripts.export_lines(job.secrets).encode(), 0o600)))

    if recipe.env.setup:
        lines, env = render_setup(job)
        digest = hashlib.sha256("\n".join([*lock, *lines]).encode()).hexdigest()
        setup = scripts.render("setup.sh.j2", name=recipe.name, setup=lines, workdir=paths.workdir,
                               venv=paths.venv, secrets_file=paths.secrets_file, exports=exports(job, env),
                               templates=recipe.templates)
        guarded = (f"marker={shlex.quote(paths.setup_marker)}\n"
                   f"if [ \"$(cat \"$marker\" 2>/dev/null)\" = {digest} ]; then "
                   "echo 'setup already ran for this lock'; exit 0; fi\n"
                   f"mkdir -p {shlex.quote(paths.workdir)}\n"
                   f"bash -s <<'RELAUNCH_SETUP'\n{setup}RELAUNCH_SETUP\n"
                   f"echo {digest} > \"$marker\"\n")

        def run_setup() -> None:
            job.say("env", f"running env.setup ({len(lines)} lines)")
            job.remote.check("bash -s", "env (setup)", EnvError, stdin=guarded.encode(), display="env.setup",
                             timeout=3600, on_output=lambda b: job.ui.detail(b.decode(errors="replace").rstrip()))

        actions.append(Action("env", "env.setup", guarded, run_setup))

    if lock:
        actions.append(Action("env", "compare pip freeze with the lock", run=lambda: report_drift(job, lock)))
    return actions


def render_setup(job: Job) -> tuple[list[str], dict[str, str]]:
    lines: list[str] = []
    env: dict[str, str] = {}
    for i in range(len(job.recipe.env.setup)):
        text, values = job.recipe.render_shell(f"env.setup.{i}", job.context())
        lines.append(text)
        env.update(values)
    return lines, env


def installed_freeze(job: Job) -> list[str]:
    result = job.remote.check(f"{shlex.quote(job.paths.venv)}/bin/python -c {shlex.quote(FREEZE_PY)}",
                              "env (pip freeze)", EnvError)
    return result.text.splitlines()


def report_drift(job: Job, lock: list[str]) -> None:
    differences = drift(lock, installed_freeze(job))
    if differences:
        job.ui.warn(f"{job.host}: the env differs from the lock in {len(differences)} package(s):")
        for line in differences[:20]:
            job.ui.warn(f"  {line}")
    else:
        job.say("env", "pip freeze matches the lock")
