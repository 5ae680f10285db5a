"""Faults searched, not listed: seeded random schedules of `up`, `sync --once`, `evacuate`, `watch`
and lost instances, with faults at random moments, and the invariants a user relies on checked
after every step against the world (the bytes in the store's own files, the trainer's own record of
what it resumed from and of the save a stop asked for, the instance's disk and processes, the
sandbox instances that exist), never against relaunch's bookkeeping: a manifest record may choose
what to look at, never prove it is there.

Real sandbox instances, the real CLI, rsync, tmux; the store is a local folder on a small tmpfs (so
that it can fill up), a real `rclone serve s3` copied to through the instance (so that credentials
travel), or a local Hub server that speaks the real API (copied to from here, or, every other Hub
schedule, by the instance's own `hf` with the token). Every fourth schedule is a `watch` left
alone: a reclaim notice (AWS, GCP), AWS's rebalance recommendation, a silent loss replaced by
`recover.command`, or a 2-node group that shrinks and grows back.

    RELAUNCH_CHAOS_SCHEDULES=N   how many schedules (CI runs a small fixed budget, a watch among them)
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
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from chaos_trainer import content
from conftest import host_side_address
from e2e import EXAMPLE, cli_env, plain_recipe, stacks, wait_for, whole
from relaunch import sandbox as sb
from test_faults import in_instance
from test_guard import metadata_service, set_keys
from test_watch import go_silent
from test_watch_unattended import sandbox_env

SCHEDULES = int(os.environ.get("RELAUNCH_CHAOS_SCHEDULES", "4"))
STEPS = int(os.environ.get("RELAUNCH_CHAOS_STEPS", "6"))
FIRST = int(os.environ.get("RELAUNCH_CHAOS_FIRST", "0"))
SEEDS = ([int(os.environ["RELAUNCH_CHAOS_SEED"])] if os.environ.get("RELAUNCH_CHAOS_SEED")
         else list(range(FIRST, FIRST + SCHEDULES)))
DEADLINE = 300            # no command may take longer, whatever the fault
CONTRACT = {0, 3, 4, 5, 6, 130}   # 1 is a bug, 2 is bad input: neither may appear here
TRAINER = Path(__file__).with_name("chaos_trainer.py")
MANIFEST = Path(".relaunch") / "manifest.json"
# a seed's kind: any 4 consecutive seeds hold one of each, so the CI's budget holds a watch schedule
KINDS = ["local", "watch", "rclone", "hf"]
SCENARIOS = ["notice-aws", "loss", "notice-gcp", "group", "rebalance"]


def expected(step: int) -> str:
    return hashlib.sha256(content(step)).hexdigest()


def step_of(name: str) -> int:
    return int(name.split("-")[1].split(".")[0])


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- the store, read where its bytes are -----------------------------------------------------------
class FolderStore:
    """A store whose objects are files in a folder on this machine (a local store, the S3 bucket's folder)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def files(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(self.root.glob("ckpt-*.pt")) if p.is_file()}

    def manifest(self) -> dict:
        path = self.root / MANIFEST
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def flip(self, name: str, rng: random.Random) -> None:
        path = self.root / name
        data = bytearray(path.read_bytes())
        data[rng.randrange(len(data))] ^= 0xFF
        path.write_bytes(bytes(data))

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

    def manifest(self) -> dict:
        entry = self._head().get(f"{self.prefix}/{MANIFEST}")
        data = self._read(entry) if entry else None
        return json.loads(data) if data else {}

    def flip(self, name: str, rng: random.Random) -> None:
        # the Hub's blobs are content-addressed: a byte flipped is another writer committing other bytes there
        data = bytearray(self.files()[name])
        data[rng.randrange(len(data))] ^= 0xFF
        self.server.store.commit("model", self.repo, "main", f"flip {name}", {f"{self.prefix}/{name}": bytes(data)}, [])

    def delete(self, name: str) -> None:
        self.server.store.commit("model", self.repo, "main", f"delete {name}", {}, [f"{self.prefix}/{name}"])


@dataclass
class Outcome:
    status: int | None          # None: killed by the test (kill -9)
    stderr: str
    stdout: str
    interrupted: bool = False   # the test sent it SIGINT (Ctrl-C) before it ended


@dataclass
class World:
    """One schedule's instance, store and trace."""
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
    trace: list[str] = field(default_factory=list)

    # -- what the world holds ----------------------------------------------------------------------
    def held(self) -> dict[int, str]:
        """step -> name of every checkpoint the store's own files hold exactly as the trainer wrote it."""
        return {step_of(name): name for name, data in self.store.files().items()
                if sha256(data) == expected(step_of(name))}

    def newest_held(self) -> int | None:
        """The newest step the store holds byte for byte, among those its manifest lists (the record
        chooses what `up` may resume from; only the bytes prove it is there)."""
        listed = {c["name"] for c in self.store.manifest().get("checkpoints", [])}
        return max((step for step, name in self.held().items() if name in listed), default=None)

    def on_instance(self) -> dict[int, str]:
        """step -> sha256 of the complete checkpoints on the instance now ({} when it cannot be reached)."""
        out = self.ssh(self.inst, "cd ~/ckpt 2>/dev/null && sha256sum ckpt-*.pt 2>/dev/null; true",
                       check=False, timeout=30)
        found = {}
        for line in out.stdout.splitlines():
            digest, name = line.split()
            found[step_of(name)] = digest
        return found

    def lines(self, file: str) -> list[str]:
        """The whole lines of a file the trainer appends to (~/starts.log, ~/stops.log)."""
        out = self.ssh(self.inst, f"cat ~/{file} 2>/dev/null; true", check=False, timeout=30).stdout
        return whole(out).splitlines()

    def starts(self) -> list[str]:
        return self.lines("starts.log")

    def stops(self) -> list[int]:
        """The steps at which the trainer stopped on SIGTERM, each after its save: the trainer's own record."""
        return [int(line.split()[-1]) for line in self.lines("stops.log") if line.startswith("stopped at step ")]

    def trainers(self, inst: sb.Instance | None = None) -> list[int]:
        """The trainer's processes on the instance (read from this machine: also when its link is down)."""
        pids = subprocess.run(["ip", "netns", "pids", f"rl-{(inst or self.inst).name}"], capture_output=True,
                              text=True).stdout.split()
        found = []
        for pid in pids:
            try:
                if b"chaos_trainer.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                continue
        return found

    def trainer_step(self) -> int | None:
        """The newest step the running trainer printed (its log, read through /proc: no link needed)."""
        for pid in self.trainers():
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
    names = sorted(world.store.files())
    if not names:
        return "flip: nothing in the store"
    name = rng.choice(names)
    world.store.flip(name, rng)
    return f"flip a byte of {name} in the store"


def delete_file(world: World, rng: random.Random) -> str:
    names = sorted(world.store.files())
    if not names:
        return "delete: nothing in the store"
    name = rng.choice(names)
    world.store.delete(name)
    return f"delete {name} from the store"


def sigterm_training(world: World, rng: random.Random) -> str:
    hit = 0
    for pid in world.trainers():
        try:
            os.kill(pid, signal.SIGTERM)
            hit += 1
        except ProcessLookupError:
            continue
    return f"SIGTERM to the training ({hit} process(es))"


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


def check_safe(world: World, what: str, got: Outcome, before: dict[int, str]) -> None:
    """An exit 0 evacuate / sync --once: the store's files hold, byte for byte, the newest complete
    checkpoint the instance had when the command started (or a newer one the trainer wrote meanwhile)."""
    if got.status != 0:
        return
    held = world.held()
    if before and not [step for step in held if step >= max(before)]:
        world.fail(f"{what} exited 0, but the store's files do not hold step {max(before)} (the instance's newest "
                   f"when it started) or anything newer, as the trainer wrote it: {sorted(held)}\n"
                   f"{got.stderr[-3000:]}")
    try:
        report = json.loads(got.stdout)
    except ValueError:
        world.fail(f"{what} --json exited 0 without one JSON document on stdout:\n{got.stdout[-2000:]}")
        return
    # "already there" is a claim about the store now: by every byte, or (`unchanged`, in sync rounds)
    # by the size it names
    files = world.store.files()
    verified_now = report.get("verified_now", [])
    for name in report.get("already", []) + verified_now:
        if name in report.get("unchanged", []) and name not in verified_now:
            if len(files.get(name, b"")) != len(content(step_of(name))):
                world.fail(f"{what} called {name} unchanged, but the store holds another size")
        elif step_of(name) not in held:
            world.fail(f"{what} counted {name} as in the store, but the store's files do not hold it as the trainer "
                       f"wrote it:\n{got.stderr[-3000:]}")


def check_stopped(world: World, got: Outcome, stops_before: int, was_running: bool) -> None:
    """An exit 0 `evacuate --stop`: the save the stop asked for (the trainer's own record: the step it
    stopped at) is in the store by its bytes, and training no longer runs on the instance."""
    if got.status != 0:
        return
    if world.trainers():
        world.fail(f"evacuate --stop exited 0 and the training still runs on the instance:\n{got.stderr[-3000:]}")
    stops = world.stops()[stops_before:]
    if was_running and not stops:
        world.fail(f"evacuate --stop exited 0, and the training it was to stop never recorded its stop and save:\n"
                   f"{got.stderr[-3000:]}")
    if stops and stops[-1] not in world.held():
        world.fail(f"evacuate --stop exited 0, but the save the stop asked for (step {stops[-1]}, the trainer's own "
                   f"record) is not in the store's files as the trainer wrote it:\n{got.stderr[-3000:]}")


def check_resume(world: World, got: Outcome, starts_before: int, verified: int | None,
                 had: dict[int, str]) -> None:
    """`up` never resumes from a checkpoint older than the newest the store holds, nor from bytes that
    are not what the trainer wrote."""
    if got.status != 0 or "already running" in got.stderr:
        return
    lines = wait_for("the trainer to record its start", lambda: world.starts()[starts_before:], timeout=30)
    line = lines[0].split()
    if line[0] == "fresh":
        if verified is not None or had:
            world.fail(f"up started fresh while the store held step {verified} and the instance had "
                       f"{sorted(had)}:\n{got.stderr[-3000:]}")
        return
    _, name, digest, step = line
    if digest != expected(int(step)):
        world.fail(f"up resumed from {name} whose bytes are not what the trainer wrote (damaged or partial)")
    if verified is not None and int(step) < verified:
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


# -- one schedule ---------------------------------------------------------------------------------------
COMMANDS = ["up", "up", "sync", "evacuate", "evacuate", "evacuate-stop", "watch", "lose-instance"]
DURING = ["none", "none", "none", "kill-9", "ctrl-c", "silent", "store-full"]
BETWEEN = ["none", "none", "none", "flip", "delete", "sigterm-training"]


@pytest.mark.parametrize("seed", SEEDS)
def test_random_schedules_keep_every_promise(seed, tmp_path, sandbox, ssh, ssh_key, package_index, s3_remote, hf_hub):
    rng = random.Random(seed)
    kind = KINDS[seed % len(KINDS)]
    scenario = SCENARIOS[(seed // len(KINDS)) % len(SCENARIOS)] if kind == "watch" else None
    if kind == "watch":     # a watch's store: a local folder or the Hub, in turn for each scenario
        kind_store = "hf" if (seed // (len(KINDS) * len(SCENARIOS))) % 2 else "local"
    else:
        kind_store = kind
    home = tmp_path / "state"
    mount = None
    index_dir = None
    if kind_store == "rclone":
        anchor = sandbox()                   # holds the address the S3 server listens on, for the whole schedule
        server = s3_remote(bind=host_side_address(anchor))
        index_dir = package_index
        inst = sandbox(rate="8mbit", index_dir=package_index)
        store: FolderStore | HubStore = FolderStore(server.bucket_dir / "c")
        env, secret = server.env, server.secret_key
        sections = {"env": {"index_url": inst.index_url, "files": {"chaos_trainer.py": "~/chaos_trainer.py"}},
                    "checkpoint": {"remote": f"rclone:{server.name}:{server.bucket}/c", "via": "instance"}}
    elif kind_store == "hf" and (seed // len(KINDS)) % 2:     # the instance runs `hf` itself, with the token
        anchor = sandbox()                   # holds the address the Hub listens on, for the whole schedule
        hub = hf_hub(bind=host_side_address(anchor), lfs_threshold=1000)
        hub.store.create_repo("model", "acme/chaos")        # as a user does first: `hf repos create`
        index_dir = package_index
        inst = sandbox(rate="8mbit", index_dir=package_index)
        store, env = HubStore(hub, "acme/chaos", "run"), hub.env(tmp_path / "hfhome")
        secret = hub.token
        sections = {"env": {"index_url": inst.index_url, "files": {"chaos_trainer.py": "~/chaos_trainer.py"}},
                    "checkpoint": {"remote": "hf:acme/chaos/run", "via": "instance"}}
    elif kind_store == "hf":
        hub = hf_hub(lfs_threshold=1000)
        hub.store.create_repo("model", "acme/chaos")
        inst = sandbox(rate="8mbit")
        store, env, secret = HubStore(hub, "acme/chaos", "run"), hub.env(tmp_path / "hfhome"), None
        sections = {"env": {"files": {"chaos_trainer.py": "~/chaos_trainer.py"}},
                    "checkpoint": {"remote": "hf:acme/chaos/run", "via": "local"}}
    else:
        mount = tmp_path / "storefs"
        mount.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], check=True)
        inst = sandbox(rate="8mbit")
        store, env, secret = FolderStore(mount / "store"), {}, None
        sections = {"env": {"files": {"chaos_trainer.py": "~/chaos_trainer.py"}},
                    "checkpoint": {"remote": str(mount / "store")}}
    shutil.copy(TRAINER, tmp_path / "chaos_trainer.py")
    name = f"chaos{seed}"
    recipe = plain_recipe(tmp_path, name=name, key=ssh_key, command='python ~/chaos_trainer.py "{{ checkpoint }}"',
                          **sections)
    world = World(seed, tmp_path, sandbox, ssh, recipe, name, store, home, inst, env, secret, index_dir,
                  local_disk=mount)
    try:
        if scenario is not None:
            world.trace.append(f"watch schedule: {scenario}, {kind_store} store")
            watch_schedule(world, rng, scenario, ssh_key)
        else:
            world.trace.append(f"{kind_store} store, via {sections['checkpoint'].get('via', 'local')}")
            schedule(world, rng)
        print(f"chaos schedule {seed}:", *world.trace, sep="\n  ")      # shown with -s, and in the long run's log
    finally:
        if mount is not None:
            subprocess.run(["umount", "-l", str(mount)], check=False)


def args_for(world: World, command: str) -> list[str]:
    host = world.inst.host
    return {"up": ["up", str(world.recipe), host],
            "sync": ["sync", str(world.recipe), host, "--once", "--json"],
            "evacuate": ["evacuate", str(world.recipe), host, "--json"],
            "evacuate-stop": ["evacuate", str(world.recipe), host, "--stop", "--json"],
            "watch": ["watch", str(world.recipe), host, "--json"]}[command]


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


def schedule(world: World, rng: random.Random) -> None:
    if rng.random() < 0.3:
        nothing_saved_yet(world, rng)
    hold = rng.random() < 0.3
    if hold:        # the training saves nothing until the test lets it
        world.ssh(world.inst, "touch ~/hold-saves", timeout=30)
    first = run(world, rng, args_for(world, "up"), "none")
    world.trace.append(f"up {world.inst.host}{' (saves held)' if hold else ''} -> {first.status}")
    if first.status != 0:
        world.fail(f"the first up failed:\n{first.stderr[-3000:]}")
    if hold:
        unsaved(world, rng)
    for _ in range(STEPS):
        between = rng.choice(BETWEEN)
        if between == "flip":
            world.trace.append(flip_byte(world, rng))
        elif between == "delete":
            world.trace.append(delete_file(world, rng))
        elif between == "sigterm-training":
            world.trace.append(sigterm_training(world, rng))
        world.training_moves_on(rng.randint(1, 20))
        command = rng.choice(COMMANDS)
        fault = rng.choice(DURING)
        if fault == "store-full" and world.local_disk is None:
            fault = "none"
        if command == "lose-instance":
            lose_instance(world, rng)
            continue
        step(world, rng, command, fault)


def step(world: World, rng: random.Random, command: str, fault: str) -> Outcome:
    args = args_for(world, command)
    before = world.on_instance()
    verified = world.newest_held()
    starts = len(world.starts())
    stops = len(world.stops())
    running = bool(world.trainers())
    got = watch_for_a_while(world, rng, args, fault) if command == "watch" else run(world, rng, args, fault)
    world.trace.append(f"{command} ({fault}) -> {'killed' if got.status is None else got.status}")
    check_exit(world, command, got)
    if command in ("sync", "evacuate", "evacuate-stop"):
        check_safe(world, command, got, before)
    if command == "evacuate-stop":
        check_stopped(world, got, stops, running)
    if command == "up":
        check_resume(world, got, starts, verified, before)
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
            sb.set_link(world.inst.name, False)
            world.training_moves_on(rng.randint(10, 40))
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


def lose_instance(world: World, rng: random.Random) -> None:
    """The provider reclaims the instance without a word; a new one comes up, often at the same
    address with a new host key, and `up` there must resume from the newest verified checkpoint."""
    verified = world.newest_held()
    listed = bool(world.store.manifest().get("checkpoints"))
    old = world.inst
    sb.destroy(old.name)
    # providers reuse addresses: most often the new one gets the old address (and a new host key)
    where = {"address": old.address} if rng.random() < 0.8 else {}
    world.inst = world.sandbox(rate="8mbit", index_dir=world.index_dir, **where) if world.index_dir else \
        world.sandbox(rate="8mbit", **where)
    world.trace.append(f"lose {old.host}; new instance {world.inst.host}")
    got = run(world, rng, ["up", str(world.recipe), world.inst.host], "none")
    if world.inst.address == old.address:
        world.trace.append(f"up {world.inst.host} (same address, new host key) -> {got.status}")
        if got.status != 3 or "HOST KEY CHANGED" not in got.stderr:
            world.fail(f"up on a reused address with a new host key was not refused:\n{got.stderr[-3000:]}")
        got = run(world, rng, ["up", "--accept-new-host-key", str(world.recipe), world.inst.host], "none")
    world.trace.append(f"up {world.inst.host} -> {got.status}")
    check_exit(world, "up", got)
    if verified is None and listed and got.status != 0:
        # every checkpoint the store lists was damaged or deleted by this schedule: nothing to resume
        # from, said as such (a fresh start with the losses named would be exit 0, checked below)
        if got.status != 5 or "Error: " not in got.stderr:
            world.fail(f"up with only damaged checkpoints in the store did not say so (exit 5):\n{got.stderr[-3000:]}")
        return
    if got.status != 0:
        world.fail(f"up on the new instance failed without a fault:\n{got.stderr[-3000:]}")
    check_resume(world, got, 0, verified, {})
    check_credentials(world, "up")


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
    newest = max(world.on_instance(), default=None)
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
    verified = world.newest_held()
    go_silent(world.inst)
    world.trace.append(f"{world.inst.host} goes silent (newest held: {verified})")
    up = until("training on a replacement", lambda: next((e for e in events(err) if e["event"] == "up"), None))
    host = up.get("host") or up["nodes"][0]
    world.trace.append(f"training resumed on {host}")
    address = host.split("@")[-1].rsplit(":", 1)[0]
    world.inst = next(i for i in sb.list_instances() if i.address == address)
    check_resume(world, Outcome(0, "", ""), 0, verified, {})


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
