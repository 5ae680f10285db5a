"""Asking training to stop reaches the training, and only the training: a run started by hand (no
pgid file: the foreground group of its tmux pane), and never a process group a stale pgid file names
(one written before a reboot, whose number another group now has). Real sandbox instances.
"""

from __future__ import annotations

import json

import pytest

from e2e import plain_recipe, run_cli, wait_for
from relaunch.cycle import stop_training
from relaunch.host.spec import HostSpec
from relaunch.recipe import load_recipe
from relaunch.ui import UI
from test_adopt import adopt, bare_venv, has_checkpoint, start_in_tmux

# saves only when asked to stop (SIGTERM): the checkpoint evacuate --stop must find is that one
SAVES_ON_TERM = r'''
import argparse, os, signal, time
from helpers import say

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--resume", default="")
a = p.parse_args()
os.makedirs(a.out, exist_ok=True)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
with open(os.path.expanduser("~/train.pid"), "w") as f:
    f.write(str(os.getpid()))
step = int(open(a.resume).read()) if a.resume else 0
while not stop:
    step += 1
    time.sleep(0.1)
    say(f"step {step} loss 0.5")
path = os.path.join(a.out, f"ckpt-{step:08d}.pt")
with open(path + ".tmp", "w") as f:
    f.write(str(step))
os.replace(path + ".tmp", path)
with open(os.path.expanduser("~/stopped"), "w") as f:
    f.write(str(step))
'''


# where the run's output goes: the pane, or a file (bash then runs the command as its child, and the
# stop must not end bash: the pane's processes would be hung up in the middle of the save)
@pytest.mark.parametrize("output", ["", " > ~/train.log 2>&1"], ids=["pane", "file"])
def test_evacuate_stop_reaches_a_run_started_by_hand_in_tmux(output, tmp_path, sandbox, ssh, ssh_key):
    home, inst = tmp_path / "state", sandbox()
    bare_venv(ssh, inst, SAVES_ON_TERM)
    start_in_tmux(ssh, inst, "byhand", "~/venv/bin/python train.py --out ~/ckpt" + output)
    shown = "cat ~/train.log" if output else "tmux capture-pane -p -t =byhand:"
    wait_for("the run started by hand to train", lambda: "step 20 " in ssh(inst, shown).stdout, timeout=120)
    out = tmp_path / "adopted" / "recipe.yaml"
    out.parent.mkdir()
    adopted = adopt(inst.host, "-o", str(out), "--set", "checkpoint.dir=~/ckpt", "--set", "checkpoint.layout=files",
                    home=home, key=ssh_key)
    assert adopted.returncode == 0, adopted.stderr
    evacuated = run_cli("evacuate", str(out), inst.host, "--stop", "--json", home=home)
    assert evacuated.returncode == 0, evacuated.stderr
    assert f"safe to destroy {inst.host}" in evacuated.stderr
    stopped = int(ssh(inst, "cat ~/stopped").stdout)           # the trainer got the stop and saved
    # the save the stop asked for is in the store, by step and bytes
    manifest = json.loads((out.parent / "store" / "byhand" / ".relaunch" / "manifest.json").read_text())
    newest = max(manifest["checkpoints"], key=lambda c: c["step"])
    assert newest["step"] == stopped and has_checkpoint(ssh, inst, "~/ckpt", stopped)
    assert (out.parent / "store" / "byhand" / newest["name"]).read_text() == str(stopped)
    # the trainer is gone (its own pid: pgrep would see other instances' processes, they share this PID space)
    assert ssh(inst, "kill -0 $(cat ~/train.pid)", check=False).returncode != 0


def live_group(ssh, inst) -> int:
    """A process group of its own, unrelated to any training (setsid: its pid is its group)."""
    pid = int(ssh(inst, "setsid sleep 600 >/dev/null 2>&1 < /dev/null & echo $!").stdout.split()[0])
    wait_for("the unrelated group to run", lambda: ssh(inst, f"kill -0 -- -{pid}", check=False).returncode == 0,
             timeout=30, every=0.1)
    return pid


@pytest.mark.parametrize("written", ["another boot", "an earlier relaunch"])
def test_a_stale_pgid_file_never_ends_another_process_group(written, tmp_path, sandbox, ssh, ssh_key, monkeypatch):
    monkeypatch.setenv("RELAUNCH_HOME", str(tmp_path / "state"))
    inst = sandbox()
    recipe = load_recipe(plain_recipe(tmp_path / "work", name="stale", key=ssh_key))
    other = live_group(ssh, inst)
    start = ssh(inst, f"sed 's/.*) //' /proc/{other}/stat | cut -d' ' -f20").stdout.strip()
    # what a reboot leaves: the run's pgid file, no exit status, no tmux session; the number is now
    # another group's (forced here: the unrelated group's own pid)
    line = f"{other} {start} 00000000-0000-0000-0000-000000000000" if written == "another boot" else f"{other}"
    ssh(inst, f"mkdir -p ~/.relaunch/stale && echo '{line}' > ~/.relaunch/stale/pgid")
    stop_training(recipe, [HostSpec.parse(inst.host)], UI(quiet=True))
    assert ssh(inst, f"kill -0 -- -{other}", check=False).returncode == 0, "a stale pgid file ended another group"


def test_the_recorded_group_of_this_boot_is_ended(tmp_path, sandbox, ssh, ssh_key, monkeypatch):
    """The other side of the stale test: a group relaunch started this boot is ended by the same call."""
    home, inst = tmp_path / "state", sandbox()
    monkeypatch.setenv("RELAUNCH_HOME", str(home))
    recipe_path = plain_recipe(tmp_path / "work", name="live", key=ssh_key, command="sleep 600")
    up = run_cli("up", str(recipe_path), inst.host, home=home)
    assert up.returncode == 0, up.stderr
    group = int(ssh(inst, "cat ~/.relaunch/live/pgid").stdout.split()[0])
    stop_training(load_recipe(recipe_path), [HostSpec.parse(inst.host)], UI(quiet=True))
    assert ssh(inst, f"kill -0 -- -{group}", check=False).returncode != 0
