"""Living with a run: sync, status, evacuate --stop, freeze (issue 3), against sandbox instances."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from e2e import example_recipe, plain_recipe, run_cli, wait_for
from relaunch import sandbox as sb

MANIFEST = Path(".relaunch") / "manifest.json"


def stored(store: Path) -> list[str]:
    path = store / MANIFEST
    return [c["name"] for c in json.loads(path.read_text())["checkpoints"]] if path.exists() else []


def _tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(none)"


def plant(ssh, inst, step: int, size: int = 2000, mtime: int | None = None) -> str:
    name = f"ckpt-{step:08d}.pt"
    touch = f" && touch -d @{mtime} ~/ckpt/{name}" if mtime else ""
    ssh(inst, f"mkdir -p ~/ckpt && head -c {size} /dev/urandom > ~/ckpt/{name}.tmp && "
              f"mv ~/ckpt/{name}.tmp ~/ckpt/{name}{touch}")
    return name


def test_sync_once_moves_only_what_is_new_and_prunes_behind_the_newest(tmp_path, sandbox, ssh, ssh_key):
    home, inst = tmp_path / "state", sandbox()
    recipe = plain_recipe(tmp_path, name="syncing", key=ssh_key)
    store = tmp_path / "store"
    plant(ssh, inst, 5)
    plant(ssh, inst, 10)
    first = run_cli("sync", str(recipe), inst.host, "--once", "--json", home=home)
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert sorted(report["copied"]) == ["ckpt-00000005.pt", "ckpt-00000010.pt"] and report["lag_steps"] == 0

    again = run_cli("sync", str(recipe), inst.host, "--once", "--json", home=home)
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    assert report["copied"] == [] and "nothing new" in again.stderr
    assert sorted(report["already"]) == ["ckpt-00000005.pt", "ckpt-00000010.pt"]

    plant(ssh, inst, 15)
    third = run_cli("sync", str(recipe), inst.host, "--once", home=home)
    assert third.returncode == 0, third.stderr
    assert stored(store) == ["ckpt-00000010.pt", "ckpt-00000015.pt"]          # keep: 2, newest kept
    assert not (store / "ckpt-00000005.pt").exists() and (store / "ckpt-00000015.pt").exists()


def test_a_checkpoint_rotated_away_mid_copy_is_skipped_not_trusted(tmp_path, sandbox, ssh, ssh_key):
    """Where its files cannot be pinned for the copy (here checkpoint.dir is a filesystem of its
    own: no hard link can reach it from outside), a checkpoint deleted mid-copy is skipped, never
    recorded. Pinned, it is copied all the same: tests/test_pins.py."""
    home, inst = tmp_path / "state", sandbox(rate="2mbit")
    recipe = plain_recipe(tmp_path, name="rotating", key=ssh_key)
    store = tmp_path / "store"
    sb.run_in(inst.name, ["sh", "-c", f"mkdir -p {inst.home}/ckpt && mount -t tmpfs -o size=32m rotating "
                                      f"{inst.home}/ckpt"], check=True)
    plant(ssh, inst, 5)
    assert run_cli("sync", str(recipe), inst.host, "--once", home=home).returncode == 0
    plant(ssh, inst, 10, size=8_000_000)
    proc = subprocess.Popen([sys.executable, "-m", "relaunch.cli", "sync", str(recipe), inst.host, "--once"],
                            env={**os.environ, "RELAUNCH_HOME": str(home)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for("the copy to start", lambda: any((store / ".relaunch" / "partial").rglob("*")), timeout=60,
                 every=0.1)
        ssh(inst, "rm ~/ckpt/ckpt-00000010.pt")                  # the trainer's rotation
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "rotated away" in err and "ckpt-00000010.pt is copied unpinned" in err
    assert stored(store) == ["ckpt-00000005.pt"]
    assert not (store / "ckpt-00000010.pt").exists()


def test_sync_keeps_going_through_an_outage(tmp_path, sandbox, ssh, ssh_key):
    home, inst = tmp_path / "state", sandbox()
    recipe = plain_recipe(tmp_path, name="outage", key=ssh_key, ssh={"wait": 3})
    store = tmp_path / "store"
    plant(ssh, inst, 5)
    err_file = tmp_path / "sync.err"
    with open(err_file, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "relaunch.cli", "sync", str(recipe), inst.host,
                                 "--every", "1"], env={**os.environ, "RELAUNCH_HOME": str(home)},
                                stdout=subprocess.DEVNULL, stderr=err, text=True)
    try:
        wait_for("the first round", lambda: stored(store) == ["ckpt-00000005.pt"], timeout=60)
        sb.set_link(inst.name, up=False)
        # a round in flight notices within the TCP timeout (30 s) and its copy step's own three
        # attempts (20 s connect timeout each) come before the round fails: minutes on a loaded machine
        wait_for("sync to notice the outage", lambda: "retrying in" in err_file.read_text(), timeout=300,
                 explain=lambda: f"sync printed:\n{err_file.read_text()}\nits debug log:\n{_tail(home / 'debug.log')}")
        assert proc.poll() is None                             # still running
        sb.set_link(inst.name, up=True)
        plant(ssh, inst, 10)
        wait_for("the round after the outage", lambda: "ckpt-00000010.pt" in stored(store), timeout=120)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err_file.read_text()
    assert "unreachable" in err_file.read_text() or "round failed" in err_file.read_text()
    assert stored(store) == ["ckpt-00000005.pt", "ckpt-00000010.pt"]


def test_status_reports_the_lag_and_exits_4_once_training_died(tmp_path, sandbox, ssh, ssh_key):
    home, inst = tmp_path / "state", sandbox()
    recipe = plain_recipe(tmp_path, name="looking", key=ssh_key, command="echo training; sleep 600")
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    t0 = 1_700_000_000
    plant(ssh, inst, 100, mtime=t0)
    assert run_cli("sync", str(recipe), "--once", home=home).returncode == 0   # HOST: the last `up`'s
    plant(ssh, inst, 250, mtime=t0 + 180)
    result = run_cli("status", str(recipe), "--json", home=home)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["alive"] and data["newest_step"] == 250 and data["stored_step"] == 100
    assert data["lag_steps"] == 150 and data["lag_seconds"] == 180
    text = run_cli("status", str(recipe), home=home)
    assert "a loss right now would cost: 150 steps, 3.0 min" in text.stdout
    assert "training" in text.stdout                             # the log's last lines

    ssh(inst, "tmux kill-session -t =looking")
    dead = run_cli("status", str(recipe), home=home)
    assert dead.returncode == 4 and "NOT RUNNING" in dead.stdout

    sb.destroy(inst.name)
    gone = run_cli("status", str(recipe), "--set", "ssh.wait=2", home=home)
    assert gone.returncode == 3


def test_status_shows_the_instance_when_the_store_does_not_answer(tmp_path, sandbox, ssh, ssh_key, s3_remote):
    """An S3 outage is when a user most wants to know whether training still runs."""
    home, inst = tmp_path / "state", sandbox()
    s3 = s3_remote()
    recipe = plain_recipe(tmp_path, name="storedown", key=ssh_key, command="echo training; sleep 600",
                          checkpoint={"remote": f"rclone:{s3.name}:{s3.bucket}/d", "via": "local"})
    assert run_cli("up", str(recipe), inst.host, home=home, env=s3.env).returncode == 0
    plant(ssh, inst, 100)
    s3.stop()
    result = run_cli("status", str(recipe), home=home, env=s3.env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "tmux session storedown: ALIVE" in result.stdout
    assert "newest checkpoint on the instance: ckpt-00000100.pt (step 100)" in result.stdout
    assert "newest verified in the store:      unknown: the store did not answer" in result.stdout
    assert f"the store rclone:{s3.name}:{s3.bucket}/d did not answer" in result.stderr
    assert "Traceback" not in result.stderr
    data = json.loads(run_cli("status", str(recipe), "--json", home=home, env=s3.env, timeout=300).stdout)
    assert data["alive"] and data["newest_step"] == 100 and data["stored_step"] is None and data["store_error"]


def test_evacuate_stop_saves_and_stops_training_then_evacuates(tmp_path, sandbox, ssh, ssh_key, package_index):
    home, inst = tmp_path / "state", sandbox(index_dir=package_index)
    recipe = example_recipe(tmp_path / "work", name="stopping", layout="files", key=ssh_key,
                            index_url=inst.index_url, steps=100000, save_every=50, sleep=0.02)
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    wait_for("training to run", lambda: "step 20 " in ssh(inst, "cat ~/stopping.log").stdout, timeout=120)
    result = run_cli("evacuate", str(recipe), "--stop", home=home)
    assert result.returncode == 0, result.stderr
    assert "safe to destroy" in result.stderr
    log = ssh(inst, "cat ~/stopping.log").stdout
    stopped_at = int(log.split("stopped at step ")[1].split()[0])
    assert ssh(inst, "tmux has-session -t =stopping", check=False).returncode != 0     # trainer gone
    store = tmp_path / "work" / "store"
    newest = json.loads((store / MANIFEST).read_text())["checkpoints"][-1]
    assert newest["step"] == stopped_at and newest["name"] == f"ckpt-{stopped_at:08d}.pt"


def test_freeze_round_trips_to_a_new_instance(tmp_path, sandbox, ssh, ssh_key, package_index):
    home = tmp_path / "state"
    first, second = sandbox(index_dir=package_index), sandbox(user="ubuntu", index_dir=package_index)
    lock = tmp_path / "requirements.lock"
    lock.write_text("mpmath==1.3.0\n")
    recipe = plain_recipe(tmp_path, name="freezing", key=ssh_key,
                          env={"lock": str(lock), "index_url": first.index_url})
    assert run_cli("up", str(recipe), first.host, home=home).returncode == 0
    ssh(first, f"~/venvs/plain/bin/pip install -q --index-url {first.index_url} sympy==1.14.0")
    frozen = run_cli("freeze", str(recipe), "--yes", home=home)
    assert frozen.returncode == 0, frozen.stderr
    assert "+sympy==1.14.0" in frozen.stdout                      # the diff was shown
    assert lock.read_text().splitlines() == ["mpmath==1.3.0", "sympy==1.14.0"]
    unchanged = run_cli("freeze", str(recipe), home=home)
    assert unchanged.returncode == 0 and "already matches" in unchanged.stderr

    assert run_cli("up", str(recipe), second.host, home=home).returncode == 0
    show = "~/venvs/plain/bin/python -m pip freeze"
    assert ssh(second, show).stdout == ssh(first, show).stdout


def test_sync_on_a_full_local_disk_exits_6_and_deletes_nothing(tmp_path, sandbox, ssh, ssh_key):
    home, inst = tmp_path / "state", sandbox()
    store = tmp_path / "store"
    store.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(store)], check=True)
    try:
        recipe = plain_recipe(tmp_path, name="fulldisk", key=ssh_key)
        plant(ssh, inst, 5, size=500_000)
        assert run_cli("sync", str(recipe), inst.host, "--once", home=home).returncode == 0
        plant(ssh, inst, 10, size=3_000_000)
        full = run_cli("sync", str(recipe), inst.host, "--once", home=home)
        assert full.returncode == 6, full.stderr
        assert "no room in the store" in full.stderr and "nothing was deleted" in full.stderr
        assert stored(store) == ["ckpt-00000005.pt"]
        assert (store / "ckpt-00000005.pt").stat().st_size == 500_000
        assert not (store / "ckpt-00000010.pt").exists()
        assert ssh(inst, "ls ~/ckpt").stdout.split() == ["ckpt-00000005.pt", "ckpt-00000010.pt"]
    finally:
        subprocess.run(["umount", str(store)], check=True)


def test_no_message_shows_a_template_of_the_recipe(tmp_path, sandbox, ssh, ssh_key):
    """Every instance path of this recipe is a template (as a team's base recipe writes them): what
    evacuate, up, status, sync and freeze say names the rendered paths, never `{{ ... }}`."""
    home, inst = tmp_path / "state", sandbox()
    (tmp_path / "notes.txt").write_text("read me\n")
    recipe = plain_recipe(tmp_path, name="tpl", key=ssh_key, command="echo training; sleep 600",
                          env={"venv": "~/venvs/{{ name }}",
                               "files": {"notes.txt": "{{ home }}/work-{{ name }}/notes.txt"}},
                          checkpoint={"dir": "{{ home }}/ckpt/{{ name }}"},
                          run={"workdir": "{{ home }}/work-{{ name }}", "log": "~/{{ name }}.log"})
    said = []

    def cli(*args: str, code: int = 0) -> str:
        out = run_cli(*args, home=home)
        assert out.returncode == code, out.stderr
        said.append(out.stdout + out.stderr)
        return said[-1]

    # an empty new box: nothing to copy, the rendered folder named
    assert "/root/ckpt/tpl does not exist, and training has made no progress" in cli("evacuate", str(recipe), inst.host)
    cli("plan", str(recipe), inst.host)
    cli("up", str(recipe), inst.host)
    assert ssh(inst, "cat /root/work-tpl/notes.txt").stdout == "read me\n"      # env.files went where it says
    assert "last lines of /root/tpl.log:" in cli("status", str(recipe))
    cli("status", str(recipe), "--json")
    cli("sync", str(recipe), "--once")
    age = "echo $(( $(date +%s) - $(tmux display-message -p -t =tpl: '#{session_created}') ))"
    wait_for("training to outlive run.grace (3s)", lambda: int(ssh(inst, age).stdout) > 3)
    # the message: training ran, nothing saved yet
    refused = cli("evacuate", str(recipe), code=6)
    assert "/root/ckpt/tpl does not exist: destroying loses all of it" in refused
    frozen = cli("freeze", str(recipe))
    # the diff of the recipe file freeze edits shows that file's own lines, templates and all
    said[-1] = "\n".join(line for line in frozen.splitlines() if not line.startswith((" ", "+", "-", "@@")))
    cli("evacuate", str(recipe), "--stop", "--allow-empty")
    assert not [text for text in said if "{{" in text or "{%" in text]


def test_the_attach_line_up_prints_works_pasted_into_a_shell(tmp_path, sandbox, ssh, ssh_key):
    """`attach: ssh ...` as printed, run by plain ssh in a terminal (script(1) gives it one): it
    trusts the host key relaunch recorded, uses its port and key, and attaches to the session."""
    home, inst = tmp_path / "state", sandbox(image="runpod")           # a mapped port, as RunPod's
    recipe = plain_recipe(tmp_path, name="attaching", key=ssh_key, command="echo training; sleep 600")
    up = run_cli("up", str(recipe), inst.host, home=home)
    assert up.returncode == 0, up.stderr
    line = next(ln for ln in up.stderr.splitlines() if ln.startswith("  attach: ")).split("attach: ", 1)[1]
    argv = shlex.split(line)
    assert argv[:2] == ["ssh", "-t"] and "BatchMode=yes" not in line
    assert f"UserKnownHostsFile={home / 'known_hosts'}" in argv and ["-p", str(inst.port)] == argv[4:6]
    assert argv[-4:] == ["tmux", "attach", "-t", "=attaching"]
    # exactly as printed (UserKnownHostsFile replaces ~/.ssh/known_hosts: only relaunch's file vouches for
    # the host key; an unknown key would prompt, and the attach below never come)
    attached = subprocess.Popen(["script", "-qec", line, "/dev/null"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
    try:
        wait_for("the pasted line to attach", lambda: ssh(inst, "tmux list-clients -t =attaching").stdout.strip(),
                 timeout=60)
        ssh(inst, "tmux detach-client -s =attaching")
        out, _ = attached.communicate(timeout=60)
    finally:
        if attached.poll() is None:
            attached.kill()
            attached.wait()
    assert attached.returncode == 0 and b"[detached" in out, out


def test_a_login_that_cannot_see_the_run_is_told_so_and_never_offered_a_second_training(
        tmp_path, sandbox, ssh, ssh_key):
    """The issue: `ubuntu@` on a box whose run is root's. status said "NOT RUNNING", exit 4, and hinted
    `relaunch up`, which would start a second training beside the running one; evacuate called the box
    safe to destroy. Now each says whose run it is, and up refuses to start another."""
    home, box = tmp_path / "state", sandbox(image="runpod")      # root's, a PID namespace of its own
    sandbox(user="ubuntu")          # the `ubuntu` user on this machine (instances share /etc): it logs in to box too
    recipe = plain_recipe(tmp_path, name="roots", key=ssh_key, command="echo training; sleep 600")
    assert run_cli("up", str(recipe), box.host, home=home).returncode == 0
    as_ubuntu, as_root = f"ubuntu@{box.address}:{box.port}", f"root@{box.address}:{box.port}"
    whose = "no run of this recipe is visible as ubuntu, but root runs it on this box (pid "
    said = []

    status = run_cli("status", str(recipe), as_ubuntu, home=home)
    said.append(status.stdout + status.stderr)
    assert status.returncode == 4, status.stderr
    assert "tmux session roots: NOT SEEN as ubuntu" in status.stdout and whose in status.stdout
    assert f"look as root: `relaunch status RECIPE {as_root}`" in status.stderr

    evacuate = run_cli("evacuate", str(recipe), as_ubuntu, home=home)
    said.append(evacuate.stdout + evacuate.stderr)
    assert evacuate.returncode == 6 and whose in evacuate.stderr and "safe to destroy" not in evacuate.stderr
    assert f"look as root: `relaunch evacuate RECIPE {as_root}`" in evacuate.stderr

    freeze = run_cli("freeze", str(recipe), as_ubuntu, home=home)
    said.append(freeze.stdout + freeze.stderr)
    assert freeze.returncode == 4 and whose in freeze.stderr

    up = run_cli("up", str(recipe), as_ubuntu, home=home)
    said.append(up.stdout + up.stderr)
    assert up.returncode == 4 and f"{whose}" in up.stderr and "starting it here would train twice" in up.stderr
    # nothing started as ubuntu in this box (instances share one PID namespace: count by network)
    assert ssh(box, "for p in $(pgrep -u ubuntu); do [ \"$(readlink /proc/$p/ns/net)\" = "
                    "\"$(readlink /proc/self/ns/net)\" ] && echo $p; done; true").stdout == ""
    # never a hint to start it: only "no `relaunch up` while that run is there"
    assert not [text for text in said if "relaunch up` starts" in text or "run `relaunch up` first" in text]

    # as root, the run is there, and the hints are the usual ones
    assert run_cli("status", str(recipe), as_root, home=home).returncode == 0
