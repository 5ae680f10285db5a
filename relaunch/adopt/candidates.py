"""Which process is the training: pure, from the scan of the instance.

A candidate is a Python process with no Python process above it (a launcher and its workers,
a trainer and its data loaders are one candidate), found in a tmux pane, a screen session, or on
its own. Relaunch's own processes, tools (pip, jupyter, tensorboard, ...) and the system's Python
services are not. When any candidate uses a GPU (nvidia-smi's compute apps, or /dev/nvidiaN held
open, which also works where nvidia-smi reports another PID namespace's ids), only those count.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from ..errors import UsageError
from .commandline import invocation
from .facts import Pane, Proc, Scan, Screen

# a program with one of these names (the script's stem, the module, the console script) is no training
TOOLS = {"pip", "pip3", "uv", "jupyter", "jupyter-lab", "jupyter-notebook", "jupyter-server", "ipykernel_launcher",
         "ipykernel", "ipython", "tensorboard", "http.server", "nvitop", "gpustat", "nvtop", "wandb", "mlflow",
         "pytest", "py.test", "ray", "streamlit", "gradio", "black", "ruff", "mypy", "relaunch", "relaunch.cli",
         "hf", "huggingface-cli", "supervisord", "unattended-upgrade", "unattended-upgrade-shutdown",
         "networkd-dispatcher", "cloud-init", "waagent", "google_guest_agent", "landscape-sysinfo"}
SYSTEM_PLACES = ("/usr/", "/lib/", "/opt/", "/snap/", "/sbin/", "/bin/", "/etc/")


@dataclass
class Candidate:
    root: Proc
    tree: list[Proc]                     # the root and everything below it
    kind: str                            # tmux | screen | process
    session: str = ""                    # tmux session name, screen NAME
    pane: Pane | None = None
    screen: Screen | None = None
    started_by: list[Proc] = field(default_factory=list)   # between the session and the root, outermost first
    gpus: list[str] = field(default_factory=list)          # why it counts as using a GPU

    @property
    def label(self) -> str:
        if self.kind == "tmux":
            assert self.pane is not None
            return f"tmux session {self.session} (pane {self.pane.window}.{self.pane.pane})"
        if self.kind == "screen":
            assert self.screen is not None
            return f"screen session {self.screen.id}"
        return f"process {self.root.pid}"

    @property
    def short(self) -> str:
        return f"tmux session {self.session}" if self.kind == "tmux" else self.label

    def line(self, home: str = "", now: float | None = None) -> str:
        """One line for a list of candidates: what, which command, how long, GPUs."""
        call = invocation(self.root.argv)
        shown = " ".join(self.root.argv[1:] if call.console else self.root.argv)
        if home:
            shown = shown.replace(home + "/", "~/")
        shown = shown.replace("\0", "$")
        if len(shown) > 90:
            shown = shown[:87] + "..."
        age = ""
        if self.root.start:
            seconds = int((now or time.time()) - self.root.start)
            age = f", running {seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
        gpu = f", on {len(self.gpus)} GPU(s)" if self.gpus else ""
        return f"{self.label}: {shown} (pid {self.root.pid}{age}{gpu})"


def not_training(proc: Proc, in_session: bool) -> str:
    """Why this Python process is no training run ("" if it may be one)."""
    argv = proc.argv
    if any("/.relaunch/" in a for a in argv):
        return "relaunch's own"
    call = invocation(argv)
    names = {os.path.basename(call.console), call.target if call.kind == "module" else "",
             os.path.splitext(os.path.basename(call.target))[0] if call.kind == "script" else ""}
    if call.kind == "module":
        names.add(call.target.split(".")[0])
    if names & TOOLS:
        return f"a tool ({sorted(names & TOOLS)[0]})"
    if not in_session and not proc.nvidia:
        program = call.console or (call.target if call.kind == "script" else "")
        exe_system = proc.exe.startswith(SYSTEM_PLACES) and not proc.argv0_root
        if exe_system and (not program or program.startswith(SYSTEM_PLACES)):
            return "a system service"
        if proc.uid not in (0, -1) and proc.uid < 1000:
            return "a system account's"
    return ""


def candidates(scan: Scan) -> tuple[list[Candidate], list[str]]:
    """(the candidates, one line for each Python process that is not one and why)."""
    procs = scan.procs
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    panes = {pane.pid: pane for pane in scan.panes if not pane.dead}
    screens = {s.pid: s for s in scan.screens}
    skipped: list[str] = []
    found: list[Candidate] = []
    gpu_apps = {int(a["pid"]): a for a in scan.gpus.apps}
    for p in sorted(procs.values(), key=lambda x: x.pid):
        if not p.python or p.pid in scan.mine or p.pid == scan.self_pid:
            continue
        chain, q = [], None if p.pid in panes or p.pid in screens else procs.get(p.ppid)
        above_python = False
        while q is not None and q.pid > 1:
            if q.python:
                above_python = True
                break
            chain.append(q)
            if q.pid in panes or q.pid in screens:
                break
            q = procs.get(q.ppid)
        if above_python:
            continue
        pane = next((panes[c.pid] for c in chain if c.pid in panes), panes.get(p.pid))
        screen = next((screens[c.pid] for c in chain if c.pid in screens), None)
        why = not_training(p, pane is not None or screen is not None)
        if why:
            skipped.append(f"pid {p.pid} ({' '.join(p.argv[:3])}): {why}")
            continue
        tree, todo = [], [p.pid]
        while todo:
            pid = todo.pop()
            if pid in procs:
                tree.append(procs[pid])
                todo += children.get(pid, [])
        gpus = sorted({f"{gpu_apps[t.pid]['uuid']} (nvidia-smi compute app, pid {t.pid})" for t in tree
                       if t.pid in gpu_apps} | {f"{d} (held open by pid {t.pid})" for t in tree for d in t.nvidia})
        started = [c for c in reversed(chain) if c.pid not in screens]
        if pane is not None:
            found.append(Candidate(p, tree, "tmux", pane.session, pane=pane, started_by=started, gpus=gpus))
        elif screen is not None:
            found.append(Candidate(p, tree, "screen", screen.name, screen=screen, started_by=started, gpus=gpus))
        else:
            found.append(Candidate(p, tree, "process", started_by=[], gpus=gpus))
    return found, skipped


def on_gpus(found: list[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
    """(the candidates to choose from, those left out for not using a GPU while others do)."""
    using = [c for c in found if c.gpus]
    return (using, [c for c in found if not c.gpus]) if using else (found, [])


def matching(found: list[Candidate], wanted: str) -> list[Candidate]:
    """`--session`: a tmux session name, a screen session (NAME or PID.NAME), or a process id."""
    if wanted.isdigit():
        by_pid = [c for c in found if c.root.pid == int(wanted) or any(t.pid == int(wanted) for t in c.tree)]
        if by_pid:
            return by_pid
    out = []
    for c in found:
        if c.kind == "tmux" and c.session == wanted:
            out.append(c)
        elif c.kind == "screen" and c.screen is not None and wanted in (c.screen.name, c.screen.id):
            out.append(c)
    return out


def nothing_found(host: str, scan: Scan, skipped: list[str]) -> UsageError:
    sessions = sorted({p.session for p in scan.panes})
    seen = []
    if sessions:
        seen.append(f"tmux session(s) {', '.join(sessions)} run no Python process")
    if scan.screens:
        seen.append(f"screen session(s) {', '.join(s.id for s in scan.screens)} run no Python process")
    if skipped:
        seen.append("Python processes that are not training: " + "; ".join(skipped[:5])
                    + (f" (and {len(skipped) - 5} more)" if len(skipped) > 5 else ""))
    if not seen:
        seen.append("no tmux or screen session and no Python process")
    return UsageError(f"{host}: nothing is training there: {'; '.join(seen)}",
                      "start the training first (adopt reads a run that is going), or write a recipe with "
                      "`relaunch init`; a run of another user is read only when you log in as that user (or root)")
