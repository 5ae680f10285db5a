"""The training as `relaunch run`'s child, in the foreground of the job: run.command in bash, in
run.workdir, with the environment run.sh gives it under `up` (the venv when the recipe has a lock,
relaunch.train on PYTHONPATH, the stop signal and the notice record, env.vars and the template
values), in a session of its own so that run.stop.signal reaches its whole process group.

Its output goes to this process's stdout (the engine's log) and to run.log, between the same start
and exit lines run.sh writes; node 0 also stamps each step line, with the time it was printed, into
the timeline beside the log (`RUN.log.timeline`, JSON lines) that `relaunch drill --job` measures.

SIGUSR1 and SIGUSR2 reach it ignored: an engine that signals every process of the job (Slurm's
`--signal` without `B:`) would otherwise kill a training that does not handle them, where relaunch
run turns them into run.stop.signal. A handler the training installs itself still gets them.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from .. import train
from ..history import iso
from ..job import Job
from ..recipe import render_shell_at
from ..scripts import START_MARK
from ..steps.env import exports
from ..steps.launch import launcher_env, train_module_path

IGNORED = (signal.SIGUSR1, signal.SIGUSR2)


def timeline_path(log: str) -> str:
    return f"{log}.timeline"


def session_members(sid: int) -> list[int]:
    """The live processes of session `sid` (zombies are done), from /proc."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()   # after comm, which may hold anything
        except (OSError, IndexError):
            continue                                              # gone meanwhile
        if len(fields) > 3 and fields[3] == str(sid) and fields[0] != "Z":
            members.append(int(entry.name))
    return members


class Training:
    """One start of run.command: start(), then poll(), stop(signal), wait()."""

    def __init__(self, job: Job, notice_file: str, lock: bool, timeline: bool, echo: IO[bytes] | None = None) -> None:
        self.job = job
        self.notice_file = notice_file
        self.lock = lock                    # the recipe has env.lock: the command runs in env.venv
        self.timeline = timeline            # node 0 writes the step lines' times
        self.echo = echo if echo is not None else sys.stdout.buffer
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.first_step_at: float | None = None   # when the first step line came (training runs again)
        self.last_step: int | None = None         # the newest step the output showed
        self._step = re.compile(job.recipe.run.metrics.step)
        self._pump: threading.Thread | None = None

    # -- its environment --------------------------------------------------------------------------
    def environment(self, values: dict[str, str]) -> dict[str, str]:
        job, paths = self.job, self.job.paths
        env = dict(os.environ)
        if self.lock:
            env["VIRTUAL_ENV"] = paths.venv
            env["PATH"] = f"{paths.venv}/bin:{env.get('PATH', '')}"
            env.pop("PYTHONHOME", None)
        env["PYTHONPATH"] = paths.python_path + (f":{env['PYTHONPATH']}" if env.get("PYTHONPATH") else "")
        env.update({"RELAUNCH_STOP_SIGNAL": job.recipe.run.stop.signal, "RELAUNCH_NOTICE": self.notice_file,
                    "RELAUNCH_STARTED": str(math.floor(self.started))})
        env.update(exports(job, {**launcher_env(job), **values}))
        return env

    def _place_train_module(self) -> None:
        """relaunch/train.py where the training imports it from (as `up` uploads it): one standard-
        library file, whatever the training's venv holds."""
        module = Path(train_module_path(self.job))
        module.parent.mkdir(parents=True, exist_ok=True)
        tmp = module.with_name(f".{module.name}.tmp")
        shutil.copyfile(train.__file__, tmp)
        os.replace(tmp, module)

    # -- running it -------------------------------------------------------------------------------
    def start(self) -> None:
        job, paths = self.job, self.job.paths
        command, values = render_shell_at(job.recipe, "run.command", job.context())
        self._place_train_module()
        Path(paths.workdir).mkdir(parents=True, exist_ok=True)
        Path(paths.log).parent.mkdir(parents=True, exist_ok=True)
        self.started = time.time()
        self._log_line(f"{START_MARK}{iso(self.started)} on {socket.gethostname()} "
                       f"(checkpoint: {job.checkpoint or 'none'})", stamp=True)
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in IGNORED}   # inherited as ignored
        try:
            self.proc = subprocess.Popen(["bash", "-c", command], cwd=paths.workdir, env=self.environment(values),
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self._pump = threading.Thread(target=self._copy_output, name="training-output", daemon=True)
        self._pump.start()

    def _copy_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with open(self.job.paths.log, "ab") as log:
            for raw in self.proc.stdout:
                self.echo.write(raw)
                self.echo.flush()
                log.write(raw)
                log.flush()
                text = raw.decode(errors="replace").rstrip("\n")
                found = self._step.search(text)
                if found:
                    try:
                        self.last_step = int(found.group(1))
                    except (IndexError, ValueError):
                        continue
                    if self.first_step_at is None:
                        self.first_step_at = time.time()
                    self._stamp(text)

    def _log_line(self, text: str, stamp: bool = False) -> None:
        with open(self.job.paths.log, "a") as log:
            log.write(text + "\n")
        if stamp:
            self._stamp(text)

    def _stamp(self, text: str) -> None:
        if not self.timeline:
            return
        with open(timeline_path(self.job.paths.log), "a") as handle:
            handle.write(json.dumps({"at": round(time.time(), 3), "host": self.job.host, "text": text}) + "\n")

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, number: int) -> bool:
        """The signal to the training's process group; False when it is gone already."""
        if self.proc is None:
            return False
        try:
            os.killpg(self.proc.pid, number)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def wait(self, seconds: float) -> int | None:
        """Its exit status once it ended within `seconds` (and its output is copied), else None.
        It has ended once its whole session has: a launcher that exits first (torchrun's agent, which
        a second SIGTERM ends at once; a shell's `cmd & wait`) leaves the processes that train still
        writing the stop's save. Those still there at the end of `seconds` are left to the copy."""
        if self.proc is None:
            return None
        end = time.monotonic() + max(seconds, 0)
        try:
            status = self.proc.wait(timeout=max(seconds, 0))
        except subprocess.TimeoutExpired:
            return None
        while session_members(self.proc.pid) and time.monotonic() < end:
            time.sleep(0.1)
        if self._pump is not None:
            self._pump.join(max(min(5.0, end - time.monotonic()), 0.1))
        return status

    def ended(self, status: int) -> None:
        """The exit line run.sh writes."""
        self._log_line(f"=== relaunch: exit {status} {iso(time.time())}")
