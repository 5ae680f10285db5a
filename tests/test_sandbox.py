"""Sandbox instances, checked with the real OpenSSH client over their own network namespaces."""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import re
import socket
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from e2e import cli_env, new_user, plain_recipe, run_cli, wait_for
from relaunch import sandbox as sb
from relaunch.errors import RelaunchError, UsageError

pytestmark = pytest.mark.sandbox  # sandbox instances, root


def _out(*argv: str, stdin: str | None = None) -> str:
    """stdout of a local command."""
    return subprocess.run(argv, capture_output=True, text=True, input=stdin).stdout


def _via_sandbox_link(address: str) -> bool:
    """This machine would send a packet for address through a sandbox link (asked locally; no
    packet is sent).

    An address of a destroyed instance is unreachable while its sandbox dir has other instances
    (their range's `unreachable` route), but with the dir's last instance that route goes too (the
    sandbox leaves no route behind), and the address then follows this machine's own routes. So
    what holds in every case is only this: no sandbox link is the way to it any more.
    """
    proc = subprocess.run(["ip", "route", "get", address], capture_output=True, text=True)
    return re.search(r"\bdev rlv\d+[hi]\b", proc.stdout) is not None


def _meta(name: str) -> dict:
    return json.loads((sb.RUN_DIR / name / "instance.json").read_text())


def _eventually(what: str, attempt, timeout: float = 60) -> object:
    """Retry `attempt` until it returns something truthy (the instance is booting)."""
    deadline = time.monotonic() + timeout
    while True:
        result = attempt()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s")
        time.sleep(0.2)


def _pids_in_mnt_ns(ns: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "ns" / "mnt") == ns:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def test_root_login_empty_private_home_and_tmp(sandbox, ssh) -> None:
    a, b = sandbox(), sandbox()
    assert a.host == f"root@{a.address}:22"
    assert ssh(a, "id -un; echo $HOME; cd && pwd").stdout.split() == ["root", "/root", "/root"]
    assert ssh(a, "ls -A ~ /tmp").stdout.split() == ["/root:", "/tmp:"]  # both empty

    marker = f"m-{uuid.uuid4().hex}"
    ssh(a, f"echo disk > ~/{marker}; echo tmp > /tmp/{marker}")
    # the instance sees its own files, run_in (a console on the instance) too ...
    assert ssh(a, f"cat ~/{marker} /tmp/{marker}").stdout.split() == ["disk", "tmp"]
    console = sb.run_in(a.name, ["cat", f"/root/{marker}", f"/tmp/{marker}"], capture_output=True, text=True)
    assert console.stdout.split() == ["disk", "tmp"]
    # ... this machine does not, nor does another instance
    assert not Path("/root", marker).exists() and not Path("/tmp", marker).exists()
    other = ssh(b, f"ls ~/{marker} /tmp/{marker}", check=False)
    assert other.returncode != 0 and "No such file" in other.stderr
    # the machine's pip configuration (local wheel folders, constraints) is not on the instance
    assert ssh(a, "cat /etc/pip.conf; ls -A /etc/xdg/pip 2>/dev/null; true").stdout.strip() == ""


def test_ubuntu_login_sudo_and_home(sandbox, ssh) -> None:
    u = sandbox(user="ubuntu")
    assert u.host == f"ubuntu@{u.address}:22" and u.home == "/home/ubuntu"
    out = ssh(u, "id -un; echo $HOME; stat -c %U:%a ~; ls -A ~ | wc -l").stdout.split()
    assert out == ["ubuntu", "/home/ubuntu", "ubuntu:755", "0"]
    assert ssh(u, "sudo -n true && sudo -n id -u").stdout.strip() == "0"
    marker = f"m-{uuid.uuid4().hex}"
    ssh(u, f"touch ~/{marker}")
    assert not Path("/home/ubuntu", marker).exists()
    assert sb.run_in(u.name, ["test", "-e", f"/home/ubuntu/{marker}"]).returncode == 0
    # no password logins of any kind
    assert "PasswordAuthentication no" in (sb.RUN_DIR / u.name / "sshd_config").read_text()


def test_each_instance_has_its_own_address_and_new_host_key(sandbox, ssh) -> None:
    a, b = sandbox(), sandbox(user="ubuntu")
    assert a.address != b.address
    assert a.host_key_fingerprint != b.host_key_fingerprint
    for inst in (a, b):
        assert inst.host_key_fingerprint.startswith("SHA256:")
        scan = _out("ssh-keyscan", "-t", "ed25519", "-p", "22", inst.address)
        assert _out("ssh-keygen", "-lf", "-", stdin=scan).split()[1] == inst.host_key_fingerprint
        ssh(inst, "true")  # and the client accepted exactly that key
        assert inst.host_key_fingerprint in _out("ssh-keygen", "-lf", str(ssh.known_hosts(inst)))


def test_list_get_and_persisted_state(sandbox) -> None:
    a = sandbox(disk="64M")
    assert sb.get(a.name) == a
    assert a in sb.list_instances()
    assert _meta(a.name)["disk"] == "64M"


def test_disk_is_limited_to_its_size(sandbox, ssh) -> None:
    a = sandbox(disk="32M")
    full = ssh(a, "head -c 40M /dev/zero > ~/big", check=False)
    assert full.returncode != 0 and "No space left" in full.stderr


def test_package_index_served_inside(sandbox, ssh, package_index: Path) -> None:
    page = (package_index / "simple" / "torch" / "index.html").read_text()
    assert "#sha256=" in page
    for project in ("uv", "pip", "mpmath"):
        assert (package_index / "simple" / project / "index.html").exists()
    # the fragment is the real hash of the file it points at
    link = re.search(r'href="\.\./\.\./files/(mpmath-[^"#]+)#sha256=([0-9a-f]{64})"', (
        package_index / "simple" / "mpmath" / "index.html").read_text())  # fmt: skip
    assert link
    assert hashlib.sha256((package_index / "files" / link.group(1)).read_bytes()).hexdigest() == link.group(2)

    inst = sandbox(index_dir=package_index)
    assert inst.index_url == "http://127.0.0.1:8765/simple/"
    fetch = f"import urllib.request; print(urllib.request.urlopen('{inst.index_url}').read().decode())"
    assert 'href="torch/"' in ssh(inst, f'python3 -c "{fetch}"').stdout
    install = ssh(
        inst,
        f"python3 -m venv ~/venv && ~/venv/bin/pip install -q --index-url {inst.index_url} mpmath==1.3.0 "
        "&& ~/venv/bin/python -c 'import mpmath; print(mpmath.__version__)'",
        timeout=300,
    )
    assert install.stdout.strip().splitlines()[-1] == "1.3.0"


def test_boot_delay_refuses_then_serves(sandbox, ssh) -> None:
    inst = sandbox(boot_delay=2)
    with pytest.raises(ConnectionRefusedError):  # the address is up, nothing listens yet
        socket.create_connection((inst.address, 22), timeout=5)
    _eventually("ssh after boot", lambda: ssh(inst, "true", check=False).returncode == 0)


def test_destroy_while_booting(ssh_key: Path) -> None:
    name = f"b{uuid.uuid4().hex[:8]}"
    inst = sb.create(name, authorized_key=Path(f"{ssh_key}.pub"), boot_delay=600, key_delay=600)
    starters = [int((sb.RUN_DIR / name / f"{role}.pid").read_text().split()[0]) for role in ("boot", "keys")]
    assert all(Path(f"/proc/{pid}").exists() for pid in starters)
    with pytest.raises(UsageError, match="not running"):  # no sshd yet, so no console either
        sb.run_in(name, ["true"])
    assert sb.destroy(name) is True
    assert [pid for pid in starters if _stat_state(pid) not in ("gone", "Z")] == []
    assert not (sb.RUN_DIR / name).exists() and f"rl-{name}" not in _out("ip", "netns", "list")
    # the address is gone with the link
    assert not _via_sandbox_link(inst.address)


def test_key_delay_fails_auth_then_works(sandbox, ssh) -> None:
    inst = sandbox(key_delay=3600)  # held until the first ssh was refused, however loaded the machine
    early = ssh(inst, "true", check=False)
    assert early.returncode == 255 and "Permission denied" in early.stderr
    sb.release_key(inst.name)
    _eventually("auth after key install", lambda: ssh(inst, "true", check=False).returncode == 0)


def test_set_link_outage_and_recovery(sandbox, ssh) -> None:
    inst = sandbox()
    ssh(inst, "true")
    sb.set_link(inst.name, up=False)
    with pytest.raises(TimeoutError):  # an outage: packets vanish, nothing answers
        socket.create_connection((inst.address, 22), timeout=1)
    sb.set_link(inst.name, up=True)
    _eventually("ssh after link up", lambda: ssh(inst, "true", check=False).returncode == 0)


def test_after_an_outage_the_instance_reaches_services_on_other_links_again(sandbox, ssh) -> None:
    """A test S3 server listens on another instance's host-side address: the way back to it (a
    route the kernel drops with the link) is there again once the link is up."""
    inst, other = sandbox(), sandbox()
    server = socket.create_server((other.address.rsplit(".", 1)[0] + ".1", 0))
    try:
        host, port = server.getsockname()
        reach = f"python3 -c 'import socket; socket.create_connection((\"{host}\", {port}), timeout=5)'"
        ssh(inst, reach)
        sb.set_link(inst.name, up=False)
        sb.set_link(inst.name, up=True)
        assert ssh(inst, reach, check=False).returncode == 0
    finally:
        server.close()


def test_rate_shapes_both_ends_of_the_link_to_this_machine_only(sandbox) -> None:
    inst = sandbox(rate="8mbit")
    host_dev, inst_dev = _meta(inst.name)["veth"]
    outside = _out("tc", "class", "show", "dev", host_dev)
    inside = sb.run_in(inst.name, ["tc", "class", "show", "dev", inst_dev], capture_output=True, text=True).stdout
    for classes in (outside, inside):
        # traffic with this machine is held to the rate; traffic between instances is not
        assert re.search(r"class htb 1:10 .*rate 8Mbit", classes) and re.search(r"class htb 1:20 .*rate 10Gbit",
                                                                               classes)
    filters = _out("tc", "filter", "show", "dev", host_dev)
    assert "match 00000001/000000ff at 12" in filters and "flowid 1:10" in filters


def test_destroy_leaves_nothing_behind(sandbox, ssh, package_index: Path, request) -> None:
    inst = sandbox(index_dir=package_index, key_delay=0.1)
    _eventually("auth", lambda: ssh(inst, "true", check=False).returncode == 0)
    # what training leaves running: a tmux server and a detached job
    ssh(inst, "tmux new-session -d -s train 'sleep 1000'; setsid sleep 1001 >/dev/null 2>&1 </dev/null &")
    meta = _meta(inst.name)
    host_dev = meta["veth"][0]
    folder = sb.RUN_DIR / inst.name
    sshd_pid = int((folder / "sshd.pid").read_text())
    # A freed namespace's number (the `mnt:[N]` of the link) is given to the next one made: under
    # other tests that make instances, a process of another instance's new namespace read as one of
    # this one's (CI: `assert [10226] == []`). Held open, the namespace keeps its number its own.
    pinned = os.open(f"/proc/{sshd_pid}/ns/mnt", os.O_RDONLY)
    request.addfinalizer(lambda: os.close(pinned))
    mnt = os.readlink(f"/proc/self/fd/{pinned}")
    pids = [int(p) for p in _out("ip", "netns", "pids", f"rl-{inst.name}").split()]
    # sshd, the index server, tmux and the two sleeps at least
    assert len(pids) >= 5

    assert sb.destroy(inst.name) is True
    assert f"rl-{inst.name}" not in _out("ip", "netns", "list")
    assert not Path("/sys/class/net", host_dev).exists()
    addrs = _out("ip", "-o", "addr")
    assert meta["address"].rsplit(".", 1)[0] + "." not in addrs
    assert not _via_sandbox_link(meta["address"])
    assert [p for p in pids if Path(f"/proc/{p}").exists() and _stat_state(p) != "Z"] == []
    # nobody holds the instance's disk mount
    assert {p: _cmdline(Path(f"/proc/{p}")) for p in _pids_in_mnt_ns(mnt)} == {}
    assert not folder.exists()
    assert inst not in sb.list_instances()
    with pytest.raises(UsageError):
        sb.get(inst.name)
    assert sb.destroy(inst.name) is False  # idempotent


def _stat_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_failing_create_leaves_nothing_behind(ssh_key: Path) -> None:
    name = f"f{uuid.uuid4().hex[:8]}"
    links_before = set(os.listdir("/sys/class/net"))
    # tc rejects the rate only after the namespace, the link and sshd are up
    with pytest.raises(UsageError, match="bad rate"):
        sb.create(name, authorized_key=Path(f"{ssh_key}.pub"), rate="fast")
    assert not (sb.RUN_DIR / name).exists()
    assert f"rl-{name}" not in _out("ip", "netns", "list")
    leftovers = [p for p in Path("/proc").iterdir()
                 if p.name.isdigit() and f"/relaunch-sandbox/{name}/".encode() in _cmdline(p)]  # fmt: skip
    assert leftovers == []

    def strays() -> set[str]:
        new_links = {dev for dev in set(os.listdir("/sys/class/net")) - links_before if dev.startswith("rlv")}
        live = {json.loads((d / "instance.json").read_text())["veth"][0]
                for d in sb.RUN_DIR.iterdir() if (d / "instance.json").exists()}  # fmt: skip
        return new_links - live

    # other sessions may create instances meanwhile: any new link must belong to a live instance, once
    # the instance whose link it is has recorded itself (its instance.json comes last)
    _eventually("every new link to belong to an instance", lambda: not strays(), timeout=60)
    assert sb.destroy(name) is False


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def test_bad_usage_is_a_usage_error(sandbox, ssh, ssh_key: Path, tmp_path: Path) -> None:
    pub = Path(f"{ssh_key}.pub")
    for bad in ("", "a" * 13, "a b", "../x", "x/y", "ü"):
        with pytest.raises(UsageError):
            sb.create(bad, authorized_key=pub)
        with pytest.raises(UsageError):
            sb.destroy(bad)
        with pytest.raises(UsageError):
            sb.get(bad)
    for kw in ({"user": "admin"}, {"disk": "lots"}, {"boot_delay": -1}, {"index_dir": tmp_path}):
        with pytest.raises(UsageError):
            sb.create("okname", authorized_key=pub, **kw)
    (tmp_path / "not-a-key").write_text("hello\n")
    with pytest.raises(UsageError, match="public key"):
        sb.create("okname", authorized_key=tmp_path / "not-a-key")
    assert not (sb.RUN_DIR / "okname").exists()
    with pytest.raises(UsageError):
        sb.get(f"n{uuid.uuid4().hex[:8]}")
    with pytest.raises(UsageError):
        sb.run_in(f"n{uuid.uuid4().hex[:8]}", ["true"])

    # a duplicate name is refused and does not harm the existing instance
    inst = sandbox()
    with pytest.raises(UsageError, match="already exists"):
        sb.create(inst.name, authorized_key=pub)
    assert ssh(inst, "echo alive").stdout.strip() == "alive"


def test_private_key_path_and_default_key(sandbox, ssh, ssh_key: Path, tmp_path, monkeypatch) -> None:
    inst = sandbox(authorized_key=ssh_key)  # the private key: its .pub beside it is used
    ssh(inst, "true")
    monkeypatch.setenv("RELAUNCH_HOME", str(tmp_path / "home"))
    key = sb.default_key()
    assert key == tmp_path / "home" / "id_ed25519" and key.stat().st_mode & 0o777 == 0o600
    assert sb.default_key() == key and Path(f"{key}.pub").exists()
    inst2 = sb.create(f"d{uuid.uuid4().hex[:8]}", authorized_key=None)
    sandbox.names.append(inst2.name)  # destroyed at teardown
    assert type(ssh)(key, tmp_path)(inst2, "id -un").stdout.strip() == "root"


def test_build_index_is_cached(tmp_path: Path, monkeypatch) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text("mpmath==1.3.0\n")
    dest = sb.build_index([req], tmp_path / "index")
    names = sorted(os.listdir(dest / "simple"))
    assert {"mpmath", "uv", "pip", "index.html"} <= set(names)
    files = {p.name: p.stat().st_mtime_ns for p in (dest / "files").iterdir()}

    # from now on pip cannot reach any index: a second build with the same inputs must not need one
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    assert sb.build_index([req], tmp_path / "index") == dest
    assert {p.name: p.stat().st_mtime_ns for p in (dest / "files").iterdir()} == files
    # ... and that really would have failed had it tried (new inputs need a download)
    with pytest.raises(RelaunchError, match="pip download failed"):
        sb.build_index([req], tmp_path / "index", extra=["sympy==1.14.0"])
    with pytest.raises(UsageError):
        sb.build_index([tmp_path / "missing.txt"], tmp_path / "index")


def test_command_log_has_every_command_byte_for_byte_and_runs_it_as_sshd_would(sandbox, ssh) -> None:
    inst = sandbox(command_log=True)
    assert sb.commands(inst.name) == []
    tricky = "printf '%s|' \"a  b\" 'c\"d' \\\\x $(echo sub)\necho \"$HOME\"; echo '$(not run)'\n"
    assert ssh(inst, tricky).stdout == "a  b|c\"d|\\x|sub|/root\n$(not run)\n"
    assert ssh(inst, "exit 7", check=False).returncode == 7
    # a session without a command is a login shell, and logs nothing
    assert ssh(inst, "", input="echo from-stdin\n").stdout.strip() == "from-stdin"
    assert sb.commands(inst.name) == [tricky, "exit 7"]

    # two at once: each arrives whole (big enough that an unlocked append could be split)
    big = {c: f": {c * 100_000}; echo {c}" for c in "xy"}
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda c: ssh(inst, big[c]).stdout, big))
    assert outs == ["x\n", "y\n"]
    logged = sb.commands(inst.name)
    assert len(logged) == 4 and sorted(logged[2:]) == sorted(big.values())

    # the log: read here, appended to by the login user, writable by no one else
    folder = sb.RUN_DIR / inst.name
    assert [p.name for p in folder.iterdir() if p.stat().st_mode & 0o002] == []
    no_log = sandbox()
    with pytest.raises(UsageError, match="does not log commands"):
        sb.commands(no_log.name)


def test_command_log_as_ubuntu_with_sftp(sandbox, ssh, tmp_path: Path) -> None:
    inst = sandbox(user="ubuntu", command_log=True)
    log = sb.RUN_DIR / inst.name / "commands.log"
    assert (log.stat().st_uid, log.stat().st_mode & 0o777) == (pwd.getpwnam("ubuntu").pw_uid, 0o644)
    assert ssh(inst, "sudo -n id -un").stdout.strip() == "root"
    # Fabric's put/get speak SFTP: it works, and the session is logged as the server it runs
    (tmp_path / "up.txt").write_text("sent\n")
    batch = tmp_path / "batch"
    batch.write_text(f"put {tmp_path / 'up.txt'} up.txt\n")
    options = ["-P" if o == "-p" else o for o in ssh.options(inst)]  # sftp's port option is -P
    sftp = subprocess.run(["sftp", *options, "-b", str(batch), f"ubuntu@{inst.address}"],
                          capture_output=True, text=True)  # fmt: skip
    assert sftp.returncode == 0, sftp.stderr
    assert ssh(inst, "cat ~/up.txt").stdout == "sent\n"
    assert sb.commands(inst.name) == ["sudo -n id -un", "/usr/lib/openssh/sftp-server", "cat ~/up.txt"]


def _fingerprint(pub: Path) -> str:
    return _out("ssh-keygen", "-lf", str(pub)).split()[1]


def test_create_authorizes_the_users_own_keys_as_a_provider_does(sandbox, ssh, tmp_path: Path, agent) -> None:
    """A new user's ~/.ssh/id_ed25519 and their ssh-agent's key may log in to what `relaunch sandbox
    create` made, with plain ssh and no key named in a recipe, as on a box rented after uploading
    them; so may the sandbox's own key. `--key` authorizes that key alone."""
    env = new_user(tmp_path / "home")
    mine = tmp_path / "home" / ".ssh" / "id_ed25519"
    held = tmp_path / "agent" / "id_held"
    new_user(tmp_path / "unused", key=held)
    subprocess.run(["ssh-add", str(held)], env={**env, "SSH_AUTH_SOCK": agent}, check=True, capture_output=True)

    inst, made = sandbox.by_cli("--image", "runpod", env={**env, "SSH_AUTH_SOCK": agent})
    yours = f"~/.ssh/id_ed25519.pub {_fingerprint(Path(f'{mine}.pub'))}, ssh-agent {_fingerprint(Path(f'{held}.pub'))}"
    assert f"your keys, authorized too (no ssh.key needed): {yours}\n" in made.stdout
    sandbox_key = tmp_path / "home" / ".local" / "state" / "relaunch" / "id_ed25519"
    assert f"ssh key: {sandbox_key}" in made.stdout
    for key in (mine, held, sandbox_key):
        assert type(ssh)(key, tmp_path)(inst, "id -un").stdout.strip() == "root", key

    # --key: that key only, as before
    only, said = sandbox.by_cli("--key", f"{held}.pub", "--json", env=env)
    assert json.loads(said.stdout)["your_keys"] == []
    assert type(ssh)(held, tmp_path)(only, "true", check=False).returncode == 0
    refused = type(ssh)(mine, tmp_path)(only, "true", check=False)
    assert refused.returncode == 255 and "Permission denied" in refused.stderr

    # no key of one's own yet: what to do about it
    bare = new_user(tmp_path / "bare", key=tmp_path / "bare-keys" / "id_ed25519")
    _, told = sandbox.by_cli(env=bare)
    assert "your keys: none found (no ~/.ssh/id_*.pub, no ssh-agent key); make one with `ssh-keygen -t ed25519`" \
        in told.stdout


def test_an_index_made_from_a_lock_is_what_a_box_installs_the_lock_from(sandbox, ssh, ssh_key: Path,
                                                                        tmp_path: Path) -> None:
    """`relaunch sandbox index DIR --from LOCK`, `sandbox create --index DIR`: `up` installs the lock
    there (uv too comes from that index) and the command imports it."""
    lock = tmp_path / "requirements.lock"
    lock.write_text("mpmath==1.3.0\n")
    made = run_cli("sandbox", "index", str(tmp_path / "index"), "--from", str(lock), home=tmp_path / "state",
                   timeout=600)
    assert made.returncode == 0, made.stderr
    assert f"relaunch sandbox create NAME --index {tmp_path / 'index'}" in made.stdout
    assert f"env.index_url: {sb.INDEX_URL}" in made.stdout

    inst, _ = sandbox.by_cli("--key", f"{ssh_key}.pub", "--index", str(tmp_path / "index"),
                             env=cli_env(tmp_path / "state"))
    recipe = plain_recipe(tmp_path, name="fromlock", key=ssh_key, env={"lock": "requirements.lock", "installer": "uv"},
                          command="python -c 'import mpmath; print(\"mpmath\", mpmath.__version__)'; sleep 600")
    up = run_cli("up", str(recipe), inst.host, home=tmp_path / "state")
    assert up.returncode == 0, up.stderr
    assert "installing 1 pinned packages with uv" in up.stderr
    wait_for("the command's import", lambda: "mpmath 1.3.0" in ssh(inst, "cat ~/fromlock.log", check=False).stdout,
             timeout=120)
