"""What `adopt` reads on the instance: templates/adopt.py run there (read-only), its JSON as values.

Two reads: `scan` (every process in the instance's mount namespace, tmux and screen sessions,
GPUs: to find the training) and `detail` (the chosen process: environment against its session's,
its environment root's packages, the files its command names, folders holding checkpoints, its
last output lines). Secret values never arrive: the script replaces them by NUL NAME NUL.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConnectError, EnvError, remote_failure, shorten
from ..host.remote import Remote
from ..scripts import plain

SCRIPT = "adopt.py"
SCAN_DEADLINE = 60.0
DETAIL_DEADLINE = 180.0       # a venv of thousands of packages, a home of many folders
MARK = "\0"                   # the script writes a secret as MARK NAME MARK


def script_command(mode: str, params: dict[str, Any] | None = None) -> str:
    """The instance's python3 (isolated, no site, no bytecode written) running the adopt script,
    which comes on stdin (script_stdin): as an argument, the script and its parameters (every
    folder a detail read looks at) could pass the kernel's limit on one argument (128 KiB)."""
    del params                    # on stdin
    return ("py=$(command -v python3 || command -v python) || { echo 'relaunch adopt: no python3 on the instance' >&2; "
            f"exit 127; }}; exec \"$py\" -I -S -B - {shlex.quote(mode)}")


def script_stdin(mode: str, params: dict[str, Any] | None) -> bytes:
    """The adopt script, preceded by the line that gives it its arguments."""
    args = [mode] + ([json.dumps(params, sort_keys=True)] if params is not None else [])
    return f"import sys\nsys.argv[1:] = {json.dumps(args)}\n{plain(SCRIPT)}".encode()


def run_script(remote: Remote, mode: str, params: dict[str, Any] | None, deadline: float) -> dict[str, Any]:
    command = script_command(mode, params)
    result = remote.exec(command, stdin=script_stdin(mode, params), deadline=deadline)
    what = f"adopt: reading the instance ({mode})"
    if result.status is None and not result.timed_out:
        raise ConnectError(f"{remote.label}: {what}: the SSH connection was lost")
    if result.timed_out:
        raise EnvError(f"{remote.label}: {what} did not answer within {deadline:g}s; it was ended",
                       "the instance may be overloaded or hung (a broken GPU driver?); rerun")
    if result.status == 127 and "no python3" in result.stderr.decode(errors="replace"):
        raise EnvError(f"{remote.label}: adopt reads the instance with its python3, and there is none on PATH",
                       "install python3 there (apt-get install python3), or write the recipe by hand (`relaunch init`)")
    if not result.ok:
        # the script's own traceback, never its output (which is the facts)
        raise remote_failure(EnvError, remote.label, what, f"python3 -c <templates/{SCRIPT}> {mode}", result.status,
                             result.stderr.decode(errors="replace"),
                             "this is a bug in relaunch adopt; please report it with the debug log")
    try:
        data = json.loads(result.text)
    except ValueError:
        raise EnvError(f"{remote.label}: {what}: the answer is not JSON: {shorten(result.text, 120)!r}") from None
    if not isinstance(data, dict):
        raise EnvError(f"{remote.label}: {what}: unexpected answer")
    return data


@dataclass
class Proc:
    pid: int
    ppid: int
    comm: str
    state: str = ""
    start: float = 0.0
    uid: int = -1
    user: str = ""
    argv: list[str] = field(default_factory=list)
    python: bool = False
    exe: str = ""
    cwd: str = ""
    argv0: str = ""               # argv[0] resolved against the process's cwd and PATH
    argv0_root: str = ""          # the venv or conda env that bin/python belongs to
    virtual_env: str = ""
    conda_prefix: str = ""
    mapped: list[str] = field(default_factory=list)   # env roots whose site-packages it has mapped
    nvidia: list[str] = field(default_factory=list)   # /dev/nvidiaN it has open
    fd1: str = ""
    fd2: str = ""
    home: str = ""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Proc:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class Pane:
    socket: str
    session: str
    created: int
    window: str
    pane: str
    id: str
    pid: int
    dead: bool
    path: str
    start: str


@dataclass
class Screen:
    pid: int
    name: str
    id: str


@dataclass
class Gpus:
    smi: bool = False
    error: str = ""
    listed: list[dict[str, str]] = field(default_factory=list)
    apps: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Scan:
    self_pid: int
    mine: list[int]
    uid: int
    user: str
    home: str
    hostname: str
    login_env: list[str]
    dmi: dict[str, str]
    procs: dict[int, Proc]
    panes: list[Pane]
    tmux_errors: list[str]
    screens: list[Screen]
    gpus: Gpus
    secret_names: list[str]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Scan:
        panes, errors = [], []
        for server in d.get("tmux", []):
            if server.get("error"):
                errors.append(f"{server['socket']}: {server['error']}")
            panes += [Pane(socket=server["socket"], **{k: v for k, v in p.items() if k != "socket"})
                      for p in server.get("panes", [])]
        g = d.get("gpus") or {}
        return cls(self_pid=int(d.get("self", 0)), mine=list(d.get("mine", [])), uid=int(d.get("uid", -1)),
                   user=str(d.get("user", "")), home=str(d.get("home", "")), hostname=str(d.get("hostname", "")),
                   login_env=list(d.get("login_env", [])), dmi=dict(d.get("dmi", {})),
                   procs={int(p["pid"]): Proc.from_dict(p) for p in d.get("procs", [])}, panes=panes,
                   tmux_errors=errors, screens=[Screen(int(s["pid"]), s["name"], s["id"]) for s in d.get("screen", [])],
                   gpus=Gpus(bool(g.get("smi")), str(g.get("error", "")), list(g.get("list", [])),
                             list(g.get("apps", []))),
                   secret_names=list(d.get("secret_names", [])))


@dataclass
class EnvVar:
    name: str
    secret: bool
    value: str | None
    in_base: bool
    same: bool


@dataclass
class Dist:
    name: str
    version: str
    direct: dict[str, Any] | None = None
    requires: list[str] = field(default_factory=list)    # its Requires-Dist lines
    top: list[str] = field(default_factory=list)         # the import names it provides (top_level.txt)


@dataclass
class EnvRoot:
    path: str
    exists: bool
    pyvenv: dict[str, str] | None
    conda: bool
    site: list[str]
    dists: list[Dist]


@dataclass
class PathInfo:
    path: str
    kind: str                     # f, d, other, missing
    size: int = 0
    text: str | None = None       # a small text file's content
    why: str = ""                 # why there is no text


@dataclass
class Folder:
    dir: str
    hits: int
    newest: float
    sample: list[str]


@dataclass
class Detail:
    pid: int
    alive: bool
    env: list[EnvVar]
    base_kind: str
    prefix: EnvRoot | None
    pip_config: list[tuple[str, str]]
    paths: dict[str, PathInfo]
    sources: dict[str, PathInfo]
    sources_capped: bool
    folders: list[Folder]
    output_from: str
    output: list[str]
    secret_names: list[str]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Detail:
        p = d.get("prefix")
        prefix = None if not p else EnvRoot(p["path"], bool(p["exists"]), p.get("pyvenv"), bool(p.get("conda")),
                                            list(p.get("site", [])), [Dist(**x) for x in p.get("dists", [])])
        return cls(pid=int(d["pid"]), alive=bool(d.get("alive")), env=[EnvVar(**e) for e in d.get("env", [])],
                   base_kind=str(d.get("base_kind", "login")), prefix=prefix,
                   pip_config=[(c["path"], c["text"]) for c in d.get("pip_config", [])],
                   paths={x["path"]: PathInfo(**x) for x in d.get("paths", [])},
                   sources={x["path"]: PathInfo(x["path"], "f", 0, x.get("text"), x.get("why", ""))
                            for x in d.get("sources", [])},
                   sources_capped=bool(d.get("sources_capped")),
                   folders=[Folder(**f) for f in d.get("checkpoint_folders", [])],
                   output_from=str((d.get("output") or {}).get("from", "")),
                   output=list((d.get("output") or {}).get("lines", [])),
                   secret_names=list(d.get("secret_names", [])))
