"""`relaunch watch` when the instance goes silent: it is declared lost, recover.command rents a
replacement (a new sandbox instance here), `up` runs there and training resumes from the newest
verified checkpoint, without anyone typing a command; the store's history records it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from e2e import EXAMPLE, example_recipe, plain_recipe, run_cli, wait_for
from relaunch import sandbox as sb
from relaunch.sandbox.instance import RUN_DIR
from relaunch.sandbox.network import netns, veths
from test_guard import HISTORY, MANIFEST, events, set_keys, step_lines, watching


def go_silent(inst: sb.Instance) -> None:
    """Every packet to and from the instance dropped without a word, as a powered-off machine does."""
    slot = int((RUN_DIR / inst.name / "slot").read_text())
    host_dev, inst_dev = veths(slot)
    drop = ["tc", "qdisc", "replace", "dev", "DEV", "root", "tbf", "rate", "8bit", "burst", "10", "limit", "1"]
    subprocess.run([*drop[:4], host_dev, *drop[5:]], check=True)
    subprocess.run(["ip", "netns", "exec", netns(inst.name), *drop[:4], inst_dev, *drop[5:]], check=True)


def test_a_lost_instance_is_replaced_and_training_resumes_there(tmp_path, sandbox, ssh, ssh_key, package_index):
    home, first = tmp_path / "state", sandbox(index_dir=package_index)
    work = tmp_path / "work"
    recipe = example_recipe(work, name="lost", layout="files", key=ssh_key, index_url=first.index_url,
                            steps=100000, save_every=20, sleep=0.05, keep=2)
    # the README's sandbox recover.command: it writes each name into rented.txt before renting,
    # so that this test's teardown destroys whatever it made
    shutil.copy(EXAMPLE / "rent-sandbox.sh", work / "rent-sandbox.sh")
    created = work / "rented.txt"
    created.write_text("")
    set_keys(recipe, checkpoint={"every": 2}, guard={"every": 1},
             recover={"command": "./rent-sandbox.sh", "lost_after": 8, "attempts": 2, "timeout": 300})
    store = work / "store"
    env = {"RELAUNCH_INDEX": str(package_index), "RELAUNCH_SANDBOX_KEY": f"{ssh_key}.pub",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}      # `relaunch` as a user has it
    try:
        assert run_cli("up", str(recipe), first.host, home=home).returncode == 0
        with watching(recipe, home, tmp_path, env=env) as watch:
            def stored_step() -> int:
                path = store / MANIFEST
                checkpoints = json.loads(path.read_text())["checkpoints"] if path.exists() else []
                return checkpoints[-1]["step"] if checkpoints else 0
            wait_for("a few verified checkpoints", lambda: stored_step() >= 60, timeout=180)
            go_silent(first)
            up = wait_for("training to run on a replacement", lambda: next(
                (e for e in events(tmp_path) if e["event"] == "up" and first.address not in e["host"]), None),
                timeout=600)
            names = created.read_text().split()
            assert len(names) == 1
            second = sb.get(names[0])
            assert up["status"] == "started" and second.address in up["host"]
            # a round on the new host: the watch goes on there
            wait_for("a sync round on the replacement", lambda: any(
                e["event"] == "round" and second.address in e["host"] for e in events(tmp_path)), timeout=120)
            watch.send_signal(signal.SIGINT)
            watch.wait(timeout=60)
        err = (tmp_path / "watch.err").read_text()
        assert watch.returncode == 130, err
        assert err.strip().endswith("watch stopped (Ctrl-C); the training was not touched and goes on")
        assert "the instance is lost" in err and "recover.command gave" in err and "recovered: training started" in err

        # the history: one interruption, its lost steps and the time until training ran again
        history = [json.loads(line) for line in (store / HISTORY).read_text().splitlines()]
        assert len(history) == 1, history
        entry = history[0]
        assert entry["cause"] == "lost" and entry["host"] == first.host
        seen, verified = entry["newest_seen_step"], entry["newest_verified_step"]
        assert seen is not None and verified is not None and seen >= verified >= 60
        assert entry["steps_lost"] == seen - verified
        assert entry["resumed_host"] == f"{second.user}@{second.address}:22" and entry["time_to_resume"] > 0
        assert entry["resumed_epoch"] > entry["at_epoch"]

        # training resumed on the replacement from the newest verified checkpoint at the time
        log = ssh(second, "cat ~/lost.log").stdout
        assert f"resumed from /root/ckpt/ckpt-{verified:08d}.pt at step {verified}" in log
        assert min(step_lines(log)) == verified + 1
        # Ctrl-C stopped the watch, not the training
        assert ssh(second, "tmux has-session -t =lost", check=False).returncode == 0
        assert ssh(second, "tmux has-session -t =lost-guard", check=False).returncode == 0
        # `status` now looks at the new host (the last `up`) and shows the interruption
        status = run_cli("status", str(recipe), home=home)
        assert status.returncode == 0, status.stderr
        assert second.address in status.stdout and "interruptions (the last 1" in status.stdout
        assert f"{first.host} lost (no answer for" in status.stdout
    finally:
        for name in created.read_text().split():
            sb.destroy(name)


def test_a_recover_command_that_fails_ends_the_watch_with_one_line(tmp_path, sandbox, ssh_key):
    """Bounded: recover.attempts tries, then exit 3 with the command's own words; the interruption
    is on record even though nothing runs again."""
    home, inst = tmp_path / "state", sandbox()
    recipe = plain_recipe(tmp_path, name="norecover", key=ssh_key, command="sleep 600", ssh={"wait": 5},
                          guard={"every": 1},
                          recover={"command": "echo 'no capacity in any region' >&2; exit 7", "lost_after": 3,
                                   "attempts": 2, "timeout": 30})
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    with watching(recipe, home, tmp_path) as watch:
        wait_for("the first round", lambda: any(e["event"] == "round" for e in events(tmp_path)), timeout=60)
        go_silent(inst)
        watch.wait(timeout=300)
    err = (tmp_path / "watch.err").read_text()
    assert watch.returncode == 3, err
    assert "recover attempt 1 of 2 failed: recover.command failed (exit 7): no capacity in any region" in err
    assert "Error: recover.command failed (exit 7): no capacity in any region" in err and "Traceback" not in err
    assert err.count("running recover.command") == 2
    history = [json.loads(line) for line in (tmp_path / "store" / HISTORY).read_text().splitlines()]
    assert [(h["cause"], h["host"], h["resumed_host"]) for h in history] == [("lost", inst.host, None)]


def waiting_recipe(tmp_path: Path, ssh_key: Path, name: str) -> Path:
    """No recover.command: a lost instance is waited for (a look every second, lost after 3 s)."""
    return plain_recipe(tmp_path, name=name, key=ssh_key, command="sleep 600", ssh={"wait": 5},
                        guard={"every": 1}, recover={"lost_after": 3})


def wait_for_the_wait(tmp_path: Path) -> None:
    wait_for("the watch to wait for the instance", lambda: "waiting for it to answer again" in
             (tmp_path / "watch.err").read_text(), timeout=120)


# `relaunch watch ARGS` whose Ctrl-C (a real SIGINT to itself) lands the moment it has said that
# training runs again (its `up` event): the user, or a script reading --json, acts on that line.
CTRL_C_AS_TRAINING_RUNS_AGAIN = """
import os, signal, sys
from relaunch.cli.main import main
from relaunch.watch.state import WatchBase

emit = WatchBase.emit

def emit_then_ctrl_c(self, event, **data):
    emit(self, event, **data)
    if event == "up":
        os.kill(os.getpid(), signal.SIGINT)

WatchBase.emit = emit_then_ctrl_c
sys.exit(main(sys.argv[1:]))
"""


def test_without_recover_command_the_watch_waits_and_restarts_training_where_it_comes_back(tmp_path, sandbox,
                                                                                           ssh, ssh_key):
    """A paused instance (Vast.ai outbid) that comes back after a reboot: no recover.command, so the
    watch waits for the same host and runs `up` there once it answers without training. A Ctrl-C
    the moment it says so finds the resumption in the history already."""
    home, inst = tmp_path / "state", sandbox()
    recipe = waiting_recipe(tmp_path, ssh_key, "paused")
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    with watching(recipe, home, tmp_path, script=CTRL_C_AS_TRAINING_RUNS_AGAIN) as watch:
        wait_for("the first round", lambda: any(e["event"] == "round" for e in events(tmp_path)), timeout=60)
        sb.set_link(inst.name, up=False)
        wait_for_the_wait(tmp_path)
        # meanwhile the instance restarted: its tmux server and training are gone, no exit status written
        sb.run_in(inst.name, ["tmux", "kill-server"], capture_output=True, timeout=30)
        sb.set_link(inst.name, up=True)
        watch.wait(timeout=180)
    err = (tmp_path / "watch.err").read_text()
    assert any(e["event"] == "up" for e in events(tmp_path)), err
    assert watch.returncode == 130, err
    assert "back; training is not running: `up` there" in err and "recover.command" in err
    entry = json.loads((tmp_path / "store" / HISTORY).read_text().splitlines()[-1])
    assert entry["cause"] == "lost" and entry["host"] == entry["resumed_host"] == inst.host
    assert entry["time_to_resume"] > 0
    assert ssh(inst, "tmux has-session -t =paused", check=False).returncode == 0     # Ctrl-C left training alone


def test_a_look_sent_before_the_outage_that_answers_after_it_does_not_count_as_the_instance_now(
        tmp_path, sandbox, ssh, ssh_key):
    """A look under way when the link went down answers once it is back, with what it saw before:
    training running. The instance restarted meanwhile; the watch must `up` there, not take the old
    answer for "training is still running". The look is held at its read of the log (a fifo whose
    writer the test holds open) after it printed the training's state, so the old answer is there
    every time, not only when the race goes that way."""
    home, inst = tmp_path / "state", sandbox()
    recipe = waiting_recipe(tmp_path, ssh_key, "held")
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    with watching(recipe, home, tmp_path) as watch:
        wait_for("the first round", lambda: any(e["event"] == "round" for e in events(tmp_path)), timeout=60)
        # training's tee keeps writing the old log file; the path becomes a fifo the next look's tail waits on
        ssh(inst, "rm ~/held.log && mkfifo ~/held.log && { nohup bash -c 'exec 3>\"$HOME/held.log\"; "
                  "echo $$ > \"$HOME/look-held\"; exec sleep 600' >/dev/null 2>&1 </dev/null & }")
        wait_for("a look held at the log, its training state already printed",
                 lambda: ssh(inst, "test -s ~/look-held", check=False).returncode == 0, timeout=60)
        sb.set_link(inst.name, up=False)
        sb.run_in(inst.name, ["tmux", "kill-server"], capture_output=True, timeout=30)   # the restart
        wait_for_the_wait(tmp_path)
        sb.set_link(inst.name, up=True)
        # the held look answers now, with what it saw before the outage
        ssh(inst, "rm ~/held.log && kill $(cat ~/look-held)")
        wait_for("training to run there again", lambda: any(e["event"] == "up" for e in events(tmp_path)),
                 timeout=180)
        watch.send_signal(signal.SIGINT)
        watch.wait(timeout=60)
    err = (tmp_path / "watch.err").read_text()
    assert watch.returncode == 130, err
    assert "back, and training is still running there" not in err, err
    assert "back; training is not running: `up` there" in err, err
    entry = json.loads((tmp_path / "store" / HISTORY).read_text().splitlines()[-1])
    assert entry["cause"] == "lost" and entry["host"] == entry["resumed_host"] == inst.host
