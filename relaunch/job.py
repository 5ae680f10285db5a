"""The shared types of one job: a recipe on one node, the facts read there, the paths it uses.

`Facts` is everything planning needs, read once per host before any step plans (see gather.py);
`Job` is a recipe + a node + its facts, and knows the template context and the instance paths.
Both are plain values: tests build them from JSON fixtures.
"""

from __future__ import annotations

import dataclasses
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from .host.facts import HostFacts
from .host.remote import expand_home
from .host.spec import Target
from .layouts import Entry
from .manifest import StoreManifest
from .recipe import Recipe, render_at, render_context


@dataclass(frozen=True)
class Node:
    """Where one node of the job runs, and its place in the group."""

    target: Target
    rank: int = 0
    nnodes: int = 1
    master_addr: str = ""
    nproc: int = 0                 # processes on this node (0: run.nproc_per_node, else its GPUs)
    world_size: int = 0            # processes in the whole group (0: nproc x nnodes)
    grad_accum: int = 1            # run.batch.global / (micro x world size)

    @property
    def label(self) -> str:
        return self.target.label


@dataclass
class StoreState:
    label: str
    empty: bool                          # no files at all besides staging leftovers
    manifest: StoreManifest | None       # None: no manifest yet


@dataclass
class Facts:
    """What planning reads: the instance, its checkpoint folder, the store, this machine's inputs."""

    host: HostFacts
    listing: list[Entry] | None = None   # checkpoint.dir on the instance; None: not read
    store: StoreState | None = None
    lock: list[str] = field(default_factory=list)          # the recipe's lock file, here
    secrets: dict[str, str] = field(default_factory=dict)  # env.secrets set on this machine
    modes: dict[str, int] = field(default_factory=dict)    # env.files here: local path -> mode
    sizes: dict[str, int] = field(default_factory=dict)    # env.files here: local path -> bytes
    withheld: list[str] = field(default_factory=list)      # env.secrets that are the store's credentials
    damaged: dict[str, str] = field(default_factory=dict)  # instance checkpoint -> why its save did not finish
    # a node group: which nodes hold each path of the merged listing (None: one node holds all)
    holders: dict[str, list[str]] | None = None
    required: dict[str, list[str]] = field(default_factory=dict)  # DCP checkpoint -> files its metadata needs
    reads: list[str] = field(default_factory=list)         # the commands that read the instance
    notices: dict[str, dict[str, Any]] = field(default_factory=dict)  # guard source -> can it fire here, why

    def as_dict(self) -> dict[str, Any]:
        return {
            "host": self.host.as_dict(),
            "listing": None if self.listing is None else [[e.kind, e.size, e.mtime, e.path] for e in self.listing],
            "store": None if self.store is None else {
                "label": self.store.label, "empty": self.store.empty,
                "manifest": None if self.store.manifest is None else self.store.manifest.to_dict()},
            "lock": self.lock, "secrets": self.secrets, "modes": self.modes, "sizes": self.sizes,
            "reads": self.reads,
            "withheld": self.withheld, "damaged": self.damaged, "holders": self.holders,
            "required": self.required, "notices": self.notices,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Facts:
        store = data.get("store")
        listing = data.get("listing")
        return cls(
            host=HostFacts.from_dict(data["host"]),
            listing=None if listing is None else [Entry(path=p, kind=k, size=s, mtime=m) for k, s, m, p in listing],
            store=None if store is None else StoreState(
                store["label"], store["empty"],
                None if store.get("manifest") is None else StoreManifest.from_dict(store["manifest"], "fixture")),
            lock=list(data.get("lock", [])), secrets=dict(data.get("secrets", {})), modes=dict(data.get("modes", {})),
            sizes=dict(data.get("sizes", {})),
            reads=list(data.get("reads", [])), withheld=list(data.get("withheld", [])),
            damaged=dict(data.get("damaged", {})), holders=data.get("holders"),
            required={k: list(v) for k, v in data.get("required", {}).items()},
            notices={k: dict(v) for k, v in data.get("notices", {}).items()},
        )


def state_folder(home: str, recipe_name: str) -> str:
    """~/.relaunch/<name>: relaunch's own files on the instance, for one recipe."""
    return f"{home.rstrip('/')}/.relaunch/{recipe_name}"


def pgid_file(state: str) -> str:
    """The training's process group as run.sh records it (`PGID START BOOT_ID`)."""
    return f"{state}/pgid"


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
        return pgid_file(self.state)

    @property
    def run_info(self) -> str:
        """How the running training was started (world size, grad_accum): evacuate records it."""
        return f"{self.state}/run.json"

    @property
    def run_script(self) -> str:
        return f"{self.state}/run.sh"

    @property
    def python_path(self) -> str:
        """The folder run.sh puts first on the training's PYTHONPATH: relaunch/train.py in it."""
        return f"{self.state}/python"

    @property
    def setup_marker(self) -> str:
        return f"{self.state}/setup.done"

    @property
    def tools(self) -> str:
        """relaunch's own tools venv (uv, rclone, hf), shared by every recipe on the instance."""
        return f"{self.home.rstrip('/')}/.relaunch/tools"

    @property
    def incoming(self) -> str:
        """Where a restored checkpoint lands before it is verified (hidden from trainers)."""
        return f"{self.ckpt_dir}/.relaunch-incoming"

    @property
    def pythons(self) -> str:
        """Where uv installs env.python when the image lacks it: beside the venv, on its disk. uv's
        default (~/.local/share/uv) is on the container disk that a RunPod or Vast stop wipes while
        a venv on /workspace survives: that venv would point at an interpreter that is gone."""
        return posixpath.join(posixpath.dirname(self.venv), ".relaunch-pythons")

    @property
    def pins(self) -> str:
        """What a copy off the instance reads while it runs: hard links of the checkpoint's files
        (templates/pin.py), or a symlink to `pins_beside` holding them."""
        return f"{self.state}/pinned"

    @property
    def pins_beside(self) -> str:
        """Where the pins go when relaunch's folder is on another filesystem than checkpoint.dir:
        next to checkpoint.dir, where neither the trainer's rotation nor relaunch's listing looks."""
        name = self.state.rsplit("/", 1)[-1]
        return posixpath.join(posixpath.dirname(self.ckpt_dir), f".relaunch-pins-{name}")


@dataclass(frozen=True)
class Job:
    """One recipe on one node, with the facts read there: what every plan function takes."""

    recipe: Recipe
    node: Node
    facts: Facts
    checkpoint: str = ""          # instance path of the restored checkpoint ("" = fresh start)
    step: int = 0
    pinned: bool = False          # a copy off this node reads the pins (paths.pins), not checkpoint.dir

    @property
    def host(self) -> str:
        return self.node.label

    @property
    def target(self) -> Target:
        return self.node.target

    def resumed(self, checkpoint: str, step: int) -> Job:
        return dataclasses.replace(self, checkpoint=checkpoint, step=step)

    def context(self) -> dict[str, Any]:
        return render_context(
            self.recipe, host=self.target.address, user=self.target.user, home=self.facts.host.home,
            checkpoint=self.checkpoint, step=self.step, gpus=len(self.facts.host.gpus),
            nnodes=self.node.nnodes, node_rank=self.node.rank,
            master_addr=self.node.master_addr or self.target.address,
            nproc_per_node=self.node.nproc or None, world_size=self.node.world_size or None,
            grad_accum=self.node.grad_accum,
        )

    @property
    def paths(self) -> InstancePaths:
        recipe, home = self.recipe, self.facts.host.home
        context = self.context()

        def path(key: str) -> str:
            return expand_home(render_at(recipe, key, context), home).rstrip("/") or "/"

        return InstancePaths(home=home, venv=path("env.venv"), ckpt_dir=path("checkpoint.dir"),
                             workdir=path("run.workdir"), log=path("run.log"),
                             state=state_folder(home, recipe.name))

    @property
    def copy_from(self) -> str:
        """The folder on the instance a copy of a checkpoint off it reads the files from."""
        return self.paths.pins if self.pinned else self.paths.ckpt_dir

    def expand(self, path: str) -> str:
        return expand_home(path, self.facts.host.home)


def paths_before_facts(recipe: Recipe, node: Node, home: str) -> InstancePaths:
    """The recipe's instance paths rendered for this node when nothing but its home is known yet
    (a log to follow): the same values as a gathered Job's, never the recipe's templates."""
    return Job(recipe, node, Facts(host=HostFacts(home=home))).paths


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
# installers put these in a venv on their own; a lock need not pin them
_IGNORED = {"pip", "setuptools", "wheel", "uv", "distribute"}


def pins(lines: list[str]) -> dict[str, str]:
    """`name==version` (or `name @ url`) lines of a lock or freeze, by normalized name.

    Options (`--index-url ...`), comments and lines that are not requirements are skipped.
    """
    result: dict[str, str] = {}
    for raw in lines:
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith(("#", "-")):
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        name = canonicalize_name(req.name)
        if req.url:
            result[name] = "@ " + req.url
        else:
            exact = [s.version for s in req.specifier if s.operator in ("==", "===")]
            if exact:
                result[name] = exact[0]
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


def normalize(name: str) -> str:
    return canonicalize_name(name)


def read_lock(path: Path | None) -> list[str]:
    """The lock's lines, blank and comment lines left out (a lock that pins nothing, as `adopt` writes
    for a venv with no packages, installs nothing); [] when the recipe names none, or names one not
    written yet (`up` refuses that before it connects; `status`, `evacuate`, `freeze` go on without it)."""
    if path is None or not path.is_file():
        return []
    return [line for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
