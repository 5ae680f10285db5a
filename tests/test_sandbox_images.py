"""Sandbox image profiles: each stock image's facts, asserted from inside the instance over real ssh.

One instance per profile carries every check of that profile (login, Pythons, venv, pip, apt-get,
port, PID 1, a stop and a start, destroy), so the file stays fast. What each profile must show is
written out here (EXPECTED), independently of relaunch/sandbox/images.py, and compared with it.
"""

from __future__ import annotations

import glob
import hashlib
import json
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

from e2e import run_cli, wait_for
from relaunch import sandbox as sb
from relaunch.errors import UsageError
from relaunch.sandbox import freezer, images, instance, network, pythons

# what each stock image shows (the providers' documentation: recipes/providers.yaml); "~" is the login user's home
EXPECTED: dict[str, dict] = {
    "ubuntu-22.04": {"user": "ubuntu", "python": "3.10", "venv": True, "pid1": "init", "mapped_port": False,
                     "term_reaches_processes": True, "survive": ["~"], "wiped": []},
    "ubuntu-24.04": {"user": "ubuntu", "python": "3.12", "venv": False, "pid1": "init", "mapped_port": False,
                     "term_reaches_processes": True, "survive": ["~"], "wiped": []},
    "runpod": {"user": "root", "python": "3.11", "venv": True, "pid1": "start.sh", "mapped_port": True,
               "term_reaches_processes": False, "survive": ["/workspace"], "wiped": ["~"]},
    "vast": {"user": "root", "python": "3.11", "venv": True, "pid1": "start.sh", "mapped_port": True,
             "term_reaches_processes": False, "survive": ["~", "/workspace"], "wiped": []},
    "lambda": {"user": "ubuntu", "python": "3.10", "venv": True, "pid1": "init", "mapped_port": False,
               "term_reaches_processes": True, "survive": ["~", "/lambda/nfs/{name}"], "wiped": []},
    "aws-dlami": {"user": "ubuntu", "python": "3.10", "venv": True, "pid1": "init", "mapped_port": False,
                  "term_reaches_processes": True, "survive": ["~"], "wiped": ["/opt/dlami/nvme"]},
}
MOUNT_POINTS = ["/workspace", "/lambda", "/opt/dlami"]

# every python3 / python3.X on PATH, with its version
LIST_PYTHONS = r"""IFS=:; for d in $PATH; do ls "$d" 2>/dev/null; done | grep -E '^python3(\.[0-9]+)?$' | sort -u |
while read -r p; do echo "$p $("$p" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"; done"""


def _machine_traces(name: str) -> dict[str, object]:
    """What an instance may leave on this machine: mounts, its netns, its cgroups, mount points."""
    mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if f"/{name}/" in line]
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    cgroups = [str(root / f"relaunch-sandbox-{name}") for root in freezer.hierarchies().values()
               if (root / f"relaunch-sandbox-{name}").exists()]
    return {"mounts": mounts, "netns": f"rl-{name}" in netns, "cgroups": cgroups}


def _mount_points_left_that_no_instance_needs(before: dict[str, bool]) -> list[str]:
    """Mount points the sandbox made that are still here though no instance (of any session) needs them."""
    with network.machine_lock():
        needed = instance._mount_points_needed()
        return [p for p in MOUNT_POINTS + ["/lambda/nfs", "/opt/dlami/nvme"]
                if Path(p).exists() and not before.get(p, False)
                and not any(n == p or n.startswith(p + "/") for n in needed)]


def _dpkg_state() -> str:
    return hashlib.sha256(Path("/var/lib/dpkg/status").read_bytes()).hexdigest()


def _bundled_pip() -> str:
    """A pip wheel an instance can see (pip runs from its wheel): the one ensurepip bundles with 3.12."""
    bundled = pythons.relocatable("3.12").root / "lib" / "python3.12" / "ensurepip" / "_bundled"
    found = glob.glob(str(bundled / "pip-*.whl"))
    assert found, "no pip wheel bundled with this machine's CPython 3.12"
    return found[0]


@pytest.mark.parametrize("image", list(EXPECTED))
def test_profile_facts_stop_start_and_destroy(image: str, sandbox, ssh) -> None:
    want = EXPECTED[image]
    before = {p: Path(p).exists() for p in MOUNT_POINTS + ["/lambda/nfs", "/opt/dlami/nvme"]}
    dpkg = _dpkg_state()
    inst = sandbox(image=image, disk="64M", volume="32M")
    name = inst.name
    home = "/root" if want["user"] == "root" else f"/home/{want['user']}"
    survive = [p.replace("~", home).format(name=name) for p in want["survive"]]
    wiped = [p.replace("~", home).format(name=name) for p in want["wiped"]]
    assert inst.image == image and sb.get(name).image == image and sb.state(name) == "running"
    # the profile's data says what this test expects
    profile = images.PROFILES[image]
    assert sorted(profile.survivors(name, home)) == sorted(survive)
    assert profile.user == want["user"] and profile.can_pause == (image == "vast")

    # login user, home, port
    out = ssh(inst, "id -un; echo $HOME; cd && pwd; echo $SSH_CONNECTION").stdout.split("\n")
    assert out[:3] == [want["user"], home, home]
    server_port = int(out[3].split()[3])
    assert server_port == inst.port and inst.host == f"{want['user']}@{inst.address}:{inst.port}"
    assert (inst.port != 22) == want["mapped_port"]

    # which Pythons are on PATH, and venv
    pythons_on_path = dict(line.split() for line in ssh(inst, LIST_PYTHONS).stdout.strip().splitlines())
    assert pythons_on_path == {"python3": want["python"], f"python{want['python']}": want["python"]}
    venv = ssh(inst, "python3 -m venv /tmp/v && /tmp/v/bin/python -c 'import sys; print(sys.prefix)'", check=False)
    assert (venv.returncode == 0 and venv.stdout.strip() == "/tmp/v") == want["venv"], venv.stderr
    if image == "ubuntu-24.04":
        assert "ensurepip" in venv.stdout + venv.stderr
        # PEP 668: pip refuses to install outside a venv (and only there)
        wheel = _bundled_pip()
        refused = ssh(inst, f"python3 {wheel}/pip install --no-index mpmath", check=False)
        assert refused.returncode != 0 and "externally-managed-environment" in refused.stderr, refused.stderr
        inside = ssh(inst, f"python3 -m venv --without-pip /tmp/bare && /tmp/bare/bin/python {wheel}/pip install "
                           "--no-index mpmath", check=False)
        assert inside.returncode != 0 and "externally-managed" not in inside.stderr
        assert "No matching distribution" in inside.stderr, inside.stderr

    # apt-get and apt refuse, and this machine's packages are untouched
    sudo = "" if want["user"] == "root" else "sudo -n "
    for apt in ("apt-get", "apt"):
        proc = ssh(inst, f"{sudo}{apt} install -y sl", check=False)
        assert proc.returncode == 100 and "refused on a relaunch sandbox instance" in proc.stderr, proc.stderr
    assert _dpkg_state() == dpkg
    assert subprocess.run(["dpkg", "-s", "sl"], capture_output=True).returncode != 0

    # PID 1 is the image's
    assert ssh(inst, "cat /proc/1/comm").stdout.strip() == want["pid1"]
    assert open(f"/proc/{sb.pid1(name)}/comm").read().strip() == want["pid1"]

    # a stop: a process that traps TERM writes a marker on a disk that survives (by a rename: the stop's
    # SIGKILL may land while it writes, and an emptied marker would shift the words read below)
    keep = survive[0]
    ssh(inst, f"nohup bash -c 'trap \"echo TERM > {keep}/term.new && mv {keep}/term.new {keep}/term; exit 0\" TERM; "
              f"echo ready > {keep}/ready; "
              "while :; do sleep 0.1; done' >/dev/null 2>&1 &")
    wait_for("the TERM trap installed", lambda: ssh(inst, f"test -e {keep}/ready", check=False).returncode == 0,
             timeout=30, every=0.1)
    for path in survive + wiped:
        ssh(inst, f"echo {path} > {path}/mark")
    meta_before = json.loads((sb.RUN_DIR / name / "instance.json").read_text())
    grace = sb.stop(name, grace=1 if image == "vast" else None)
    assert grace == (1 if image == "vast" else profile.stop_grace)
    assert sb.state(name) == "stopped"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((inst.address, inst.port), timeout=5).close()
    with pytest.raises(UsageError, match="not running"):
        sb.run_in(name, ["true"])
    with pytest.raises(UsageError, match="stopped"):
        sb.stop(name)

    sb.start(name)
    assert sb.get(name) == inst and sb.state(name) == "running"  # same address, port, host key
    # (the known_hosts file holds the first key: ssh refuses another)
    got = ssh(inst, "for p in " + " ".join(survive + wiped) + "; do cat $p/mark 2>/dev/null || echo gone:$p; done; "
                    f"cat {keep}/term 2>/dev/null || echo no-term").stdout.split()
    assert got[:-1] == survive + [f"gone:{p}" for p in wiped]
    assert (got[-1] == "TERM") == want["term_reaches_processes"], got
    assert ssh(inst, "cat /proc/1/comm").stdout.strip() == want["pid1"]
    with pytest.raises(UsageError, match="running"):
        sb.start(name)
    if image != "vast":
        with pytest.raises(UsageError, match="cannot pause"):
            sb.pause(name)

    # destroy leaves nothing on this machine
    traces = _machine_traces(name)
    assert traces["netns"] and (bool(traces["mounts"]) == bool(profile.survivors(name, home)))
    assert bool(traces["cgroups"]) == profile.can_pause
    assert meta_before["port"] == inst.port
    assert sb.destroy(name) is True
    assert _machine_traces(name) == {"mounts": [], "netns": False, "cgroups": []}
    assert not (sb.RUN_DIR / name).exists()
    assert _mount_points_left_that_no_instance_needs(before) == []
    if image == "lambda":
        assert not Path(f"/lambda/nfs/{name}").exists()


@pytest.mark.parametrize("kind", sorted(freezer.hierarchies()))  # each cgroup hierarchy this machine has
def test_vast_pause_freezes_without_a_signal_and_resume_goes_on(kind: str, sandbox, ssh, monkeypatch) -> None:
    monkeypatch.setattr(freezer, "KINDS", (kind,))
    inst = sandbox(image="vast")
    name = inst.name
    cgroup = freezer.of(name)
    assert [c.kind for c in cgroup] == [kind]
    # a counter that notes any signal it gets; each value goes in by a rename, so the pause never
    # freezes it between emptying the file and writing it (`echo $i > tick` alone read '' once)
    pid = ssh(inst, "nohup bash -c 'trap \"echo signalled >> /workspace/signals\" TERM INT HUP CONT USR1; "
                    "i=0; while :; do i=$((i + 1)); echo $i > /workspace/tick.new; "
                    "mv /workspace/tick.new /workspace/tick; sleep 0.05; done' "
                    ">/dev/null 2>&1 & echo $!").stdout.strip()

    def tick() -> int:
        """The counter's value (0 before its first); a file that is there holds a whole number."""
        got = ssh(inst, "cat /workspace/tick 2>/dev/null || echo 0").stdout.strip()
        assert got.isdigit(), f"the counter's file held {got!r}"
        return int(got)

    wait_for("the counter", tick, timeout=30, every=0.1)

    sb.pause(name)
    assert sb.state(name) == "paused" and cgroup[0].frozen()
    # sshd is frozen too: the connection is accepted by the kernel, no banner ever comes
    argv = ["ConnectTimeout=3" if a == "ConnectTimeout=10" else a for a in ssh.argv(inst, "true")]
    silent = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert silent.returncode == 255 and "timed out" in silent.stderr, silent.stderr
    frozen_at = sb.run_in(name, ["cat", "/workspace/tick"], capture_output=True, text=True).stdout.strip()
    assert frozen_at.isdigit(), f"the paused counter's file held {frozen_at!r}"
    state = sb.run_in(name, ["cat", f"/proc/{pid}/comm"], capture_output=True, text=True)
    assert state.stdout.strip() == "bash"
    with pytest.raises(UsageError, match="paused"):
        sb.pause(name)

    sb.resume(name)
    assert sb.state(name) == "running" and not cgroup[0].frozen()
    # the same process goes on counting from where it was, and never heard a signal
    assert ssh(inst, f"cat /proc/{pid}/cmdline | tr '\\0' ' '").stdout.startswith("bash -c trap")
    wait_for("the counter to go on after resume", lambda: tick() > int(frozen_at), timeout=30, every=0.1)
    assert ssh(inst, "cat /workspace/signals 2>/dev/null || echo none").stdout.strip() == "none"

    # destroyed while paused: nothing left, the cgroup neither
    sb.pause(name)
    assert sb.destroy(name) is True
    assert _machine_traces(name) == {"mounts": [], "netns": False, "cgroups": []}


def test_cli_images_create_stop_start_pause_and_bad_input(tmp_path: Path, ssh_key: Path, ssh) -> None:
    home = tmp_path / "state"
    listed = run_cli("sandbox", "images", "--json", home=home)
    assert listed.returncode == 0 and [i["name"] for i in json.loads(listed.stdout)] == list(images.PROFILES)
    text = run_cli("sandbox", "images", home=home).stdout
    assert all(line.split()[0] in images.PROFILES for line in text.strip().splitlines())

    name = f"c{uuid.uuid4().hex[:8]}"
    try:
        made = run_cli("sandbox", "create", name, "--image", "runpod", "--key", f"{ssh_key}.pub", "--json",
                       home=home, timeout=120)
        assert made.returncode == 0, made.stderr
        data = json.loads(made.stdout)
        assert data["image"] == "runpod" and data["port"] != 22 and data["host"].endswith(f":{data['port']}")
        rows = json.loads(run_cli("sandbox", "list", "--json", home=home).stdout)
        assert {"name": name, "image": "runpod", "state": "running"}.items() <= next(
            r for r in rows if r["name"] == name).items()
        assert f"{name} " in run_cli("sandbox", "list", home=home).stdout

        # a container cannot pause; usage errors exit 2 with one JSON document, no traceback
        for argv in (["pause", name], ["resume", name], ["start", name], ["stop", name, "--grace", "-1"],
                     ["create", "x", "--image", "centos"], ["create", "x", "--image", "lambda", "--user", "root"],
                     ["create", "x", "--image", "runpod", "--volume", "lots"], ["stop", "nosuchname"]):
            proc = run_cli("sandbox", *argv, "--json", home=home, timeout=60)
            assert proc.returncode == 2, (argv, proc.stdout, proc.stderr)
            assert "Traceback" not in proc.stderr and json.loads(proc.stdout)["exit"] == 2

        stopped = run_cli("sandbox", "stop", name, "--grace", "0", "--json", home=home, timeout=60)
        assert stopped.returncode == 0 and json.loads(stopped.stdout) == {"name": name, "state": "stopped",
                                                                          "grace": 0.0}
        started = run_cli("sandbox", "start", name, "--json", home=home, timeout=60)
        assert started.returncode == 0 and json.loads(started.stdout)["state"] == "running"
        inst = sb.get(name)
        assert ssh(inst, "cat /proc/1/comm").stdout.strip() == "start.sh"
    finally:
        run_cli("sandbox", "destroy", name, home=home, timeout=120)
    assert _machine_traces(name) == {"mounts": [], "netns": False, "cgroups": []}


def test_default_image_stop_kills_everything_at_once_wipes_home_and_start_serves_again(sandbox, ssh,
                                                                                         tmp_path: Path) -> None:
    index = tmp_path / "index"
    (index / "simple").mkdir(parents=True)
    (index / "simple" / "index.html").write_text("<a href='mpmath/'>mpmath</a>\n")
    inst = sandbox(index_dir=index)
    fetch = f"python3 -c \"import urllib.request; print(urllib.request.urlopen('{inst.index_url}').read().decode())\""
    assert "mpmath" in ssh(inst, fetch).stdout
    # a process that would write a marker on TERM: the default image's stop sends none
    marker = sb.RUN_DIR / inst.name / "term"  # the instance's folder: seen here, gone with it
    ssh(inst, f"echo kept > ~/f; nohup bash -c 'trap \"echo TERM > {marker}\" TERM; "
              "echo $$ > ~/pid; while :; do sleep 0.1; done' >/dev/null 2>&1 &")
    wait_for("the trapping process", lambda: ssh(inst, "cat ~/pid", check=False).stdout.strip(), timeout=30,
             every=0.1)
    assert sb.stop(inst.name) == 0.0 and sb.state(inst.name) == "stopped"
    assert subprocess.run(["ip", "netns", "pids", f"rl-{inst.name}"], capture_output=True, text=True).stdout == ""
    assert not marker.exists()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((inst.address, 22), timeout=5).close()

    sb.start(inst.name)
    assert sb.get(inst.name) == inst and sb.state(inst.name) == "running"
    assert ssh(inst, "ls -A ~ | wc -l").stdout.strip() == "0"  # home wiped
    assert "mpmath" in ssh(inst, fetch).stdout  # the package index is served again
    assert (sb.RUN_DIR / inst.name / "sshd.pid").exists()
    assert sb.run_in(inst.name, ["true"]).returncode == 0
