"""Read-only facts about an instance: one script, one round trip, a pure parser."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..scripts import plain, with_inputs
from ..train import ASIDE_DIR, LINEAGE_FILE
from .spec import Target

FACTS_DEADLINE = 90.0       # the script bounds each slow probe itself (nvidia-smi on a broken box hangs)


@dataclass
class HostFacts:
    home: str = ""
    user: str = ""
    uid: int = -1
    now: float = 0.0              # the instance's clock when the facts were read (seconds since the epoch)
    python: str = ""              # interpreter matching env.python, "" if none
    python3_version: str = ""
    venv_module: bool = False
    tools: dict[str, bool] = field(default_factory=dict)
    can_root: bool = False
    free_ckpt: int = 0
    total_ckpt: int = 0           # size of the disk checkpoint.dir is on
    free_venv: int = 0
    ckpt_blocked: str = ""        # checkpoint.dir does not exist and this user cannot write in this, its
    venv_blocked: str = ""        # nearest existing folder (the same for env.venv); "": it can be made
    session_alive: bool = False
    session_since: str = ""
    gpus: list[str] = field(default_factory=list)   # nvidia-smi csv rows: name, memory, driver
    gpu_error: str = ""                             # nvidia-smi present but failed or hung
    venv_freeze: list[str] | None = None            # None: no venv yet (or one whose python does not run)
    venv_python: str = ""                           # the venv's Python version, read by running it
    missing_apt: list[str] = field(default_factory=list)
    run: dict[str, Any] = field(default_factory=dict)  # run.json: how the last `up` started training
    # what this login cannot see through its tmux (facts.sh): processes of this box running this
    # recipe's run.sh, other users' tmux servers ({"uid", "user", "pid"} each), and the folder on the
    # way to checkpoint.dir this user cannot look into ("OWNER PATH", "" when none)
    runs: list[dict[str, Any]] = field(default_factory=list)
    other_tmux: list[dict[str, Any]] = field(default_factory=list)
    ckpt_hidden: str = ""
    # checkpoint.dir's lineage file: the branches started there by resuming an older checkpoint
    lineage: list[dict[str, Any]] = field(default_factory=list)

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    @property
    def driver(self) -> str:
        return self.gpus[0].split(",")[-1].strip() if self.gpus else ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HostFacts:
        return cls(**data)


# What is installed in the venv itself (not the image's site-packages), like `pip freeze --local`;
# works in uv venvs, which have no pip.
FREEZE_PY = (
    "import importlib.metadata as md, sys\n"
    "paths = [p for p in sys.path if p.startswith(sys.prefix) and p.endswith('site-packages')]\n"
    "print('\\n'.join(sorted({f\"{d.metadata['Name']}=={d.version}\" for d in md.distributions(path=paths)},"
    " key=str.lower)))\n"
)


def facts_script(python: str, venv: str, ckpt: str, session: str, apt: list[str],
                 templates: Path | None = None, run_info: str = "", name: str = "") -> str:
    return with_inputs(plain("facts.sh", templates), py_want=python, venv=venv, ckpt=ckpt, session=session,
                       run_info=run_info, lineage=f"{ckpt.rstrip('/')}/{ASIDE_DIR}/{LINEAGE_FILE}",
                       apt=" ".join(apt), freeze_py=FREEZE_PY, name=name)


def _processes(lines: list[str]) -> list[dict[str, Any]]:
    """`UID USER PID` lines, as facts.sh writes them."""
    found = []
    for line in lines:
        words = line.split()
        if len(words) == 3 and words[0].isdigit() and words[2].isdigit():
            found.append({"uid": int(words[0]), "user": words[1], "pid": int(words[2])})
    return found


def parse_facts(text: str) -> HostFacts:
    facts = HostFacts()
    values: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    lists: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("missing_apt="):
            facts.missing_apt.append(line.partition("=")[2].strip())
            continue
        if line.startswith(("run_process=", "other_tmux=")):
            key, _, value = line.partition("=")
            lists.setdefault(key, []).append(value.strip())
            continue
        if line.startswith("--- "):
            name = line[4:].strip()
            current = None if name == "end" else sections.setdefault(name, [])
            continue
        if current is not None:
            if line.strip():
                current.append(line.strip())
            continue
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip()
    facts.home = values.get("home", "")
    facts.user = values.get("user", "")
    facts.uid = int(values["uid"]) if values.get("uid", "").isdigit() else -1
    facts.now = float(_number(values.get("now")))
    facts.python = values.get("python", "")
    facts.python3_version = values.get("python3_version", "")
    facts.venv_module = values.get("venv_module") == "1"
    facts.tools = {k[4:]: v == "1" for k, v in values.items() if k.startswith("has_")}
    facts.can_root = values.get("can_root") == "1"
    facts.free_ckpt = _number(values.get("free_ckpt"))
    facts.total_ckpt = _number(values.get("total_ckpt"))
    facts.free_venv = _number(values.get("free_venv"))
    facts.ckpt_blocked = values.get("ckpt_blocked", "")
    facts.venv_blocked = values.get("venv_blocked", "")
    facts.session_alive = values.get("session_alive") == "1"
    facts.session_since = values.get("session_since", "")
    facts.gpus = sections.get("gpus", [])
    facts.gpu_error = values.get("gpu_error", "")
    facts.venv_python = values.get("venv_python", "")
    facts.venv_freeze = sections.get("freeze")
    try:
        run = json.loads("\n".join(sections.get("run", [])) or "{}")
    except ValueError:
        run = {}
    facts.run = run if isinstance(run, dict) else {}
    facts.runs = _processes(lists.get("run_process", []))
    facts.other_tmux = _processes(lists.get("other_tmux", []))
    facts.ckpt_hidden = values.get("ckpt_hidden", "")
    for line in sections.get("lineage", []):
        try:
            branch = json.loads(line)
        except ValueError:
            continue                      # a line cut short (the file is replaced whole, but be lenient)
        if isinstance(branch, dict):
            facts.lineage.append(branch)
    return facts


def _number(text: str | None) -> int:
    try:
        return int(float(text or 0))
    except ValueError:
        return 0


@dataclass(frozen=True)
class Unseen:
    """A run of this recipe on the instance that this login does not see in its tmux session."""

    why: str                         # in words: what was seen
    owner: str                       # whose run it is ("": this login's own, outside its session)
    certain: bool                    # its run.sh runs (else only signs of one: a tmux, a folder)

    def hint(self, command: str, target: Target) -> str:
        """What to do instead: never `relaunch up`, which would start a second training."""
        if self.owner:
            other = dataclasses.replace(target, user=self.owner, alias=None)
            return (f"look as {self.owner}: `relaunch {command} RECIPE {other.endpoint}` (or ssh.user: "
                    f"{self.owner}); no `relaunch up` while that run is there: it would start a second training")
        return ("it may be ending (a stop, a save): look again in a moment; stop it before any `relaunch up`, "
                "which would start a second training beside it")


def unseen_run(facts: HostFacts, session: str) -> Unseen | None:
    """Why "training is not running" would be a verdict on what this login cannot see: a run of this
    recipe on the instance outside this user's tmux session (facts.sh: this recipe's run.sh in any
    user's process, another user's tmux server, a folder on the way to checkpoint.dir this user cannot
    look into). None when nothing says so. For an instance whose session is not alive."""
    me = facts.user or "this user"

    def pids(found: list[dict[str, object]]) -> str:
        return ", ".join(str(r["pid"]) for r in found[:3]) + (", ..." if len(found) > 3 else "")

    others = [r for r in facts.runs if r["uid"] != facts.uid]
    if others:
        owner = str(others[0]["user"])
        return Unseen(f"no run of this recipe is visible as {me}, but {owner} runs it on this box (pid "
                      f"{pids(others)}: its run.sh): the box's run is {owner}'s", owner, True)
    if facts.runs:
        return Unseen(f"this recipe's training still runs on this box outside its tmux session {session} "
                      f"(pid {pids(facts.runs)}: its run.sh)", "", True)
    if facts.other_tmux:
        owner = str(facts.other_tmux[0]["user"])
        return Unseen(f"no run of this recipe is visible as {me}, but {owner} has a tmux server on this box "
                      f"(pid {pids(facts.other_tmux)}): the box's run may be {owner}'s", owner, False)
    owner, _, folder = facts.ckpt_hidden.partition(" ")
    if folder and owner != me:
        return Unseen(f"{me} cannot look into {folder} ({owner}'s), on the way to checkpoint.dir: the box's run "
                      f"may be {owner}'s", owner, False)
    return None
