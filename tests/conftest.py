"""Shared fixtures: an SSH key, throwaway sandbox instances, a real ssh client, the local package index.

Everything here is real: instances are network namespaces with a real sshd (relaunch.sandbox),
and `ssh` runs the OpenSSH client with its own known_hosts file per instance.
"""

from __future__ import annotations

import hashlib
import shlex
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from relaunch import sandbox as sandbox_mod
from relaunch.sandbox import Instance

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_LOCK = REPO / "recipes" / "example" / "requirements.lock"


@pytest.fixture(scope="session")
def ssh_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Private key path of a fresh ed25519 pair (the public half is beside it, `<key>.pub`)."""
    key = tmp_path_factory.mktemp("sshkey") / "id_ed25519"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "relaunch-tests", "-f", str(key)], check=True
    )
    return key


class SandboxFactory:
    """`sandbox(user="root", **create_kwargs) -> Instance`; every instance made is destroyed at teardown."""

    def __init__(self, key: Path) -> None:
        self.key = key
        self.names: list[str] = []

    def __call__(self, user: str = "root", **kw: object) -> Instance:
        name = f"t{uuid.uuid4().hex[:8]}"
        kw.setdefault("authorized_key", Path(f"{self.key}.pub"))
        self.names.append(name)
        return sandbox_mod.create(name, user=user, **kw)  # type: ignore[arg-type]

    def destroy_all(self) -> None:
        errors = []
        for name in self.names:
            try:
                sandbox_mod.destroy(name)
            except Exception as e:  # keep destroying the others, report at the end
                errors.append(f"{name}: {e}")
        assert not errors, "sandbox teardown failed: " + "; ".join(errors)


@pytest.fixture
def sandbox(ssh_key: Path) -> Iterator[SandboxFactory]:
    factory = SandboxFactory(ssh_key)
    try:
        yield factory
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
