"""How close do `up`, `evacuate` and `sync` come to the floor, and how does their cost grow?

The floor is physical: the checkpoint's bytes over the link, or the install, whichever is slower.
Every figure here is a whole command timed as a user runs it, against sandbox instances (Linux,
root) whose link to this machine is shaped to RATE, paired with the bare tool doing the same work
(`rsync -a`, `rclone copy`, `hf upload`, `uv pip sync`, `pip install -r`) in the same run, in
turns, so that both see the same machine:

  table   1 GiB (--size) over 400 Mbit/s (--rate), one row per case, --runs pairs each:
          up-uv / up-pip       `up` until the training command starts, on a fresh instance with
                               an empty disk (env from the example's torch lock + the checkpoint
                               from a local store) / the slower of a bare `rsync` push of the same
                               bytes and a bare install of the same lock on another fresh instance
          evacuate             `evacuate` into an empty local store / bare `rsync` pull
          sync                 one `sync --once` round, the same copy while training runs
          rclone-local         `evacuate` into an rclone remote (S3: `rclone serve s3` on this
                               machine), `via: local` / the slower of the bare pull and a bare
                               `rclone copy` from here
          rclone-instance      the same, `via: instance`, on an instance whose tools are not
                               installed yet (`first`) and again with them (`cached`) / a bare
                               `rclone copy` run on the instance
          hf-local, hf-instance  the same into a Hugging Face repo (the fake Hub of
                               tests/hubserver.py, which speaks the Hub's HTTP API to the real
                               client) / a bare `hf upload` from here or from the instance
  size    evacuate and up (restore only) for 0.25 to 8 GiB (--sizes)
  files   evacuate and up for 1 to 1000 files of the same total (--counts)
  rate    evacuate and up for several link rates (--rates)
  streams evacuate and up of 1 GiB in 16 files with 1 to 8 rsync streams (--stream-counts,
          checkpoint.streams) on a link with a round trip (--latency, delay.py), where one SSH
          stream cannot fill the link; paired with one bare rsync
  plot    draw benchmarks/speed.png from benchmarks/speed.json (written by the others)

  sudo python benchmarks/speed.py table [--size 1G] [--rate 400mbit] [--runs 3] [-v]
  sudo python benchmarks/speed.py size files rate streams plot [--runs 1]

The package index is served inside each instance (on a real box pip reads PyPI, not this
machine's link), so an install does not share the shaped link with the copy; the Hub and the S3
server listen on this machine's side of the link, so `via: instance` crosses it. Instances and
this machine share this machine's CPUs. No asserts: this measures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from relaunch import sandbox as sb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from delay import Delay  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the fake Hub

LOCK = REPO / "examples" / "pytorch" / "requirements.lock"
RESULTS = Path(__file__).resolve().with_name("speed.json")
PLOT = RESULTS.with_suffix(".png")
VERBOSE = False
STEP = 100
GIB = 1 << 30


def size_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": GIB}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def rate_bits(rate: str) -> float:
    """tc's "400mbit" in bits per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * factor
    return float(rate)


def human(n: int) -> str:
    return f"{n / GIB:g} GiB" if n >= GIB else f"{n / (1 << 20):g} MiB"


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def timed(argv: list[str], env: dict[str, str] | None = None, what: str = "") -> float:
    """Seconds `argv` took; its output is shown on failure (or with -v), and a failure stops here."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    assert proc.stdout is not None
    lines = [f"{time.monotonic() - started:6.1f}s  {line.rstrip()}" for line in proc.stdout if line.strip()]
    seconds = time.monotonic() - started
    if VERBOSE or proc.wait() != 0:
        say("\n".join([f"$ {what or shlex.join(argv)}", *lines[-60:]]))
    if proc.wait() != 0:
        raise SystemExit(f"{what or shlex.join(argv)}: exit {proc.returncode}")
    return seconds


@dataclass
class Checkpoint:
    """What training left: one file, or a folder of `files` shards (hf-trainer layout)."""

    size: int
    files: int = 1

    @property
    def name(self) -> str:
        return f"ckpt-{STEP:08d}.pt" if self.files == 1 else f"checkpoint-{STEP}"

    @property
    def layout(self) -> dict[str, str]:
        return {"layout": "files", "pattern": "ckpt-*.pt"} if self.files == 1 else {"layout": "hf-trainer"}


@dataclass
class Lab:
    """Instances, a key, a package index and relaunch's state folder; all gone at the end."""

    rate: str
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="relaunch-speed-", dir="/var/tmp")))
    made: list[str] = field(default_factory=list)
    counter: int = 0
    servers: list[Callable[[], None]] = field(default_factory=list)
    one_way: float = 0.0        # seconds of latency added each way (a relay in front of sshd)
    relays: dict[str, tuple[Delay, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.home = self.root / "state"
        self.home.mkdir(mode=0o700)
        self.key = self.root / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)], check=True)
        self.index = sb.build_index([LOCK])
        self.known = self.root / "known_hosts"
        self.ssh = (f"ssh -i {self.key} -o UserKnownHostsFile={self.known} -o StrictHostKeyChecking=accept-new "
                    "-o BatchMode=yes -o IdentitiesOnly=yes -F /dev/null")
        self.data: dict[tuple[int, int], Path] = {}
        self.stores: dict[tuple[int, int], Path] = {}

    def instance(self, disk: str) -> sb.Instance:
        self.counter += 1
        name = f"spd{os.getpid() % 1000}x{self.counter}"
        self.made.append(name)
        self.known.unlink(missing_ok=True)  # sandbox addresses come back with new host keys
        inst = sb.create(name, user="root", authorized_key=self.key.with_suffix(".pub"), rate=self.rate,
                         index_dir=self.index, disk=disk)
        if self.one_way:
            relay = Delay((inst.address, 22), self.one_way)
            self.relays[name] = (relay, relay.__enter__())
        return inst

    def drop(self, inst: sb.Instance) -> None:
        if inst.name in self.relays:
            self.relays.pop(inst.name)[0].__exit__()
        sb.destroy(inst.name)
        self.made.remove(inst.name)

    def host(self, inst: sb.Instance) -> str:
        """USER@ADDRESS[:PORT] to reach it (through the latency relay when there is one)."""
        return f"root@127.0.0.1:{self.relays[inst.name][1]}" if inst.name in self.relays else f"root@{inst.address}"

    def ssh_for(self, inst: sb.Instance) -> str:
        return self.ssh + (f" -p {self.relays[inst.name][1]}" if inst.name in self.relays else "")

    def remote(self, inst: sb.Instance, path: str) -> str:
        return f"{self.host(inst).rsplit(':', 1)[0] if inst.name in self.relays else self.host(inst)}:{path}"

    def close(self) -> None:
        for stop in self.servers:
            with contextlib.suppress(Exception):
                stop()
        for relay, _ in self.relays.values():
            relay.__exit__()
        for name in list(self.made):
            sb.destroy(name)
        shutil.rmtree(self.root, ignore_errors=True)

    def source(self, ckpt: Checkpoint) -> Path:
        """The checkpoint's bytes, made once on this machine (random, so nothing compresses)."""
        key = (ckpt.size, ckpt.files)
        if key not in self.data:
            folder = self.root / f"data-{ckpt.size}-{ckpt.files}"
            target = folder / ckpt.name
            if ckpt.files == 1:
                folder.mkdir()
                subprocess.run(["sh", "-c", f"head -c {ckpt.size} /dev/urandom > {shlex.quote(str(target))}"],
                               check=True)
            else:
                target.mkdir(parents=True)
                each = ckpt.size // ckpt.files
                for i in range(ckpt.files):
                    with open(target / f"shard-{i:05d}.bin", "wb") as out:
                        left = each
                        while left:
                            chunk = min(left, 1 << 24)
                            out.write(os.urandom(chunk))
                            left -= chunk
                (target / "trainer_state.json").write_text(json.dumps({"global_step": STEP}))
            self.data[key] = folder
        return self.data[key]

    def plant(self, inst: sb.Instance, ckpt: Checkpoint) -> None:
        """Training's checkpoint on the instance (copied inside it: no link involved)."""
        src = shlex.quote(str(self.source(ckpt) / ckpt.name))
        sb.run_in(inst.name, ["sh", "-c", f"mkdir -p /root/ckpt && cp -r {src} /root/ckpt/"], check=True)

    def relaunch(self, command: str, recipe: Path, inst: sb.Instance, *extra: str,
                 env: dict[str, str] | None = None) -> float:
        args = [command, str(recipe), self.host(inst), "--set",
                f"ssh.host_key={inst.host_key_fingerprint}", "--yes", *extra]
        return timed([sys.executable, "-m", "relaunch.cli", *args], {"RELAUNCH_HOME": str(self.home), **(env or {})},
                     what=f"relaunch {command} {recipe.name} {inst.address} {' '.join(extra)}")

    def up(self, recipe: Path, inst: sb.Instance) -> float:
        """Seconds from `relaunch up` until the training command started (it stamps the time)."""
        started = time.time()
        self.relaunch("up", recipe, inst)
        stamp = sb.run_in(inst.name, ["cat", "/root/started"], capture_output=True, text=True, check=True)
        return float(stamp.stdout) - started

    def recipe(self, name: str, ckpt: Checkpoint, remote: str, *, lock: bool = False, installer: str = "uv",
               **checkpoint: object) -> Path:
        env: dict[str, object] = {"python": "3.11", "venv": "~/venvs/bench", "installer": installer,
                                  "index_url": f"http://127.0.0.1:{sb.INDEX_PORT}/simple/"}
        if lock:
            shutil.copy(LOCK, self.root / LOCK.name)
            env["lock"] = LOCK.name
        data = {"name": "bench", "provider": "sandbox", "ssh": {"key": str(self.key), "wait": 30}, "env": env,
                "checkpoint": {"dir": "~/ckpt", **ckpt.layout, "keep": 2, "remote": remote, **checkpoint},
                "run": {"command": "date +%s.%N > ~/started; exec sleep 3600", "workdir": "~", "grace": 1}}
        path = self.root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    def fresh_store(self, label: str) -> Path:
        self.counter += 1
        return self.root / f"store-{label}-{self.counter}"

    # bare tools: what a user types, timed the same way
    def rsync_pull(self, inst: sb.Instance, ckpt: Checkpoint) -> float:
        dest = self.root / f"bare-{self.counter}"
        self.counter += 1
        dest.mkdir()
        try:
            return timed(["rsync", "-a", "-e", self.ssh_for(inst), self.remote(inst, f"ckpt/{ckpt.name}"), f"{dest}/"])
        finally:
            shutil.rmtree(dest)

    def rsync_push(self, inst: sb.Instance, folder: Path, ckpt: Checkpoint) -> float:
        seconds = timed(["rsync", "-a", "-e", self.ssh_for(inst), str(folder / ckpt.name), self.remote(inst, "ckpt/")])
        sb.run_in(inst.name, ["rm", "-rf", "/root/ckpt"], check=True)
        return seconds

    def on(self, inst: sb.Instance, script: str, env: dict[str, str] | None = None) -> float:
        """Seconds a shell script takes on the instance, run over ssh as a user would."""
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in (env or {}).items())
        return timed([*shlex.split(self.ssh_for(inst)), self.remote(inst, "").rstrip(":"), exports + script],
                     what=f"[{inst.name}] {script}")

    def bare_install(self, inst: sb.Instance, installer: str) -> float:
        lock, index = shlex.quote(str(LOCK)), f"http://127.0.0.1:{sb.INDEX_PORT}/simple/"
        if installer == "pip":
            return self.on(inst, f"python3.11 -m venv ~/venvs/bare && ~/venvs/bare/bin/pip install -q "
                                 f"--index-url {index} -r {lock}")
        # uv itself is there already (its own install is not part of the floor)
        self.on(inst, f"python3.11 -m venv ~/uvtool && ~/uvtool/bin/pip install -q --index-url {index} uv")
        return self.on(inst, f"~/uvtool/bin/uv venv -q --python python3.11 ~/venvs/bare && ~/uvtool/bin/uv pip sync "
                             f"-q --python ~/venvs/bare/bin/python --index-url {index} {lock}")


# ---------------------------------------------------------------------------------------------
# cases: each returns rows (label, relaunch seconds, floor seconds, what the floor is). The two
# halves of a pair run in turns (`flip` alternates which goes first from one run to the next).

Row = tuple[str, float, float, str]


def in_turn(flip: bool, ours: Callable[[], float], floor: Callable[[], tuple[float, str]]) -> tuple[float, float, str]:
    if flip:
        bare, what = floor()
        return ours(), bare, what
    mine = ours()
    bare, what = floor()
    return mine, bare, what


def disk_for(ckpt: Checkpoint) -> str:
    return f"{max(6, 3 * ckpt.size // GIB + 4)}G"


@contextlib.contextmanager
def planted(lab: Lab, ckpt: Checkpoint) -> Iterator[sb.Instance]:
    inst = lab.instance(disk_for(ckpt))
    try:
        lab.plant(inst, ckpt)
        yield inst
    finally:
        lab.drop(inst)


def case_evacuate(lab: Lab, ckpt: Checkpoint, flip: bool, **checkpoint: object) -> list[Row]:
    with planted(lab, ckpt) as inst:
        recipe = lab.recipe("evac", ckpt, str(lab.fresh_store("evac")), **checkpoint)
        mine, bare, what = in_turn(flip, lambda: lab.relaunch("evacuate", recipe, inst),
                                   lambda: (lab.rsync_pull(inst, ckpt), "rsync pull"))
    return [("evacuate", mine, bare, what)]


def case_sync(lab: Lab, ckpt: Checkpoint, flip: bool) -> list[Row]:
    with planted(lab, ckpt) as inst:
        recipe = lab.recipe("sync", ckpt, str(lab.fresh_store("sync")))
        mine, bare, what = in_turn(flip, lambda: lab.relaunch("sync", recipe, inst, "--once"),
                                   lambda: (lab.rsync_pull(inst, ckpt), "rsync pull"))
    return [("sync round", mine, bare, what)]


def store_with(lab: Lab, ckpt: Checkpoint) -> Path:
    """A local store holding `ckpt`, written by a real evacuate (sha256 both ends, manifest)."""
    key = (ckpt.size, ckpt.files)
    if key not in lab.stores:
        with planted(lab, ckpt) as inst:
            store = lab.fresh_store("full")
            lab.relaunch("evacuate", lab.recipe("plant", ckpt, str(store)), inst)
        lab.stores[key] = store
    return lab.stores[key]


def on_fresh(lab: Lab, ckpt: Checkpoint, work: Callable[[sb.Instance], float]) -> float:
    inst = lab.instance(disk_for(ckpt))
    try:
        return work(inst)
    finally:
        lab.drop(inst)


def case_up(lab: Lab, ckpt: Checkpoint, flip: bool, installer: str | None = None, **checkpoint: object) -> list[Row]:
    """`up` on a fresh instance until training starts; installer None: no lock (the restore alone)."""
    store = store_with(lab, ckpt)
    recipe = lab.recipe(f"up-{installer}", ckpt, str(store), lock=installer is not None, installer=installer or "uv",
                        **checkpoint)

    def floor() -> tuple[float, str]:
        copy = on_fresh(lab, ckpt, lambda inst: lab.rsync_push(inst, store, ckpt))
        if installer is None:
            return copy, "rsync push"
        install = on_fresh(lab, ckpt, lambda inst: lab.bare_install(inst, installer))
        return max(copy, install), f"max(rsync push {copy:.1f} s, {installer} install {install:.1f} s)"

    mine, bare, what = in_turn(flip, lambda: on_fresh(lab, ckpt, lambda inst: lab.up(recipe, inst)), floor)
    return [(f"up, {installer}" if installer else "up (restore)", mine, bare, what)]


def shape(ckpt: Checkpoint) -> str:
    return "1 file" if ckpt.files == 1 else f"{ckpt.files} files"


def s3_server(lab: Lab, bind: str) -> tuple[dict[str, str], str]:
    """`rclone serve s3` on this machine at `bind` that keeps each object's md5 as S3 does (rclone's
    hasher overlay: computed as the object arrives), so that a listing costs what it costs on S3,
    not a read of every object (the tests' plain server reads them all again for each listing).
    Returns (the environment defining remote `bench`, the remote path `bench:bucket/run`)."""
    from conftest import S3_ACCESS_KEY, S3_SECRET_KEY, tool_path

    lab.counter += 1
    folder = lab.root / f"s3-{lab.counter}"
    (folder / "bucket").mkdir(parents=True)
    log = folder.with_suffix(".log")
    with log.open("wb") as out:
        proc = subprocess.Popen([tool_path("rclone"), "serve", "s3", "--addr", f"{bind}:0", "--dir-cache-time", "100ms",
                                 "--poll-interval", "0", "--auth-key", f"{S3_ACCESS_KEY},{S3_SECRET_KEY}",
                                 "--config", "/dev/null", f":hasher,remote='{folder}',hashes=md5,max_age=off:"],
                                stdout=out, stderr=subprocess.STDOUT)
    lab.servers.append(lambda: (proc.terminate(), proc.wait(10)))
    deadline = time.monotonic() + 30
    while not (found := re.search(r"Starting s3 server on \[(http://[^\]/]+)/?\]", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"rclone serve s3 did not start:\n{log.read_text()}")
        time.sleep(0.05)
    env = {"RCLONE_CONFIG_BENCH_TYPE": "s3", "RCLONE_CONFIG_BENCH_PROVIDER": "Rclone",
           "RCLONE_CONFIG_BENCH_ENDPOINT": found[1], "RCLONE_CONFIG_BENCH_ACCESS_KEY_ID": S3_ACCESS_KEY,
           "RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY": S3_SECRET_KEY}
    return env, "bench:bucket/run"


def case_rclone(lab: Lab, ckpt: Checkpoint, flip: bool, via: str) -> list[Row]:
    from conftest import host_side_address, tool_path

    with planted(lab, ckpt) as inst:
        env, remote = s3_server(lab, host_side_address(inst))
        recipe = lambda sub: lab.recipe(f"rclone-{via}-{sub}", ckpt, f"rclone:{remote}-{sub}", via=via)  # noqa: E731
        if via == "local":
            def floor() -> tuple[float, str]:
                pull = lab.rsync_pull(inst, ckpt)
                push = timed([tool_path("rclone"), "copy", str(lab.source(ckpt)), f"{remote}-bare"], env)
                return max(pull, push), f"max(rsync pull {pull:.1f} s, rclone copy from here {push:.1f} s)"

            mine, bare, what = in_turn(flip, lambda: lab.relaunch("evacuate", recipe("a"), inst, env=env), floor)
            return [(f"rclone, via local, {shape(ckpt)}", mine, bare, what)]
        first = lab.relaunch("evacuate", recipe("a"), inst, env=env)
        # the bare copy uses the rclone relaunch installed: its install is not part of the floor
        bare_copy = lambda: (lab.on(inst, f"~/.relaunch/tools/bin/rclone copy ~/ckpt/ {remote}-bare", env),  # noqa: E731
                             "rclone copy on the instance")
        cached, bare, what = in_turn(flip, lambda: lab.relaunch("evacuate", recipe("b"), inst, env=env), bare_copy)
        return [("rclone, via instance, first use", first, bare, what),
                ("rclone, via instance, tools cached", cached, bare, what)]


def case_hf(lab: Lab, ckpt: Checkpoint, flip: bool, via: str) -> list[Row]:
    """A fresh fake Hub for each upload: the Hub skips bytes it already holds (LFS by sha256)."""
    from conftest import host_side_address, tool_path
    from hubserver import start_hub

    with planted(lab, ckpt) as inst:
        def hub() -> Any:
            lab.counter += 1
            server = start_hub(lab.root / f"hub-{lab.counter}", host=host_side_address(inst))
            lab.servers.append(server.stop)
            server.create_repo("acme/ckpts")
            return server

        def ours() -> float:
            server = hub()
            recipe = lab.recipe(f"hf-{via}", ckpt, "hf:acme/ckpts/run", via=via)
            return lab.relaunch("evacuate", recipe, inst, env=server.env(lab.root / "hf-home"))

        def floor() -> tuple[float, str]:
            server = hub()
            env = server.env()
            if via == "local":
                pull = lab.rsync_pull(inst, ckpt)
                push = timed([tool_path("hf"), "upload", "acme/ckpts", str(lab.source(ckpt)), "bare"], env)
                return max(pull, push), f"max(rsync pull {pull:.1f} s, hf upload from here {push:.1f} s)"
            seconds = lab.on(inst, "~/.relaunch/tools/bin/hf upload acme/ckpts ~/ckpt/ bare", env)
            return seconds, "hf upload on the instance"

        if via == "local":
            mine, bare, what = in_turn(flip, ours, floor)
            return [(f"hf, via local, {shape(ckpt)}", mine, bare, what)]
        first = ours()
        cached, bare, what = in_turn(flip, ours, floor)
        return [("hf, via instance, first use", first, bare, what),
                ("hf, via instance, tools cached", cached, bare, what)]


MANY = 8   # the shards of the "many files" rows: 1 GiB as 8 files of 128 MiB
# name: (case, its arguments, files in the checkpoint, the goal for its ratio(s); None: shown, no goal)
TABLE: dict[str, tuple[Callable[..., list[Row]], dict[str, object], int, float | None]] = {
    "up-pip": (case_up, {"installer": "pip"}, 1, 1.10),
    "up-uv": (case_up, {"installer": "uv"}, 1, 1.10),
    "evacuate": (case_evacuate, {}, 1, 1.10),
    "sync": (case_sync, {}, 1, 1.10),
    "rclone-local": (case_rclone, {"via": "local"}, MANY, 1.25),
    "rclone-local-1": (case_rclone, {"via": "local"}, 1, None),
    "rclone-instance": (case_rclone, {"via": "instance"}, 1, 1.15),
    "hf-local": (case_hf, {"via": "local"}, MANY, None),
    "hf-instance": (case_hf, {"via": "instance"}, 1, None),
}
GOALS = {"rclone, via instance, tools cached": 1.10}


def table(lab: Lab, args: argparse.Namespace) -> list[dict[str, object]]:
    names = args.cases.split(",") if args.cases else list(TABLE)
    pairs: dict[str, list[Row]] = {}
    goals: dict[str, float | None] = {}
    size = size_bytes(args.size)
    for run in range(args.runs):
        for name in names:
            case, kwargs, files, goal = TABLE[name]
            for row in case(lab, Checkpoint(size, files), run % 2 == 1, **kwargs):
                pairs.setdefault(row[0], []).append(row)
                goals[row[0]] = GOALS.get(row[0], goal)
                say(f"run {run + 1}: {row[0]}: relaunch {row[1]:.1f} s, floor {row[2]:.1f} s ({row[3]}), "
                    f"ratio {row[1] / row[2]:.2f}")
    out = []
    print(f"\n{human(size)} checkpoint over a {args.rate} link, {args.runs} pair(s) each, medians; "
          "ratio = relaunch / floor, pair by pair")
    print("| what | relaunch | floor | ratio | goal | the floor |\n|---|---|---|---|---|---|")
    for label, rows in pairs.items():
        mine = statistics.median(r[1] for r in rows)
        bare = statistics.median(r[2] for r in rows)
        ratio = statistics.median(r[1] / r[2] for r in rows)
        goal = goals[label]
        print(f"| {label} | {mine:.1f} s | {bare:.1f} s | {ratio:.2f} | {f'<= {goal:.2f}' if goal else '-'} "
              f"| {rows[-1][3]} |")
        out.append({"what": label, "relaunch": mine, "floor": bare, "ratio": ratio, "goal": goal,
                    "pairs": [[r[1], r[2]] for r in rows], "size": size, "rate": args.rate})
    return out


def curve(lab: Lab, args: argparse.Namespace, kind: str) -> list[dict[str, object]]:
    """evacuate and up (the restore alone) at each point of the curve, each paired with rsync."""
    size = size_bytes(args.size)
    points: list[tuple[str, Checkpoint, str, dict[str, object]]]
    if kind == "size":
        points = [(s, Checkpoint(size_bytes(s)), args.rate, {}) for s in args.sizes.split(",")]
    elif kind == "files":
        points = [(n, Checkpoint(size, int(n)), args.rate, {}) for n in args.counts.split(",")]
    elif kind == "rate":
        points = [(r, Checkpoint(size), r, {}) for r in args.rates.split(",")]
    else:   # streams, on a link with latency: one SSH stream is limited by its window / RTT
        lab.one_way = args.latency / 2000
        points = [(n, Checkpoint(size, 16), args.rate, {"streams": int(n)}) for n in args.stream_counts.split(",")]
    out = []
    for label, ckpt, rate, extra in points:
        lab.rate = rate
        for run in range(args.runs):
            for row in [*case_evacuate(lab, ckpt, run % 2 == 1, **extra),
                        *case_up(lab, ckpt, run % 2 == 0, **extra)]:
                say(f"{kind} {label}: {row[0]}: relaunch {row[1]:.1f} s, floor {row[2]:.1f} s, "
                    f"ratio {row[1] / row[2]:.2f}")
                out.append({"curve": kind, "point": label, "what": row[0], "relaunch": row[1], "floor": row[2],
                            "size": ckpt.size, "files": ckpt.files, "rate": rate,
                            "latency_ms": lab.one_way * 2000})
        lab.stores.clear()
        if kind == "size":      # the next point has other bytes: do not keep 8 GiB around
            shutil.rmtree(lab.source(ckpt), ignore_errors=True)
            lab.data.clear()
    lab.one_way = 0.0
    latency = f", {args.latency:g} ms round trip" if kind == "streams" else ""
    print(f"\n{kind} curve{latency}: medians; ratio = relaunch / bare rsync (one stream), pair by pair; "
          "the link: the bytes at the link's rate")
    print(f"| {kind} | the link | evacuate | ratio | up (restore) | ratio |\n|---|---|---|---|---|---|")
    for label, ckpt, rate, _ in points:
        cells = [f"{ckpt.size * 8 / rate_bits(rate):.1f} s"]
        for what in ("evacuate", "up (restore)"):
            rows = [r for r in out if r["point"] == label and r["what"] == what]
            cells += [f"{statistics.median(float(r['relaunch']) for r in rows):.1f} s",
                      f"{statistics.median(float(r['relaunch']) / float(r['floor']) for r in rows):.2f}"]
        print(f"| {label} | {' | '.join(cells)} |")
    return out


def plot(results: dict[str, list[dict[str, object]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"size": "checkpoint size (one file)", "files": "files of the same 1 GiB", "rate": "link rate",
              "streams": "rsync streams, 1 GiB in 16 files, with latency"}
    kinds = [k for k in titles if results.get(k)]
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.6 * len(kinds), 3.8), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        rows = results[kind]
        labels = list(dict.fromkeys(str(r["point"]) for r in rows))
        for what in ("evacuate", "up (restore)"):
            ys = [statistics.median(float(r["relaunch"]) / float(r["floor"]) for r in rows
                                    if r["point"] == p and r["what"] == what) for p in labels]
            ax.plot(labels, ys, marker="o", label=what)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        if kind != "streams":
            ax.axhline(1.15, color="grey", linewidth=0.8, linestyle="--", label="goal from 1 GiB")
        ax.set_title(titles[kind], fontsize=10)
        ax.set_ylabel("relaunch / bare rsync" + (" (one stream)" if kind == "streams" else ""))
        top = max(float(r["relaunch"]) / float(r["floor"]) for r in rows)
        ax.set_ylim(0 if kind == "streams" else 0.8, max(1.6, top * 1.1))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    say(f"wrote {PLOT}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("what", nargs="+", choices=["table", "size", "files", "rate", "streams", "plot"])
    parser.add_argument("--size", default="1G", help="checkpoint size for table, files, rate and streams")
    parser.add_argument("--rate", default="400mbit", help="tc rate of each instance's link")
    parser.add_argument("--runs", type=int, default=3, help="pairs per case")
    parser.add_argument("--cases", default="", help=f"table: some of {','.join(TABLE)}")
    parser.add_argument("--sizes", default="256M,512M,1G,2G,4G,8G")
    parser.add_argument("--counts", default="1,10,100,1000")
    parser.add_argument("--rates", default="100mbit,400mbit,1gbit")
    parser.add_argument("--stream-counts", default="1,2,4,8")
    parser.add_argument("--latency", type=float, default=100.0, help="streams: round trip in ms")
    parser.add_argument("-v", "--verbose", action="store_true", help="every command's output, timestamped")
    args = parser.parse_args()
    global VERBOSE
    VERBOSE = args.verbose
    results: dict[str, list[dict[str, object]]] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    measured = [w for w in args.what if w != "plot"]
    if measured:
        if os.geteuid() != 0:
            sys.exit("needs root: sandbox instances are network namespaces")
        lab = Lab(args.rate)
        try:
            for what in measured:
                results[what] = table(lab, args) if what == "table" else curve(lab, args, what)
                RESULTS.write_text(json.dumps(results, indent=1) + "\n")
        finally:
            lab.close()
    if "plot" in args.what:
        plot(results)


if __name__ == "__main__":
    main()
