"""HOST + recipe + ~/.ssh/config -> what relaunch contacts, and the ssh argv rsync gets: no network.

The end-to-end side (real sshd, rsync, ssh-agent) is tests/test_ssh_config.py.
"""

from __future__ import annotations

import getpass
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from relaunch.cycle import last_host, make_target, remember_host
from relaunch.errors import UsageError
from relaunch.host.connection import public_blob
from relaunch.host.spec import HostSpec, Target
from relaunch.host.ssh_argv import ssh_argv
from relaunch.host.sshconfig import ENV_VAR, Layer, SSHConfigFile, config_path, resolve
from relaunch.recipe import load_recipe
from relaunch.ui import UI

DEFAULTS = Layer(user="root", port=22)


def config(tmp_path: Path, text: str) -> SSHConfigFile:
    path = tmp_path / "ssh_config"
    path.write_text(text)
    return SSHConfigFile(path)


@pytest.fixture
def key(tmp_path: Path) -> Path:
    path = tmp_path / "id_gpu"
    path.write_text("not read here\n")
    return path


def test_an_alias_contacts_its_hostname_port_user_and_key(tmp_path, key):
    cfg = config(tmp_path, f"Host gpu-box\n  HostName 10.0.0.5\n  Port 2222\n  User ubuntu\n"
                           f"  IdentityFile {tmp_path}/missing_key\n  IdentityFile {key}\n")
    target = resolve(HostSpec.parse("gpu-box"), Layer(), DEFAULTS, config=cfg)
    assert (target.address, target.port, target.user, target.key) == ("10.0.0.5", 2222, "ubuntu", str(key))
    # keys are recorded and checked under what is contacted, never under the alias
    assert target.known_hosts_name == "[10.0.0.5]:2222"
    assert target.label == "gpu-box (ubuntu@10.0.0.5:2222)"
    assert target.jump is None


def test_precedence_host_then_recipe_then_ssh_config_then_preset(tmp_path):
    cfg = config(tmp_path, "Host gpu-box\n  HostName 10.0.0.5\n  Port 2222\n  User fromconfig\n")
    preset = Layer(user="ubuntu", port=22)
    assert resolve(HostSpec.parse("gpu-box"), Layer(), preset, config=cfg).user == "fromconfig"
    from_recipe = resolve(HostSpec.parse("gpu-box"), Layer(user="fromrecipe", port=2200), preset, config=cfg)
    assert (from_recipe.user, from_recipe.port) == ("fromrecipe", 2200)
    from_host = resolve(HostSpec.parse("me@gpu-box:3333"), Layer(user="fromrecipe", port=2200), preset, config=cfg)
    assert (from_host.user, from_host.port, from_host.address) == ("me", 3333, "10.0.0.5")
    # a host the config says nothing about: the preset, then nothing else changes
    plain = resolve(HostSpec.parse("10.0.0.9"), Layer(), preset, config=cfg)
    assert (plain.address, plain.user, plain.port, plain.alias, plain.label) == (
        "10.0.0.9", "ubuntu", 22, None, "ubuntu@10.0.0.9")


def test_the_recipes_own_key_wins_over_identityfile(tmp_path, key):
    other = tmp_path / "recipe_key"
    other.write_text("x")
    cfg = config(tmp_path, f"Host gpu-box\n  HostName 10.0.0.5\n  IdentityFile {key}\n")
    assert resolve(HostSpec.parse("gpu-box"), Layer(key=str(other)), DEFAULTS, config=cfg).key == str(other)


def test_identitiesonly_as_in_openssh(tmp_path, key):
    """ssh offers an IdentityFile after the agent's keys unless IdentitiesOnly; the recipe's
    ssh.key is always offered alone. paramiko and rsync's ssh are told the same."""
    known = tmp_path / "known_hosts"
    cfg = config(tmp_path, f"Host loose\n  IdentityFile {key}\nHost strict\n  IdentityFile {key}\n"
                           "  IdentitiesOnly yes\n")
    loose = resolve(HostSpec.parse("loose"), Layer(), DEFAULTS, config=cfg)
    strict = resolve(HostSpec.parse("strict"), Layer(), DEFAULTS, config=cfg)
    mine = resolve(HostSpec.parse("loose"), Layer(key=str(key)), DEFAULTS, config=cfg)
    assert (loose.key_only, strict.key_only, mine.key_only) == (False, True, True)
    assert "IdentitiesOnly=yes" not in ssh_argv(loose, known) and str(key) in ssh_argv(loose, known)
    assert "IdentitiesOnly=yes" in ssh_argv(strict, known) and "IdentitiesOnly=yes" in ssh_argv(mine, known)


def test_patterns_and_the_first_value_win_as_in_openssh(tmp_path):
    cfg = config(tmp_path, "Host gpu-*\n  User first\n  Port 2000\nHost *\n  User second\n  Port 3000\n")
    target = resolve(HostSpec.parse("gpu-7"), Layer(), DEFAULTS, config=cfg)
    assert (target.address, target.user, target.port) == ("gpu-7", "first", 2000)


def test_a_missing_config_file_changes_nothing(tmp_path):
    target = resolve(HostSpec.parse("10.0.0.9"), Layer(), DEFAULTS, config=SSHConfigFile(tmp_path / "none"))
    assert target == Target(address="10.0.0.9", user="root", port=22)


def test_the_config_path_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "cfg"))
    assert config_path() == tmp_path / "cfg"
    monkeypatch.delenv(ENV_VAR)
    assert config_path() == Path.home() / ".ssh" / "config"


def test_proxyjump_is_resolved_through_its_own_host_entry(tmp_path, key):
    cfg = config(tmp_path, f"Host bastion\n  HostName 192.0.2.10\n  Port 2022\n  User jumper\n  IdentityFile {key}\n"
                           "Host gpu-box\n  HostName 10.0.0.5\n  ProxyJump bastion\n"
                           "Host other\n  HostName 10.0.0.6\n  ProxyJump admin@192.0.2.11:2200\n"
                           "Host bare\n  HostName 10.0.0.7\n  ProxyJump 192.0.2.12\n")
    target = resolve(HostSpec.parse("gpu-box"), Layer(), DEFAULTS, config=cfg)
    assert target.jump == Target(address="192.0.2.10", user="jumper", port=2022, key=str(key), key_only=False,
                                 alias="bastion")
    assert target.jump.known_hosts_name == "[192.0.2.10]:2022"
    other = resolve(HostSpec.parse("other"), Layer(), DEFAULTS, config=cfg).jump
    assert other is not None and (other.address, other.user, other.port) == ("192.0.2.11", "admin", 2200)
    # like ssh, a jump host without a User is logged into as the local user, not the recipe's
    bare = resolve(HostSpec.parse("bare"), Layer(user="ubuntu"), DEFAULTS, config=cfg).jump
    assert bare is not None and (bare.user, bare.port) == (getpass.getuser(), 22)


def test_proxyjump_none_means_no_jump(tmp_path):
    cfg = config(tmp_path, "Host direct\n  ProxyJump none\nHost *\n  ProxyJump bastion\n")
    assert resolve(HostSpec.parse("direct"), Layer(), DEFAULTS, config=cfg).jump is None


@pytest.mark.parametrize("text, message", [
    ("Host gpu-box\n  Port twenty\n", "Port 'twenty' is not a number from 1 to 65535"),
    ("Host gpu-box\n  HostName -oProxyCommand=touch\n", "is not an address or host name"),
    ("Host gpu-box\n  User 'x y'\n", "is not a user name"),
    ("Host gpu-box\n  ProxyJump a,b\n", "has several hops; relaunch goes through one jump host"),
    ("Host gpu-box\n  ProxyJump j\nHost j\n  ProxyJump k\n", "has a ProxyJump of its own"),
    ("Host gpu-box\n  ProxyJump bad host\n", "ProxyJump 'bad host'"),
    ("Host gpu-box\n  ProxyCommand nc %h %p\n", "ProxyCommand is not supported"),
    ("Host gpu-box\n  =broken\n", "Unparsable line"),
])
def test_bad_config_values_are_one_line_usage_errors_naming_the_file(tmp_path, text, message):
    with pytest.raises(UsageError) as info:
        resolve(HostSpec.parse("gpu-box"), Layer(), DEFAULTS, config=config(tmp_path, text))
    assert message in str(info.value) and str(tmp_path / "ssh_config") in str(info.value)
    assert "\n" not in str(info.value)


def test_include_is_read_relative_to_dot_ssh(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh" / "config.d").mkdir(parents=True)
    (tmp_path / ".ssh" / "config.d" / "gpu").write_text("Host gpu-box\n  HostName 10.0.0.5\n  User included\n")
    main = tmp_path / ".ssh" / "config"
    main.write_text("Host gpu-box\n  Include config.d/*\n  Port 2222\nHost *\n  User fallback\n")
    target = resolve(HostSpec.parse("gpu-box"), Layer(), DEFAULTS, config=SSHConfigFile(main))
    # the lines after an Include inside a Host block stay in that block
    assert (target.address, target.user, target.port) == ("10.0.0.5", "included", 2222)
    assert resolve(HostSpec.parse("elsewhere"), Layer(), DEFAULTS, config=SSHConfigFile(main)).port == 22


def _recipe(tmp_path: Path, **ssh: object) -> Path:
    data = {"name": "r", "provider": "lambda", "env": {"python": "3.11"}, "checkpoint": {"remote": "./store"},
            "run": {"command": "true"}}
    if ssh:
        data["ssh"] = ssh
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_make_target_tells_what_the_recipe_wrote_from_what_the_preset_filled(tmp_path, monkeypatch):
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host gpu-box\n  HostName 10.0.0.5\n  User fromconfig\n  Port 2222\n")
    monkeypatch.setenv(ENV_VAR, str(cfg))
    preset_only = load_recipe(_recipe(tmp_path))                 # lambda: ubuntu@:22, from the preset
    assert preset_only.ssh.user == "ubuntu"
    target = make_target(preset_only, HostSpec.parse("gpu-box"))
    assert (target.user, target.port) == ("fromconfig", 2222)
    assert make_target(preset_only, HostSpec.parse("10.0.0.9")).user == "ubuntu"
    written = load_recipe(_recipe(tmp_path, user="fromrecipe", port=22))
    target = make_target(written, HostSpec.parse("gpu-box"))
    assert (target.user, target.port) == ("fromrecipe", 22)
    by_set = load_recipe(_recipe(tmp_path), ["ssh.user=fromset"])
    assert make_target(by_set, HostSpec.parse("gpu-box")).user == "fromset"


def test_an_alias_is_remembered_as_typed_and_resolved_again(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAUNCH_HOME", str(tmp_path / "state"))
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host gpu-box\n  HostName 10.0.0.5\n")
    monkeypatch.setenv(ENV_VAR, str(cfg))
    recipe = load_recipe(_recipe(tmp_path))
    spec = HostSpec.parse("gpu-box")
    remember_host(recipe, (make_target(recipe, spec), spec))
    cfg.write_text("Host gpu-box\n  HostName 10.0.0.6\n")        # the alias now names a new instance
    again = last_host(recipe, UI())
    assert make_target(recipe, again).address == "10.0.0.6"
    plain = HostSpec.parse("10.0.0.9")
    remember_host(recipe, (make_target(recipe, plain), plain))
    assert last_host(recipe, UI()) == HostSpec("10.0.0.9", "ubuntu", 22)


def test_ssh_argv_reads_no_config_and_carries_the_resolved_values(tmp_path):
    known = tmp_path / "known_hosts"
    target = Target(address="10.0.0.5", user="ubuntu", port=2222, key="/keys/id", alias="gpu-box")
    argv = ssh_argv(target, known)
    assert argv[:3] == ["ssh", "-F", "/dev/null"]
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-l") + 1] == "ubuntu"
    assert argv[argv.index("-i") + 1] == "/keys/id" and "IdentitiesOnly=yes" in argv
    assert f"UserKnownHostsFile={known}" in argv and "StrictHostKeyChecking=yes" in argv
    assert "gpu-box" not in " ".join(argv)
    assert not any(a.startswith("ProxyCommand") for a in argv)


def test_ssh_argv_checks_the_jump_hosts_key_the_same_strict_way(tmp_path):
    known = tmp_path / "50% state" / "known_hosts"
    jump = Target(address="192.0.2.10", user="jumper", port=2022, key="/keys/jump")
    argv = ssh_argv(Target(address="10.0.0.5", user="ubuntu", port=22, jump=jump), known)
    proxy = [a for a in argv if a.startswith("ProxyCommand=")]
    assert len(proxy) == 1
    hop = shlex.split(proxy[0].removeprefix("ProxyCommand="))
    assert hop[:3] == ["ssh", "-F", "/dev/null"] and hop[-3:] == ["-W", "[%h]:%p", "192.0.2.10"]
    # ssh expands %-tokens in a ProxyCommand: a literal % in a path is doubled
    assert f"UserKnownHostsFile={str(known).replace('%', '%%')}" in hop and "StrictHostKeyChecking=yes" in hop
    assert "BatchMode=yes" in hop and "GlobalKnownHostsFile=/dev/null" in hop
    assert (hop[hop.index("-p") + 1], hop[hop.index("-l") + 1], hop[hop.index("-i") + 1]) == (
        "2022", "jumper", "/keys/jump")


def test_public_half_of_a_key_with_a_passphrase_without_its_pub_file(tmp_path):
    key = tmp_path / "locked"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "a passphrase", "-f", str(key)], check=True)
    from_pub = public_blob(key)
    assert from_pub is not None
    key.with_name("locked.pub").unlink()
    assert public_blob(key) == from_pub       # read from the unencrypted header, as ssh does
