"""This node as the "instance" the plans run on: every command line an action holds runs here, in
bash, in a process group of its own with its deadline (processes.run), and rsync copies between
two paths of this machine (a Target marked `local`). With it, `relaunch run` uses the steps, the
executor and the stores exactly as `up` and `evacuate` do over SSH.
"""

from __future__ import annotations

import getpass
import os
from collections.abc import Callable
from pathlib import Path

from .. import processes
from ..host.remote import ExecResult, Remote
from ..host.spec import Target


def node_target(name: str) -> Target:
    """This machine, as the steps name a host; `local`: rsync without SSH, and no connection."""
    return Target(address=name, user=getpass.getuser(), port=22, local=True)


class NodeShell(Remote):
    """Remote's surface for this machine: `exec` runs `bash -c COMMAND` here."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.home = str(Path.home())
        self.jump = None

    @property
    def alive(self) -> bool:
        return True

    def close(self) -> None:
        pass

    def exec(self, command: str, *, deadline: float, stdin: bytes | Path | None = None,
             on_output: Callable[[bytes], None] | None = None,
             cancelled: Callable[[], bool] = processes.interrupted) -> ExecResult:
        done = processes.run(["bash", "-c", command], deadline=deadline, stdin=stdin, on_stdout=on_output,
                             on_stderr=on_output, cancelled=cancelled, env=dict(os.environ))
        return ExecResult(command, done.status, done.stdout, done.stderr, done.timed_out)
