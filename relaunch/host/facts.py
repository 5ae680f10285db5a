"""Read-only facts about an instance: one script, one round trip, a pure parser."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..scripts import plain, with_inputs
from ..train import ASIDE_DIR, LINEAGE_FILE

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
                 templates: Path | None = None, run_info: str = "") -> str:
    return with_inputs(plain("facts.sh", templates), py_want=python, venv=venv, ckpt=ckpt, session=session,
                       run_info=run_info, lineage=f"{ckpt.rstrip('/')}/{ASIDE_DIR}/{LINEAGE_FILE}",
                       apt=" ".join(apt), freeze_py=FREEZE_PY)


def parse_facts(text: str) -> HostFacts:
    facts = HostFacts()
    values: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("missing_apt="):
            facts.missing_apt.append(line.partition("=")[2].strip())
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
