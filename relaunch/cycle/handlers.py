"""The in-process calls a plan makes (`checks.x`, `fanout.x`, the store's) and the executor that
runs a plan with them.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import EnvError, RelaunchError, shorten
from ..executor import Executor
from ..host.remote import Remote
from ..job import Job, drift
from ..recipe import Recipe
from ..steps.evacuate import Unpinned
from ..steps.group import MARK
from ..transports import Store
from ..transports.tools import indexes_searched
from ..ui import UI, redact

# the lines of pip's or uv's output that name what could not be installed, best first
_INSTALL_ERRORS = (re.compile(r"Because (.+?)(?:, we can conclude.*)?$", re.M),            # uv
                   re.compile(r"^ERROR: (No matching distribution found for .+)$", re.M),   # pip
                   re.compile(r"^(?:ERROR|error): (.+)$", re.M))


# templates/env.sh.j2 announces what it does next: uv providing the Python, or installing the lock
_ENV_PHASE = re.compile(r"^relaunch-env-phase (\w+)$", re.M)


# templates/setup.sh.j2 announces each env.setup line before it runs it
_SETUP_LINE = re.compile(r"^relaunch-setup-line (\d+)$", re.M)


SETUP_TAIL_LINES = 15


class StepOutputs:
    """What the plans' steps printed, read in-process (`checks.x`): each says what it found."""

    def __init__(self, ui: UI, host: str, recipe: Recipe | None = None) -> None:
        self.ui, self.host, self.recipe = ui, host, recipe

    def setup_failure(self, status: int | None, output: str) -> RelaunchError | None:
        """The env.setup line that failed, where the recipe wrote it, and the last lines it printed
        (None leaves the usual failure block: a timeout, or a team's setup.sh.j2 without the
        announcements)."""
        starts = list(_SETUP_LINE.finditer(output))
        if status is None or not starts or self.recipe is None:
            return None
        last = starts[-1]
        key = f"env.setup.{last.group(1)}"
        where = self.recipe.origin(tuple(key.split(".")))
        printed = [ln for ln in redact(output[last.end():]).splitlines() if ln.strip()][-SETUP_TAIL_LINES:]
        message = (f"{self.host}: env.setup failed (exit {status}) at {where}: {key}: "
                   f"{shorten(redact(str(self.recipe.value(key))))}")
        message += "".join(f"\n  | {ln}" for ln in printed) if printed else "\n  (it printed nothing)"
        return EnvError(message, "fix that line (or the instance), then rerun `relaunch up`: the setup runs "
                                 "again from its first line; the full output is in the debug log")

    def install_failure(self, status: int | None, output: str) -> RelaunchError | None:
        """The installer's own words for the package it could not install (or for the Python uv
        could not provide), as the error line; the hint names the indexes it searched."""
        text = redact(output)
        phases = list(_ENV_PHASE.finditer(text))
        providing = bool(phases) and phases[-1].group(1) == "python"
        if providing:
            text = text[phases[-1].end():]
        for pattern in _INSTALL_ERRORS:
            found = pattern.search(text)
            if not found:
                continue
            if providing and self.recipe is not None:
                env = self.recipe.env
                source = (f"env.python_mirror {redact(env.python_mirror)}" if env.python_mirror
                          else "uv's default download source (python-build-standalone on GitHub)")
                return EnvError(f"{self.host}: env: uv could not provide Python {env.python}: "
                                f"{shorten(found.group(1))}",
                                f"it downloads from {source}: an instance without internet access needs "
                                "env.python_mirror; or pick an image that has that Python; the full output is "
                                "in the debug log")
            searched = f"the indexes searched: {redact(indexes_searched(self.recipe))}; " if self.recipe else ""
            return EnvError(f"{self.host}: env: installing the lock failed: {shorten(found.group(1))}",
                            f"{searched}fix that pin in env.lock (or env.index_url / env.extra_index_urls if the "
                            "package lives on another index), then rerun `relaunch up`; the full output is in the "
                            "debug log")
        return None

    def pinned(self, name: str, hosts: list[str], found: list[dict[str, Any] | None]) -> None:
        """Say where each node pinned checkpoint `name` for its copy (and that it removed what an
        earlier copy left); Unpinned for the nodes where it could not, with why."""
        refused: dict[str, str] = {}
        for host, doc in zip(hosts, found, strict=True):
            doc = doc or {}
            if doc.get("stale"):
                self.ui.step(host, "evacuate", f"removed {doc['stale']} pinned file(s) an earlier copy left "
                                               "(its relaunch was stopped before it could)")
            if doc.get("pinned"):
                self.ui.step(host, "evacuate", f"{name} pinned for its copy: {doc.get('files')} hard link(s) in "
                                               f"{doc['pinned']}")
            else:
                refused[host] = str(doc.get("unpinned") or "pin.py said nothing")
        if refused:
            raise Unpinned(refused)

    def drift(self, lock: list[str], freeze: list[str]) -> None:
        differences = drift(lock, freeze)
        if differences:
            self.ui.warn(f"{self.host}: the env differs from the lock in {len(differences)} package(s):")
            for line in differences[:20]:
                self.ui.warn(f"  {line}")
        else:
            self.ui.step(self.host, "env", "pip freeze matches the lock")


class GroupCopyKey:
    """The key a node group uses to copy a checkpoint between its nodes (`fanout.keypair`): made
    here for one copy, never written to this machine's disk."""

    def keypair(self) -> dict[str, bytes]:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        key = Ed25519PrivateKey.generate()
        private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                    serialization.NoEncryption())
        public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        # `restrict`: no forwarding, no pty; the copy needs nothing else
        return {"private": private, "authorized": b"restrict " + public + f" {MARK}\n".encode()}


def executor_for(job: Job, remote: Remote, store: Store | None, ui: UI,
                 remotes: dict[str, Remote] | None = None) -> Executor:
    handlers: dict[str, Any] = {"checks": StepOutputs(ui, job.host, job.recipe), "fanout": GroupCopyKey()}
    if store is not None:
        handlers.update(store.handlers())
    return Executor(ui, job.host, remote, handlers, remotes)
