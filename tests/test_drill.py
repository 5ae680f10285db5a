"""`relaunch drill` by hand on one node, against a training that saves often: a save lands
between any look at the log and the kill that follows it. The drill decides on a paused world
(the training's process group stopped, a last copy-off round, the log read again), so the
checkpoint it resumes from always has steps after it that were run before the interruption."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from e2e import plain_recipe, run_cli

TRAINER = Path(__file__).with_name("chaos_trainer.py")


def test_drill_compares_steps_run_twice_though_saves_come_every_half_second(tmp_path, sandbox, ssh, ssh_key):
    home, inst = tmp_path / "state", sandbox()
    shutil.copy(TRAINER, tmp_path / "chaos_trainer.py")
    recipe = plain_recipe(tmp_path, name="drilled", key=ssh_key, command='python ~/chaos_trainer.py "{{ checkpoint }}"',
                          env={"files": {"chaos_trainer.py": "~/chaos_trainer.py"},
                               "vars": {"CHAOS_EVERY": "10", "CHAOS_TICK": "0.05"}},
                          checkpoint={"keep": 3})
    drill = run_cli("drill", str(recipe), inst.host, "--past", "3", "--json", home=home, timeout=600)
    assert drill.returncode == 0, drill.stderr
    result = json.loads(drill.stdout)
    assert result["continuous"] and result["rows"], result
    assert result["steps_lost"] == result["interrupted_at"] - result["resumed_at"] >= 3
    assert [row["step"] for row in result["rows"]] == list(range(result["resumed_at"] + 1,
                                                                 result["interrupted_at"] + 1))
    # the world: the resumed training read the checkpoint the drill names, and the store holds it
    starts = ssh(inst, "cat ~/starts.log").stdout.splitlines()
    assert starts[0] == "fresh" and starts[-1].startswith(f"resumed {result['checkpoint']} "), starts
    assert int(starts[-1].split()[-1]) == result["resumed_at"]
    assert (tmp_path / "store" / result["checkpoint"]).is_file()
