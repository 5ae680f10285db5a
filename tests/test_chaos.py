"""Faults searched, not listed: seeded random schedules of `up`, `sync --once`, `evacuate`, `watch`
and lost instances, with faults at random moments, and the invariants a user relies on checked
after every step against the world (the bytes in the store, the trainer's own record of what it
resumed from, the instance's disk and processes), never against relaunch's bookkeeping.

Real sandbox instances, the real CLI, rsync, tmux; a local store on a small tmpfs (so that it can
fill up), or a real `rclone serve s3` copied to through the instance (so that credentials travel).

    RELAUNCH_CHAOS_SCHEDULES=N   how many schedules (CI runs a small fixed budget)
    RELAUNCH_CHAOS_STEPS=N       steps per schedule
    RELAUNCH_CHAOS_FIRST=S       the first seed (a long run after an earlier one tries new schedules)
    RELAUNCH_CHAOS_SEED=S        replay one schedule (a failure prints its seed and steps)

The long run, and what the long runs found: docs/guarantees.md, "Faults searched".
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from chaos_trainer import content
from conftest import host_side_address
from e2e import plain_recipe, start_cli, wait_for
from test_faults import in_instance, records

from relaunch import sandbox as sb

SCHEDULES = int(os.environ.get("RELAUNCH_CHAOS_SCHEDULES", "3"))
STEPS = int(os.environ.get("RELAUNCH_CHAOS_STEPS", "9"))
FIRST = int(os.environ.get("RELAUNCH_CHAOS_FIRST", "0"))
SEEDS = ([int(os.environ["RELAUNCH_CHAOS_SEED"])] if os.environ.get("RELAUNCH_CHAOS_SEED")
         else list(range(FIRST, FIRST + SCHEDULES)))
DEADLINE = 300            # no command may take longer, whatever the fault
CONTRACT = {0, 3, 4, 5, 6, 130}   # 1 is a bug, 2 is bad input: neither may appear here
TRAINER = Path(__file__).with_name("chaos_trainer.py")


def expected(step: int) -> str:
    return hashlib.sha256(content(step)).hexdigest()


def step_of(name: str) -> int:
    return int(name.split("-")[1].split(".")[0])


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
    sandbox: object
    ssh: object
    recipe: Path
    store: Path
    home: Path
    inst: sb.Instance
    env: dict[str, str]
    secret: str | None
    index_dir: Path | None
    trace: list[str] = field(default_factory=list)

    # -- what the world holds ----------------------------------------------------------------------
    def held(self, record: dict) -> bool:
        for rel, f in record["files"].items():
            path = self.store / rel
            if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != f["sha256"]:
                return False
        return True

    def newest_verified(self) -> int | None:
        """The highest step the store holds byte for byte as its record says, and as the trainer wrote it."""
        good = [r["step"] for r in records(self.store).values()
                if self.held(r) and all(f["sha256"] == expected(r["step"]) for f in r["files"].values())]
        return max(good, default=None)

    def on_instance(self) -> dict[int, str]:
        """step -> sha256 of the complete checkpoints on the instance now ({} when it cannot be reached)."""
        out = self.ssh(self.inst, "cd ~/ckpt 2>/dev/null && sha256sum ckpt-*.pt 2>/dev/null; true",
                       check=False, timeout=30)
        found = {}
        for line in out.stdout.splitlines():
            digest, name = line.split()
            found[step_of(name)] = digest
        return found

    def starts(self) -> list[str]:
        return self.ssh(self.inst, "cat ~/starts.log 2>/dev/null; true", check=False, timeout=30).stdout.splitlines()

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
    files = [p for p in world.store.glob("ckpt-*.pt")]
    if not files:
        return "flip: nothing in the store"
    path = rng.choice(sorted(files))
    data = bytearray(path.read_bytes())
    data[rng.randrange(len(data))] ^= 0xFF
    path.write_bytes(bytes(data))
    return f"flip a byte of {path.name} in the store"


def delete_file(world: World, rng: random.Random) -> str:
    files = sorted(world.store.glob("ckpt-*.pt"))
    if not files:
        return "delete: nothing in the store"
    path = rng.choice(files)
    path.unlink()
    return f"delete {path.name} from the store"


def sigterm_training(world: World, rng: random.Random) -> str:
    pids = subprocess.run(["ip", "netns", "pids", f"rl-{world.inst.name}"], capture_output=True,
                          text=True).stdout.split()
    hit = 0
    for pid in pids:
        try:
            if b"chaos_trainer.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(int(pid), signal.SIGTERM)
                hit += 1
        except (OSError, ProcessLookupError):
            continue
    return f"SIGTERM to the training ({hit} process(es))"


def run(world: World, rng: random.Random, args: list[str], fault: str) -> Outcome:
    """One command, with `fault` injected at a random moment while it runs."""
    err, out = world.tmp / "cmd.err", world.tmp / "cmd.out"
    filler = world.store.parent / "filler"
    if fault == "store-full":
        # the store's disk fills up while the command runs (only the local store is on a tmpfs)
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M", "count=200"], capture_output=True)
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "relaunch.cli", *args], stdout=stdout, stderr=stderr,
                                env={**os.environ, "RELAUNCH_HOME": str(world.home), "COLUMNS": "200", **world.env})
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
            proc.kill()
            world.fail(f"`relaunch {' '.join(args[:1])}` still running after {DEADLINE}s ({fault})")
    finally:
        for t in timers:
            t.join()
        if fault.startswith("silent"):
            sb.set_link(world.inst.name, True)
        if fault == "store-full":
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
    if got.status == -signal.SIGINT and got.interrupted:
        return      # Ctrl-C before relaunch's handler was in place (Python still importing): a shell sees 130
    if got.status not in CONTRACT:
        world.fail(f"{what} exited {got.status}, not a code from the contract's table:\n{got.stderr[-3000:]}")
    if "Traceback" in got.stderr:
        world.fail(f"{what} printed a traceback:\n{got.stderr[-3000:]}")
    if got.status == 130 and not got.interrupted:
        world.fail(f"{what} exited 130 without a Ctrl-C:\n{got.stderr[-3000:]}")


def check_safe(world: World, what: str, got: Outcome, before: dict[int, str]) -> None:
    """An exit 0 evacuate / sync --once: the store holds, byte for byte, the newest complete checkpoint
    the instance had when the command started (or a newer one the trainer wrote meanwhile)."""
    if got.status != 0 or not before:
        return
    newest = max(before)
    held = [r for r in records(world.store).values() if r["step"] >= newest and world.held(r)]
    if not held:
        world.fail(f"{what} exited 0, but the store does not hold step {newest} (the instance's newest when it "
                   f"started) or anything newer:\n{got.stderr[-3000:]}")
    for r in held:
        for f in r["files"].values():
            if f["sha256"] != expected(r["step"]):
                world.fail(f"{what} exited 0 with {r['name']} recorded as other bytes than the trainer wrote")
    try:
        report = json.loads(got.stdout)
    except ValueError:
        return
    # "already there" is a claim about the store now: by every byte, or (`unchanged`, in sync rounds)
    # by the sizes it names
    unchanged = report.get("unchanged", [])
    for name in report.get("already", []) + report.get("verified_now", []):
        record = records(world.store).get(name)
        if record is None:
            continue
        if name in unchanged and name not in report.get("verified_now", []):
            sizes = {rel: (world.store / rel).stat().st_size if (world.store / rel).is_file() else None
                     for rel in record["files"]}
            if sizes != {rel: f["size"] for rel, f in record["files"].items()}:
                world.fail(f"{what} called {name} unchanged, but the store holds other sizes: {sizes}")
        elif not world.held(record):
            world.fail(f"{what} counted {name} as in the store, but the store does not hold it:\n{got.stderr[-3000:]}")


def check_resume(world: World, got: Outcome, starts_before: int, verified: int | None,
                 had: dict[int, str]) -> None:
    """`up` never resumes from a checkpoint older than the newest verified one, nor from bytes that
    are not what the trainer wrote."""
    if got.status != 0 or "already running" in got.stderr:
        return
    lines = wait_for("the trainer to record its start", lambda: world.starts()[starts_before:], timeout=30)
    line = lines[0].split()
    if line[0] == "fresh":
        if verified is not None or had:
            world.fail(f"up started fresh while step {verified} was verified in the store and the instance had "
                       f"{sorted(had)}:\n{got.stderr[-3000:]}")
        return
    _, name, digest, step = line
    if digest != expected(int(step)):
        world.fail(f"up resumed from {name} whose bytes are not what the trainer wrote (damaged or partial)")
    if verified is not None and int(step) < verified:
        world.fail(f"up resumed from step {step} while step {verified} was verified in the store:\n"
                   f"{got.stderr[-3000:]}")


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
def test_random_schedules_keep_every_promise(seed, tmp_path, sandbox, ssh, ssh_key, package_index, s3_remote):
    rng = random.Random(seed)
    via_instance = seed % 3 == 2
    home = tmp_path / "state"
    if via_instance:
        anchor = sandbox()                   # holds the address the S3 server listens on, for the whole schedule
        server = s3_remote(bind=host_side_address(anchor))
        inst = sandbox(rate="8mbit", index_dir=package_index)
        store, env = server.bucket_dir / "c", server.env
        secret = server.secret_key
        sections = {"env": {"index_url": inst.index_url, "files": {"chaos_trainer.py": "~/chaos_trainer.py"}},
                    "checkpoint": {"remote": f"rclone:{server.name}:{server.bucket}/c", "via": "instance"}}
        mount = None
    else:
        mount = tmp_path / "storefs"
        mount.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], check=True)
        inst = sandbox(rate="8mbit")
        store, env, secret = mount / "store", {}, None
        sections = {"env": {"files": {"chaos_trainer.py": "~/chaos_trainer.py"}},
                    "checkpoint": {"remote": str(store)}}
    shutil.copy(TRAINER, tmp_path / "chaos_trainer.py")
    recipe = plain_recipe(tmp_path, name=f"chaos{seed}", key=ssh_key,
                          command='python ~/chaos_trainer.py "{{ checkpoint }}"', **sections)
    world = World(seed, tmp_path, sandbox, ssh, recipe, store, home, inst, env, secret,
                  package_index if via_instance else None)
    try:
        schedule(world, rng)
        print(f"chaos schedule {seed}:", *world.trace, sep="\n  ")      # shown with -s, and in the long run's log
    finally:
        if mount is not None:
            subprocess.run(["umount", "-l", str(mount)], check=False)


def schedule(world: World, rng: random.Random) -> None:
    first = run(world, rng, ["up", str(world.recipe), world.inst.host], "none")
    world.trace.append(f"up {world.inst.host} -> {first.status}")
    if first.status != 0:
        world.fail(f"the first up failed:\n{first.stderr[-3000:]}")
    for _ in range(STEPS):
        between = rng.choice(BETWEEN)
        if between == "flip":
            world.trace.append(flip_byte(world, rng))
        elif between == "delete":
            world.trace.append(delete_file(world, rng))
        elif between == "sigterm-training":
            world.trace.append(sigterm_training(world, rng))
        time.sleep(rng.uniform(0, 2))                          # let training move on
        command = rng.choice(COMMANDS)
        fault = rng.choice(DURING)
        if fault == "store-full" and world.secret is not None:
            fault = "none"
        if command == "lose-instance":
            lose_instance(world, rng)
            continue
        host = world.inst.host
        args = {"up": ["up", str(world.recipe), host],
                "sync": ["sync", str(world.recipe), host, "--once", "--json"],
                "evacuate": ["evacuate", str(world.recipe), host, "--json"],
                "evacuate-stop": ["evacuate", str(world.recipe), host, "--stop", "--json"],
                "watch": ["watch", str(world.recipe), host]}[command]
        before = world.on_instance()
        verified = world.newest_verified()
        starts = len(world.starts())
        if command == "watch":
            got = watch_for_a_while(world, rng, args, fault)
        else:
            got = run(world, rng, args, fault)
        world.trace.append(f"{command} ({fault}) -> {'killed' if got.status is None else got.status}")
        check_exit(world, command, got)
        if command in ("sync", "evacuate", "evacuate-stop"):
            check_safe(world, command, got, before)
        if command == "up":
            check_resume(world, got, starts, verified, before)
        check_credentials(world, command)


def watch_for_a_while(world: World, rng: random.Random, args: list[str], fault: str) -> Outcome:
    """A few of `watch`'s rounds, then Ctrl-C: it must end at once, with 0 or 130."""
    err = world.tmp / "watch.err"
    proc = start_cli(*args, home=world.home, env=world.env, err=err)
    try:
        time.sleep(rng.uniform(2, 6))
        if fault.startswith("silent"):
            sb.set_link(world.inst.name, False)
            time.sleep(rng.uniform(1, 4))
            sb.set_link(world.inst.name, True)
        if fault == "kill-9":
            proc.kill()
            proc.wait()
            return world.keep(args, fault, Outcome(None, err.read_text(errors="replace"), ""))
        proc.send_signal(signal.SIGINT)
        try:
            status = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            world.fail("watch still running 60s after Ctrl-C")
    finally:
        sb.set_link(world.inst.name, True)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return world.keep(args, fault, Outcome(status, err.read_text(errors="replace"), "", interrupted=True))


def lose_instance(world: World, rng: random.Random) -> None:
    """The provider reclaims the instance without a word; a new one comes up, often at the same
    address with a new host key, and `up` there must resume from the newest verified checkpoint."""
    verified = world.newest_verified()
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
    if verified is None and records(world.store) and got.status != 0:
        # every checkpoint the store lists was damaged or deleted by this schedule: nothing to resume
        # from, said as such (a fresh start with the losses named would be exit 0, checked below)
        if got.status != 5 or "Error: " not in got.stderr:
            world.fail(f"up with only damaged checkpoints in the store did not say so (exit 5):\n{got.stderr[-3000:]}")
        return
    if got.status != 0:
        world.fail(f"up on the new instance failed without a fault:\n{got.stderr[-3000:]}")
    check_resume(world, got, 0, verified, {})
    check_credentials(world, "up")
