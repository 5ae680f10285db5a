"""~/.ssh/config aliases, jump hosts and ssh-agent, end to end on sandbox instances.

Every run gets its own ssh config file (RELAUNCH_SSH_CONFIG); this machine's ~/.ssh/config is
never read. Ports other than 22 and addresses that only a jump host can reach are made with
small TCP relays this test starts and stops (on 127.0.0.1, on an instance's host-side address,
or inside the jump instance itself).
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import host_side_address
from e2e import new_user, plain_recipe, run_cli, wait_for
from relaunch.host.spec import Target
from relaunch.host.ssh_argv import ssh_argv

CHECKPOINT = "mkdir -p ~/ckpt && head -c 3000 /dev/urandom > ~/ckpt/ckpt-00000005.pt && sleep 600"


class Relay:
    """A TCP relay on `bind`:port to a target that can be switched (new connections only)."""

    def __init__(self, bind: str, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server((bind, 0))
        self.port = self.server.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed = True
        self.server.close()
        for s in self.sockets:
            s.close()


@pytest.fixture
def relay() -> Iterator:
    made: list[Relay] = []

    def make(bind: str, target: tuple[str, int]) -> Relay:
        made.append(Relay(bind, target))
        return made[-1]

    yield make
    for r in made:
        r.close()


def recipe_without_key(tmp_path: Path, name: str, key: Path | None = None) -> Path:
    # ssh.key left out: the key comes from the ssh config's IdentityFile
    return plain_recipe(tmp_path, name=name, key=key or Path("unused"), command=CHECKPOINT,
                        ssh={"key": str(key) if key else None})


def test_alias_resolves_hostname_user_port_and_key_and_a_new_key_behind_it_is_refused(tmp_path, sandbox, ssh_key,
                                                                                    relay):
    home = tmp_path / "state"
    first, second = sandbox(user="ubuntu"), sandbox(user="ubuntu")
    forward = relay("127.0.0.1", (first.address, 22))
    config = tmp_path / "ssh_config"
    config.write_text(f"Host gpu-box\n  HostName 127.0.0.1\n  Port {forward.port}\n  User ubuntu\n"
                      f"  IdentityFile {ssh_key}\n")
    env = {"RELAUNCH_SSH_CONFIG": str(config)}
    recipe = recipe_without_key(tmp_path, "alias")          # default user root: ubuntu must come from the config

    up = run_cli("up", str(recipe), "gpu-box", home=home, env=env)
    assert up.returncode == 0, up.stderr
    name = f"[127.0.0.1]:{forward.port}"
    assert f"first contact with {name} (gpu-box)" in up.stderr and first.host_key_fingerprint in up.stderr
    assert f"gpu-box (ubuntu@127.0.0.1:{forward.port})" in up.stderr
    recorded = (home / "known_hosts").read_text()
    assert recorded.startswith(f"{name} ssh-ed25519 ") and "gpu-box" not in recorded

    # evacuate copies with rsync: its ssh must reach the same address, port, user and key
    evac = run_cli("evacuate", str(recipe), "gpu-box", home=home, env=env)
    assert evac.returncode == 0, evac.stderr
    assert (tmp_path / "store" / "ckpt-00000005.pt").stat().st_size == 3000 and "safe to destroy" in evac.stderr
    status = run_cli("status", str(recipe), home=home, env=env)           # the remembered HOST is the alias
    assert status.returncode == 0, status.stderr
    assert "using gpu-box, the host of the last" in status.stderr

    forward.target = (second.address, 22)                    # a new machine behind the same alias and port
    for command in (["plan", str(recipe), "gpu-box"], ["up", str(recipe), "gpu-box"]):
        refused = run_cli(*command, home=home, env=env)
        assert refused.returncode == 3, refused.stderr
        assert "HOST KEY CHANGED" in refused.stderr and second.host_key_fingerprint in refused.stderr
        assert "Traceback" not in refused.stderr
    evac = run_cli("evacuate", str(recipe), "gpu-box", home=home, env=env)
    assert evac.returncode == 6 and "HOST KEY CHANGED" in evac.stderr and "DO NOT destroy" in evac.stderr
    assert (home / "known_hosts").read_text() == recorded   # nothing replaced, nothing recorded under the alias


JUMP_RELAY = """
import socket, sys, threading
listen, to = int(sys.argv[1]), (sys.argv[2], int(sys.argv[3]))
server = socket.create_server(("127.0.0.1", listen))
def pump(a, b):
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    for s in (a, b):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
while True:
    c, _ = server.accept()
    u = socket.create_connection(to)
    for x, y in ((c, u), (u, c)):
        threading.Thread(target=pump, args=(x, y), daemon=True).start()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_proxyjump_through_a_second_instance_checks_both_keys(tmp_path, sandbox, ssh, ssh_key, relay):
    home = tmp_path / "state"
    jump, target, impostor = sandbox(), sandbox(user="ubuntu"), sandbox()
    # the target answers at 127.0.0.1:PORT *inside the jump instance* only: a relay there leads to
    # one on this machine's side of the jump's link, which leads to the target's sshd
    outer = relay(host_side_address(jump), (target.address, 22))
    inner = free_port()
    ssh(jump, f"setsid nohup python3 -c '{JUMP_RELAY}' {inner} {host_side_address(jump)} {outer.port} "
              ">/dev/null 2>&1 < /dev/null &")
    wait_for("the relay on the jump host", lambda: ssh(jump, f"python3 -c 'import socket; socket.create_connection("
                                                            f"(\"127.0.0.1\", {inner}))'", check=False).returncode == 0,
             timeout=20)
    with pytest.raises(OSError):                 # from here, that address leads nowhere: only the jump reaches it
        socket.create_connection(("127.0.0.1", inner), timeout=2).close()
    door = relay("127.0.0.1", (jump.address, 22))             # the jump host itself, at a port of its own
    config = tmp_path / "ssh_config"
    config.write_text(f"Host bastion\n  HostName 127.0.0.1\n  Port {door.port}\n  User root\n  IdentityFile {ssh_key}\n"
                      f"Host gpu-box\n  HostName 127.0.0.1\n  Port {inner}\n  User ubuntu\n  ProxyJump bastion\n")
    env = {"RELAUNCH_SSH_CONFIG": str(config)}
    recipe = recipe_without_key(tmp_path, "jumped", key=ssh_key)

    up = run_cli("up", str(recipe), "gpu-box", home=home, env=env)
    assert up.returncode == 0, up.stderr
    assert f"first contact with jump host [127.0.0.1]:{door.port} (bastion)" in up.stderr
    assert jump.host_key_fingerprint in up.stderr and target.host_key_fingerprint in up.stderr
    recorded = (home / "known_hosts").read_text()
    assert {line.split()[0] for line in recorded.splitlines()} == {f"[127.0.0.1]:{door.port}", f"[127.0.0.1]:{inner}"}
    evac = run_cli("evacuate", str(recipe), "gpu-box", home=home, env=env)     # rsync's ssh goes through the jump
    assert evac.returncode == 0, evac.stderr
    assert (tmp_path / "store" / "ckpt-00000005.pt").stat().st_size == 3000

    door.target = (impostor.address, 22)          # the jump host now offers another key
    refused = run_cli("evacuate", str(recipe), "gpu-box", home=home, env=env)
    assert refused.returncode == 6, refused.stderr
    assert "jump host bastion" in refused.stderr and "HOST KEY CHANGED" in refused.stderr
    assert impostor.host_key_fingerprint in refused.stderr and "Traceback" not in refused.stderr
    assert run_cli("up", "--accept-new-host-key", str(recipe), "gpu-box", home=home, env=env).returncode == 3
    assert (home / "known_hosts").read_text() == recorded
    # the ssh that rsync runs refuses the changed jump key by itself, too
    hop = Target(address="127.0.0.1", user="root", port=door.port, key=str(ssh_key))
    argv = ssh_argv(Target(address="127.0.0.1", user="ubuntu", port=inner, key=str(ssh_key), jump=hop),
                    home / "known_hosts")
    direct = subprocess.run([*argv, "127.0.0.1", "true"], capture_output=True, text=True, timeout=60)
    assert direct.returncode == 255 and "REMOTE HOST IDENTIFICATION HAS CHANGED" in direct.stderr


PASSPHRASE = "correct horse battery staple"


def test_a_key_with_a_passphrase_works_through_ssh_agent_for_paramiko_and_rsync(tmp_path, sandbox, agent):
    home = tmp_path / "state"
    key = tmp_path / "keys" / "id_locked"
    key.parent.mkdir()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", PASSPHRASE, "-f", str(key)], check=True)
    inst = sandbox(authorized_key=Path(f"{key}.pub"))
    recipe = plain_recipe(tmp_path, name="agent", key=key, command=CHECKPOINT)
    env = {"SSH_AUTH_SOCK": agent}

    empty = run_cli("plan", str(recipe), inst.host, home=home, env=env)
    assert empty.returncode == 3, empty.stderr
    assert f"the key {key} has a passphrase and ssh-agent does not hold it" in empty.stderr
    assert f"ssh-add {key}" in empty.stderr and "Traceback" not in empty.stderr

    askpass = tmp_path / "askpass"
    askpass.write_text(f"#!/bin/sh\necho '{PASSPHRASE}'\n")
    askpass.chmod(0o700)
    added = subprocess.run(["ssh-add", str(key)], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                           start_new_session=True, timeout=30,
                           env={**os.environ, "SSH_AUTH_SOCK": agent, "SSH_ASKPASS": str(askpass),
                                "SSH_ASKPASS_REQUIRE": "force", "DISPLAY": ":0"})
    assert added.returncode == 0, added.stderr

    up = run_cli("up", str(recipe), inst.host, home=home, env=env)
    assert up.returncode == 0, up.stderr
    evac = run_cli("evacuate", str(recipe), inst.host, home=home, env=env)     # rsync's ssh asks the agent too
    assert evac.returncode == 0, evac.stderr
    assert (tmp_path / "store" / "ckpt-00000005.pt").stat().st_size == 3000
    everything = up.stdout + up.stderr + evac.stdout + evac.stderr + (home / "debug.log").read_text()
    assert PASSPHRASE not in everything

    gone = run_cli("plan", str(recipe), inst.host, home=home, env={"SSH_AUTH_SOCK": ""})
    assert gone.returncode == 3 and "no ssh-agent is running" in gone.stderr and "Traceback" not in gone.stderr


def test_host_argument_wins_over_the_alias_user(tmp_path, sandbox, ssh_key):
    home = tmp_path / "state"
    inst = sandbox(user="ubuntu")
    config = tmp_path / "ssh_config"
    config.write_text(f"Host box\n  HostName {inst.address}\n  User nobody-here\n  IdentityFile {ssh_key}\n")
    recipe = recipe_without_key(tmp_path, "hostwins")
    env = {"RELAUNCH_SSH_CONFIG": str(config)}
    refused = run_cli("plan", str(recipe), "box", "--set", "ssh.wait=2", home=home, env=env)
    assert refused.returncode == 3 and "authentication refused for user nobody-here" in refused.stderr
    ok = run_cli("plan", str(recipe), "ubuntu@box", home=home, env=env)
    assert ok.returncode == 0, ok.stderr
    assert f"box (ubuntu@{inst.address})" in ok.stderr


def test_with_home_elsewhere_than_the_password_databases_the_copy_offers_the_key_the_connection_did(tmp_path,
                                                                                                     sandbox):
    """HOME set by hand (sudo keeping it, a service, a container's user): paramiko finds the user's
    ~/.ssh/id_ed25519 under $HOME and connects, OpenSSH looks under the password database's home. The
    ssh under rsync must offer the same key, or evacuate connects, then cannot copy (exit 6)."""
    home = tmp_path / "me"
    env = new_user(home)
    box = sandbox(authorized_key=home / ".ssh" / "id_ed25519.pub")   # the user's key only
    recipe = recipe_without_key(tmp_path, "elsewhere")
    state = tmp_path / "state"
    up = run_cli("up", str(recipe), box.host, home=state, env=env)
    assert up.returncode == 0, up.stderr
    wait_for("the checkpoint on the instance", lambda: run_cli("status", str(recipe), box.host, "--json", home=state,
                                                              env=env).stdout.count("ckpt-00000005.pt") > 0,
             timeout=120)
    evac = run_cli("evacuate", str(recipe), box.host, home=state, env=env)
    assert evac.returncode == 0, evac.stderr
    assert "safe to destroy" in evac.stderr and (tmp_path / "store" / "ckpt-00000005.pt").stat().st_size == 3000
