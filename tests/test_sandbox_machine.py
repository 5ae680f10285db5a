"""What the sandbox does to this machine: the address range it picks, that it leaves nothing, and
that it can undo all of it after a reboot (its journal).

Other sessions may have sandbox instances on this machine while these tests run. The end-to-end
test therefore uses a sandbox dir of its own (RELAUNCH_SANDBOX_DIR), whose range and whose last
instance it controls; what is shared by every dir (the `ubuntu` user, its sudoers file) is checked
under the sandbox's machine-wide lock, when no instance of any dir is left.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import uuid
from ipaddress import IPv4Network, ip_address
from pathlib import Path

import pytest

from e2e import run_cli
from relaunch import sandbox as sb
from relaunch.errors import UsageError
from relaunch.sandbox import journal, network, users

NET = IPv4Network


def _out(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True).stdout


def _addresses_in(net: IPv4Network) -> list[str]:
    """This machine's addresses inside net."""
    links = json.loads(_out("ip", "-j", "-4", "addr"))
    return [a["local"] for link in links for a in link["addr_info"] if ip_address(a["local"]) in net]


def test_choose_range_skips_ranges_in_use() -> None:
    choose = network.choose_range
    # what a plain machine has: a default route, its LAN and its own addresses
    plain = [
        {"dst": "default", "gateway": "192.0.2.1", "dev": "eth0"},
        {"dst": "192.0.2.0/24", "dev": "eth0"},
        {"type": "local", "dst": "192.0.2.2", "dev": "eth0", "table": "local"},
        {"type": "local", "dst": "127.0.0.0/8", "dev": "lo", "table": "local"},
    ]
    assert choose(plain) == NET("10.213.0.0/16")
    # the sandbox's own unreachable route (or one left by an older version) is no reason to move
    assert choose([*plain, {"type": "unreachable", "dst": "10.213.0.0/16"}]) == NET("10.213.0.0/16")
    # ... but a range another sandbox dir uses is
    assert choose([{"type": "unreachable", "dst": "10.213.0.0/16"}], [NET("10.213.0.0/16")]) == NET("10.214.0.0/16")
    # a real network inside a candidate, an address in one, a route around several
    assert choose([*plain, {"dst": "10.213.7.0/24", "dev": "wg0"}]) == NET("10.214.0.0/16")
    assert choose([{"type": "local", "dst": "10.213.255.254", "dev": "dummy0"}]) == NET("10.214.0.0/16")
    assert choose([{"dst": "10.0.0.0/8", "dev": "tun0"}]) == NET("172.28.0.0/16")
    assert choose([{"dst": "10.0.0.0/8"}, {"dst": "172.28.0.0/15"}]) == NET("172.30.0.0/16")
    # other kinds of route for a candidate are not the sandbox's: someone else's
    assert choose([{"type": "blackhole", "dst": "10.213.0.0/16"}]) == NET("10.214.0.0/16")
    assert choose([{"type": "unreachable", "dst": "10.213.0.0/17"}]) == NET("10.214.0.0/16")
    with pytest.raises(UsageError, match="no free address range"):
        choose([{"dst": "10.0.0.0/8"}, {"dst": "172.16.0.0/12"}])


def test_addresses_are_slot_dot_1_and_dot_2_in_any_range() -> None:
    assert network.addresses(7, NET("10.213.0.0/16")) == ("10.213.7.1", "10.213.7.2")
    assert network.addresses(254, NET("172.29.0.0/16")) == ("172.29.254.1", "172.29.254.2")


def test_the_journal_is_roots_only_takes_in_what_older_versions_kept_under_run_and_goes_when_empty(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state, legacy = tmp_path / "var-lib" / "relaunch-sandbox", tmp_path / "run"
    legacy.mkdir()
    monkeypatch.setattr(journal, "STATE", state)
    monkeypatch.setattr(journal, "JOURNAL", state / "changes.json")
    monkeypatch.setattr(journal, "LEGACY", legacy)
    monkeypatch.setattr(journal, "LEGACY_MOUNT_POINTS", legacy / ".mount-points.json")
    # what a version before the journal recorded under /run, which a reboot empties
    (legacy / ".user-ubuntu.json").write_text('{"created": true, "password": null, "home": true}\n')
    (legacy / ".mount-points.json").write_text('["/workspace"]\n')
    journal.add("files", "/etc/sudoers.d/relaunch-sandbox")
    data = json.loads((state / "changes.json").read_text())
    assert data["users"] == {"ubuntu": {"created": True, "password": None, "home": True}}
    assert data["folders"] == ["/workspace"] and data["files"] == ["/etc/sudoers.d/relaunch-sandbox"]
    assert (state / "changes.json").stat().st_mode & 0o777 == 0o600 and state.stat().st_mode & 0o777 == 0o700
    for key, item in (("users", "ubuntu"), ("folders", "/workspace"), ("files", "/etc/sudoers.d/relaunch-sandbox")):
        journal.forget(key, item)
    assert not state.exists() and list(legacy.iterdir()) == []   # nothing recorded: nothing left of it


def _shadow(user: str) -> str | None:
    for line in Path("/etc/shadow").read_text().splitlines():
        if line.split(":")[0] == user:
            return line.split(":")[1]
    return None


def _has_group(group: str) -> bool:
    return any(line.split(":")[0] == group for line in Path("/etc/group").read_text().splitlines())


@pytest.mark.sandbox  # root: useradd
def test_a_user_the_sandbox_made_is_deleted_one_it_found_is_restored(tmp_path: Path) -> None:
    """The bookkeeping behind the `ubuntu` user, on throwaway users (the real `ubuntu` is shared)."""
    made, found = f"rlt{uuid.uuid4().hex[:8]}", f"rlt{uuid.uuid4().hex[:8]}"
    homes = {made: tmp_path / "made", found: tmp_path / "found"}
    try:
        subprocess.run(["useradd", "-M", "-d", str(homes[found]), found], check=True)
        homes[found].mkdir()
        assert _shadow(found) == "!"  # locked, as useradd leaves it
        with network.machine_lock():
            for user in (made, found):
                users.ensure_user(user, str(homes[user]))
                assert _shadow(user) == "*" and homes[user].is_dir()
                users.ensure_user(user, str(homes[user]))  # a second instance changes nothing more
            # recorded where a reboot keeps it (a reboot empties /run), root's only: it holds a hash
            recorded = journal.read()["users"]
            assert recorded[made]["created"] and not recorded[found]["created"]
            assert recorded[found]["password"] == "!"
            assert not list(network.MACHINE_DIR.glob(".user-rlt*"))
            assert journal.JOURNAL.stat().st_mode & 0o777 == 0o600 and journal.STATE.stat().st_mode & 0o777 == 0o700
            for user in (made, found):
                users.restore_user(user, str(homes[user]))
            assert made not in journal.read()["users"] and found not in journal.read()["users"]
        assert _shadow(made) is None and not _has_group(made) and not homes[made].exists()
        assert _shadow(found) == "!" and homes[found].is_dir()  # as it was
    finally:
        for user in (made, found):
            subprocess.run(["userdel", user], capture_output=True)
            with network.machine_lock():
                journal.forget("users", user)


def _create(world: Path, name: str, user: str, key: Path, home: Path) -> sb.Instance:
    """`relaunch sandbox create` in sandbox dir `world`, as a user would run it."""
    proc = run_cli("sandbox", "create", name, "--user", user, "--key", f"{key}.pub", "--json", home=home,
                   env={"RELAUNCH_SANDBOX_DIR": str(world)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    return sb.Instance(**{k: data[k] for k in ("name", "address", "user", "port", "home",
                                                "host_key_fingerprint", "index_url")})


def _destroy(world: Path, name: str, home: Path) -> None:
    proc = run_cli("sandbox", "destroy", name, home=home, env={"RELAUNCH_SANDBOX_DIR": str(world)}, timeout=120)
    assert proc.returncode == 0, proc.stderr


def _machine_state() -> dict[str, object]:
    """The shared things the sandbox may change, with whether any instance exists (under the lock)."""
    with network.machine_lock():
        return {
            "instances": sorted(network.names_everywhere()),
            "sudoers": users.SUDOERS.exists(),
            "ubuntu": _shadow("ubuntu"),
            "ubuntu_record": "ubuntu" in journal.read()["users"],
        }


def test_own_sandbox_dir_avoids_a_range_in_use_and_goes_without_a_trace(tmp_path: Path, ssh, ssh_key) -> None:
    world = Path(f"/run/relaunch-sandbox-test-{uuid.uuid4().hex[:8]}")
    dummy = f"rltd{uuid.uuid4().hex[:8]}"
    taken = "10.213.255.254"  # in the first candidate, and never an instance's (slots end at 254)
    home = tmp_path / "state"
    names = [f"w{uuid.uuid4().hex[:8]}", f"w{uuid.uuid4().hex[:8]}"]
    before = _machine_state()
    try:
        # a network of this machine that the sandbox must not shadow (no `dummy` module here: a
        # veth pair, left down, holds the address as well)
        subprocess.run(["ip", "link", "add", dummy, "type", "veth", "peer", "name", f"{dummy}p"], check=True)
        subprocess.run(["ip", "addr", "add", f"{taken}/32", "dev", dummy], check=True)

        first = _create(world, names[0], "ubuntu", ssh_key, home)
        net = IPv4Network((world / ".range").read_text().strip())
        assert ip_address(taken) not in net and ip_address(first.address) in net
        # (gone at once: other sessions need not move off 10.213 for longer than this test needs)
        subprocess.run(["ip", "link", "del", dummy], check=True)
        # X.Y.N.2 inside, X.Y.N.1 on this machine's side of its link
        assert first.address.endswith(".2") and first.address[:-1] + "1" in _addresses_in(net)
        assert f"unreachable {net}" in _out("ip", "route")
        with network.machine_lock():  # no other sandbox dir on this machine has this range
            assert [w for w in network.sandbox_dirs() - {world} if network.range_of(w) == net] == []
        assert ssh(first, "id -un; sudo -n id -un").stdout.split() == ["ubuntu", "root"]

        # the range stays while the dir has an instance
        second = _create(world, names[1], "root", ssh_key, home)
        assert ip_address(second.address) in net
        _destroy(world, names[0], home)
        assert f"unreachable {net}" in _out("ip", "route") and (world / ".range").exists()
        assert ssh(second, "echo up").stdout.strip() == "up"

        _destroy(world, names[1], home)
        # the last instance of the dir took its range with it
        assert not (world / ".range").exists() and [p.name for p in world.iterdir()] == []
        for name in names:
            assert f"rl-{name}" not in _out("ip", "netns", "list")
            assert not (network.CLAIMS / f"{name}.json").exists()
        with network.machine_lock():
            # (unless another session's dir chose the freed range since: then the route is its)
            if not [w for w in network.sandbox_dirs() if network.range_of(w) == net]:
                assert f"unreachable {net}" not in _out("ip", "route") and _addresses_in(net) == []

        # what every dir shares goes with the last instance on this machine, whoever destroys it
        after = _machine_state()
        if not after["instances"]:
            assert not after["sudoers"] and not after["ubuntu_record"]
            if not before["ubuntu_record"]:  # the user was there before any sandbox, or not at all
                assert after["ubuntu"] == before["ubuntu"]
    finally:
        for name in names:
            run_cli("sandbox", "destroy", name, home=home, env={"RELAUNCH_SANDBOX_DIR": str(world)})
        subprocess.run(["ip", "link", "del", dummy], capture_output=True)
        shutil.rmtree(world, ignore_errors=True)


@pytest.mark.sandbox  # root: a real instance, then `sandbox clean`
def test_a_reboot_loses_the_records_under_run_and_clean_still_undoes_what_the_sandbox_changed(
        tmp_path: Path, ssh_key: Path) -> None:
    """What an instance changed on this machine is in the journal (/var/lib, root's only) before it
    is made; a reboot empties /run, where the sandbox's records of the instance live (simulated:
    its claim and its folder's records removed, its processes left running), and `relaunch sandbox
    clean` still undoes it: processes, namespace, link, disks, the mount point made for it
    (/lambda/nfs/NAME), the route, and, with no instance left anywhere, the sudoers file and the
    `ubuntu` user as they were."""
    world = Path(f"/run/relaunch-sandbox-test-{uuid.uuid4().hex[:8]}")
    name = f"r{uuid.uuid4().hex[:8]}"
    home = tmp_path / "state"
    env = {"RELAUNCH_SANDBOX_DIR": str(world)}
    nfs = Path(f"/lambda/nfs/{name}")
    try:
        made = run_cli("sandbox", "create", name, "--image", "lambda", "--key", f"{ssh_key}.pub", home=home, env=env,
                       timeout=300)
        assert made.returncode == 0, made.stderr
        slot = int((world / name / "slot").read_text())
        net = (world / ".range").read_text().strip()
        assert nfs.is_dir()
        with network.machine_lock():
            recorded = journal.read()
        assert recorded["instances"][name] == {"dir": str(world), "slot": slot}
        assert net in recorded["routes"] and str(nfs) in recorded["folders"]
        assert str(users.SUDOERS) in recorded["files"] and "ubuntu" in recorded["users"]
        assert journal.JOURNAL.stat().st_mode & 0o777 == 0o600 and journal.STATE.stat().st_mode & 0o777 == 0o700

        # the reboot: every record of the instance under /run is gone (its disks stay mounted there)
        (network.CLAIMS / f"{name}.json").unlink()
        for record in ("slot", "instance.json", "image"):
            (world / name / record).unlink()
        assert f"rl-{name}" in _out("ip", "netns", "list")           # what no record names any more

        out = run_cli("sandbox", "clean", "--json", home=home, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        undone = json.loads(out.stdout)["undone"]
        assert f"removed what the instance {name} of {world} left (its records under /run were gone)" in undone
        assert f"rl-{name}" not in _out("ip", "netns", "list") and not Path(f"/sys/class/net/rlv{slot}h").exists()
        # (gone; by this clean, or by any destroy meanwhile: no instance needs it any more)
        assert not nfs.exists() and not (world / name).exists()
        after = _machine_state()
        with network.machine_lock():
            recorded = journal.read()
            assert name not in recorded["instances"] and str(nfs) not in recorded["folders"]
            if not [w for w in network.sandbox_dirs() if str(network.range_of(w)) == net]:
                assert net not in recorded["routes"] and f"unreachable {net}" not in _out("ip", "route")
        if not after["instances"]:                    # no other session's instance needs them
            assert not after["sudoers"] and not after["ubuntu_record"]
            assert str(users.SUDOERS) not in recorded["files"]
        again = run_cli("sandbox", "clean", home=home, env=env, timeout=300)
        assert again.returncode == 0, again.stderr
        assert name not in again.stdout                                   # nothing of it left to undo
    finally:
        run_cli("sandbox", "clean", home=home, env=env, timeout=300)
        shutil.rmtree(world, ignore_errors=True)


def test_create_returns_once_sshd_has_written_the_pid_file_a_console_command_enters_by(tmp_path: Path) -> None:
    """sshd accepts connections a moment before it writes its pid file, and run_in() enters the
    instance by that pid: a console command right after create() found an empty file (CI: an
    IndexError). The wait for sshd goes on until the file names it. Here a listener stands for sshd
    and the file is written only after the wait has come back to connect twice more."""
    from relaunch.sandbox import instance
    from relaunch.sandbox.processes import sshd_pid

    folder = tmp_path / "inst"
    folder.mkdir()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stand_in = subprocess.Popen(["sh", "-c", "sleep 600", f"{folder}/sshd"])   # its cmdline names the folder
    returned = threading.Event()

    def wait() -> None:
        instance._wait_for_sshd("t0", "127.0.0.1", port, stand_in, folder / "sshd.log", timeout=120,
                                pid_folder=folder)
        returned.set()

    def connected() -> None:
        try:
            listener.accept()[0].close()
        except TimeoutError:
            pytest.fail(f"the wait for sshd stopped connecting (returned: {returned.is_set()}) before the pid file "
                        "named sshd")

    waiter = threading.Thread(target=wait, daemon=True)
    try:
        waiter.start()
        listener.settimeout(60)
        for _ in range(3):                                  # it connected, and came back: not returned yet
            connected()
        assert not returned.is_set() and sshd_pid(folder) is None
        (folder / "sshd.pid").write_text("")                # being written: still not
        connected()
        assert not returned.is_set()
        (folder / "sshd.pid").write_text(f"{stand_in.pid}\n")
        assert returned.wait(timeout=60), "the wait for sshd did not end once its pid file named it"
        assert sshd_pid(folder) == stand_in.pid
    finally:
        stand_in.kill()
        stand_in.wait()
        listener.close()
