"""Faults searched, not listed: seeded random schedules of `up`, `sync --once`, `evacuate`, `watch`,
lost instances and rollbacks (`up --checkpoint` of an older checkpoint), with faults at random
moments, and the invariants a user relies on checked after every step against the world (the bytes
in the store's own files, the trainer's own record of what it resumed from, of its branches and of
the save a stop asked for, the instance's disk and processes, the sandbox instances that exist),
never against relaunch's bookkeeping: a manifest record may choose what to look at, never prove it
is there.

Real sandbox instances, the real CLI, rsync, tmux; the store is a local folder on a small tmpfs (so
that it can fill up), a real `rclone serve s3` copied to through the instance (so that credentials
travel), or a local Hub server that speaks the real API (copied to from here, or, every other Hub
schedule, by the instance's own `hf` with the token). Every other schedule on a local folder or
rclone trains through relaunch.train.Checkpointer (tests/chaos_ckpt_trainer.py: PyTorch DCP,
torchrun), half of those on the local folder as a 2-node group with `keep: 1`, and kills itself
where it is told to: part way through a prune, between the two renames of a node's save. Every
fourth schedule is a `watch` left alone: a reclaim notice (AWS, GCP), AWS's rebalance
recommendation, a silent loss replaced by `recover.command`, or a 2-node group that shrinks and
grows back.

    RELAUNCH_CHAOS_SCHEDULES=N   how many schedules, from RELAUNCH_CHAOS_FIRST (without either: CI's 4
                                 chosen seeds, a watch, a rollback and kills in a prune among them)
    RELAUNCH_CHAOS_STEPS=N       steps per schedule (CI: 6; the long run: 9)
    RELAUNCH_CHAOS_FIRST=S       the first seed (a long run after an earlier one tries new schedules)
    RELAUNCH_CHAOS_SEED=S        replay one schedule (a failure prints its seed and steps)

The long run, and what the long runs found: docs/guarantees.md, "Faults searched".
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from chaos_branches import Branches, Ident, dcp_identity, identities, merged
from chaos_trainer import content, identity
from conftest import host_side_address
from e2e import EXAMPLE, cli_env, plain_recipe, stacks, wait_for, whole
from relaunch import sandbox as sb
from relaunch.sandbox.console import anchor_pid
from test_faults import in_instance
from test_guard import metadata_service, set_keys
from test_watch import go_silent
from test_watch_unattended import sandbox_env

SCHEDULES = int(os.environ.get("RELAUNCH_CHAOS_SCHEDULES", "4"))
STEPS = int(os.environ.get("RELAUNCH_CHAOS_STEPS", "6"))
FIRST = int(os.environ.get("RELAUNCH_CHAOS_FIRST", "0"))
# CI's budget, one of each kind, chosen by their plans: 32 trains through the Checkpointer on a local
# store and arms a kill in a prune three times, early and before any loss the test makes; 2 rolls back
# (a plain trainer through rclone); 1 is a watch; 3 the Hub
CI = [32, 1, 2, 3]
LONG = {"RELAUNCH_CHAOS_SCHEDULES", "RELAUNCH_CHAOS_FIRST"} & {*os.environ}
SEEDS = ([int(os.environ["RELAUNCH_CHAOS_SEED"])] if os.environ.get("RELAUNCH_CHAOS_SEED")
         else list(range(FIRST, FIRST + SCHEDULES)) if LONG else CI)
DEADLINE = 300            # no command may take longer, whatever the fault
CONTRACT = {0, 3, 4, 5, 6, 130}   # 1 is a bug, 2 is bad input: neither may appear here
TRAINER = Path(__file__).with_name("chaos_trainer.py")
CKPT_TRAINER = Path(__file__).with_name("chaos_ckpt_trainer.py")
MANIFEST = Path(".relaunch") / "manifest.json"
ASIDE = ".relaunch-aside"              # where a rollback sets the later checkpoints aside on the instance
# a seed's kind: any 4 consecutive seeds hold one of each, so the CI's budget holds a watch schedule
KINDS = ["local", "watch", "rclone", "hf"]
SCENARIOS = ["notice-aws", "loss", "notice-gcp", "group", "rebalance"]


def expected(step: int, line: int = 0) -> str:
    return hashlib.sha256(content(step, line)).hexdigest()


def step_of(name: str) -> int:
    return int(name.split("-")[1].split(".")[0])


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def trains_with_checkpointer(seed: int) -> bool:
    """Every other local-folder and rclone schedule trains through relaunch.train.Checkpointer (seed 32's
    does, seed 2's does not: the CI's budget holds one of each)."""
    return KINDS[seed % len(KINDS)] in ("local", "rclone") and (seed // len(KINDS) + (seed % len(KINDS) == 2)) % 2 == 0


def as_group(seed: int) -> bool:
    """Every other Checkpointer schedule on a local folder: a 2-node group, `keep: 1`."""
    return trains_with_checkpointer(seed) and KINDS[seed % len(KINDS)] == "local" and (seed // 8) % 2 == 1


# -- the store, read where its bytes are -----------------------------------------------------------
class FolderStore:
    """A store whose objects are files in a folder on this machine (a local store, the S3 bucket's folder)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.flipped: dict[str, str] = {}      # part -> sha256 of the bytes a flip left there

    def files(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(self.root.glob("ckpt-*.pt")) if p.is_file()}

    def ids(self) -> dict[str, Ident]:
        """name -> identity of every checkpoint the store holds exactly as the trainer wrote it. DCP
        reads some flipped bytes back as the same state (a byte it never looks at): a part that still
        holds the bytes a flip left is not as written, whatever DCP reads (long run, seed 1406)."""
        found = identities(self.root)
        for part, digest in self.flipped.items():
            name = part.split("/")[0]
            try:
                if name in found and hashlib.sha256((self.root / part).read_bytes()).hexdigest() == digest:
                    del found[name]
            except OSError:
                pass
        return found

    def parts(self) -> list[str]:
        """Every file of a checkpoint at its own name (what a fault may hit), relative to the root."""
        return sorted(str(p.relative_to(self.root)) for pattern in ("ckpt-*.pt", "step-*/*")
                      for p in self.root.glob(pattern) if p.is_file())

    def manifest(self) -> dict:
        path = self.root / MANIFEST
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def kept_aside(self, name: str, ident: Ident) -> bool:
        """Is `name`, as written, under `.relaunch/aside/` (where a new save of its name moved it)?"""
        for path in (self.root / ".relaunch" / "aside").rglob(name):
            if (identity(path.read_bytes()) if path.is_file() else dcp_identity(path)) == ident:
                return True
        return False

    def flip(self, name: str, rng: random.Random) -> None:
        path = self.root / name
        data = bytearray(path.read_bytes())
        data[rng.randrange(len(data))] ^= 0xFF
        path.write_bytes(bytes(data))
        self.flipped[name] = hashlib.sha256(data).hexdigest()

    def delete(self, name: str) -> None:
        (self.root / name).unlink()


class HubStore:
    """A store on the local Hub: the head commit's files under the prefix, read from the Hub's own blobs."""

    def __init__(self, server: Any, repo: str, prefix: str) -> None:
        self.server, self.repo, self.prefix = server, repo, prefix

    def _head(self) -> dict[str, list]:
        from hubserver import HubError
        try:
            state = self.server.store.state("model", self.repo)
            return state["refs"] and self.server.store.resolve(state, "main")["files"] or {}
        except HubError:
            return {}

    def _read(self, entry: list) -> bytes | None:
        path = self.server.store.blob_path(entry[1])
        return path.read_bytes() if path.is_file() else None

    def files(self) -> dict[str, bytes]:
        out = {}
        for path, entry in self._head().items():
            folder, _, name = path.rpartition("/")
            if folder == self.prefix and re.fullmatch(r"ckpt-\d+\.pt", name):
                data = self._read(entry)
                if data is not None:
                    out[name] = data
        return out

    def ids(self) -> dict[str, Ident]:
        return {name: ident for name, data in self.files().items() if (ident := identity(data)) is not None}

    def parts(self) -> list[str]:
        return sorted(self.files())

    def manifest(self) -> dict:
        entry = self._head().get(f"{self.prefix}/{MANIFEST}")
        data = self._read(entry) if entry else None
        return json.loads(data) if data else {}

    def kept_aside(self, name: str, ident: Ident) -> bool:
        """A Hub repo keeps what a new save of its name replaced in its history: at some commit."""
        for commit in self.server.commits(self.repo):
            data = self.server.read_files(self.repo, commit["sha"]).get(f"{self.prefix}/{name}")
            if data is not None and identity(data) == ident:
                return True
        return False

    def flip(self, name: str, rng: random.Random) -> None:
        # the Hub's blobs are content-addressed: a byte flipped is another writer committing other bytes there
        data = bytearray(self.files()[name])
        data[rng.randrange(len(data))] ^= 0xFF
        self.server.store.commit("model", self.repo, "main", f"flip {name}", {f"{self.prefix}/{name}": bytes(data)}, [])

    def delete(self, name: str) -> None:
        self.server.store.commit("model", self.repo, "main", f"delete {name}", {}, [f"{self.prefix}/{name}"])


class Trace(list[str]):
    """A schedule's steps, each with the seconds since it began (where a slow or stuck step shows)."""

    def __init__(self) -> None:
        super().__init__()
        self.began = time.monotonic()

    def append(self, step: str) -> None:
        super().append(f"{time.monotonic() - self.began:5.0f}s  {step}")


@dataclass
class Outcome:
    status: int | None          # None: killed by the test (kill -9)
    stderr: str
    stdout: str
    interrupted: bool = False   # the test sent it SIGINT (Ctrl-C) before it ended


@dataclass
class Abandoned:
    """A checkpoint of a branch a rollback left, where it was when relaunch set it aside."""
    name: str
    ident: Ident
    node: str | None            # the instance whose .relaunch-aside/ holds it; None: in the store
    fork: int                   # the line of the branch that left it
    lost: bool = False          # that instance is gone (a provider took it)


@dataclass
class World:
    """One schedule's instances, store and trace, and what the test knows of the run's branches."""
    seed: int
    tmp: Path
    sandbox: Any
    ssh: Any
    recipe: Path
    name: str
    store: FolderStore | HubStore
    home: Path
    inst: sb.Instance
    env: dict[str, str]
    secret: str | None
    index_dir: Path | None
    local_disk: Path | None = None           # the tmpfs a local store lives on (it can fill up)
    script: str = "chaos_trainer.py"         # the trainer (chaos_ckpt_trainer.py: the Checkpointer)
    others: list[sb.Instance] = field(default_factory=list)   # a node group's nodes after node 0
    trace: Trace = field(default_factory=Trace)
    branches: Branches = field(default_factory=Branches)
    abandoned: list[Abandoned] = field(default_factory=list)
    hurt: set[str] = field(default_factory=set)   # store checkpoints this test damaged or deleted a file of
    whole_before: bool = False               # a whole checkpoint of the current branch existed after the last step
    fired: dict[str, int] = field(default_factory=dict)   # the trainer's own kills, by fault
    sigterm_at: int | None = None            # the starts recorded when the test last sent the training SIGTERM

    # -- what the world holds ----------------------------------------------------------------------
    def nodes(self) -> list[sb.Instance]:
        return [self.inst, *self.others]

    def hosts(self) -> list[str]:
        return [n.host for n in self.nodes()]

    def disk(self, inst: sb.Instance | None = None) -> Path | None:
        """The instance's home folder, read from this machine (through its sshd's mount namespace:
        also when its link is down); None once it is gone."""
        inst = inst or self.inst
        try:
            root = Path(f"/proc/{anchor_pid(inst.name)}/root{inst.home}")
        except Exception:
            return None
        return root if root.is_dir() else None

    def read(self, file: str, inst: sb.Instance | None = None) -> str:
        """A file in the instance's home folder, whole lines only ('' when it is not there)."""
        home = self.disk(inst)
        try:
            return whole((home / file).read_text(errors="replace")) if home else ""
        except OSError:
            return ""

    def ids(self) -> dict[str, Ident]:
        """name -> identity of every checkpoint the store's own files hold exactly as the trainer wrote it."""
        return self.store.ids()

    def held(self) -> dict[int, str]:
        """step -> name of every checkpoint the store's own files hold exactly as the trainer wrote it."""
        return {ident[0]: name for name, ident in self.ids().items()}

    def listed(self) -> set[str]:
        """The checkpoints the store's manifest lists as the current branch's (not set aside)."""
        return {c["name"] for c in self.store.manifest().get("checkpoints", []) if not c.get("aside")}

    def newest_held(self) -> int | None:
        """The newest step of the current branch the store holds byte for byte, among those its manifest
        lists (the record chooses what `up` may resume from; only the bytes prove it is there)."""
        listed = self.listed()
        return max((ident[0] for name, ident in self.ids().items() if name in listed and self.branches.on(ident)),
                   default=None)

    def _look(self, sub: str = "ckpt") -> Path | None:
        """The checkpoint folder `sub` of every node, as one folder here (None: node 0 is gone)."""
        homes = [self.disk(n) for n in self.nodes()]
        if homes[0] is None:
            return None
        if len(homes) == 1:
            return homes[0] / sub
        return merged([h / sub for h in homes if h is not None], self.tmp / "look" / sub.replace("/", "_"))

    def on_instance(self) -> dict[str, Ident]:
        """name -> identity of the whole checkpoints in checkpoint.dir on the instance (a group: on its
        nodes together); {} when it is gone."""
        folder = self._look()
        return identities(folder) if folder else {}

    def instance_asides(self) -> dict[tuple[str, str], Ident]:
        """(branch folder, name) -> identity of the whole checkpoints a rollback set aside on the instance."""
        home = self.disk()
        found: dict[tuple[str, str], Ident] = {}
        if home is None:
            return found
        try:
            branches = sorted(p.name for p in (home / "ckpt" / ASIDE).iterdir() if p.is_dir())
        except OSError:
            return found
        for branch in branches:
            folder = self._look(f"ckpt/{ASIDE}/{branch}")
            for name, ident in (identities(folder) if folder else {}).items():
                found[(branch, name)] = ident
        return found

    def lineage_ids(self, inst: sb.Instance | None = None) -> set[str]:
        """The branch ids in the instance's lineage file (relaunch's record of its rollbacks there)."""
        ids = set()
        for row in self.read(f"ckpt/{ASIDE}/lineage.jsonl", inst).splitlines():
            try:
                ids.add(json.loads(row)["id"])
            except (ValueError, KeyError, TypeError):
                continue
        return ids

    def store_branches(self) -> set[str]:
        return {b.get("id", "") for b in self.store.manifest().get("branches", [])}

    def refresh(self) -> None:
        """Learn what the trainer recorded (its lines, the kills it landed on itself), and keep the
        current branch's fork where its next start looks for it."""
        self.branches.learn(self.read("branches.log"), self.read("line"))
        for node in self.nodes():
            for i, row in enumerate(self.read("faults.log", node).splitlines()):
                key = f"{node.name} {i} {row}"      # the same leftover may be where two kills land
                if key not in self.fired:
                    self.fired[key] = 1
                    self.trace.append(f"the trainer on {node.host} killed itself: {row}")
        fork = self.branches.forks[-1] if self.branches.forks else None
        home = self.disk()
        if fork is not None and fork.line == self.branches.current and home is not None:
            # the start that resumes the fork's checkpoint takes the new branch's line (its bytes
            # differ from the abandoned ones'), also on a later start or another instance
            try:
                ask = home / "branch"
                if not ask.exists():
                    ask.write_text(f"{fork.line} {fork.name}\n")
                    os.chown(ask, (home / ".").stat().st_uid, (home / ".").stat().st_gid)
            except OSError:
                pass

    def identify(self, step: int, digest: str) -> Ident | None:
        """The checkpoint of `step` whose bytes hash to `digest`, on a line the trainer took."""
        return next(((step, line) for line in self.branches.lines() | {0} if expected(step, line) == digest), None)

    def lines(self, file: str) -> list[str]:
        """The whole lines of a file the trainer appends to (~/starts.log, ~/stops.log)."""
        return self.read(file).splitlines()

    def starts(self) -> list[str]:
        return self.lines("starts.log")

    def stops(self) -> list[int]:
        """The steps at which the trainer stopped on SIGTERM, each after its save: the trainer's own record."""
        return [int(line.split()[-1]) for line in self.lines("stops.log") if line.startswith("stopped at step ")]

    def trainers(self, inst: sb.Instance | None = None) -> list[int]:
        """The trainer's processes on the instance (every node of a group; read from this machine: also
        when a link is down)."""
        found = []
        for node in [inst] if inst else self.nodes():
            pids = subprocess.run(["ip", "netns", "pids", f"rl-{node.name}"], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                try:
                    if self.script.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                        found.append(int(pid))
                except OSError:
                    continue
        return found

    def trainer_step(self) -> int | None:
        """The newest step the running trainer printed (its log, read through /proc: no link needed)."""
        for pid in self.trainers(self.inst):
            try:
                log = Path(f"/proc/{pid}/cwd/{self.name}.log").read_text(errors="replace")
            except OSError:
                continue
            steps = re.findall(r"^step (\d+) ", whole(log), re.M)
            return int(steps[-1]) if steps else 0
        return None

    def training_moves_on(self, steps: int) -> None:
        """Wait until the running trainer is `steps` further on (or has ended): training moving on meanwhile."""
        start = self.trainer_step()
        if start is None:
            return
        wait_for(f"the training to move on by {steps} steps",
                 lambda: (now := self.trainer_step()) is None or now >= start + steps, timeout=120, every=0.2)

    def keep(self, args: list[str], fault: str, got: Outcome) -> Outcome:
        """Every command's output, kept beside the test for reading a failure."""
        n = len(list(self.tmp.glob("step-*.txt")))
        (self.tmp / f"step-{n:02d}.txt").write_text(f"relaunch {' '.join(args)}  [{fault}] -> {got.status}\n"
                                                     f"{got.stderr}\n--- stdout\n{got.stdout}")
        return got

    def fail(self, why: str) -> None:
        steps = "\n  ".join(self.trace)
        pytest.fail(f"chaos schedule {self.seed}: {why}\n  {steps}\nevery command's output: {self.tmp}/step-*.txt\n"
                    f"replay: RELAUNCH_CHAOS_SEED={self.seed} python -m pytest tests/test_chaos.py", pytrace=False)


# -- faults --------------------------------------------------------------------------------------------
def flip_byte(world: World, rng: random.Random) -> str:
    names = world.store.parts()
    if not names:
        return "flip: nothing in the store"
    name = rng.choice(names)
    world.store.flip(name, rng)
    world.hurt.add(name.split("/")[0])
    return f"flip a byte of {name} in the store"


def delete_file(world: World, rng: random.Random) -> str:
    names = world.store.parts()
    if not names:
        return "delete: nothing in the store"
    name = rng.choice(names)
    world.store.delete(name)
    world.hurt.add(name.split("/")[0])
    return f"delete {name} from the store"


def sigterm_training(world: World, rng: random.Random) -> str:
    world.sigterm_at = len(world.starts())
    hit = 0
    for pid in world.trainers():
        try:
            os.kill(pid, signal.SIGTERM)
            hit += 1
        except ProcessLookupError:
            continue
    return f"SIGTERM to the training ({hit} process(es))"


def arm(world: World, rng: random.Random, fault: str) -> str:
    """The Checkpointer kills itself at its next prune (or between the two renames of a node's save):
    armed by a file on one node, landed by the training's own process (chaos_ckpt_trainer.py)."""
    node = rng.choice(world.nodes())
    world.ssh(node, f"touch ~/{fault}", timeout=30)
    return f"{fault} armed on {node.host}"


def run(world: World, rng: random.Random, args: list[str], fault: str) -> Outcome:
    """One command, with `fault` injected at a random moment while it runs."""
    err, out = world.tmp / "cmd.err", world.tmp / "cmd.out"
    filler = world.local_disk / "filler" if world.local_disk else None
    if fault == "store-full" and filler is not None:
        # the store's disk fills up while the command runs (only the local store is on a tmpfs)
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M", "count=200"], capture_output=True)
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "relaunch.cli", *args], stdout=stdout, stderr=stderr,
                                env=cli_env(world.home, world.env))
    at = rng.uniform(0.2, 4.0)
    killed = interrupted = False
    timers = []
    try:
        if fault in ("kill-9", "ctrl-c"):
            try:
                proc.wait(timeout=at)
            except subprocess.TimeoutExpired:
                if fault == "kill-9":
                    proc.kill()
                    killed = True
                else:
                    proc.send_signal(signal.SIGINT)
                    interrupted = True
        elif fault.startswith("silent"):
            back = rng.uniform(2, 8)
            timers = [threading.Timer(at, sb.set_link, (world.inst.name, False)),
                      threading.Timer(at + back, sb.set_link, (world.inst.name, True))]
            for t in timers:
                t.start()
        try:
            status = proc.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            where = stacks(proc, err, 10)[-6000:] or "(no stacks printed after SIGUSR1)"
            proc.kill()
            world.fail(f"`relaunch {' '.join(args[:1])}` still running after {DEADLINE}s ({fault}); where its "
                       f"threads were:\n{where}")
    finally:
        for t in timers:
            t.join()
        if fault.startswith("silent"):
            sb.set_link(world.inst.name, True)
        if filler is not None:
            filler.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    got = Outcome(None if killed else status, err.read_text(errors="replace"),
                  out.read_text(errors="replace") if out.exists() else "", interrupted)
    world.keep(args, fault, got)
    return got


# -- invariants ---------------------------------------------------------------------------------------
def check_exit(world: World, what: str, got: Outcome) -> None:
    if got.status is None:
        return
    if got.interrupted and (got.status == -signal.SIGINT or "Fatal Python error: init_import_site" in got.stderr):
        return      # Ctrl-C before relaunch's code ran (Python still starting up): nothing of relaunch's ran
    if got.status not in CONTRACT:
        world.fail(f"{what} exited {got.status}, not a code from the contract's table:\n{got.stderr[-3000:]}")
    if "Traceback" in got.stderr:
        world.fail(f"{what} printed a traceback:\n{got.stderr[-3000:]}")
    if got.status == 130 and not got.interrupted:
        world.fail(f"{what} exited 130 without a Ctrl-C:\n{got.stderr[-3000:]}")


def newest_of(world: World, found: dict[str, Ident]) -> int | None:
    """The newest step of the current branch among `found`."""
    return max((ident[0] for ident in found.values() if world.branches.on(ident)), default=None)


def check_safe(world: World, what: str, got: Outcome, before: dict[str, Ident]) -> None:
    """An exit 0 evacuate / sync --once: the store's files hold, byte for byte, the newest complete
    checkpoint of the current branch the instance had when the command started (or a newer one the
    trainer wrote meanwhile), and the newest it names is the current branch's."""
    if got.status != 0:
        return
    ids = world.ids()
    newest = newest_of(world, before)
    if newest is not None and not [i for i in ids.values() if world.branches.on(i) and i[0] >= newest]:
        world.fail(f"{what} exited 0, but the store's files do not hold step {newest} of the current branch (the "
                   f"instance's newest when it started) or anything newer, as the trainer wrote it: "
                   f"{sorted(ids.items())}\n{got.stderr[-3000:]}")
    try:
        report = json.loads(got.stdout)
    except ValueError:
        world.fail(f"{what} --json exited 0 without one JSON document on stdout:\n{got.stdout[-2000:]}")
        return
    stored = report.get("stored")
    if stored and stored in ids and not world.branches.on(ids[stored]):
        world.fail(f"{what} named {stored} the newest, a checkpoint of an abandoned branch:\n{got.stderr[-3000:]}")
    # "already there" is a claim about the store now: by every byte, or (`unchanged`, in sync rounds)
    # by the size it names
    files = world.store.files()
    verified_now = report.get("verified_now", [])
    for name in report.get("already", []) + verified_now:
        if name in report.get("unchanged", []) and name not in verified_now:
            sizes = {len(content(step_of(name), line)) for line in world.branches.lines() | {0}}
            if name.endswith(".pt") and len(files.get(name, b"")) not in sizes:
                world.fail(f"{what} called {name} unchanged, but the store holds another size")
        elif name not in ids:
            world.fail(f"{what} counted {name} as in the store, but the store's files do not hold it as the trainer "
                       f"wrote it:\n{got.stderr[-3000:]}")


def check_stopped(world: World, got: Outcome, stops_before: int, was_running: bool, fired: int) -> None:
    """An exit 0 `evacuate --stop`: the save the stop asked for (the trainer's own record: the step it
    stopped at) is in the store by its bytes, and training no longer runs on the instance. A training
    that killed itself in its stop where the test armed it (a prune after the stop's save), or that
    the test had sent SIGTERM already (every process of it, torchrun too: a worker whose launcher is
    gone fails in its stop's collectives), recorded no stop: then the newest whole checkpoint it left
    on the instance is in the store."""
    if got.status != 0:
        return
    if world.trainers():
        world.fail(f"evacuate --stop exited 0 and the training still runs on the instance:\n{got.stderr[-3000:]}")
    world.refresh()
    stops = world.stops()[stops_before:]
    stopping = world.sigterm_at is not None and world.sigterm_at == len(world.starts())
    if was_running and not stops and (len(world.fired) > fired or stopping):
        newest = newest_of(world, world.on_instance())
        if newest is not None and not [i for i in world.ids().values() if world.branches.on(i) and i[0] >= newest]:
            world.fail(f"evacuate --stop exited 0 after the training died in its stop, and the store's "
                       f"files do not hold its newest checkpoint left on the instance (step {newest}):\n"
                       f"{got.stderr[-3000:]}")
        return
    if was_running and not stops:
        world.fail(f"evacuate --stop exited 0, and the training it was to stop never recorded its stop and save:\n"
                   f"{got.stderr[-3000:]}")
    if stops and not [i for i in world.ids().values() if i[0] == stops[-1] and world.branches.on(i)]:
        world.fail(f"evacuate --stop exited 0, but the save the stop asked for (step {stops[-1]}, the trainer's own "
                   f"record) is not in the store's files as the trainer wrote it:\n{got.stderr[-3000:]}")


def check_resume(world: World, got: Outcome, starts_before: int, verified: int | None,
                 had: dict[str, Ident], fired: int, wanted: str | None = None) -> None:
    """`up` never resumes from a checkpoint older than the current branch's newest the store holds,
    nor from another branch's, nor from bytes that are not what the trainer wrote (a DCP checkpoint
    missing a node's part among them). A training that dies as it starts is a failure, unless it
    killed itself there as the test asked (a prune's leftover removed at the start)."""
    landed = lambda: len(world.fired) > fired     # noqa: E731
    world.refresh()
    if got.status == 4 and "but not on" in got.stderr and world.fired:
        # a group left half running by a node's trainer that killed itself as asked (its peer may end
        # meanwhile): up refuses to start beside it, and must start nothing (seed 1464)
        if world.starts()[starts_before:]:
            world.fail(f"up refused a group half running and yet a training started:\n{got.stderr[-3000:]}")
        return
    if got.status == 4 and world.script != TRAINER.name and not landed():
        world.fail(f"the training died as it started, and no fault of the test's was landed in it:\n"
                   f"{got.stderr[-3000:]}")
    if got.status != 0 or "already running" in got.stderr:
        return

    def started() -> list[str] | str:
        world.refresh()
        return world.starts()[starts_before:] or ((landed() or not world.trainers()) and "ended")

    lines = wait_for("the trainer to record its start", started, timeout=120)
    if lines == "ended":
        if not landed():
            world.fail(f"`up` exited 0 and the training ended before it recorded its start:\n{got.stderr[-3000:]}")
        return
    line = lines[0].split()
    if line[0] == "fresh":
        if verified is not None or newest_of(world, had) is not None:
            world.fail(f"up started fresh while the store held step {verified} and the instance had "
                       f"{sorted(had)}:\n{got.stderr[-3000:]}")
        return
    _, name, digest, step = line
    ident = world.identify(int(step), digest)
    if ident is None:
        world.fail(f"up resumed from {name} whose bytes are not what the trainer wrote (damaged, partial, a "
                   f"node's part missing)")
    assert ident is not None
    if wanted is not None and name != wanted:
        world.fail(f"up --checkpoint {wanted} resumed from {name}:\n{got.stderr[-3000:]}")
    if not world.branches.on(ident):
        world.fail(f"up resumed from {name} (step {step}), a checkpoint of the branch a rollback abandoned:\n"
                   f"{got.stderr[-3000:]}")
    if wanted is None and verified is not None and int(step) < verified:
        world.fail(f"up resumed from step {step} while the store held step {verified}:\n{got.stderr[-3000:]}")


def check_credentials(world: World, what: str) -> None:
    """No store credentials on the instance's disk or in its command lines once no copy runs there."""
    if world.secret is None:
        return
    wait_for("the instance's copies to end", lambda: not in_instance(world.inst, "rclone"), timeout=120)
    on_disk = world.ssh(world.inst, f"grep -rl -- {world.secret} ~ /tmp 2>/dev/null; true",
                        check=False, timeout=60).stdout.split()
    if on_disk:
        world.fail(f"after {what}, the store's secret is on the instance's disk: {on_disk}")
    if any(world.secret in line for line in in_instance(world.inst, "")):
        world.fail(f"after {what}, the store's secret is on a command line on the instance")


def check_counted_whole(world: World, what: str) -> None:
    """A checkpoint folder under its own name on the instance (`step-N` with DCP's `.metadata`, which
    the Checkpointer, relaunch's layout and `up` count as complete) holds every file its `.metadata`
    names: a prune cut short leaves a `tmp-` folder, never a counted one with files gone. (One node:
    a group's node 0 holds only its own part.)"""
    home = world.disk()
    if world.others or home is None:
        return
    from relaunch.layouts.dcp import required_files
    try:
        folders = [e for e in os.scandir(home / "ckpt") if re.fullmatch(r"step-\d+", e.name) and e.is_dir()]
    except OSError:
        return
    for folder in folders:
        try:
            metadata = (Path(folder.path) / ".metadata").read_bytes()
            have = set(os.listdir(folder.path))
            missing = sorted(required_files(metadata) - have) if metadata else []
        except (OSError, ValueError):        # renamed away meanwhile; no metadata: not counted
            continue
        if missing:
            world.fail(f"after {what}, {folder.name} in checkpoint.dir on the instance has its .metadata and misses "
                       f"{', '.join(missing)}: counted complete (newest, restore, evacuate) with files gone")


def whole_somewhere(world: World) -> list[Ident]:
    """The current branch's whole checkpoints: on the instance (every node's part), or verified in the
    store (listed, and there by its bytes)."""
    listed = world.listed()
    found = list(world.on_instance().values()) + [i for n, i in world.ids().items() if n in listed]
    return [i for i in found if world.branches.on(i)]


def check_branches(world: World, what: str, got: Outcome | None, copied: bool = False) -> None:
    """After every step, in the world: the abandoned branch stays where the user was told, nothing of
    the current branch is set aside, "newest" is the current branch's (on the instance once a command
    that read it ended well; in the store once a copy did), and a whole checkpoint never goes missing
    but by a loss the test made itself."""
    world.refresh()
    on = world.branches.on
    if got is not None and got.status == 0:
        for name, ident in world.on_instance().items():
            if not on(ident):
                world.fail(f"after {what} (exit 0), {name} in checkpoint.dir on the instance is a checkpoint of the "
                           f"branch a rollback abandoned ({ident}), where every layout counts it")
    asides = world.instance_asides()
    for (branch, name), ident in asides.items():
        if on(ident):
            world.fail(f"after {what}, {name}, a save of the current branch, is set aside on the instance ({branch})")
    ids = world.ids()
    for record in world.store.manifest().get("checkpoints", []):
        ident = ids.get(record["name"])
        if record.get("aside") and ident is not None and on(ident):
            world.fail(f"after {what}, the store sets {record['name']}, a save of the current branch, aside")
    listed = world.listed()
    if copied and got is not None and got.status == 0:
        newest = max((ids[n] for n in listed if n in ids), default=None)
        if newest is not None and not on(newest):
            world.fail(f"after {what} (exit 0), the store's newest checkpoint of the current branch is an abandoned "
                       f"branch's: {newest}:\n{got.stderr[-3000:]}")
    for gone in world.abandoned:
        if gone.node is None:
            kept = gone.name in world.hurt or ids.get(gone.name) == gone.ident or \
                world.store.kept_aside(gone.name, gone.ident)
        else:
            # (a rollback's `up` killed part way leaves it in checkpoint.dir: the next command completes it)
            kept = gone.lost or any(n == gone.name and i == gone.ident for (_, n), i in asides.items()) or \
                world.on_instance().get(gone.name) == gone.ident
        if not kept:
            where = "in the store" if gone.node is None else "set aside on the instance"
            world.fail(f"after {what}, {gone.name} of the abandoned branch ({gone.ident}) is no longer {where}, "
                       "where the user was told it is kept")
    check_counted_whole(world, what)
    whole_now = whole_somewhere(world)
    if world.whole_before and not whole_now:
        try:        # a save, a prune, a rename in flight: look again until the folders settle
            whole_now = wait_for("a whole checkpoint of the current branch", lambda: whole_somewhere(world),
                                 timeout=30, every=1)
        except AssertionError:
            world.fail(f"after {what}, no whole checkpoint of the current branch is left, on the instance (every "
                       "node's part) or verified in the store, and the test removed none")
    world.whole_before = bool(whole_now)


# -- one schedule ---------------------------------------------------------------------------------------
COMMANDS = ["up", "up", "sync", "evacuate", "evacuate", "evacuate-stop", "watch", "lose-instance", "rollback"]
DURING = ["none", "none", "none", "kill-9", "ctrl-c", "silent", "store-full"]
BETWEEN = ["none", "none", "none", "flip", "delete", "sigterm-training"]
# the Checkpointer kills itself: part way through a prune; between the two renames of a node's save
# (node 1's at every save, node 0's only for a step saved again: a group's)
LANDED = {"single": ["kill-in-prune"], "group": ["kill-in-prune", "kill-in-resave"]}
GROUP_PORT = 29531


@pytest.mark.parametrize("seed", SEEDS)
def test_random_schedules_keep_every_promise(seed, tmp_path, sandbox, ssh, ssh_key, package_index, s3_remote, hf_hub):
    rng = random.Random(seed)
    kind = KINDS[seed % len(KINDS)]
    scenario = SCENARIOS[(seed // len(KINDS)) % len(SCENARIOS)] if kind == "watch" else None
    if kind == "watch":     # a watch's store: a local folder or the Hub, in turn for each scenario
        kind_store = "hf" if (seed // (len(KINDS) * len(SCENARIOS))) % 2 else "local"
    else:
        kind_store = kind
    checkpointer, grouped = trains_with_checkpointer(seed), as_group(seed)
    home = tmp_path / "state"
    mount = None
    index_dir = None
    files = {"chaos_trainer.py": "~/chaos_trainer.py"}
    if kind_store == "rclone":
        anchor = sandbox()                   # holds the address the S3 server listens on, for the whole schedule
        server = s3_remote(bind=host_side_address(anchor))
        index_dir = package_index
        inst = sandbox(rate="8mbit", index_dir=package_index)
        store: FolderStore | HubStore = FolderStore(server.bucket_dir / "c")
        env, secret = server.env, server.secret_key
        sections = {"env": {"index_url": inst.index_url, "files": files},
                    "checkpoint": {"remote": f"rclone:{server.name}:{server.bucket}/c", "via": "instance"}}
    elif kind_store == "hf" and (seed // len(KINDS)) % 2:     # the instance runs `hf` itself, with the token
        anchor = sandbox()                   # holds the address the Hub listens on, for the whole schedule
        hub = hf_hub(bind=host_side_address(anchor), lfs_threshold=1000)
        hub.store.create_repo("model", "acme/chaos")        # as a user does first: `hf repos create`
        index_dir = package_index
        inst = sandbox(rate="8mbit", index_dir=package_index)
        store, env = HubStore(hub, "acme/chaos", "run"), hub.env(tmp_path / "hfhome")
        secret = hub.token
        sections = {"env": {"index_url": inst.index_url, "files": files},
                    "checkpoint": {"remote": "hf:acme/chaos/run", "via": "instance"}}
    elif kind_store == "hf":
        hub = hf_hub(lfs_threshold=1000)
        hub.store.create_repo("model", "acme/chaos")
        inst = sandbox(rate="8mbit")
        store, env, secret = HubStore(hub, "acme/chaos", "run"), hub.env(tmp_path / "hfhome"), None
        sections = {"env": {"files": files}, "checkpoint": {"remote": "hf:acme/chaos/run", "via": "local"}}
    else:
        mount = tmp_path / "storefs"
        mount.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], check=True)
        index_dir = package_index if checkpointer else None
        inst = sandbox(rate="8mbit", **({"index_dir": package_index} if checkpointer else {}))
        store, env, secret = FolderStore(mount / "store"), {}, None
        sections = {"env": {"files": files}, "checkpoint": {"remote": str(mount / "store")}}
    shutil.copy(TRAINER, tmp_path / "chaos_trainer.py")
    name = f"chaos{seed}"
    command = 'python ~/chaos_trainer.py "{{ checkpoint }}"'
    others = []
    if checkpointer:
        # torch from the example's lock; the trainer under torchrun, on one node or two (a folder each)
        shutil.copy(CKPT_TRAINER, tmp_path / CKPT_TRAINER.name)
        shutil.copy(EXAMPLE / "requirements.lock", tmp_path / "requirements.lock")
        files[CKPT_TRAINER.name] = f"~/{CKPT_TRAINER.name}"
        sections["env"].update(index_url=inst.index_url, lock="requirements.lock",
                               vars={"CHAOS_KEEP": "1" if grouped else "2", "OMP_NUM_THREADS": "1"})
        sections["checkpoint"].update(layout="dcp", keep=1 if grouped else 2)
        sections["run"] = {"nproc_per_node": 1, "ready": "^(resumed|fresh|started rank)", "grace": 180,
                           "stop": {"signal": "TERM", "timeout": 120}}
        command = ("torchrun --nnodes {{ nnodes }} --node-rank {{ node_rank }} --nproc-per-node 1 "
                   f"--master-addr {{{{ master_addr }}}} --master-port {GROUP_PORT} ~/{CKPT_TRAINER.name} "
                   '"{{ checkpoint }}"')
        if grouped:
            others = [sandbox(rate="8mbit", index_dir=package_index)]
    recipe = plain_recipe(tmp_path, name=name, key=ssh_key, command=command, **sections)
    world = World(seed, tmp_path, sandbox, ssh, recipe, name, store, home, inst, env, secret, index_dir,
                  local_disk=mount, script=CKPT_TRAINER.name if checkpointer else TRAINER.name, others=others)
    try:
        if scenario is not None:
            world.trace.append(f"watch schedule: {scenario}, {kind_store} store")
            watch_schedule(world, rng, scenario, ssh_key)
        else:
            trainer = ("relaunch.train.Checkpointer" + (", a 2-node group, keep 1" if grouped else "")
                       if checkpointer else "files")
            world.trace.append(f"{kind_store} store, via {sections['checkpoint'].get('via', 'local')}; {trainer}")
            schedule(world, rng, LANDED["group" if grouped else "single"] if checkpointer else [])
        print(f"chaos schedule {seed}:", *world.trace, sep="\n  ")      # shown with -s, and in the long run's log
    finally:
        if mount is not None:
            subprocess.run(["umount", "-l", str(mount)], check=False)


def args_for(world: World, command: str) -> list[str]:
    hosts = world.hosts()
    return {"up": ["up", str(world.recipe), *hosts],
            "sync": ["sync", str(world.recipe), *hosts, "--once", "--json"],
            "evacuate": ["evacuate", str(world.recipe), *hosts, "--json"],
            "evacuate-stop": ["evacuate", str(world.recipe), *hosts, "--stop", "--json"],
            "watch": ["watch", str(world.recipe), *hosts, "--json"]}[command]


def nothing_saved_yet(world: World, rng: random.Random) -> None:
    """The verdicts when nothing has been saved: on a fresh instance with no training, and beside a
    training that has run for a while and saved nothing yet."""
    command = rng.choice(["sync", "evacuate"])
    got = run(world, rng, args_for(world, command), "none")
    world.trace.append(f"{command} on a fresh instance, no training -> {got.status}")
    check_exit(world, command, got)
    if got.status != 0:      # nothing is lost by destroying it: exit 0, said as such
        world.fail(f"{command} on a fresh instance with no training did not exit 0:\n{got.stderr[-3000:]}")
    if world.held():
        world.fail(f"{command} on a fresh instance put checkpoints in the store: {sorted(world.held())}")


def schedule(world: World, rng: random.Random, landed: list[str]) -> None:
    # what happens, drawn before anything runs: the same seed is the same schedule whatever the timing
    plan = random.Random(rng.random())
    first_sync = plan.random() < 0.3
    hold = plan.random() < 0.3
    steps = [(plan.choice(BETWEEN + landed), plan.choice(COMMANDS), plan.choice(DURING)) for _ in range(STEPS)]
    if first_sync:
        nothing_saved_yet(world, rng)
    if hold:        # the training saves nothing until the test lets it
        world.ssh(world.inst, "touch ~/hold-saves", timeout=30)
    first = run(world, rng, args_for(world, "up"), "none")
    world.trace.append(f"up {' '.join(world.hosts())}{' (saves held)' if hold else ''} -> {first.status}")
    if first.status != 0:
        world.fail(f"the first up failed:\n{first.stderr[-3000:]}")
    world.refresh()
    if hold:
        unsaved(world, rng)
    for between, command, fault in steps:
        if between == "flip":
            world.trace.append(flip_byte(world, rng))
        elif between == "delete":
            world.trace.append(delete_file(world, rng))
        elif between == "sigterm-training":
            world.trace.append(sigterm_training(world, rng))
        elif between.startswith("kill-in-"):
            world.trace.append(arm(world, rng, between))
        if between in ("flip", "delete"):
            world.whole_before = bool(whole_somewhere(world))     # a loss the test made itself
        world.training_moves_on(rng.randint(1, 20))
        if fault == "store-full" and world.local_disk is None:
            fault = "none"
        if command == "lose-instance":
            got: Outcome | None = lose_instance(world, rng)
        elif command == "rollback":
            got = rollback(world, rng, fault)
        else:
            got = step(world, rng, command, fault)
        check_branches(world, command, got, copied=command in ("sync", "evacuate", "evacuate-stop"))


def step(world: World, rng: random.Random, command: str, fault: str) -> Outcome:
    args = args_for(world, command)
    world.refresh()
    before = world.on_instance()
    verified = world.newest_held()
    starts = len(world.starts())
    stops = len(world.stops())
    fired = len(world.fired)
    running = bool(world.trainers())
    got = watch_for_a_while(world, rng, args, fault) if command == "watch" else run(world, rng, args, fault)
    world.trace.append(f"{command} ({fault}) -> {'killed' if got.status is None else got.status}")
    check_exit(world, command, got)
    if command in ("sync", "evacuate", "evacuate-stop"):
        check_safe(world, command, got, before)
    if command == "evacuate-stop":
        check_stopped(world, got, stops, running, fired)
    if command == "up":
        check_resume(world, got, starts, verified, before, fired)
    check_credentials(world, command)
    return got


def unsaved(world: World, rng: random.Random) -> None:
    """Training has run for a while and saved nothing: `evacuate` must not call it safe (destroying
    loses every step); a `sync --once` round has nothing to copy; `evacuate --stop` gets the save the
    stop asks for into the store. Then the training saves as usual."""
    world.training_moves_on(10)
    if world.on_instance():
        world.fail("the trainer saved while its saves were held")
    command = rng.choice(["evacuate", "sync", "evacuate-stop"])
    got = step(world, rng, command, "none")
    if command == "evacuate" and (got.status != 6 or "destroying loses" not in got.stderr):
        world.fail(f"evacuate beside a training that saved nothing yet did not exit 6 saying what is lost:\n"
                   f"{got.stderr[-3000:]}")
    if command != "evacuate" and got.status != 0:
        world.fail(f"{command} beside a training that saved nothing yet did not exit 0:\n{got.stderr[-3000:]}")
    world.ssh(world.inst, "rm -f ~/hold-saves", timeout=30)


def watch_for_a_while(world: World, rng: random.Random, args: list[str], fault: str) -> Outcome:
    """`watch` until its first round, then Ctrl-C: it must end at once, with 0 or 130, and one JSON document."""
    err, out = world.tmp / "watch.err", world.tmp / "watch.out"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "relaunch.cli", *args], stdout=stdout, stderr=stderr,
                                env=cli_env(world.home, world.env))
    try:
        wait_for("the watch's first round", lambda: proc.poll() is not None or "round" in kinds(err), timeout=DEADLINE)
        if fault.startswith("silent"):
            steps = rng.randint(10, 40)
            sb.set_link(world.inst.name, False)
            if world.others:
                # a group's training stalls with node 0's link (torchrun's collectives cross it): the
                # silence lasts until the watch says node 0 does not answer (long run, seed 1336)
                wait_for("the watch to say node 0 does not answer",
                         lambda: proc.poll() is not None or "unreachable" in kinds(err), timeout=DEADLINE)
            else:
                world.training_moves_on(steps)
            sb.set_link(world.inst.name, True)
        if fault == "kill-9":
            proc.kill()
            proc.wait()
            return world.keep(args, fault, Outcome(None, err.read_text(errors="replace"), ""))
        proc.send_signal(signal.SIGINT)
        try:
            status = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            world.fail("watch still running 60s after Ctrl-C\n"
                       + (stacks(proc, err, 10)[-6000:] or "(no stacks printed after SIGUSR1)"))
    finally:
        sb.set_link(world.inst.name, True)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    got = world.keep(args, fault, Outcome(status, err.read_text(errors="replace"), out.read_text(errors="replace"),
                                          interrupted=True))
    one_document(world, got)
    return got


def lose_instance(world: World, rng: random.Random) -> Outcome:
    """The provider reclaims the instance (a group's: one of its nodes) without a word; a new one
    comes up, often at the same address with a new host key, and `up` there must resume from the
    newest verified checkpoint of the current branch."""
    world.refresh()
    verified = world.newest_held()
    listed = bool(world.store.manifest().get("checkpoints"))
    nodes = world.nodes()
    k = rng.randrange(len(nodes))
    old = nodes[k]
    fork = world.branches.forks[-1] if world.branches.forks else None
    if fork is not None and fork.line == world.branches.current:
        known = world.store_branches().union(*(world.lineage_ids(n) for n in nodes if n is not old))
        if fork.ids and not fork.ids & known:
            # a rollback that only this instance knew of (its lineage file; the store never heard of
            # it) goes with it: the branch it left is the current one again
            world.branches.forget(fork)
            world.abandoned = [a for a in world.abandoned if a.fork != fork.line]
            world.trace.append(f"the rollback to {fork.name} was known only to {old.host}: forgotten with it")
    sb.destroy(old.name)
    for gone in world.abandoned:
        gone.lost = gone.lost or gone.node is not None
    # providers reuse addresses: most often the new one gets the old address (and a new host key)
    where = {"address": old.address} if rng.random() < 0.8 else {}
    new = world.sandbox(rate="8mbit", index_dir=world.index_dir, **where) if world.index_dir else \
        world.sandbox(rate="8mbit", **where)
    if k == 0:
        world.inst = new
    else:
        world.others[k - 1] = new
    world.trace.append(f"lose {old.host}; new instance {new.host}")
    world.refresh()
    world.whole_before = bool(whole_somewhere(world))       # a loss the test made itself
    starts, fired, had = len(world.starts()), len(world.fired), world.on_instance()
    got = run(world, rng, args_for(world, "up"), "none")
    if new.address == old.address:
        world.trace.append(f"up {new.host} (same address, new host key) -> {got.status}")
        if got.status != 3 or "HOST KEY CHANGED" not in got.stderr:
            world.fail(f"up on a reused address with a new host key was not refused:\n{got.stderr[-3000:]}")
        got = run(world, rng, ["up", "--accept-new-host-key", *args_for(world, "up")[1:]], "none")
    world.trace.append(f"up {' '.join(world.hosts())} -> {got.status}")
    check_exit(world, "up", got)
    if verified is None and listed and got.status != 0:
        # every checkpoint the store lists was damaged or deleted by this schedule: nothing to resume
        # from, said as such (a fresh start with the losses named would be exit 0, checked below)
        if got.status != 5 or "Error: " not in got.stderr:
            world.fail(f"up with only damaged checkpoints in the store did not say so (exit 5):\n{got.stderr[-3000:]}")
        return got
    if got.status != 0:
        world.fail(f"up on the new instance failed without a fault:\n{got.stderr[-3000:]}")
    check_resume(world, got, starts, verified, had, fired)
    check_credentials(world, "up")
    return got


def stop_training(world: World, rng: random.Random) -> None:
    """The training stopped with its save, as a user does before going back (`up` leaves a running one alone)."""
    if not world.trainers():
        return
    got = step(world, rng, "evacuate-stop", "none")
    check_branches(world, "evacuate-stop", got, copied=True)
    if world.trainers():            # the stop's copy failed (a damaged store, say): the stop itself
        world.trace.append(sigterm_training(world, rng))
        wait_for("the training to end", lambda: not world.trainers(), timeout=DEADLINE)


def rollback(world: World, rng: random.Random, fault: str) -> Outcome | None:
    """Back to an older checkpoint of the current branch (after a loss spike), in the store or on the
    instance, while newer ones exist: `up --checkpoint NAME`, with a fault while it runs. Once relaunch
    acted on it (its lineage file or the store's manifest say so, or training resumed it), the later
    checkpoints are an abandoned branch's: kept where the user was told, never counted again."""
    stop_training(world, rng)
    world.refresh()
    here, ids, listed = world.on_instance(), world.ids(), world.listed()
    known = {n: i for n, i in {**{n: i for n, i in ids.items() if n in listed}, **here}.items()
             if world.branches.on(i)}
    newest = max((i[0] for i in known.values()), default=None)
    older = sorted(n for n, i in known.items() if newest is not None and i[0] < newest)
    if not older:
        world.trace.append(f"rollback: nothing older than the newest to go back to ({sorted(known)})")
        return None
    name = rng.choice(older)
    at = known[name]
    later_here = {n: i for n, i in here.items() if i[0] > at[0]}
    later_stored = {n: i for n, i in ids.items() if n in listed and i[0] > at[0] and world.branches.on(i)}
    line = 1 + max((n for n in world.branches.lines() if n < 1_000_000), default=0)
    world.ssh(world.inst, f"echo {line} {name} > ~/branch", timeout=30)
    lineage, branches = world.lineage_ids(), world.store_branches()
    starts, fired = len(world.starts()), len(world.fired)
    before = world.read("line").strip()
    got = run(world, rng, ["up", str(world.recipe), *world.hosts(), "--checkpoint", name], fault)
    world.trace.append(f"rollback: up --checkpoint {name} (step {at[0]}, the newest {newest}) ({fault}) -> "
                       f"{'killed' if got.status is None else got.status}")
    check_exit(world, "up --checkpoint", got)
    check_resume(world, got, starts, None, here, fired, wanted=name)
    if got.status == 0:
        untold = [n for n in sorted({**later_here, **later_stored}) if n not in got.stderr]
        if untold:
            world.fail(f"up --checkpoint {name} did not say where the later {', '.join(untold)} went:\n"
                       f"{got.stderr[-3000:]}")
    if world.trainers():
        wait_for("the trainer to record its start",
                 lambda: world.starts()[starts:] or len(world.fired) > fired or not world.trainers(), timeout=120)
    taken = (world.lineage_ids() - lineage) | (world.store_branches() - branches)
    resumed = any(s.split()[:2] == ["resumed", name] for s in world.starts()[starts:])
    if not taken and not resumed:
        world.ssh(world.inst, "rm -f ~/branch", timeout=30)
        world.trace.append(f"rollback to {name} not taken")
        return got
    world.branches.fork(line, name, at, taken, int(before) if before.isdigit() else None)
    world.abandoned += [Abandoned(n, i, world.inst.name, line) for n, i in later_here.items()]
    world.abandoned += [Abandoned(n, i, None, line) for n, i in later_stored.items() if n not in world.hurt]
    world.trace.append(f"a new branch from {name}: abandoned {sorted({**later_here, **later_stored})}")
    return got


# -- a watch left alone ---------------------------------------------------------------------------------
def kinds(err: Path) -> list[str]:
    return [e["event"] for e in events(err)]


def events(err: Path) -> list[dict]:
    """The watch's events so far: JSON lines on its stderr (--json)."""
    return [json.loads(line) for line in whole(err.read_text(errors="replace")).splitlines()
            if line.startswith('{"event"')]


def one_document(world: World, got: Outcome) -> dict:
    """`watch --json`'s stdout: exactly one JSON document, holding every event said on stderr."""
    try:
        doc = json.loads(got.stdout)
    except ValueError:
        world.fail(f"watch --json ended ({got.status}) without one JSON document on stdout:\n{got.stdout[-2000:]}")
    said = [json.loads(line) for line in got.stderr.splitlines() if line.startswith('{"event"')]
    # also a watch that failed before its first event (exit 5: nothing in the store to resume from)
    if doc.get("events") != said:
        world.fail("watch --json's document does not hold the events it said on stderr")
    return doc


def lease_holders(world: World) -> dict:
    """The watch lease in the store (`.relaunch/watch.json`): who holds it, read from the store's own file."""
    if isinstance(world.store, FolderStore):
        path = world.store.root / ".relaunch" / "watch.json"
        text = path.read_text() if path.exists() else ""
    else:
        entry = world.store._head().get(f"{world.store.prefix}/.relaunch/watch.json")
        text = (world.store._read(entry) or b"").decode() if entry else ""
    return json.loads(text) if text.strip() else {}


def check_watch_world(world: World, err: Path, rented: Path, watch: subprocess.Popen | None) -> None:
    """After every step of a watch: nothing rented that its events do not name, no rented instance
    billing unreported, at most one lease holder (and it is this watch while it runs)."""
    said = events(err)
    named = {e["new_host"].split()[0] for e in said if e["event"] == "recover"}
    in_use: set[str] = set()
    ups = [e for e in said if e["event"] == "up"]
    if ups:
        in_use = set(ups[-1].get("nodes") or [ups[-1].get("host")])
    unused = {n for e in said if e["event"] == "unused" for n in e["nodes"]}
    text = err.read_text(errors="replace")
    ended = watch is None or watch.poll() is not None
    for name in rented.read_text().split() if rented.exists() else []:
        try:
            host = sb.get(name).host
        except Exception:
            continue        # its creation failed: nothing rented
        if host not in named and not ended:
            continue        # rented this moment: the watch names it when the command prints it
        if host not in named:
            world.fail(f"recover.command rented {name} ({host}) and the watch never named it")
        if ended and host not in in_use and host not in unused and f"{host}" not in \
                "\n".join(line for line in text.splitlines() if "billing" in line):
            world.fail(f"{name} ({host}), rented by recover.command, bills unreported: not in use, not said unused")
    lease = lease_holders(world)
    if watch is not None and watch.poll() is None:
        if lease and lease.get("pid") not in (watch.pid, None):
            world.fail(f"the store's lease names {lease} while this watch (pid {watch.pid}) runs")
    elif lease:
        world.fail(f"the watch ended and its lease is still in the store: {lease}")


def watch_schedule(world: World, rng: random.Random, scenario: str, ssh_key: Path) -> None:
    """One `watch --json` left alone through one thing that happens at night, checked in the world."""
    sources = {"notice-aws": ["aws"], "notice-gcp": ["gcp"], "rebalance": ["aws", "aws-rebalance"]}.get(scenario, [])
    shutil.copy(EXAMPLE / "rent-sandbox.sh", world.tmp / "rent-sandbox.sh")
    rented = world.tmp / "rented.txt"
    rented.write_text("")
    set_keys(world.recipe, guard={"every": 1, **({"sources": sources} if sources else {})},
             checkpoint={"every": 2}, ssh={"wait": 5})
    nodes = [world.inst]
    if scenario in ("loss", "group"):
        set_keys(world.recipe, recover={"command": "./rent-sandbox.sh", "lost_after": 4, "attempts": 2,
                                        "timeout": 300, "shrink": scenario == "group"})
    if scenario == "group":
        command = yaml.safe_load(world.recipe.read_text())["run"]["command"]
        set_keys(world.recipe, run={"command": f"{{% if node_rank == 0 %}}{command}{{% else %}}sleep 100000"
                                               f"{{% endif %}}"})
        nodes.append(world.sandbox(rate="8mbit"))
    env = {**world.env, **sandbox_env(ssh_key), "RELAUNCH_LEASE_EVERY": "2"}
    err, out = world.tmp / "watch.err", world.tmp / "watch.out"
    with ExitStack() as stack:
        metadata = stack.enter_context(metadata_service(world.inst, sources[0], world.tmp)) if sources else None
        first = run(world, rng, ["up", str(world.recipe), *[n.host for n in nodes]], "none")
        world.trace.append(f"up {' '.join(n.host for n in nodes)} -> {first.status}")
        if first.status != 0:
            world.fail(f"the first up failed:\n{first.stderr[-3000:]}")
        with open(out, "w") as stdout, open(err, "w") as stderr:
            watch = subprocess.Popen([sys.executable, "-m", "relaunch.cli", "watch", str(world.recipe),
                                      *[n.host for n in nodes], "--json"], stdout=stdout, stderr=stderr,
                                     cwd=world.tmp, env=cli_env(world.home, env))
        try:
            def until(what: str, predicate: Any, timeout: float = DEADLINE) -> Any:
                got = wait_for(what, lambda: predicate() or (watch.poll() is not None and "ended"), timeout=timeout)
                check_watch_world(world, err, rented, watch)
                if got == "ended" and not predicate():
                    world.fail(f"the watch ended ({watch.returncode}) before {what}:\n{err.read_text()[-3000:]}")
                return got

            until("the watch's first round", lambda: "round" in kinds(err))
            world.trace.append("watch: first round")
            world.training_moves_on(rng.randint(20, 60))
            if rng.random() < 0.5:
                second = run(world, rng, ["watch", str(world.recipe), *[n.host for n in nodes], "--json"], "none")
                world.trace.append(f"a second watch of the same store -> {second.status}")
                if second.status != 2 or watch.poll() is not None:
                    world.fail(f"a second watch of a held store was not refused (exit 2):\n{second.stderr[-3000:]}")
                check_watch_world(world, err, rented, watch)
            if scenario.startswith("notice"):
                notice(world, rng, scenario, metadata, watch, until)
            elif scenario == "rebalance":
                rebalance(world, metadata, until)
            elif scenario == "loss":
                loss(world, nodes, until)
            else:
                group(world, nodes, until)
            if watch.poll() is None:
                watch.send_signal(signal.SIGINT)
                watch.wait(timeout=60)
        finally:
            if watch.poll() is None:
                watch.send_signal(signal.SIGINT)
                try:
                    watch.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    watch.kill()
                    watch.wait()
            for name in rented.read_text().split():
                world.trace.append(f"rented {name}")
                stack.callback(sb.destroy, name)
        got = world.keep(["watch"], scenario, Outcome(watch.returncode, err.read_text(errors="replace"),
                                                      out.read_text(errors="replace"), interrupted=True))
        world.trace.append(f"watch -> {got.status}")
        check_exit(world, "watch", got)
        one_document(world, got)
        check_watch_world(world, err, rented, None)


def notice(world: World, rng: random.Random, scenario: str, metadata: Any, watch: subprocess.Popen,
           until: Any) -> None:
    """A reclaim notice: the watch ends 0 once the save the notice asked for (the trainer's own record
    of where it stopped) is in the store by its bytes; training no longer runs."""
    stops = len(world.stops())
    metadata.raise_notice(120)
    world.trace.append(f"{scenario}: raised")
    wait_for("the watch to end after the notice", lambda: watch.poll() is not None, timeout=DEADLINE)
    world.trace.append(f"watch ended -> {watch.returncode}")
    if watch.returncode != 0:
        world.fail(f"the watch did not end 0 after a notice:\n{(world.tmp / 'watch.err').read_text()[-3000:]}")
    saved = world.stops()[stops:]
    if not saved:
        world.fail("the watch ended 0 after a notice and the training never recorded the save it asked for")
    if saved[-1] not in world.held():
        world.fail(f"the watch ended 0 after a notice, and the save it asked for (step {saved[-1]}) is not in the "
                   f"store's files as the trainer wrote it: {sorted(world.held())}")
    if world.trainers():
        world.fail("the watch ended 0 after a notice and the training still runs")


def rebalance(world: World, metadata: Any, until: Any) -> None:
    """A rebalance recommendation: a round at once (after the one in flight, which began before it), whose
    checkpoint the store's files hold; training goes on."""
    err = world.tmp / "watch.err"
    newest = max((ident[0] for ident in world.on_instance().values()), default=None)
    metadata.recommend_rebalance()
    world.trace.append("rebalance recommended")

    def round_begun_after() -> dict | None:
        seen = events(err)
        asked = next((e for e in seen if e["event"] == "rebalance"), None)
        return asked and next((e for e in seen if e["event"] == "round" and e["started"] > asked["time"]), None)

    until("a round begun after the recommendation", round_begun_after)
    if newest is not None and not [s for s in world.held() if s >= newest]:
        world.fail(f"a round begun after the recommendation, and the store's files do not hold step {newest} "
                   "or newer")
    if not world.trainers():
        world.fail("the training stopped on a rebalance recommendation")


def loss(world: World, nodes: list[sb.Instance], until: Any) -> None:
    """The instance goes silent: the watch rents one replacement, names it, and training resumes there from
    the newest checkpoint the store holds (the trainer's own record of what it read)."""
    err = world.tmp / "watch.err"
    world.refresh()             # the trainer's line: what the replacement's resume must read
    verified = world.newest_held()
    go_silent(world.inst)
    world.trace.append(f"{world.inst.host} goes silent (newest held: {verified})")
    up = until("training on a replacement", lambda: next((e for e in events(err) if e["event"] == "up"), None))
    host = up.get("host") or up["nodes"][0]
    world.trace.append(f"training resumed on {host}")
    address = host.split("@")[-1].rsplit(":", 1)[0]
    world.inst = next(i for i in sb.list_instances() if i.address == address)
    check_resume(world, Outcome(0, "", ""), 0, verified, {}, len(world.fired))


def group(world: World, nodes: list[sb.Instance], until: Any) -> None:
    """A 2-node group loses node 1: training goes on node 0 alone, the replacement joins, the group is back."""
    err = world.tmp / "watch.err"
    go_silent(nodes[1])
    world.trace.append(f"node 1 {nodes[1].host} goes silent")
    until("training on node 0 alone", lambda: any(e["event"] == "up" and len(e.get("nodes") or []) == 1
                                                  for e in events(err)))
    world.trace.append("the group shrank to node 0")
    grown = until("the group grown back", lambda: next((e for e in events(err) if e["event"] == "up" and
                                                        len(e.get("nodes") or []) == 2), None))
    world.trace.append(f"the group grew back: {grown['nodes']}")
    if grown["nodes"][0] != nodes[0].host or grown["nodes"][1] == nodes[1].host:
        world.fail(f"the group grew back on {grown['nodes']}, not node 0 and a replacement")
