"""Env: the venv from the pinned lock, the recipe's files, secrets and setup; then a drift check."""

from __future__ import annotations

import hashlib
import shlex
import urllib.parse

from .. import scripts
from ..host.facts import FREEZE_PY
from ..host.remote import upload_command
from ..job import Job, drift
from ..plan import LOCAL, Action, Ref
from ..recipe import render_shell_at, variables
from ..recipe.render import render_text
from ..scripts import export_lines
from ..transports import rsync
from ..transports.tools import index_exports, indexes_searched, tool_action

LANE = "env"
INSTALL_DEADLINE = 3600.0
UPLOAD_DEADLINE = 60.0


def upload_deadline(size: int) -> float:
    """A minute, plus as long as `size` bytes take on the slowest link relaunch plans for (the
    rate rsync's copies get): a big env.files file (a tokenizer, a shard) is not ended halfway."""
    return float(round(UPLOAD_DEADLINE + rsync.DEADLINE_PER_GIB * size / 1024**3))


def exports(job: Job, extra: dict[str, str] | None = None) -> dict[str, str]:
    """env.vars as rendered for this job (`OUT: ~/out/{{ name }}` -> `~/out/llama-ft`), plus extra."""
    context = job.context()
    values = {k: str(context[k]) for k in job.recipe.env.vars}
    values.update(extra or {})
    return values


def render_setup(job: Job) -> tuple[list[str], dict[str, str]]:
    lines: list[str] = []
    env: dict[str, str] = {}
    for i in range(len(job.recipe.env.setup)):
        text, values = render_shell_at(job.recipe, f"env.setup.{i}", job.context())
        lines.append(text)
        env.update(values)
    return lines, env


def provides_python(job: Job) -> bool:
    """uv installs env.python: the image has no such Python and the installer is uv."""
    return not job.facts.host.python and job.recipe.env.installer == "uv"


def uv_makes_venv(job: Job) -> bool:
    """uv (not `python -m venv`) makes the venv: it has a lock to install, a Python to provide, or,
    with neither, the recipe names the index uv comes from. uv makes a venv in a fraction of a
    second where `python -m venv` spends seconds of CPU in ensurepip, and needs no `pythonX.Y-venv`.
    A recipe with no lock and no index fetches nothing from any index (an image that reaches none
    would first spend seconds on uv and on pip's retries, for a venv that installs nothing).
    `python -m venv` is also the fallback where the index has no uv."""
    env = job.recipe.env
    return env.installer == "uv" and (bool(job.facts.lock) or provides_python(job) or bool(env.index_url))


def venv_works(job: Job) -> bool:
    """The venv is there, its python runs and is env.python's major.minor (a venv whose Python a
    stop wiped, or one made with another Python, is made again)."""
    host = job.facts.host
    return host.venv_freeze is not None and host.venv_python.split(".")[:2] == job.recipe.env.python.split(".")


def python_env(job: Job) -> dict[str, str]:
    """uv's variables for the Python it provides: where it goes, and where it comes from (a URL may
    hold a token: exported by the script on stdin, never an argument)."""
    if not provides_python(job):
        return {}
    values = {"UV_PYTHON_INSTALL_DIR": job.paths.pythons}
    mirror = variables.python_mirror(job.recipe)
    if mirror:
        own_list = urllib.parse.urlsplit(mirror).path.endswith(".json")
        values["UV_PYTHON_DOWNLOADS_JSON_URL" if own_list else "UV_PYTHON_INSTALL_MIRROR"] = mirror
    return values


def plan_files(job: Job) -> list[Action]:
    """env.files: each local file to its instance path (rendered), its mode kept."""
    facts, recipe = job.facts, job.recipe
    actions = []
    for local, remote_path in recipe.env.files.items():
        dest = job.expand(render_text(recipe, str(remote_path), job.context(), f"env.files.{local}"))
        actions.append(Action("env", f"upload {local} -> {dest}", lane=LANE,
                              command=upload_command(dest, facts.modes.get(str(local), 0o644)), stdin=local,
                              deadline=upload_deadline(facts.sizes.get(str(local), 0)),
                              done=f"uploaded {local.name} -> {dest}"))
    return actions


def plan_env(job: Job) -> list[Action]:
    recipe, paths, facts = job.recipe, job.paths, job.facts
    lock = facts.lock
    q = shlex.quote

    def act(title: str, **kw: object) -> Action:
        return Action("env", title, lane=LANE, **kw)  # type: ignore[arg-type]

    actions = [act("relaunch's folder on the instance",
                   command=f"mkdir -p -- {q(paths.state)} && chmod 700 -- {q(paths.state)}")]

    installed = facts.host.venv_freeze if venv_works(job) else None
    if installed is not None and lock and not drift(lock, installed):
        actions.append(act("venv", skip=f"venv {paths.venv} already matches the lock ({len(lock)} lines)"))
    elif installed is not None and not lock:
        actions.append(act("venv", skip=f"venv {paths.venv} exists and there is no env.lock"))
    else:
        provide = provides_python(job)
        # the indexes (and where uv gets the Python) above the script, so that a team's own env.sh.j2
        # gets them too
        exported = index_exports(job) + (export_lines(python_env(job)) if provide else "")
        script = exported + scripts.render(
            "env.sh.j2", name=recipe.name, venv=paths.venv, python=facts.host.python or recipe.env.python,
            want=recipe.env.python, lock=paths.lock if lock else "", installer=recipe.env.installer,
            uv=uv_makes_venv(job), provide=provide, system_site_packages=recipe.env.system_site_packages,
            templates=recipe.templates)
        if lock:
            actions.append(act(f"upload {recipe.env.lock} -> {paths.lock}", command=upload_command(paths.lock, 0o600),
                               stdin=recipe.env.lock))
        if uv_makes_venv(job):
            # straight from its wheel (a download and an unzip); the env script falls back to pip
            uv = tool_action(job, "uv", "env", "env")
            actions.append(act(uv.title, command=f"{uv.command} || true", stdin=uv.stdin, deadline=uv.deadline))
        title = f"create {paths.venv}"
        if facts.host.venv_freeze is not None and not venv_works(job):
            title = (f"make {paths.venv} again (its Python is {facts.host.venv_python or 'broken'}, "
                     f"env.python is {recipe.env.python})")
        say = (f"installing {len(lock)} pinned packages with {recipe.env.installer} from {indexes_searched(recipe)}"
               if lock else "creating the venv")
        if provide:
            say = f"Python {recipe.env.python} from uv (the image has none) into {paths.pythons}; {say}"
        actions.append(act(title + (f" and install {len(lock)} pinned packages" if lock else ""),
                           command="bash -s", stdin=script.encode(), deadline=INSTALL_DEADLINE,
                           say=say, explain="checks.install_failure", progress="time",
                           hint="the full output is in the debug log (relaunch -v shows it live)"))

    actions += plan_files(job)

    if facts.secrets:
        names = tuple(sorted(facts.secrets))
        actions.append(act(f"secrets {', '.join(names)} -> {paths.secrets_file} (mode 0600)",
                           command=upload_command(paths.secrets_file, 0o600),
                           stdin=scripts.export_lines(facts.secrets).encode(), secret=names))

    if recipe.env.setup:
        lines, env = render_setup(job)
        digest = hashlib.sha256("\n".join([*lock, *lines]).encode()).hexdigest()
        setup = scripts.render("setup.sh.j2", name=recipe.name, setup=lines, workdir=paths.workdir,
                               venv=paths.venv, secrets_file=paths.secrets_file, exports=exports(job, env),
                               templates=recipe.templates)
        # set -e: a failing setup exits with its status (exit 4, its line named by checks.setup_failure)
        # before the marker is written, so the next `up` runs the whole setup again
        guarded = ("set -e\n"
                   f"marker={q(paths.setup_marker)}\n"
                   f"if [ \"$(cat \"$marker\" 2>/dev/null)\" = {digest} ]; then "
                   "echo 'setup already ran for this lock'; exit 0; fi\n"
                   "rm -f \"$marker\"\n"
                   f"mkdir -p {q(paths.workdir)}\n"
                   f"bash -s <<'RELAUNCH_SETUP'\n{setup}RELAUNCH_SETUP\n"
                   f"echo {digest} > \"$marker\"\n")
        actions.append(act("env.setup", command="bash -s", stdin=guarded.encode(), deadline=INSTALL_DEADLINE,
                           say=f"running env.setup ({len(lines)} lines)", progress="time",
                           explain="checks.setup_failure",
                           hint="fix that line (or the instance), then rerun `relaunch up`: the setup runs again "
                                "from its first line"))

    if lock:
        actions += [act("pip freeze of the venv", command=f"{q(paths.venv)}/bin/python -c {q(FREEZE_PY)}",
                        produces="freeze", parse="lines"),
                    act("compare pip freeze with the lock", where=LOCAL, call="checks.drift",
                        args={"lock": lock, "freeze": Ref("freeze")})]
    return actions
