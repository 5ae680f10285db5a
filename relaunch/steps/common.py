"""What every step needs about one host: the recipe, the connection, its facts and its paths."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..host.connection import Remote, expand_home
from ..host.facts import HostFacts
from ..host.spec import Target
from ..recipe import Recipe, render_context
from ..ui import UI


@dataclass
class InstancePaths:
    home: str
    venv: str
    ckpt_dir: str
    workdir: str
    log: str
    state: str            # ~/.relaunch/<name>: relaunch's own files on the instance

    @property
    def secrets_file(self) -> str:
        return f"{self.state}/secrets.env"

    @property
    def lock(self) -> str:
        return f"{self.state}/requirements.lock"

    @property
    def status_file(self) -> str:
        return f"{self.state}/exit_status"

    @property
    def pgid_file(self) -> str:
        return f"{self.state}/pgid"

    @property
    def run_script(self) -> str:
        return f"{self.state}/run.sh"

    @property
    def setup_marker(self) -> str:
        return f"{self.state}/setup.done"

    @property
    def incoming(self) -> str:
        """Where a restored checkpoint lands before it is verified (hidden from trainers)."""
        return f"{self.ckpt_dir}/.relaunch-incoming"


def instance_paths(recipe: Recipe, context: dict[str, Any], home: str) -> InstancePaths:
    def path(key: str) -> str:
        return expand_home(recipe.render(key, context), home).rstrip("/") or "/"

    return InstancePaths(
        home=home,
        venv=path("env.venv"),
        ckpt_dir=path("checkpoint.dir"),
        workdir=path("run.workdir"),
        log=path("run.log"),
        state=f"{home.rstrip('/')}/.relaunch/{recipe.name}",
    )


@dataclass
class Job:
    """One recipe on one connected host."""

    recipe: Recipe
    target: Target
    remote: Remote
    facts: HostFacts
    ui: UI
    secrets: dict[str, str] = field(default_factory=dict)
    checkpoint: str = ""          # instance path of the restored checkpoint ("" = fresh start)
    step: int = 0
    node_rank: int = 0
    nnodes: int = 1
    master_addr: str = ""

    @property
    def host(self) -> str:
        return self.target.label

    def context(self) -> dict[str, Any]:
        return render_context(
            self.recipe, host=self.target.address, user=self.target.user, home=self.facts.home,
            checkpoint=self.checkpoint, step=self.step, gpus=len(self.facts.gpus),
            nnodes=self.nnodes, node_rank=self.node_rank, master_addr=self.master_addr or self.target.address,
        )

    @property
    def paths(self) -> InstancePaths:
        return instance_paths(self.recipe, self.context(), self.facts.home)

    def say(self, step: str, text: str) -> None:
        self.ui.step(self.host, step, text)


@dataclass(kw_only=True)
class Lag:
    """Newest complete checkpoint on the instance vs newest verified in the store."""

    newest: str | None = None
    newest_step: int | None = None
    newest_mtime: float | None = None
    stored: str | None = None
    stored_step: int | None = None
    stored_written_at: float | None = None

    @property
    def lag_steps(self) -> int | None:
        """Steps a loss right now would cost."""
        return None if self.newest_step is None else self.newest_step - (self.stored_step or 0)

    @property
    def lag_seconds(self) -> float | None:
        if self.newest_mtime is None or self.stored_written_at is None:
            return None
        return max(self.newest_mtime - self.stored_written_at, 0.0)

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "lag_steps": self.lag_steps, "lag_seconds": self.lag_seconds}


# -- locks and freezes ------------------------------------------------------------------------
_IGNORED = {"pip", "setuptools", "wheel", "uv", "distribute"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lines: list[str]) -> dict[str, str]:
    """`name==version` lines of a lock or freeze, by normalized name (options and comments skipped)."""
    result: dict[str, str] = {}
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        name, sep, version = line.partition("==")
        if sep:
            name = name.split("[", 1)[0].strip()
            result[normalize(name)] = version.split(";", 1)[0].strip()
        elif " @ " in line:
            name, _, ref = line.partition(" @ ")
            result[normalize(name)] = "@ " + ref.strip()
    return result


def drift(lock: list[str], freeze: list[str]) -> list[str]:
    """How an installed env differs from its lock, one line per package (empty = identical)."""
    want, have = pins(lock), pins(freeze)
    out = []
    for name in sorted(set(want) | set(have)):
        if name in _IGNORED:
            continue
        if name not in have:
            out.append(f"missing {name}=={want[name]}")
        elif name not in want:
            out.append(f"extra {name}=={have[name]}")
        elif want[name] != have[name]:
            out.append(f"{name}: lock {want[name]}, installed {have[name]}")
    return out


def read_lock(path: Path | None) -> list[str]:
    return path.read_text().splitlines() if path else []
