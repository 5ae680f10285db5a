"""`relaunch drill` by hand on one node, against a training that saves often: a save lands
between any look at the log and the kill that follows it. The drill decides on a paused world
(the training's process group stopped, a last copy-off round, the log read again), so the
checkpoint it resumes from always has steps after it that were run before the interruption. The
trainer leaves the process group relaunch recorded, as torchrun's workers do: the drill pauses and
kills by the process tree."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from e2e import plain_recipe, run_cli, wait_for

TRAINER = Path(__file__).with_name("chaos_trainer.py")


def often_saving_recipe(folder: Path, name: str, key: Path, **more: str) -> Path:
    """A save every 10 steps of 0.05 s, by a trainer out of relaunch's recorded process group."""
    shutil.copy(TRAINER, folder / "chaos_trainer.py")
    return plain_recipe(folder, name=name, key=key, command='python ~/chaos_trainer.py "{{ checkpoint }}"',
                        env={"files": {"chaos_trainer.py": "~/chaos_trainer.py"},
                             "vars": {"CHAOS_EVERY": "10", "CHAOS_TICK": "0.05", "CHAOS_OWN_SESSION": "1", **more}},
                        checkpoint={"keep": 3})


def test_drill_compares_every_step_run_twice_though_saves_come_every_half_second(tmp_path, sandbox, ssh, ssh_key):
    """More steps lost (7 or more) than the drill trains after the resume by default (5), and the
    resumed run's steps slower than the drill's looks at its log: every step run twice is still
    compared, none left out because the resumed run had not reached it yet."""
    home, inst = tmp_path / "state", sandbox()
    recipe = often_saving_recipe(tmp_path, "drilled", ssh_key, CHAOS_TICK_RESUMED="1.2")
    drill = run_cli("drill", str(recipe), inst.host, "--past", "7", "--json", home=home, timeout=600)
    assert drill.returncode == 0, drill.stderr
    result = json.loads(drill.stdout)
    assert result["continuous"] and result["rows"], result
    assert result["steps_lost"] == result["interrupted_at"] - result["resumed_at"] >= 7
    assert [row["step"] for row in result["rows"]] == list(range(result["resumed_at"] + 1,
                                                                 result["interrupted_at"] + 1))
    # the world: the resumed training read the checkpoint the drill names, and the store holds it
    starts = ssh(inst, "cat ~/starts.log").stdout.splitlines()
    assert starts[0] == "fresh" and starts[-1].startswith(f"resumed {result['checkpoint']} "), starts
    assert int(starts[-1].split()[-1]) == result["resumed_at"]
    assert (tmp_path / "store" / result["checkpoint"]).is_file()


# `relaunch drill ARGS` whose Ctrl-C (a real SIGINT to itself) lands the moment the pause has
# reached every node, before the drill's next statement: the narrowest place a Ctrl-C can land
# while training is held, and one a Ctrl-C from outside hits only now and then.
CTRL_C_AS_THE_PAUSE_LANDS = """
import os, signal, sys
from relaunch.cli.main import main
from relaunch.drill import by_hand

send = by_hand._signal

def send_then_ctrl_c(recipe, specs, name, ui):
    send(recipe, specs, name, ui)
    if name == "STOP":
        os.kill(os.getpid(), signal.SIGINT)

by_hand._signal = send_then_ctrl_c
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_while_the_drill_holds_training_paused_lets_it_train_on(tmp_path, sandbox, ssh, ssh_key):
    home, inst = tmp_path / "state", sandbox()
    recipe = often_saving_recipe(tmp_path, "held", ssh_key)
    drill = run_cli("drill", str(recipe), inst.host, "--past", "3", home=home, timeout=600,
                    script=CTRL_C_AS_THE_PAUSE_LANDS)
    assert drill.returncode == 130, drill.stderr
    assert "drill 2/5" not in drill.stdout + drill.stderr, drill.stdout + drill.stderr
    steps = int(ssh(inst, "grep -c '^step ' ~/held.log").stdout)
    wait_for("the training to run on", lambda: int(ssh(inst, "grep -c '^step ' ~/held.log").stdout) > steps + 10,
             timeout=60)
    assert ssh(inst, "tmux has-session -t =held", check=False).returncode == 0


def test_interrupt_destroy_is_refused_before_anything_starts(tmp_path):
    """A node that is not a sandbox instance, or a group of one: exit 2 before any connection (the
    drill would otherwise train, pause the training, and only then find it cannot destroy)."""
    home = tmp_path / "state"
    recipe = plain_recipe(tmp_path, name="refused", key=tmp_path / "none", ssh={"wait": 60})
    one = run_cli("drill", str(recipe), "203.0.113.9", "--interrupt", "destroy", "--set", "ssh.key=", home=home,
                  timeout=60)
    assert one.returncode == 2 and "needs a group" in one.stderr, one.stderr
    two = run_cli("drill", str(recipe), "203.0.113.9", "203.0.113.10", "--interrupt", "destroy", "--set", "ssh.key=",
                  home=home, timeout=60)
    assert two.returncode == 2 and "203.0.113.10" in two.stderr and "is not one" in two.stderr, two.stderr
    assert "connecting" not in one.stderr + two.stderr


def test_the_drill_compares_whole_log_lines_only(tmp_path):
    """The drill reads the log of a training it paused (SIGSTOP), which may stop mid-line: `step 12
    loss 0.4` of `step 12 loss 0.45 grad_norm 1.2` is not step 12's loss, and is not read as one."""
    from relaunch.drill.by_hand import _metrics
    from relaunch.recipe import load_recipe

    recipe = load_recipe(plain_recipe(tmp_path, name="paused", key=tmp_path / "key",
                                      run={"metrics": {"grad_norm": r"grad_norm ([\d.]+)"}}))
    log = "=== relaunch: start 2026-01-01T00:00:00Z on box (checkpoint: none)\nstep 11 loss 0.5 grad_norm 1.3\n"
    assert _metrics(recipe, log + "step 12 loss 0.4") == {11: (0.5, 1.3)}
    assert _metrics(recipe, log + "step 12 loss 0.45 grad_norm 1.2\n") == {11: (0.5, 1.3), 12: (0.45, 1.2)}
