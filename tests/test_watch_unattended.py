"""`relaunch watch` left alone overnight: each guarantee with the fault that makes it matter, on
sandbox instances (a real sshd each), the real CLI, rsync and tmux, and `rclone serve s3` as a
store that fails and refuses. The trainer is tests/spot_trainer.py (stdlib only: nothing to
install on the instance), whose checkpoints' bytes the tests know.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e import EXAMPLE, plain_recipe, run_cli, wait_for, whole
from relaunch import sandbox as sb
from relaunch.manifest import CheckpointRecord, FileRecord, StoreManifest, utc_now
from relaunch.sandbox.instance import RUN_DIR
from relaunch.sandbox.network import netns, veths
from relaunch.transports.folder import StoreFolder
from spot_trainer import content
from test_guard import HISTORY, MANIFEST, guard_file, metadata_service, watching
from test_guard import events as lines
from test_watch import go_silent

HERE = Path(__file__).parent
TRAINER = HERE / "spot_trainer.py"


def spot_recipe(folder: Path, name: str, key: Path, *, size: int = 50_000, every: int = 20, keep: int = 3,
                sleep: float = 0.1, **sections: dict) -> Path:
    """A plain recipe (no lock: nothing installed) running spot_trainer.py from ~."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(TRAINER, folder / "spot_trainer.py")
    env = {"files": {"spot_trainer.py": "~/spot_trainer.py"}, **sections.pop("env", {})}
    return plain_recipe(folder, name=name, key=key, env=env,
                        command=f'python ~/spot_trainer.py "{{{{ checkpoint }}}}" --size {size} --every {every} '
                                f'--keep {keep} --sleep {sleep}', **sections)


def events(folder: Path) -> list[dict]:
    """The watch's events (--json), without the error line a Ctrl-C or a failure ends it with."""
    return [e for e in lines(folder) if "event" in e]


def speak_again(inst: sb.Instance) -> None:
    """Undo go_silent: the link passes packets again."""
    slot = int((RUN_DIR / inst.name / "slot").read_text())
    host_dev, inst_dev = veths(slot)
    subprocess.run(["tc", "qdisc", "del", "dev", host_dev, "root"], check=False, capture_output=True)
    subprocess.run(["ip", "netns", "exec", netns(inst.name), "tc", "qdisc", "del", "dev", inst_dev, "root"],
                   check=False, capture_output=True)


def manifest(store: Path) -> dict:
    path = store / MANIFEST
    return json.loads(path.read_text()) if path.exists() else {"checkpoints": []}


def history(store: Path) -> list[dict]:
    path = store / HISTORY
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def err_of(folder: Path) -> str:
    return (folder / "watch.err").read_text()


def steps_on(ssh, inst: sb.Instance, name: str) -> int:
    lines = [ln for ln in whole(ssh(inst, f"cat ~/{name}.log 2>/dev/null || true").stdout).splitlines()
             if ln.startswith("step ")]
    return int(lines[-1].split()[1]) if lines else 0


def steps_inside(inst: sb.Instance, name: str) -> int:
    """steps_on, read from inside the instance (sb.run_in): works while its link is down."""
    out = sb.run_in(inst.name, ["sh", "-c", f"cat {inst.home}/{name}.log 2>/dev/null || true"], capture_output=True,
                    text=True, timeout=30).stdout
    lines = [ln for ln in whole(out).splitlines() if ln.startswith("step ")]
    return int(lines[-1].split()[1]) if lines else 0


def failed_children(home: Path) -> int:
    """Commands that ended in an error, by the debug log they share (each writes `relaunch DEBUG error`)."""
    log = home / "debug.log"
    return log.read_text(errors="replace").count(" relaunch DEBUG error\n") if log.exists() else 0


def sandbox_env(key: Path, index: Path | None = None) -> dict[str, str]:
    """What examples/pytorch/rent-sandbox.sh needs to rent a sandbox instance, as a user has it."""
    env = {"RELAUNCH_SANDBOX_KEY": f"{key}.pub", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    if index is not None:
        env["RELAUNCH_INDEX"] = str(index)
    return env


# -- looks never wait on copies ------------------------------------------------------------------
def test_a_notice_mid_copy_its_save_goes_first_and_is_verified_before_the_deadline(tmp_path, sandbox, ssh, ssh_key):
    """150 MB checkpoints over a 40 Mbit/s link (about 30 s a copy) and a 60 s notice while a round
    copies an older one: the round is ended at once (its partial stays in the store's staging, nothing
    of it trusted) and the save the notice asked for is the one copied and verified, in time. A watch
    that only looks between rounds sees the notice after that round's copy and misses the deadline."""
    size = 150_000_000
    home, inst = tmp_path / "state", sandbox(rate="40mbit", disk="2G")
    name = "midcopy"
    recipe = spot_recipe(tmp_path, name, ssh_key, size=size, every=50, keep=2, sleep=0.1,
                         guard={"sources": ["file:~/RECLAIM"], "every": 1}, checkpoint={"every": 2})
    store = tmp_path / "store"
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    with watching(recipe, home, tmp_path) as watch:
        def copying() -> bool:      # a round has moved 20 MB of a checkpoint, none recorded yet
            moved = sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) if store.exists() else 0
            return moved > 20_000_000 and not manifest(store)["checkpoints"]
        wait_for("a round in the middle of a copy", copying, timeout=180, every=0.2)
        ssh(inst, "echo '{\"seconds\": 60}' > ~/RECLAIM.tmp && mv ~/RECLAIM.tmp ~/RECLAIM")
        watch.wait(timeout=300)
    err = err_of(tmp_path)
    assert watch.returncode == 0, err
    assert "reclaim notice from file:/root/RECLAIM" in err
    assert "the sync round copying meanwhile was ended: the save after the notice goes first" in err
    log = ssh(inst, f"cat ~/{name}.log").stdout
    stopped = int(log.split("stopped at step ")[1].split()[0])
    saved = f"ckpt-{stopped:08d}.pt"
    notice = guard_file(ssh, inst, "notice.json", name)
    assert notice is not None and notice["copy"]["checkpoint"] == saved
    assert notice["copy"]["verified"] is True and notice["copy"]["made_deadline"] is True, notice
    assert f"evacuated after the notice: {saved} (step {stopped}) verified in" in err and "before the deadline" in err
    # the store holds the save's bytes, byte for byte, and the history says it made the deadline
    held = hashlib.sha256((store / saved).read_bytes()).hexdigest()
    assert held == hashlib.sha256(content(stopped, size)).hexdigest()
    assert manifest(store)["checkpoints"][-1]["name"] == saved
    entry = history(store)[-1]
    assert entry["cause"] == "notice" and entry["made_deadline"] is True and entry["steps_lost"] == 0


def test_a_notice_too_short_for_the_copy_is_said_and_recorded_as_late(tmp_path, sandbox, ssh, ssh_key):
    """20 MB over an 8 Mbit/s link is a 20 s copy; a notice 3 s ahead cannot be met: the save is still
    verified (this instance does not really go away), and the watch, the notice record and the history
    all say it was NOT verified before the deadline."""
    size = 20_000_000
    home, inst = tmp_path / "state", sandbox(rate="8mbit")
    name = "late"
    recipe = spot_recipe(tmp_path, name, ssh_key, size=size, every=100000, keep=2, sleep=0.1,
                         guard={"sources": ["file:~/RECLAIM"], "every": 1}, checkpoint={"every": 600})
    store = tmp_path / "store"
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    with watching(recipe, home, tmp_path) as watch:
        wait_for("the first round", lambda: any(e["event"] == "round" for e in events(tmp_path)), timeout=60)
        ssh(inst, "echo '{\"seconds\": 3}' > ~/RECLAIM")
        watch.wait(timeout=300)
    err = err_of(tmp_path)
    assert watch.returncode == 0, err
    log = ssh(inst, f"cat ~/{name}.log").stdout
    saved = f"ckpt-{int(log.split('stopped at step ')[1].split()[0]):08d}.pt"
    assert f"evacuated after the notice: {saved}" in err and "NOT before the deadline" in err
    notice = guard_file(ssh, inst, "notice.json", name)
    assert notice is not None and notice["copy"]["verified"] is True and notice["copy"]["made_deadline"] is False
    assert "AFTER the deadline" in notice["verdict"]
    entry = history(store)[-1]
    assert entry["made_deadline"] is False and entry["steps_lost"] == 0
    assert manifest(store)["checkpoints"][-1]["name"] == saved


# this machine's clock 10 min ahead of the instance's (the instance's own clock cannot be set in a sandbox,
# which shares this machine's kernel: the watch's is moved instead, and the offset is the same)
CLOCK_AHEAD = """
import sys, time
from relaunch.cli.main import main

real = time.time
time.time = lambda: real() + 600
sys.exit(main(sys.argv[1:]))
"""


def test_a_notice_deadline_is_read_on_the_instances_clock(tmp_path, sandbox, ssh, ssh_key):
    """A 60 s notice and a copy of a few seconds: in time. This machine's clock runs 600 s ahead of the
    instance's, where the deadline was set; compared with this machine's clock, the copy was "540 s
    late". The looks measure the instance's clock, the deadline is read on it, and the offset is said."""
    home, inst = tmp_path / "state", sandbox()
    name = "skewed"
    recipe = spot_recipe(tmp_path, name, ssh_key, every=20, keep=2, sleep=0.1,
                         guard={"sources": ["file:~/RECLAIM"], "every": 1}, checkpoint={"every": 600})
    store = tmp_path / "store"
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    with watching(recipe, home, tmp_path, script=CLOCK_AHEAD) as watch:
        wait_for("the first round", lambda: any(e["event"] == "round" for e in events(tmp_path)), timeout=60)
        ssh(inst, "echo '{\"seconds\": 60}' > ~/RECLAIM")
        watch.wait(timeout=300)
    err = err_of(tmp_path)
    assert watch.returncode == 0, err
    offsets = [int(m) for m in re.findall(r"the instance's clock is (\d+)s behind this machine's", err)]
    assert offsets and all(590 <= m <= 610 for m in offsets), err
    log = ssh(inst, f"cat ~/{name}.log").stdout
    saved = f"ckpt-{int(log.split('stopped at step ')[1].split()[0]):08d}.pt"
    assert f"evacuated after the notice: {saved}" in err and "NOT before the deadline" not in err
    notice = guard_file(ssh, inst, "notice.json", name)
    assert notice is not None and notice["copy"]["made_deadline"] is True, notice
    assert -610 <= notice["copy"]["clock_offset"] <= -590
    assert history(store)[-1]["made_deadline"] is True


# -- recover.command's contract --------------------------------------------------------------------
def test_a_recover_command_that_exits_0_without_a_host_rents_nothing_more(tmp_path, sandbox, ssh_key):
    """`OK` on its last line is not a HOST: the watch stops at once, quotes what the command printed and
    never runs it again (each run may have rented and billed an instance)."""
    home, inst = tmp_path / "state", sandbox()
    runs = tmp_path / "runs.txt"
    recipe = plain_recipe(tmp_path, name="garbage", key=ssh_key, ssh={"wait": 5}, guard={"every": 1},
                          recover={"command": f"echo run >> {runs}; echo 'instance i-0abc requested' >&2; echo OK",
                                   "lost_after": 3, "attempts": 3, "timeout": 30})
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    with watching(recipe, home, tmp_path) as watch:
        wait_for("the first round", lambda: any(e["event"] == "round" for e in events(tmp_path)), timeout=60)
        go_silent(inst)
        watch.wait(timeout=180)
    err = err_of(tmp_path)
    assert watch.returncode == 3, err
    assert runs.read_text().split() == ["run"]                  # once, never again
    assert "recover.command exited 0 but its last line 'OK' is not a HOST" in err
    assert "it printed: OK | instance i-0abc requested" in err and "nothing more is rented" in err
    assert "Traceback" not in err
    assert "recover attempt 2" not in err


def test_a_rented_instance_that_refuses_the_key_is_tried_again_never_rented_twice(tmp_path, sandbox, ssh_key):
    """recover.command rented an instance (it printed its HOST) that does not take the recipe's key:
    the next attempts connect to that one again, nothing more is rented, and the watch ends (exit 3)
    saying the instance is rented and billing."""
    home, inst = tmp_path / "state", sandbox()
    work = tmp_path / "work"
    other = tmp_path / "otherkey"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    recipe = plain_recipe(work, name="wrongkey", key=ssh_key, ssh={"wait": 5}, guard={"every": 1},
                          recover={"command": "./rent-sandbox.sh", "lost_after": 3, "attempts": 2, "timeout": 120})
    shutil.copy(EXAMPLE / "rent-sandbox.sh", work / "rent-sandbox.sh")
    rented = work / "rented.txt"
    rented.write_text("")
    try:
        assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
        with watching(recipe, home, tmp_path, env={**sandbox_env(ssh_key), "RELAUNCH_SANDBOX_KEY": f"{other}.pub"}) \
                as watch:
            wait_for("the first round", lambda: any(e["event"] == "round" for e in events(tmp_path)), timeout=60)
            go_silent(inst)
            watch.wait(timeout=300)
        err = err_of(tmp_path)
        assert watch.returncode == 3, err
        names = rented.read_text().split()
        assert len(names) == 1, err                                   # rented once, never again
        host = sb.get(names[0]).host
        assert f"recover attempt 2 of 2: connecting to {host} again (rented already: nothing more is rented)" in err
        assert err.count("running recover.command") == 1
        assert f"{host} was rented by recover.command and is billing" in err and "Traceback" not in err
    finally:
        for name in rented.read_text().split():
            sb.destroy(name)


def test_a_replacement_at_an_address_seen_before_is_accepted_with_its_new_key(tmp_path, sandbox, ssh, ssh_key):
    """Providers reuse addresses: the replacement recover.command prints (HOST only, no fingerprint) has
    an address whose old key is in known_hosts. It is a new instance the user's own command just
    rented, so its key is accepted for that address; `up` there resumes the training."""
    home, first = tmp_path / "state", sandbox()
    work = tmp_path / "work"
    recipe = spot_recipe(work, "reused", ssh_key, every=10, guard={"every": 1}, checkpoint={"every": 2},
                         recover={"command": f"relaunch sandbox destroy {first.name} >&2 && "
                                             f"RELAUNCH_SANDBOX_ADDRESS={first.address} ./rent-sandbox.sh | "
                                             "cut -d' ' -f1", "lost_after": 4, "attempts": 2, "timeout": 120})
    shutil.copy(EXAMPLE / "rent-sandbox.sh", work / "rent-sandbox.sh")
    rented = work / "rented.txt"
    rented.write_text("")
    try:
        assert run_cli("up", str(recipe), first.host, home=home).returncode == 0
        with watching(recipe, home, tmp_path, env=sandbox_env(ssh_key)) as watch:
            wait_for("a verified checkpoint", lambda: manifest(work / "store")["checkpoints"], timeout=120)
            go_silent(first)
            up = wait_for("training on the replacement", lambda: next(
                (e for e in events(tmp_path) if e["event"] == "up"), None), timeout=300)
            names = rented.read_text().split()
            assert len(names) == 1
            second = sb.get(names[0])
            # the precondition of this test: the provider (the sandbox, asked to) gave the old address to
            # the new one
            assert second.address == first.address and second.host_key_fingerprint != first.host_key_fingerprint
            assert up["status"] == "started"
            after = len(events(tmp_path))
            wait_for("a round on the replacement", lambda: any(e["event"] == "round"
                                                               for e in events(tmp_path)[after:]), timeout=120)
            watch.send_signal(signal.SIGINT)
            watch.wait(timeout=60)
        err = err_of(tmp_path)
        assert "its host key is accepted for that address" in err and "HOST KEY CHANGED" not in err, err
        log = ssh(second, "cat ~/reused.log").stdout
        assert "resumed from /root/ckpt/ckpt-" in log
    finally:
        for n in rented.read_text().split():
            sb.destroy(n)


# -- lost is not decided from this machine alone ---------------------------------------------------
def test_this_machines_outage_longer_than_lost_after_rents_nothing_when_the_provider_says_it_runs(
        tmp_path, sandbox, ssh, ssh_key):
    """The link is down for three times recover.lost_after while the instance trains on; recover.alive
    (here: is the address among the sandbox's instances, as a provider CLI's `show instance` would
    say) answers that it still runs: no interruption, recover.command never runs, and once the link
    is back the watch goes on with the same instance, whose training never stopped."""
    home, inst = tmp_path / "state", sandbox()
    runs = tmp_path / "runs.txt"
    alive = tmp_path / "is-it-running.sh"
    alive.write_text("#!/bin/sh\nrelaunch sandbox list --json | python3 -c 'import json, os, sys; sys.exit(0 if any("
                     "i[\"address\"] in os.environ[\"RELAUNCH_HOST\"] for i in json.load(sys.stdin)) else 1)'\n")
    alive.chmod(0o755)
    recipe = spot_recipe(tmp_path, "outage", ssh_key, guard={"every": 1}, checkpoint={"every": 2}, ssh={"wait": 5},
                         recover={"command": f"echo run >> {runs}; exit 1", "alive": str(alive), "lost_after": 4})
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    with watching(recipe, home, tmp_path, env=env) as watch:
        wait_for("the first round", lambda: any(e["event"] == "round" for e in events(tmp_path)), timeout=60)
        before = steps_on(ssh, inst, "outage")
        sb.set_link(inst.name, up=False)
        wait_for("recover.alive's answer", lambda: "recover.alive says the provider still runs" in err_of(tmp_path),
                 timeout=60)
        # three times lost_after (a step is at least 0.1 s), still not lost: read inside the instance
        wait_for("120 steps trained through the outage", lambda: steps_inside(inst, "outage") >= before + 120,
                 timeout=120)
        sb.set_link(inst.name, up=True)
        wait_for("the watch to hear from it again", lambda: "answers again" in err_of(tmp_path), timeout=60)
        rounds = sum(e["event"] == "round" for e in events(tmp_path))
        wait_for("a round after the outage", lambda: sum(e["event"] == "round" for e in events(tmp_path)) > rounds,
                 timeout=60)
        watch.send_signal(signal.SIGINT)
        watch.wait(timeout=60)
    err = err_of(tmp_path)
    assert watch.returncode == 130, err
    assert not runs.exists()                                      # nothing was rented
    assert "not lost; nothing is rented" in err and "is lost" not in err
    assert history(tmp_path / "store") == []
    assert [e for e in events(tmp_path) if e.get("event") in ("interruption", "recover", "up")] == []
    assert ssh(inst, "tmux has-session -t =outage", check=False).returncode == 0
    assert steps_on(ssh, inst, "outage") > before + 50            # it trained through the outage
    log = ssh(inst, "cat ~/outage.log").stdout
    assert "fresh start" in log and "resumed" not in log


# a training that saved step 40 once (a fresh start only: a resume keeps the restored bytes), then runs on
SAVED_ONCE = ('if [ -z "{{ checkpoint }}" ]; then mkdir -p ~/ckpt && head -c 3000 /dev/urandom > ~/ckpt/c.tmp && '
              'mv ~/ckpt/c.tmp ~/ckpt/ckpt-00000040.pt; fi; trap "exit 0" TERM; echo "step 40"; '
              'while true; do sleep 0.2; done')
NEVER_SAVES = "trap 'exit 0' TERM; i=0; while true; do i=$((i+1)); echo \"step $i\"; sleep 0.2; done"


@pytest.mark.parametrize("case", ["held", "bytes gone", "unknown"])
def test_a_replaced_instance_that_answers_again_is_ended_only_when_the_store_holds_its_newest(case, tmp_path,
                                                                                             sandbox, ssh, ssh_key):
    """Without recover.alive an outage of the link counts as a loss: a replacement is rented and
    trains. When the first instance answers again still training, the watch ends its training (two
    trainings would write one store) only when that loses no checkpoint: `held`, the store holds its
    newest, ckpt-40, by its bytes; `bytes gone`, the manifest still records ckpt-40 but its file is
    gone from the store; `unknown`, it never saved, so how far it trained is unknown. A kill on the
    manifest's word, or on an unknown, loses training; both left running are said to bill."""
    home, first = tmp_path / "state", sandbox()
    work = tmp_path / "work"
    name = "twice"
    recipe = plain_recipe(work, name=name, key=ssh_key, command=NEVER_SAVES if case == "unknown" else SAVED_ONCE,
                          ssh={"wait": 5}, guard={"every": 1}, checkpoint={"every": 600},
                          recover={"command": "./rent-sandbox.sh", "lost_after": 4, "attempts": 2, "timeout": 120})
    shutil.copy(EXAMPLE / "rent-sandbox.sh", work / "rent-sandbox.sh")
    store = work / "store"
    rented = work / "rented.txt"
    rented.write_text("")
    try:
        assert run_cli("up", str(recipe), first.host, home=home).returncode == 0
        with watching(recipe, home, tmp_path, env=sandbox_env(ssh_key)) as watch:
            wait_for("the first round", lambda: any(e["event"] == "round" for e in events(tmp_path)), timeout=60)
            if case != "unknown":
                assert [c["name"] for c in manifest(store)["checkpoints"]] == ["ckpt-00000040.pt"]
            sb.set_link(first.name, up=False)
            wait_for("training on a replacement", lambda: any(e["event"] == "up" for e in events(tmp_path)),
                     timeout=300)
            second = sb.get(rented.read_text().split()[0])
            inside = sb.run_in(first.name, ["tmux", "has-session", "-t", f"={name}"], capture_output=True, timeout=30)
            assert inside.returncode == 0                                 # both train now
            if case == "bytes gone":
                (store / "ckpt-00000040.pt").unlink()                     # a lifecycle rule, a cleanup by hand
            sb.set_link(first.name, up=True)
            wait_for("the watch's word on the first one", lambda: f"{first.host} (replaced) answers again and"
                     in err_of(tmp_path), timeout=120)
            if case == "held":
                wait_for("the first one's training ended", lambda: ssh(first, f"tmux has-session -t ={name}",
                                                                        check=False).returncode != 0, timeout=120)
            watch.send_signal(signal.SIGINT)
            watch.wait(timeout=60)
        err = err_of(tmp_path)
        said = {"held": "was still training; it holds nothing newer than the store: its newest is ckpt-00000040.pt "
                        "(step 40), and the store holds ckpt-00000040.pt (step 40), its bytes checked now: ending "
                        "its training now. It is still billing until you destroy it",
                "bytes gone": "is still training: left running, it holds ckpt-00000040.pt (step 40), and the store "
                              "holds no checkpoint by its bytes now",
                "unknown": "is still training: left running, it holds no complete checkpoint: how far it trained "
                           "is unknown"}[case]
        assert f"{first.host} (replaced) answers again and {said}" in err, err
        if case != "held":
            assert "both are billing" in err
            assert ssh(first, f"tmux has-session -t ={name}", check=False).returncode == 0     # left running
        assert ssh(second, f"tmux has-session -t ={name}", check=False).returncode == 0       # the replacement trains
    finally:
        for n in rented.read_text().split():
            sb.destroy(n)


# -- steps lost are what training did, not what it saved -------------------------------------------
def test_steps_lost_are_counted_from_this_runs_log_when_it_is_ahead_of_the_checkpoints(tmp_path, sandbox, ssh,
                                                                                       ssh_key):
    """The store holds step 40; training resumes from it and saves nothing more for a long while
    (every 100000 steps) while its log goes on: 41, 42, ... The instance goes silent: the steps lost
    in the history are the log's newest step minus 40 (the checkpoints alone say 0). The log also
    holds an earlier run's lines, up to step 900, before this run's start line, and the watch looks
    while this run has printed no step yet: those are not this run's steps."""
    home, inst = tmp_path / "state", sandbox(command_log=True)
    name, size, verified = "ahead", 50_000, 40
    # the trainer starts once ~/go exists: the watch looks at a log whose last step is the earlier run's
    recipe = spot_recipe(tmp_path, name, ssh_key, size=size, ssh={"wait": 5}, guard={"every": 1},
                         checkpoint={"every": 2},
                         run={"command": 'while [ ! -e ~/go ]; do sleep 0.2; done; python ~/spot_trainer.py '
                                         f'"{{{{ checkpoint }}}}" --size {size} --every 100000 --sleep 0.5'},
                         recover={"command": "echo 'no capacity' >&2; exit 7", "lost_after": 3, "attempts": 1,
                                  "timeout": 30})
    store = tmp_path / "store"
    saved = f"ckpt-{verified:08d}.pt"
    data = content(verified, size)
    store.mkdir()
    (store / saved).write_bytes(data)
    StoreFolder(store).save_manifest(StoreManifest(name, {saved: CheckpointRecord(
        saved, verified, {saved: FileRecord(size, hashlib.sha256(data).hexdigest())}, utc_now(),
        "root@192.0.2.1:22")}))
    earlier = ["=== relaunch: start 2026-12-01T10:00:00Z on vm (checkpoint: none)", "fresh start",
               *(f"step {s} loss {s}" for s in (898, 899, 900))]
    ssh(inst, f"printf '%s\\n' {shlex.join(earlier)} > ~/{name}.log")
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    before = len(sb.commands(inst.name))

    def looks() -> int:
        """The watch's looks the instance was asked for so far (one at a time: the one before a
        look that arrived has answered)."""
        return sum("--rebalance" in c for c in sb.commands(inst.name)[before:])

    with watching(recipe, home, tmp_path) as watch:
        wait_for("the first round", lambda: any(e["event"] == "round" for e in events(tmp_path)), timeout=60)
        wait_for("a look before this run's first step", lambda: looks() >= 2, timeout=60)
        ssh(inst, "touch ~/go")
        wait_for("the log to run ahead of the checkpoints", lambda: steps_on(ssh, inst, name) > verified, timeout=60)
        ahead = looks()
        wait_for("a look at the log ahead", lambda: looks() >= ahead + 2, timeout=60)
        go_silent(inst)
        watch.wait(timeout=180)
    err = err_of(tmp_path)
    assert watch.returncode == 3, err
    assert "the instance is lost" in err
    log = sb.run_in(inst.name, ["cat", f"/root/{name}.log"], capture_output=True, text=True, timeout=30).stdout
    assert f"resumed from /root/ckpt/{saved} at step {verified}" in log
    assert sb.run_in(inst.name, ["ls", "/root/ckpt"], capture_output=True, text=True, timeout=30).stdout.split() == [
        saved]                                                      # nothing newer was ever saved
    this_run = [int(line.split()[1]) for line in whole(log).split(f"at step {verified}\n", 1)[1].splitlines()
                if line.startswith("step ")]
    [entry] = history(store)
    assert entry["cause"] == "lost" and entry["newest_verified_step"] == verified
    seen = entry["newest_seen_step"]
    assert seen in this_run and seen > verified                    # what this run's log showed last, not 900
    assert entry["steps_lost"] == seen - verified


# -- transient is not fatal; a refusal ends it ---------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_s3(folder: Path, port: int, keys: str, log: Path) -> subprocess.Popen:
    from conftest import tool_path

    proc = subprocess.Popen([tool_path("rclone"), "serve", "s3", "--addr", f"127.0.0.1:{port}", "--dir-cache-time",
                             "100ms", "--poll-interval", "0", "--auth-key", keys, str(folder)],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True
        except OSError:
            return proc.poll() is not None
    wait_for("rclone serve s3", listening, timeout=30, every=0.1)
    assert proc.poll() is None, log.read_text()
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def test_a_store_that_fails_once_is_tried_again_and_one_that_refuses_ends_the_watch(tmp_path, sandbox, ssh_key):
    """An S3 store (rclone serve s3) goes away for a while: the round fails, is tried again under the
    retry policy and said once, the watch goes on and the rounds work again; `status` shows the last
    error. Then the store refuses the credentials: the watch ends (exit 6) with the store's words."""
    from conftest import S3_ACCESS_KEY, S3_SECRET_KEY

    home, inst = tmp_path / "state", sandbox()
    served = tmp_path / "s3"
    (served / "bucket").mkdir(parents=True)
    port, log = _free_port(), tmp_path / "s3.log"
    keys = f"{S3_ACCESS_KEY},{S3_SECRET_KEY}"
    env = {"RCLONE_CONFIG_FLAKY_TYPE": "s3", "RCLONE_CONFIG_FLAKY_PROVIDER": "Rclone",
           "RCLONE_CONFIG_FLAKY_ENDPOINT": f"http://127.0.0.1:{port}",
           "RCLONE_CONFIG_FLAKY_ACCESS_KEY_ID": S3_ACCESS_KEY, "RCLONE_CONFIG_FLAKY_SECRET_ACCESS_KEY": S3_SECRET_KEY}
    recipe = spot_recipe(tmp_path, "flaky", ssh_key, every=10, guard={"every": 1},
                         checkpoint={"every": 2, "remote": "rclone:flaky:bucket/run"})
    server = _serve_s3(served, port, keys, log)
    try:
        assert run_cli("up", str(recipe), inst.host, home=home, env=env).returncode == 0
        with watching(recipe, home, tmp_path, env=env) as watch:
            wait_for("a checkpoint copied", lambda: any(e["event"] == "round" and e["copied"]
                                                        for e in events(tmp_path)), timeout=120)
            failed_before = failed_children(home)
            _stop(server)
            wait_for("the failure said", lambda: "sync round failed" in err_of(tmp_path), timeout=120)
            # a few more tries fail while it is away (each round's child logs its error)
            wait_for("two more failed tries", lambda: failed_children(home) >= failed_before + 3, timeout=120)
            server = _serve_s3(served, port, keys, log)
            wait_for("the rounds to work again", lambda: "sync rounds work again after" in err_of(tmp_path),
                     timeout=300)
            status = run_cli("status", str(recipe), home=home, env=env)
            assert "watch: running here" in status.stdout and "last error at" in status.stdout, status.stdout
            copied = sum(e["event"] == "round" for e in events(tmp_path))
            wait_for("another round", lambda: sum(e["event"] == "round" for e in events(tmp_path)) > copied,
                     timeout=60)
            _stop(server)
            server = _serve_s3(served, port, "someoneElsesAccessKey0,someoneElsesSecretKey0123456789", log)
            watch.wait(timeout=300)
        err = err_of(tmp_path)
        assert watch.returncode == 6, err
        assert err.count("sync round failed") == 1                 # said once, however many tries
        assert "access denied by the remote" in err.splitlines()[-2] or "access denied by the remote" in err
        assert "Traceback" not in err
    finally:
        _stop(server)


# -- rebalance is not a notice ------------------------------------------------------------------------
def test_a_rebalance_recommendation_copies_at_once_and_training_goes_on(tmp_path, sandbox, ssh, ssh_key):
    """AWS's rebalance recommendation means an elevated risk, not a reclaim: the guard records it and
    keeps watching, training keeps running, and the watch runs a round at once (rounds are otherwise
    10 minutes apart here) and records it."""
    home, inst = tmp_path / "state", sandbox()
    name = "rebalance"
    recipe = spot_recipe(tmp_path, name, ssh_key, every=10, guard={"sources": ["aws", "aws-rebalance"], "every": 1},
                         checkpoint={"every": 600})
    with metadata_service(inst, "aws", tmp_path) as metadata:
        assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
        with watching(recipe, home, tmp_path) as watch:
            wait_for("the first round", lambda: any(e["event"] == "round" for e in events(tmp_path)), timeout=60)
            wait_for("a few checkpoints more", lambda: steps_on(ssh, inst, name) >= 60, timeout=120)
            metadata.recommend_rebalance()
            wait_for("a round after the recommendation", lambda: [e["event"] for e in events(tmp_path)].count("round")
                     >= 2, timeout=60)
            wait_for("the watch to say training goes on", lambda: "training goes on" in err_of(tmp_path), timeout=60)
            watch.send_signal(signal.SIGINT)
            watch.wait(timeout=60)
    err = err_of(tmp_path)
    assert watch.returncode == 130, err
    kinds = [e["event"] for e in events(tmp_path)]
    assert kinds.index("rebalance") < len(kinds) - 1 - kinds[::-1].index("round")      # a round after it
    assert "notice" not in kinds and "training goes on" in err
    # training and the guard run on; the guard recorded it, and no notice
    assert ssh(inst, f"tmux has-session -t ={name}", check=False).returncode == 0
    assert ssh(inst, f"tmux has-session -t ={name}-guard", check=False).returncode == 0
    assert guard_file(ssh, inst, "notice.json", name) is None
    advice = guard_file(ssh, inst, "rebalance.json", name)
    assert advice is not None and advice["source"] == "aws-rebalance"
    entry = history(tmp_path / "store")[-1]
    assert entry["cause"] == "rebalance" and entry["time_to_resume"] == 0.0
    second = [e for e in events(tmp_path) if e["event"] == "round"][1]
    assert second["copied"]                                       # it copied what was new
    status = run_cli("status", str(recipe), home=home)
    assert "rebalance recommendation from aws-rebalance" in status.stdout


# -- one watch per recipe and store -------------------------------------------------------------------
def test_a_second_watch_of_the_same_recipe_says_who_holds_it_and_exits(tmp_path, sandbox, ssh_key):
    home, inst = tmp_path / "state", sandbox()
    recipe = plain_recipe(tmp_path, name="onewatch", key=ssh_key, guard={"every": 1})
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    with watching(recipe, home, tmp_path) as first:
        wait_for("the first round", lambda: any(e["event"] == "round" for e in events(tmp_path)), timeout=60)
        second = run_cli("watch", str(recipe), inst.host, home=home, timeout=60)
        assert second.returncode == 2, second.stderr
        assert f"another `relaunch watch` of onewatch on the store {tmp_path / 'store'} is running here: pid " \
               f"{first.pid}" in second.stderr
        # a watch on another machine: its lease in the store, renewed a minute ago
        other = home.parent / "elsewhere"
        lease = {"token": "gpu-box:4242:1", "machine": "gpu-box", "pid": 4242, "since": "2026-12-01T00:00:00Z",
                 "hosts": [inst.host], "renewed_epoch": time.time() - 60, "renewed": "a minute ago"}
        first.send_signal(signal.SIGINT)
        first.wait(timeout=60)
        (tmp_path / "store" / ".relaunch" / "watch.json").write_text(json.dumps(lease))
        third = run_cli("watch", str(recipe), inst.host, home=other, timeout=60)
        assert third.returncode == 2 and "holds the store" in third.stderr and "gpu-box" in third.stderr
        assert "--take-over" in third.stderr
        with subprocess.Popen([sys.executable, "-m", "relaunch.cli", "watch", str(recipe), inst.host, "--take-over",
                               "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RELAUNCH_HOME": str(other)}) as taking:
            wait_for("the lease taken over", lambda: json.loads(
                (tmp_path / "store" / ".relaunch" / "watch.json").read_text()).get("machine") != "gpu-box", timeout=60)
            taking.send_signal(signal.SIGINT)
            taking.wait(timeout=60)
        assert json.loads((tmp_path / "store" / ".relaunch" / "watch.json").read_text()) == {}   # given back


# -- node groups ------------------------------------------------------------------------------------
def test_a_group_that_loses_a_node_trains_on_the_one_left_and_grows_back_with_a_replacement(
        tmp_path, sandbox, ssh, ssh_key, package_index):
    """2 nodes x 2 processes (torchrun, gloo, DCP shards on each node's own disk); node 1 goes silent.
    With recover.shrink the watch ends the stuck training on node 0 and resumes there at once (1 x 2,
    grad_accum doubled, the global batch kept) from the newest checkpoint the store verified, rents a
    replacement meanwhile, and when it answers the group saves and comes back on 2 nodes. The history
    records both changes of shape. Every resumed step's loss matches the uninterrupted run's within the
    tolerance of tests/test_groups.py."""
    from test_groups import close, dist_recipe, losses, reference
    from test_guard import set_keys

    home = tmp_path / "state"
    n0, n1 = sandbox(index_dir=package_index), sandbox(index_dir=package_index)
    work = tmp_path / "work"
    recipe = dist_recipe(work, ssh_key, n0.index_url, steps=100000, sleep=0.3)
    shutil.copy(EXAMPLE / "rent-sandbox.sh", work / "rent-sandbox.sh")
    rented = work / "rented.txt"
    rented.write_text("")
    set_keys(recipe, guard={"every": 1}, checkpoint={"every": 2},
             recover={"command": "./rent-sandbox.sh", "shrink": True, "lost_after": 8, "attempts": 2,
                      "timeout": 300})
    store = work / "store" / "example-dist"
    try:
        assert run_cli("up", str(recipe), n0.host, n1.host, home=home).returncode == 0
        with watching(recipe, home, tmp_path, n0.host, n1.host, env=sandbox_env(ssh_key, package_index)) as watch:
            wait_for("a checkpoint of the group verified", lambda: any(c["step"] >= 20 for c in
                                                                       manifest(store)["checkpoints"]), timeout=300)
            go_silent(n1)
            shrunk = wait_for("training on node 0 alone", lambda: next(
                (e for e in events(tmp_path) if e["event"] == "up" and e.get("nodes") == [n0.host]), None),
                timeout=300)
            grown = wait_for("training on 2 nodes again", lambda: next(
                (e for e in events(tmp_path) if e["event"] == "up" and len(e.get("nodes") or []) == 2), None),
                timeout=600)
            third = sb.get(rented.read_text().split()[0])
            assert grown["nodes"] == [n0.host, third.host]
            wait_for("5 steps on the grown group", lambda: f"step {grown['step'] + 5} " in
                     ssh(n0, "cat ~/example-dist.log").stdout, timeout=300)
            watch.send_signal(signal.SIGINT)
            watch.wait(timeout=60)
        err = err_of(tmp_path)
        assert watch.returncode == 130, err
        assert "1 of 2 nodes lost" in err and "recover.shrink: training goes on on the 1 node(s) left now" in err
        assert "growing back to 2 nodes" in err
        # the replacement's env was made while node 0 trained alone, not while the group waited:
        # its venv is older than the moment training stopped to grow back
        assert err.index(f"recover: making the env on {third.host}") < err.index("growing back to 2 nodes")
        grow = next(h for h in history(store) if h["cause"] == "grow")
        made = float(ssh(third, "stat -c %Y ~/venvs/example/bin/activate").stdout)
        assert made < grow["at_epoch"], (made, grow)
        log = ssh(n0, "cat ~/example-dist.log").stdout
        assert f"at step {shrunk['step']} (world size 2, grad_accum 4)" in log
        assert f"at step {grown['step']} (world size 4, grad_accum 2)" in log
        assert grown["step"] > shrunk["step"]
        # the history: the loss of a node (2 -> 1) and the grow back (1 -> 2), each with its steps lost
        shapes = [(h["cause"], h["nodes_before"], h["nodes_after"]) for h in history(store)]
        assert shapes == [("lost", 2, 1), ("grow", 1, 2)], history(store)
        assert all(h["steps_lost"] is not None and h["time_to_resume"] > 0 for h in history(store))
        # every step trained after each resume is what the uninterrupted run trained at that step
        runs = log.split("=== relaunch: start ")
        ref = reference(tmp_path, grown["step"] + 5)
        for text in runs[-2:]:
            for step, (loss, grad) in losses(text).items():
                if step in ref:
                    assert close(loss, ref[step][0]) and close(grad, ref[step][1]), (step, loss, ref[step])
    finally:
        for name in rented.read_text().split():
            sb.destroy(name)


def test_a_notice_on_one_node_saves_the_whole_group_and_a_replacement_brings_it_back_at_full_size(
        tmp_path, sandbox, ssh, ssh_key, package_index):
    """A reclaim notice on node 1 of 2: the group saves (every node's training is asked to stop, every
    rank saves the same step), that checkpoint is evacuated from both nodes and verified; without
    recover.shrink a replacement is rented for node 1 and the group comes back at full size on node 0
    and the replacement, resumed from that save: no step lost."""
    from test_groups import dist_recipe
    from test_guard import set_keys

    home = tmp_path / "state"
    n0, n1 = sandbox(index_dir=package_index), sandbox(index_dir=package_index)
    work = tmp_path / "work"
    recipe = dist_recipe(work, ssh_key, n0.index_url, steps=100000, sleep=0.3)
    shutil.copy(EXAMPLE / "rent-sandbox.sh", work / "rent-sandbox.sh")
    rented = work / "rented.txt"
    rented.write_text("")
    set_keys(recipe, guard={"sources": ["file:~/RECLAIM"], "every": 1}, checkpoint={"every": 2},
             recover={"command": "./rent-sandbox.sh", "lost_after": 60, "attempts": 2, "timeout": 300})
    store = work / "store" / "example-dist"
    try:
        assert run_cli("up", str(recipe), n0.host, n1.host, home=home).returncode == 0
        with watching(recipe, home, tmp_path, n0.host, n1.host, env=sandbox_env(ssh_key, package_index)) as watch:
            wait_for("a checkpoint of the group verified", lambda: manifest(store)["checkpoints"], timeout=300)
            ssh(n1, "echo '{\"seconds\": 120}' > ~/RECLAIM")
            up = wait_for("the group back at full size", lambda: next(
                (e for e in events(tmp_path) if e["event"] == "up"), None), timeout=600)
            wait_for("the resumed run's first line", lambda: f"at step {up['step']} (world size 4" in
                     ssh(n0, "cat ~/example-dist.log").stdout, timeout=120)
            watch.send_signal(signal.SIGINT)
            watch.wait(timeout=60)
        err = err_of(tmp_path)
        third = sb.get(rented.read_text().split()[0])
        assert up["nodes"] == [n0.host, third.host], up
        assert f"{n1.host} (node 1): reclaim notice from file:/root/RECLAIM" in err
        assert "evacuating every node now" in err and "before the deadline" in err
        log = ssh(n0, "cat ~/example-dist.log").stdout
        stopped = int(log.split("stopped at step ")[1].split()[0])
        saved = manifest(store)["checkpoints"][-1]
        assert saved["step"] == stopped and saved["saved_with"]["world_size"] == 4
        assert {Path(p).name for p in saved["files"]} == {".metadata", "__0_0.distcp", "__1_0.distcp",
                                                           "__2_0.distcp", "__3_0.distcp"}
        assert up["step"] == stopped and f"at step {stopped} (world size 4, grad_accum 2)" in log
        entry = history(store)[-1]
        assert (entry["cause"], entry["steps_lost"], entry["made_deadline"]) == ("notice", 0, True)
        assert (entry["nodes_before"], entry["nodes_after"]) == (2, 2)
    finally:
        for name in rented.read_text().split():
            sb.destroy(name)
