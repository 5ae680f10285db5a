"""The fault matrix: every promise relaunch makes, tested with the fault that would break it.

Real sandbox instances (network namespaces with a real sshd), the real CLI, real rsync and tmux.
Each test asserts what a user relies on: the exit code, the decisive words, the store's contents
by sha256, whether a trainer runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from io import BytesIO
from pathlib import Path

import pytest

from e2e import plain_recipe, run_cli, start_cli, wait_for
from relaunch import sandbox as sb

MANIFEST = Path(".relaunch") / "manifest.json"


def records(store: Path) -> dict[str, dict]:
    path = store / MANIFEST
    return {c["name"]: c for c in json.loads(path.read_text())["checkpoints"]} if path.exists() else {}


def plant(ssh, inst, step: int, size: int = 3000, data: bytes | None = None) -> str:
    """A checkpoint file written as careful trainers do (temp name, then rename); returns its sha256."""
    name = f"ckpt-{step:08d}.pt"
    if data is None:
        ssh(inst, f"mkdir -p ~/ckpt && head -c {size} /dev/urandom > ~/ckpt/{name}.tmp && "
                  f"mv ~/ckpt/{name}.tmp ~/ckpt/{name}")
    else:
        ssh(inst, f"mkdir -p ~/ckpt && base64 -d > ~/ckpt/{name}.tmp && mv ~/ckpt/{name}.tmp ~/ckpt/{name}",
            input=__import__("base64").b64encode(data).decode())
    return ssh(inst, f"sha256sum ~/ckpt/{name}").stdout.split()[0]


def torch_like_zip(size: int = 20000) -> bytes:
    """What torch.save writes: a zip archive (its central directory at the very end)."""
    out = BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("archive/data.pkl", os.urandom(size))
    return out.getvalue()


def in_instance(inst, pattern: str) -> list[str]:
    """Command lines of processes inside the instance (its network namespace) matching pattern."""
    pids = subprocess.run(["ip", "netns", "pids", f"rl-{inst.name}"], capture_output=True, text=True).stdout.split()
    found = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if pattern in cmd:
            found.append(cmd)
    return found


def instance_pids(inst) -> list[str]:
    """Every process inside the instance (its network namespace), each as `PID START-TIME`."""
    pids = subprocess.run(["ip", "netns", "pids", f"rl-{inst.name}"], capture_output=True, text=True).stdout.split()
    alive = []
    for pid in pids:
        try:
            alive.append(f"{pid} {Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[19]}")
        except (OSError, IndexError):
            continue
    return alive


def local_processes(pattern: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if pattern in line and "ps -eo" not in line]


def received_bytes(inst) -> int:
    """Bytes this machine has received from the instance over its link so far."""
    meta = json.loads((sb.RUN_DIR / inst.name / "instance.json").read_text())
    return int(Path(f"/sys/class/net/{meta['veth'][0]}/statistics/rx_bytes").read_text())


# -- 1. a false `safe to destroy` ------------------------------------------------------------------
def test_an_earlier_runs_higher_steps_never_make_a_new_run_look_safe(tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    old, new = sandbox(), sandbox()
    recipe = plain_recipe(tmp_path, name="reuse", key=ssh_key)
    store = tmp_path / "store"
    plant(ssh, old, 900)
    plant(ssh, old, 1000)
    assert run_cli("evacuate", str(recipe), old.host, home=home).returncode == 0
    fresh = plant(ssh, new, 100)            # a new run of the same name, started by hand

    evac = run_cli("evacuate", str(recipe), new.host, "--json", home=home)
    assert evac.returncode == 0, evac.stderr
    assert "safe to destroy" in evac.stderr
    report = json.loads(evac.stdout)
    assert report["safe"] and report["newest"] == "ckpt-00000100.pt" and report["copied"] == ["ckpt-00000100.pt"]
    held = records(store)
    # what this evacuation counts on stays, verified, whatever keep says about older runs' steps
    assert held["ckpt-00000100.pt"]["files"]["ckpt-00000100.pt"]["sha256"] == fresh
    assert hashlib.sha256((store / "ckpt-00000100.pt").read_bytes()).hexdigest() == fresh
    assert {"ckpt-00000900.pt", "ckpt-00001000.pt"} <= set(held)


# -- 2. lost before the first save -------------------------------------------------------------------
def test_an_instance_lost_before_its_first_save_is_a_fresh_start(tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    first, second = sandbox(), sandbox()
    recipe = plain_recipe(tmp_path, name="early", key=ssh_key)
    sync = run_cli("sync", str(recipe), first.host, "--once", home=home)
    assert sync.returncode == 0, sync.stderr
    assert (tmp_path / "store" / ".relaunch").is_dir()           # the round wrote metadata
    sb.destroy(first.name)
    up = run_cli("up", str(recipe), second.host, home=home)
    assert up.returncode == 0, up.stderr
    assert "holds no verified checkpoint yet: fresh start" in up.stderr
    assert "training is running" in up.stderr


# -- 3. a killed evacuation ---------------------------------------------------------------------
def test_kill_9_mid_evacuate_then_a_rerun_continues_and_is_safe(tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    inst = sandbox(rate="8mbit")
    recipe = plain_recipe(tmp_path, name="killed", key=ssh_key)
    store = tmp_path / "store"
    size = 6_000_000
    want = plant(ssh, inst, 10, size=size)
    proc = start_cli("evacuate", str(recipe), inst.host, home=home, err=tmp_path / "first.err")
    try:
        staged = store / ".relaunch" / "partial"
        wait_for("a third of the copy", lambda: sum(p.stat().st_size for p in staged.rglob("*") if p.is_file())
                 > size // 3, timeout=120, every=0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    # the copy it started dies with it: nothing keeps writing into the store
    wait_for("the orphaned copy to end", lambda: not local_processes(str(staged)), timeout=30)
    assert records(store) == {}

    before = received_bytes(inst)
    rerun = run_cli("evacuate", str(recipe), inst.host, home=home)
    assert rerun.returncode == 0, rerun.stderr
    assert "safe to destroy" in rerun.stderr and "unexpected" not in rerun.stderr
    assert received_bytes(inst) - before < size * 0.8             # continued, did not start over
    assert records(store)["ckpt-00000010.pt"]["files"]["ckpt-00000010.pt"]["sha256"] == want
    assert hashlib.sha256((store / "ckpt-00000010.pt").read_bytes()).hexdigest() == want
    assert not list((store / ".relaunch" / "partial").rglob("*.pt*"))


# -- 4. Ctrl-C ---------------------------------------------------------------------------------------
def test_ctrl_c_during_up_stops_local_and_remote_work_and_a_rerun_resumes(tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    source, target = sandbox(), sandbox(rate="8mbit")
    recipe = plain_recipe(tmp_path, name="ctrlc", key=ssh_key, command='echo "resume {{ checkpoint }}"; sleep 600',
                          env={"setup": ["sleep 300 # a long install step"]})
    want = plant(ssh, source, 40, size=20_000_000)
    assert run_cli("evacuate", str(recipe), source.host, home=home).returncode == 0

    proc = start_cli("up", str(recipe), target.host, home=home, err=tmp_path / "up.err")
    try:
        wait_for("the restore and the setup to run", lambda: in_instance(target, "rsync --server")
                 and in_instance(target, "sleep 300"), timeout=120, every=0.2)
        proc.send_signal(signal.SIGINT)                # to relaunch alone, as a supervisor would
        status = proc.wait(timeout=30)                 # promptly: the bound is generous, the wait real
    finally:
        proc.kill()
    err = (tmp_path / "up.err").read_text()
    assert status == 130, err
    assert "interrupted: nothing half-written is trusted" in err
    wait_for("the instance's work to end", lambda: not in_instance(target, "sleep 300")
             and not in_instance(target, "rsync --server"), timeout=15, every=0.2)
    assert not local_processes(f"{target.address}:")
    assert ssh(target, "ls ~/ckpt 2>/dev/null || true").stdout.split() in ([], [".relaunch-incoming"])

    rerun = run_cli("up", str(recipe), target.host, "--set", "env.setup=[]", home=home)
    assert rerun.returncode == 0, rerun.stderr
    assert ssh(target, "sha256sum ~/ckpt/ckpt-00000040.pt").stdout.split()[0] == want
    log = wait_for("the command", lambda: ssh(target, "cat ~/ctrlc.log 2>/dev/null", check=False).stdout)
    assert f"resume {target.home}/ckpt/ckpt-00000040.pt" in log


# -- 6. a command that dies after a while ------------------------------------------------------------
def test_a_command_dying_8s_in_is_exit_4_with_its_last_lines(tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    inst = sandbox()
    recipe = plain_recipe(tmp_path, name="dies", key=ssh_key, run={"grace": 20},
                          command="echo loading the model; sleep 8; echo 'CUDA out of memory' >&2; exit 3")
    up = run_cli("up", str(recipe), inst.host, home=home)
    assert up.returncode == 4, up.stderr
    assert "watching the command for 20s (run.grace)" in up.stderr
    assert "the command died" in up.stderr and "(exit 3)" in up.stderr
    assert "CUDA out of memory" in up.stderr and "training is running" not in up.stderr

    ready = plain_recipe(tmp_path / "ready", name="ready", key=ssh_key, run={"grace": 300, "ready": "^step 1 "},
                         command="sleep 2; echo 'step 1 loss 0.9'; sleep 600")
    fine = run_cli("up", str(ready), inst.host, home=home)
    assert fine.returncode == 0, fine.stderr
    assert "its log says 'step 1 loss 0.9'" in fine.stderr


def test_up_takes_a_ready_line_only_once_it_is_whole(tmp_path):
    """templates/watch.py, what `up` runs to see the command start, on a log whose last line is still
    being written: `step 1` of `step 12 of 100: CUDA out of memory` matches run.ready `^step \\d+$`, the
    whole line would not. The command is gone (no tmux session): it died, it was never ready."""
    log, status = tmp_path / "run.log", tmp_path / "exit_status"
    start = "=== relaunch: start 2026-01-01T00:00:00Z on box (checkpoint: none)\nloading\n"

    def watched(text: str) -> tuple[str, str]:
        log.write_text(text)
        out = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "templates" / "watch.py"),
                              "no-such-session", str(log), str(status), r"^step \d+$", "30"], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "TMUX_TMPDIR": str(tmp_path)})
        result = json.loads(out.stdout)
        return result["state"], result["line"]

    assert watched(start + "step 1") == ("died", "")
    assert watched(start + "step 1\n") == ("ready", "step 1")


def test_a_venv_whose_creation_was_cut_short_is_made_again(tmp_path, sandbox, ssh, ssh_key):
    """A venv's python appears first and its activate script last (after ensurepip, the slow part):
    an `up` stopped in between (Ctrl-C, its lane stopped by a failing sibling, a lost connection)
    leaves a venv that only looks made. The next `up` does not trust it: it makes it again, and the
    command runs in it. (Found by the chaos test: `python: command not found` at start.)"""
    home, inst = tmp_path / "state", sandbox()
    recipe = plain_recipe(tmp_path, name="halfvenv", key=ssh_key, command="python -c 'import sys; print(sys.prefix)'; "
                          "sleep 600")
    ssh(inst, "python3.11 -m venv --without-pip ~/venvs/plain && rm ~/venvs/plain/bin/activate")
    up = run_cli("up", str(recipe), inst.host, home=home)
    assert up.returncode == 0, up.stderr
    assert "creating the venv" in up.stderr and "exists and there is no env.lock" not in up.stderr
    assert ssh(inst, "test -f ~/venvs/plain/bin/activate && echo whole").stdout.strip() == "whole"
    wait_for("the command's first line", lambda: "/root/venvs/plain" in ssh(inst, "cat ~/halfvenv.log").stdout,
             timeout=30)


def test_a_failing_setup_line_is_exit_4_naming_it_and_the_next_up_runs_the_setup_again(tmp_path, sandbox, ssh,
                                                                                         ssh_key):
    """env.setup runs like a CI `run:` step: the first failing line ends it, `up` says which line
    and what it printed, and the setup counts as done only once every line succeeded."""
    home = tmp_path / "state"
    inst = sandbox()
    setup = ["echo ok", "echo listing the dataset >&2; ls ~/dataset", "touch ~/after"]
    recipe = plain_recipe(tmp_path, name="setupfail", key=ssh_key, env={"setup": setup})
    up = run_cli("up", str(recipe), inst.host, home=home)
    assert up.returncode == 4, up.stderr
    error = up.stderr[up.stderr.index("Error:"):]
    assert f"{recipe}:" in error and "env.setup.1" in error and "ls ~/dataset" in error
    assert "listing the dataset" in error and "No such file or directory" in error
    assert "training is running" not in up.stderr and "Traceback" not in up.stderr
    assert ssh(inst, "test -e ~/after", check=False).returncode == 1          # the lines after it never ran
    assert ssh(inst, "test -e ~/.relaunch/setupfail/setup.done", check=False).returncode == 1
    assert not ssh(inst, "tmux ls 2>/dev/null || true").stdout.strip()       # nothing was started

    ssh(inst, "mkdir ~/dataset")                   # the instance fixed: the same recipe runs the setup again
    again = run_cli("up", str(recipe), inst.host, "-v", home=home)
    assert again.returncode == 0, again.stderr
    assert "setup already ran" not in again.stderr
    ssh(inst, "test -e ~/after && test -e ~/.relaunch/setupfail/setup.done")


# -- 7. nothing hangs --------------------------------------------------------------------------------
def test_a_hung_nvidia_smi_does_not_hang_up(tmp_path, sandbox, ssh, ssh_key):
    inst = sandbox()
    ssh(inst, "mkdir -p /tmp/stub && printf '#!/bin/sh\\nsleep 3600\\n' > /tmp/stub/nvidia-smi && "
              "chmod +x /tmp/stub/nvidia-smi")
    # only inside the instance: its own mount namespace
    sb.run_in(inst.name, ["mount", "--bind", "/tmp/stub", "/usr/local/bin"], check=True)
    recipe = plain_recipe(tmp_path, name="gpuhang", key=ssh_key)
    proc = start_cli("plan", str(recipe), inst.host, home=tmp_path / "state", err=tmp_path / "plan.err")
    try:
        assert proc.wait(timeout=60) == 0, (tmp_path / "plan.err").read_text()
    finally:
        proc.kill()
    assert "GPUs: unknown (nvidia-smi did not answer within 10s)" in (tmp_path / "plan.err").read_text()


def test_a_remote_command_that_keeps_printing_ends_at_its_deadline(sandbox, ssh_key):
    from relaunch.host.connection import connect
    from relaunch.host.spec import Target

    inst = sandbox()
    target = Target(inst.address, inst.user, inst.port, key=str(ssh_key), host_key=inst.host_key_fingerprint, wait=20)
    with connect(target) as remote:
        result = remote.exec("yes relaunch-never-ends", deadline=3)
        assert result.timed_out and result.status is None and len(result.stdout) > 1000
        wait_for("its process group to be ended on the instance",
                 lambda: not in_instance(inst, "yes relaunch-never-ends"), timeout=10, every=0.2)
        assert remote.exec("echo still usable", deadline=10).text == "still usable\n"


def test_a_command_whose_connection_is_closed_under_it_has_no_exit_status(sandbox, ssh_key):
    """Another lane gives up on the host and closes the shared connection while this command runs
    (the link went down): the command has no exit status, which the executor takes as a lost
    connection (a transient ConnectError: `sync` retries through an outage), not as an exit -1 of
    the command (an EvacuationError that ended `sync` in a CI run)."""
    import threading

    from relaunch.host.connection import connect
    from relaunch.host.spec import Target

    inst = sandbox()
    target = Target(inst.address, inst.user, inst.port, key=str(ssh_key), host_key=inst.host_key_fingerprint, wait=20)
    with connect(target) as remote:
        started = threading.Event()
        closer = threading.Thread(target=lambda: started.wait(30) and remote.conn.transport.close())
        closer.start()
        result = remote.exec("echo begun; sleep 60", deadline=120,
                             on_output=lambda data: started.set() if b"begun" in data else None)
        closer.join(timeout=30)
    assert started.is_set()
    assert result.status is None and not result.timed_out, result
    assert "the SSH connection was lost" in result.stderr.decode()


def test_the_store_lock_wait_is_bounded_and_names_the_holder(tmp_path, sandbox, ssh, ssh_key):
    import fcntl

    from relaunch.transports.local import LocalPathStore
    from relaunch.ui import UI

    home = tmp_path / "state"
    inst = sandbox()
    recipe = plain_recipe(tmp_path, name="locked", key=ssh_key)
    plant(ssh, inst, 5)
    os.environ["RELAUNCH_HOME"] = str(home)
    try:
        store = LocalPathStore(tmp_path / "store", "locked")
        with store.lock(UI(quiet=True)):                  # this test process is the writer now
            lock = next((home / "locks").glob("*.lock"))
            assert json.loads(lock.read_text())["pid"] == os.getpid()
            evac = run_cli("evacuate", str(recipe), inst.host, home=home, env={"RELAUNCH_LOCK_WAIT": "2"})
            with open(lock) as handle:                    # still ours: the waiter gave up, it did not steal it
                with pytest.raises(BlockingIOError):
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        del os.environ["RELAUNCH_HOME"]
    assert evac.returncode == 6, evac.stderr
    assert f"(pid {os.getpid()}, since " in evac.stderr and "after 2s" in evac.stderr
    assert "DO NOT destroy" in evac.stderr and records(tmp_path / "store") == {}


# -- 8. damaged checkpoints --------------------------------------------------------------------------
def test_a_flipped_byte_in_the_store_falls_back_to_the_newest_that_verifies(tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    first, second = sandbox(), sandbox()
    recipe = plain_recipe(tmp_path, name="flip", key=ssh_key, command='echo "resume {{ checkpoint }}"; sleep 600')
    store = tmp_path / "store"
    older = plant(ssh, first, 10)
    plant(ssh, first, 20)
    assert run_cli("evacuate", str(recipe), first.host, home=home).returncode == 0
    damaged = store / "ckpt-00000020.pt"
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0xFF
    damaged.write_bytes(bytes(data))

    up = run_cli("up", str(recipe), second.host, home=home)
    assert up.returncode == 0, up.stderr
    assert "ckpt-00000020.pt in the store" in up.stderr and "is damaged and kept as it is" in up.stderr
    assert "restored ckpt-00000010.pt" in up.stderr
    assert ssh(second, "sha256sum ~/ckpt/ckpt-00000010.pt").stdout.split()[0] == older
    assert ssh(second, "ls ~/ckpt").stdout.split() == ["ckpt-00000010.pt"]
    assert damaged.read_bytes() == bytes(data) and "ckpt-00000020.pt" in records(store)   # kept, never deleted

    third = sandbox()
    nothing = run_cli("plan", str(recipe), third.host, "--checkpoint", "ckpt-00000099.pt", home=home)
    assert nothing.returncode == 5, nothing.stderr
    assert "no such verified checkpoint" in nothing.stderr
    assert "the store holds: ckpt-00000010.pt, ckpt-00000020.pt" in nothing.stderr
    asked = run_cli("up", str(recipe), third.host, "--checkpoint", "ckpt-00000010.pt", home=home)
    assert asked.returncode == 0, asked.stderr
    assert "ckpt-00000010.pt (step 10) from the store, as asked (--checkpoint)" in asked.stderr


def test_a_truncated_torch_save_on_the_instance_is_never_trusted(tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    inst, other = sandbox(), sandbox()
    recipe = plain_recipe(tmp_path, name="trunc", key=ssh_key, command='echo "resume {{ checkpoint }}"; sleep 600')
    whole = torch_like_zip()
    good = plant(ssh, inst, 10, data=whole)
    plant(ssh, inst, 20, data=whole[: len(whole) // 2])            # a crash half-way through torch.save
    evac = run_cli("evacuate", str(recipe), inst.host, home=home)
    assert evac.returncode == 0, evac.stderr
    assert "ckpt-00000020.pt is damaged on the instance" in evac.stderr and "truncated zip" in evac.stderr
    held = records(tmp_path / "store")
    assert list(held) == ["ckpt-00000010.pt"]
    assert held["ckpt-00000010.pt"]["files"]["ckpt-00000010.pt"]["sha256"] == good

    # an `up` on an instance that holds a newer but truncated save resumes from the verified one
    plant(ssh, other, 30, data=whole[:-100])
    up = run_cli("up", str(recipe), other.host, home=home)
    assert up.returncode == 0, up.stderr
    assert "ckpt-00000030.pt on the instance is a save that did not finish" in up.stderr
    log = wait_for("the command", lambda: ssh(other, "cat ~/trunc.log 2>/dev/null", check=False).stdout)
    assert f"resume {other.home}/ckpt/ckpt-00000010.pt" in log


# -- 9. say what was verified ------------------------------------------------------------------------
def test_evacuate_says_which_hashes_were_compared_where(tmp_path, sandbox, ssh, ssh_key):
    inst = sandbox()
    recipe = plain_recipe(tmp_path, name="said", key=ssh_key)
    plant(ssh, inst, 5)
    evac = run_cli("evacuate", str(recipe), inst.host, home=tmp_path / "state")
    assert evac.returncode == 0, evac.stderr
    assert "sha256 computed on the instance = sha256 of the copy, computed here" in evac.stderr
    again = run_cli("sync", str(recipe), inst.host, "--once", home=tmp_path / "state")
    assert "same sizes as their verified copies" in again.stderr


# -- 10. store credentials stay out of training ------------------------------------------------------
def test_store_credentials_reach_the_instance_only_for_a_copy(tmp_path, sandbox, ssh, ssh_key, s3_remote,
                                                              package_index):
    from conftest import host_side_address

    home = tmp_path / "state"
    first, second = sandbox(index_dir=package_index), sandbox(index_dir=package_index)
    s3 = s3_remote(bind=host_side_address(second))
    secret = s3.env[f"RCLONE_CONFIG_{s3.name.upper()}_SECRET_ACCESS_KEY"]
    # the old advice: the store's variables listed as training secrets, beside a real one
    recipe = plain_recipe(tmp_path, name="creds", key=ssh_key,
                          env={"index_url": first.index_url, "secrets": [*sorted(s3.env), "TRAIN_TOKEN"]},
                          checkpoint={"remote": f"rclone:{s3.name}:{s3.bucket}/c", "via": "instance"})
    env = {**s3.env, "TRAIN_TOKEN": "train-token-value-7"}
    plant(ssh, first, 5)
    assert run_cli("evacuate", str(recipe), first.host, home=home, env=env).returncode == 0
    up = run_cli("up", str(recipe), second.host, home=home, env=env)
    assert up.returncode == 0, up.stderr
    assert "the credentials of the store" in up.stderr and "remove them from env.secrets" in up.stderr
    for inst in (first, second):
        leftovers = ssh(inst, "cat ~/.relaunch/creds/*.env 2>/dev/null || true").stdout
        assert secret not in leftovers
    assert "train-token-value-7" in ssh(second, "cat ~/.relaunch/creds/secrets.env").stdout
    assert ssh(second, "ls ~/.relaunch/creds/store.env 2>/dev/null || true").stdout == ""


def test_a_relaunch_killed_as_the_copy_starts_leaves_no_credentials_on_the_instance(tmp_path, sandbox, ssh, ssh_key,
                                                                                   s3_remote, package_index):
    """kill -9 of relaunch at the moment the instance gets the store's credentials. They used to go
    to a file first, removed by the copy when it started: relaunch killed in between (found by the
    chaos test's long run) left the file on the instance's disk for good."""
    from conftest import host_side_address

    inst = sandbox(index_dir=package_index, command_log=True)
    s3 = s3_remote(bind=host_side_address(inst))
    secret = s3.env[f"RCLONE_CONFIG_{s3.name.upper()}_SECRET_ACCESS_KEY"]
    recipe = plain_recipe(tmp_path, name="killedcreds", key=ssh_key, env={"index_url": inst.index_url},
                          checkpoint={"remote": f"rclone:{s3.name}:{s3.bucket}/k", "via": "instance"})
    plant(ssh, inst, 5)
    before = set(instance_pids(inst))
    proc = start_cli("evacuate", str(recipe), inst.host, home=tmp_path / "state", env=s3.env, err=tmp_path / "err")
    try:
        # the first command that hands the credentials over (a file of them, or the copy itself)
        wait_for("the credentials handed over", lambda: any(
            "store.env" in c or "--files-from0 - " in c for c in sb.commands(inst.name)), timeout=300, every=0.01)
        proc.kill()
    finally:
        proc.kill()
        proc.wait()
    # whatever was on its way lands: every process the killed relaunch had started there has ended
    wait_for("the killed relaunch's commands on the instance to end",
             lambda: not set(instance_pids(inst)) - before, timeout=120, every=0.1)
    # nothing of it on a command line there (checked before the grep below, which names it)
    assert not [c[:300] for c in sb.commands(inst.name) if secret in c]
    on_disk = ssh(inst, f"grep -rl -- {secret} ~ /tmp 2>/dev/null; true").stdout.strip()
    assert on_disk == "", f"the store's secret is on the instance's disk: {on_disk}"
    # the next evacuate copies and verifies as always
    again = run_cli("evacuate", str(recipe), inst.host, home=tmp_path / "state", env=s3.env)
    assert again.returncode == 0 and "safe to destroy" in again.stderr, again.stderr


# -- 13. messages ------------------------------------------------------------------------------------
@pytest.mark.sandbox  # root: a blackhole route
def test_an_unreachable_address_is_said_so_in_one_line(tmp_path, ssh_key):
    address = "192.0.2.77"                              # TEST-NET-1: never a real host
    subprocess.run(["ip", "route", "add", "blackhole", f"{address}/32"], check=True)
    try:
        # no route never mends: said after one attempt, far within ssh.wait (FAST: see below)
        recipe = plain_recipe(tmp_path, name="nowhere", key=ssh_key, ssh={"wait": 600})
        result = run_cli("plan", str(recipe), f"root@{address}", home=tmp_path / "state", timeout=FAST)
    finally:
        subprocess.run(["ip", "route", "del", "blackhole", f"{address}/32"], check=True)
    assert result.returncode == 3, result.stderr
    assert "no route to the host" in result.stderr and "invalid argument" not in result.stderr
    assert len([ln for ln in result.stderr.splitlines() if ln.startswith("Error:")]) == 1
    assert "retrying" not in result.stderr, result.stderr


# What waiting cannot mend is said at once, with its fix: after one attempt (no "retrying"). Each
# command gets ssh.wait=600 and a deadline far below it (the subprocess timeout): a command that
# waited would miss it.
FAST = 30


def test_no_key_anywhere_is_said_at_once_naming_the_fix(tmp_path, sandbox):
    inst = sandbox()
    home = tmp_path / "home"                    # no ~/.ssh, no ssh-agent: a new user's machine
    (home).mkdir()
    result = run_cli("adopt", inst.host, "-o", str(tmp_path / "adopted.yaml"), "--set", "ssh.wait=600",
                     home=tmp_path / "state", env={"HOME": str(home), "SSH_AUTH_SOCK": ""}, timeout=FAST)
    assert result.returncode == 3, result.stderr
    error = result.stderr.split("Error:")[1]
    assert f"no SSH key to offer as {inst.user}" in error and "no ssh-agent runs" in error, error
    assert "--set ssh.key=PATH" in error and "ssh-add" in error, error
    assert "retrying" not in result.stderr and "banner" not in result.stderr and "ssh.wait" not in error


def test_a_refused_key_is_said_at_once_naming_the_fix(tmp_path, sandbox):
    inst = sandbox()
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    recipe = plain_recipe(tmp_path, name="refused", key=other, ssh={"wait": 600})
    result = run_cli("status", str(recipe), inst.host, home=tmp_path / "state", timeout=FAST)
    assert result.returncode == 3, result.stderr
    error = result.stderr.split("Error:")[1]
    assert f"authentication refused for user root with key {other}" in error, error
    assert "--set ssh.key=PATH" in error and "ssh-add" in error and "USER@" in error, error
    assert "retrying" not in result.stderr and "ssh.wait" not in error    # one attempt, not a grace


def test_a_refused_port_on_a_running_instance_is_said_at_once_naming_the_fix(tmp_path, sandbox, ssh_key):
    inst = sandbox()
    recipe = plain_recipe(tmp_path, name="port", key=ssh_key, ssh={"wait": 600})
    result = run_cli("status", str(recipe), f"root@{inst.address}:2222", home=tmp_path / "state", timeout=FAST)
    assert result.returncode == 3, result.stderr
    error = result.stderr.split("Error:")[1]
    assert "connection refused on port 2222" in error and "USER@ADDRESS:PORT" in error, error
    assert "retrying" not in result.stderr and "ssh.wait" not in error


def test_up_gives_a_refused_key_a_short_grace_and_leaves_no_connection_open(tmp_path, sandbox):
    """Each failed attempt's connection is closed: sshd kept them for its LoginGraceTime, and past
    MaxStartups (10) dropped new ones before their banner ("no SSH banner" from a running sshd)."""
    inst = sandbox()
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    recipe = plain_recipe(tmp_path, name="grace", key=other, ssh={"wait": 600})
    err = tmp_path / "err"
    proc = start_cli("up", str(recipe), inst.host, home=tmp_path / "state", err=err)
    try:
        # several refused attempts later (the key's grace is 20 s, the line comes after 15 s)
        wait_for("the grace's progress line", lambda: "still waiting for SSH" in err.read_text(), timeout=FAST,
                 every=0.1, explain=err.read_text)
        held = subprocess.run(["ip", "netns", "exec", f"rl-{inst.name}", "ss", "-Htn", "state", "established",
                               "sport", "=", ":22"], capture_output=True, text=True, check=True).stdout
        assert proc.wait(timeout=FAST) == 3
    finally:
        proc.kill()
    assert len(held.splitlines()) <= 1, held
    text = err.read_text()
    assert "left of the 20s a new instance's key may take, Ctrl-C stops" in text, text
    assert f"authentication refused for user root with key {other}" in text.split("Error:")[1]


@pytest.mark.parametrize("index", [True, False], ids=["index", "no-index"])
def test_without_a_lock_uv_makes_the_venv_where_the_recipe_names_an_index(tmp_path, sandbox, ssh, ssh_key, index):
    """No lock, installer uv (the default): with env.index_url, uv makes the venv, as it does with a
    lock, and pip is in it as `python -m venv` would leave it (for a package added by hand, then
    `relaunch freeze`). With no index named, `python -m venv` makes it and nothing is fetched from
    any index: an instance that reaches none (this one) spends no time on uv and pip's retries."""
    inst = sandbox() if index else sandbox(index_dir=None)
    recipe = plain_recipe(tmp_path, name="nolock", key=ssh_key, **({} if index else {"env": {"index_url": None}}))
    up = run_cli("up", str(recipe), inst.host, "-v", home=tmp_path / "state")
    assert up.returncode == 0, up.stderr
    made_by_uv = "uv = " in ssh(inst, "cat ~/venvs/plain/pyvenv.cfg").stdout
    assert made_by_uv == index
    pip = ssh(inst, "~/venvs/plain/bin/python -m pip --version").stdout
    assert "/root/venvs/plain/" in pip, pip
    assert (ssh(inst, "test -e ~/.relaunch/tools", check=False).returncode == 0) == index
    assert "pypi.org" not in up.stderr and "Retrying" not in up.stderr


@pytest.mark.parametrize("lock", [True, False], ids=["lock", "no-lock"])
def test_uv_missing_from_the_index_falls_back_to_pip(tmp_path, sandbox, ssh, ssh_key, package_index, lock):
    """uv is the default installer; an index without it (a mirror of only the lock's packages)
    must still give a working venv, with pip, and say so."""
    index = tmp_path / "index"
    (index / "simple").mkdir(parents=True)
    shutil.copytree(package_index / "simple" / "mpmath", index / "simple" / "mpmath")
    (index / "files").mkdir()
    for wheel in (package_index / "files").glob("mpmath-*"):
        shutil.copy(wheel, index / "files")
    inst = sandbox(index_dir=index)
    env = {"index_url": inst.index_url}
    if lock:
        (tmp_path / "requirements.lock").write_text("mpmath==1.3.0\n")
        env["lock"] = str(tmp_path / "requirements.lock")
    recipe = plain_recipe(tmp_path, name="nouv", key=ssh_key, env=env)
    up = run_cli("up", str(recipe), inst.host, "-v", home=tmp_path / "state")
    assert up.returncode == 0, up.stderr
    assert "uv = " not in ssh(inst, "cat ~/venvs/plain/pyvenv.cfg").stdout
    assert "/root/venvs/plain/" in ssh(inst, "~/venvs/plain/bin/python -m pip --version").stdout
    if not lock:
        assert "uv is not on the package index; making the venv with python -m venv instead" in up.stderr
        return
    assert "uv is not on the package index; installing with pip instead" in up.stderr
    assert ssh(inst, "~/venvs/plain/bin/python -c 'import mpmath; print(mpmath.__version__)'").stdout.strip() == "1.3.0"
    assert "pip freeze matches the lock" in up.stderr


def test_a_bad_lock_names_the_package(tmp_path, sandbox, ssh_key, package_index):
    inst = sandbox(index_dir=package_index)
    lock = tmp_path / "requirements.lock"
    lock.write_text("mpmath==1.3.0\nnosuchpackage-relaunch==1.0\n")
    recipe = plain_recipe(tmp_path, name="badlock", key=ssh_key,
                          env={"lock": str(lock), "index_url": inst.index_url, "installer": "uv"})
    up = run_cli("up", str(recipe), inst.host, home=tmp_path / "state")
    assert up.returncode == 4, up.stderr
    error = next(ln for ln in up.stderr.splitlines() if ln.startswith("Error:"))
    assert "installing the lock failed" in error and "nosuchpackage-relaunch" in error
    assert "Traceback" not in up.stderr
