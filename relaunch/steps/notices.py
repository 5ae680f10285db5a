"""Which of the guard's notice sources can fire on this instance, and what bounds a loss when none can.

A `sigterm` source is a promise only where a stop's SIGTERM reaches the guard (PID 1 an init that
ends every process at a shutdown; in a container whose PID 1 is a start script, it never arrives),
and a metadata source only where the metadata service answers. Before training starts, `up` asks
the guard script itself (templates/guard.py in its probe mode: one look at every source, on the
instance, with short timeouts) and says plainly which sources protect this run; where none can,
the copy-off interval is what bounds the loss, and it says how much that is. `status` says the same.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any

from ..job import Job
from ..resources import templates_dir
from .guard import SCRIPT, classify, sources

PROBE_DEADLINE = 60.0
_END = "RELAUNCH_GUARD_PY"


def probe_script(job: Job) -> str:
    """For `bash -s`: the guard script in its probe mode, its config in the environment (a url:
    source may hold a token: never on a command line)."""
    config = json.dumps({"sources": sources(job)})
    python = job.facts.host.python or "python3"
    return (f"export RELAUNCH_GUARD_PROBE={shlex.quote(config)}\n"
            f"exec {shlex.quote(python)} - <<'{_END}'\n{(templates_dir() / SCRIPT).read_text()}\n{_END}\n")


def parse_probe(text: str) -> dict[str, dict[str, Any]]:
    """The probe's last line: {source: {"fires": bool | None, "why": str}}."""
    lines = [ln for ln in text.strip().splitlines() if ln.startswith("{")]
    try:
        data = json.loads(lines[-1]) if lines else {}
    except ValueError:
        return {}
    return {str(k): v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


@dataclass(frozen=True)
class Protection:
    """What the probe found: the sources that can fire, those that cannot (with why), those that
    depend on the user (file:), and what bounds a loss."""

    fire: dict[str, str]
    cannot: dict[str, str]
    depends: dict[str, str]
    every: float                   # checkpoint.every: the copy-off interval
    stored: str                    # the store's newest verified checkpoint, in words

    off: str = ""                  # why the guard listens to nothing ("": it listens)

    @property
    def protected(self) -> bool:
        return bool(self.fire)

    def lines(self) -> list[str]:
        out = [self.off] if self.off else []
        out += [f"{name} can fire: {why}" for name, why in self.fire.items()]
        out += [f"{name} cannot reach this run: {why}" for name, why in self.cannot.items()]
        out += [f"{name}: {why}" for name, why in self.depends.items()]
        if self.fire:
            out.append(f"protected by {', '.join(self.fire)}: a notice becomes a save (copied off by `relaunch watch`)")
        else:
            unless = f" unless {', '.join(self.depends)} is written" if self.depends else ""
            out.append(f"no notice can protect this run{unless}: {self.bound()}")
        return out

    def bound(self) -> str:
        return (f"a loss costs what was saved after the store's newest verified checkpoint ({self.stored}); keep "
                "`relaunch watch` running and that is at most one save interval plus a copy (it copies each "
                f"checkpoint as it is saved), with `relaunch sync` alone checkpoint.every = {self.every:g}s of copies "
                "plus one save interval")

    def as_dict(self) -> dict[str, Any]:
        return {"sources": {**{n: {"fires": True, "why": w} for n, w in self.fire.items()},
                            **{n: {"fires": False, "why": w} for n, w in self.cannot.items()},
                            **{n: {"fires": None, "why": w} for n, w in self.depends.items()}},
                "protected_by": list(self.fire), "protected": self.protected, "said": self.lines(),
                "loss_bound": None if self.protected else {"every": self.every, "stored": self.stored,
                                                             "said": self.bound()}}


def protection(job: Job, probed: dict[str, dict[str, Any]]) -> Protection:
    """From the probe's findings: which sources protect this run, and what bounds a loss."""
    guard = job.recipe.guard
    off = ("the guard is off (guard.enabled: false)" if not guard.enabled else
           "guard.sources is empty: the guard listens to nothing" if not guard.sources else "")
    names = sources(job) if not off else []

    def why(name: str) -> str:
        found = probed.get(name)
        return str(found.get("why") or "") if found else "the instance did not say (no python3 to ask with?)"

    fire, depends, cannot = ({n: why(n) for n in group} for group in classify(names, probed))
    store = job.facts.store
    record = store.manifest.newest() if store and store.manifest else None
    stored = f"{record.name}, step {record.step}" if record else "none yet"
    return Protection(fire, cannot, depends, job.recipe.checkpoint.every, stored, off)
