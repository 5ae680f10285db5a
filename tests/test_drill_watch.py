"""`relaunch drill --watch`: the real `relaunch watch` left alone beside training while the drill
raises a reclaim notice (the guard's file: source) and then silences the instance it moved to;
recover.command (examples/pytorch/rent-sandbox.sh) rents sandbox instances. The report's numbers
are checked against the world: the store's history (what the watch recorded), the training logs
on every instance (read here over SSH or inside the instance), and tests/spot_trainer.py's loss
formula. No timing is asserted, only how the times add up.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from e2e import EXAMPLE, run_cli, whole
from relaunch import sandbox as sb
from relaunch.drill.follow import Line
from relaunch.drill.timeline import Measured, measure
from relaunch.history import Interruption
from relaunch.recipe.model import Metrics
from spot_trainer import loss
from test_guard import HISTORY, guard_file
from test_watch_unattended import sandbox_env, spot_recipe

NOTICE_FILE = "~/.relaunch/{name}/drill-notice"


def drill_recipe(folder: Path, name: str, key: Path, every: int = 50, **recover: object) -> Path:
    """spot_trainer.py (stdlib: nothing installed), a step every 0.1 s, a checkpoint every `every`
    steps (50: 5 s, longer than a sync round, so the newest verified checkpoint does not change
    between the drill's look and its silencing the link), rent-sandbox.sh beside it."""
    recipe = spot_recipe(folder, name, key, every=every, sleep=0.1, guard={"every": 1}, checkpoint={"every": 2},
                         recover={"command": "./rent-sandbox.sh", "lost_after": 6, "attempts": 2, "timeout": 120,
                                  **recover})
    shutil.copy(EXAMPLE / "rent-sandbox.sh", folder / "rent-sandbox.sh")
    (folder / "rented.txt").write_text("")
    return recipe


def env_for(tmp_path: Path, key: Path) -> dict[str, str]:
    index = tmp_path / "index"                       # spot_trainer needs no package: an empty index
    (index / "simple").mkdir(parents=True, exist_ok=True)
    return sandbox_env(key, index)


def rented_names(folder: Path) -> list[str]:
    path = folder / "rented.txt"
    return path.read_text().split() if path.exists() else []


def destroy_rented(folder: Path) -> None:
    for name in rented_names(folder):
        sb.destroy(name)


def history(store: Path) -> list[dict]:
    path = store / HISTORY
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def steps(log: str) -> list[int]:
    """The step numbers of the last run in a log (after the last start line)."""
    text = whole(log).rsplit("=== relaunch: start ", 1)[-1]
    return [int(line.split()[1]) for line in text.splitlines() if line.startswith("step ")]


def resumed_at(log: str) -> int:
    return int(log.rsplit("resumed from ", 1)[1].split(" at step ")[1].split()[0])


def assert_times_add_up(report: dict) -> None:
    gaps = report["interruptions"]
    assert report["without_training_seconds"] == round(sum(g["seconds_without_training"] for g in gaps), 3)
    assert report["redo_seconds"] == round(sum(g["redo_seconds"] for g in gaps), 3)
    parts = report["productive_seconds"] + report["without_training_seconds"] + report["redo_seconds"]
    assert abs(parts - report["wall_seconds"]) < 0.01, report
    assert 0 < report["goodput"] < 1
    assert report["goodput"] == round(report["productive_seconds"] / report["wall_seconds"], 4)
    assert report["badput"] == round(1 - report["productive_seconds"] / report["wall_seconds"], 4)
    for g in gaps:        # measured from the step lines: the last before and the first after, as seen
        assert g["seconds_without_training"] == round(g["first_after_at"] - g["last_before_at"], 3) > 0


# -- end to end -------------------------------------------------------------------------------------
def test_a_notice_then_a_silent_loss_recovered_by_the_watch_and_measured_from_the_world(tmp_path, sandbox, ssh,
                                                                                         ssh_key):
    home, inst, work = tmp_path / "state", sandbox(), tmp_path / "work"
    name = "drillw"
    recipe = drill_recipe(work, name, ssh_key)
    store = work / "store"
    try:
        drill = run_cli("drill", str(recipe), inst.host, "--watch", "--keep", "--json", home=home,
                        env=env_for(tmp_path, ssh_key), timeout=600)
        assert drill.returncode == 0, drill.stderr
        report = json.loads(drill.stdout)
        first, second = (sb.get(n) for n in rented_names(work))     # --keep: the two replacements are there
        assert report["injected"] == ["notice", "lost"] and report["passed"] and report["failures"] == []

        # the injections happened: the guard saw the drill's file, then the watch declared the instance lost
        notice = guard_file(ssh, inst, "notice.json", name)
        assert notice is not None and notice["source"] == f"file:/root/.relaunch/{name}/drill-notice"
        assert ssh(inst, f"test -e {NOTICE_FILE.format(name=name)}", check=False).returncode != 0   # removed
        records = history(store)
        assert [(r["cause"], r["host"], r["resumed_host"]) for r in records] == [
            ("notice", inst.host, first.host), ("lost", first.host, second.host)]
        assert records[0]["made_deadline"] is True and records[0]["steps_lost"] == 0
        gap1, gap2 = report["interruptions"]
        assert (gap1["record"], gap2["record"]) == (records[0], records[1])     # each matched with its record
        assert (gap1["before_host"], gap1["after_host"], gap2["before_host"], gap2["after_host"]) == (
            inst.host, first.host, first.host, second.host)

        # the notice: the guard's save on the instance, resumed on the first replacement at the next step
        log0 = ssh(inst, f"cat ~/{name}.log").stdout
        stopped = int(log0.split("stopped at step ")[1].split()[0])
        assert gap1["last_before"] == max(steps(log0)) == stopped == records[0]["newest_verified_step"]
        log1 = sb.run_in(first.name, ["cat", f"/root/{name}.log"], capture_output=True, text=True, timeout=30).stdout
        assert resumed_at(log1) == stopped and gap1["resumed_from"] == stopped and gap1["first_after"] == stopped + 1
        assert min(steps(log1)) == stopped + 1 and gap1["steps_lost"] == 0 and gap1["rows"] == []

        # the silent loss: the first replacement trained on in the dark (its log, read inside it), the
        # second resumed from the store's newest verified checkpoint and trained the lost steps again
        verified = records[1]["newest_verified_step"]
        assert gap2["last_before"] in steps(log1) and gap2["last_before"] < max(steps(log1))
        assert gap2["last_before"] >= verified + 3                     # --past 3: at least 3 steps lost
        log2 = ssh(second, f"cat ~/{name}.log").stdout
        assert resumed_at(log2) == verified == gap2["resumed_from"] and min(steps(log2)) == gap2["first_after"]
        assert gap2["steps_lost"] == gap2["last_before"] - verified
        assert [row["step"] for row in gap2["rows"]] == list(range(verified + 1, gap2["last_before"] + 1))
        for row in gap2["rows"]:                                       # spot_trainer's loss, both times
            assert row["loss_before"] == row["loss_after"] == loss(row["step"]) and row["loss_diff"] == 0.0
        assert report["steps_lost"] == gap2["steps_lost"]
        assert report["first_step"] == 1 and report["last_step"] in steps(log2)

        assert_times_add_up(report)
        assert gap2["redo_seconds"] > 0 and gap1["redo_seconds"] == 0.0

        # what it says, and its record in the store
        assert f"drill --watch of {name}: a reclaim notice then a silent loss" in drill.stderr
        assert "goodput" in drill.stderr and "passed: every interruption recovered" in drill.stderr
        assert "watch stopped (Ctrl-C)" in drill.stderr                # the real watch, ended as a user ends it
        record = json.loads(next((store / ".relaunch").glob("drill-*.json")).read_text())
        assert record == report
        assert f"sandbox {first.name}, rented by recover.command during the drill, left (silenced" in drill.stderr
    finally:
        destroy_rented(work)


def test_notice_only_evacuates_and_destroys_the_sandbox_it_had_rented(tmp_path, sandbox, ssh, ssh_key):
    """--watch=notice: no silent loss; at the end the training on the replacement is saved and
    evacuated, and the replacement (a sandbox instance the drill had rented) destroyed."""
    home, inst, work = tmp_path / "state", sandbox(), tmp_path / "work"
    name = "drilln"
    recipe = drill_recipe(work, name, ssh_key)
    store = work / "store"
    try:
        drill = run_cli("drill", str(recipe), inst.host, "--watch=notice", "--json", home=home,
                        env=env_for(tmp_path, ssh_key), timeout=600)
        assert drill.returncode == 0, drill.stderr
        report = json.loads(drill.stdout)
        [rented] = rented_names(work)
        assert rented not in {i.name for i in sb.list_instances()}       # destroyed by the drill
        assert f"sandbox {rented}, rented by recover.command during the drill: destroyed" in drill.stderr
        records = history(store)
        assert [r["cause"] for r in records] == ["notice"]
        [gap] = report["interruptions"]
        assert report["injected"] == ["notice"] and gap["record"] == records[0] and gap["steps_lost"] == 0
        assert report["steps_lost"] == 0 and report["redo_seconds"] == 0.0
        assert_times_add_up(report)
        # the replacement's training was stopped and evacuated before it went: the store holds its save
        manifest = json.loads((store / ".relaunch" / "manifest.json").read_text())
        assert manifest["checkpoints"][-1]["step"] > gap["first_after"] + 5 - 1
        assert "stopped and evacuated" in drill.stderr
        assert ssh(inst, f"tmux has-session -t ={name}", check=False).returncode != 0   # stopped by the notice
    finally:
        destroy_rented(work)


@pytest.mark.sandbox  # half a minute of CLI runs
def test_refused_before_anything_is_contacted(tmp_path, ssh_key):
    """Nothing answers at 192.0.2.1 (TEST-NET-1): each of these is said before a connection is tried."""
    home, work = tmp_path / "state", tmp_path / "work"
    recipe = drill_recipe(work, "refused", ssh_key, command=None)
    nowhere = "root@192.0.2.1"
    out = run_cli("drill", str(recipe), nowhere, "--watch", home=home, timeout=60)
    assert out.returncode == 2 and "drill --watch needs recover.command" in out.stderr, out.stderr
    assert "rent-sandbox.sh" in out.stderr
    out = run_cli("drill", str(recipe), nowhere, "--watch", "--set", "recover.command=./rent-sandbox.sh", home=home,
                  timeout=60)
    assert out.returncode == 2 and f"{nowhere} is not a sandbox instance here" in out.stderr, out.stderr
    assert "--watch=notice" in out.stderr
    out = run_cli("drill", str(recipe), nowhere, "--watch", "--resume-on", nowhere, home=home, timeout=60)
    assert out.returncode == 2 and "--resume-on does not go with --watch" in out.stderr
    out = run_cli("drill", str(recipe), "--watch", nowhere, home=home, timeout=60)
    assert out.returncode == 2 and "write --watch, --watch=notice or --watch=lost" in out.stderr
    assert not (work / "store").exists()                             # nothing was written anywhere


# -- the measurement, from lines and records ------------------------------------------------------------
def lines(host: str, first: int, last: int, start: float, step: float = 0.1, mark: bool = True,
          loss_of=loss) -> list[Line]:
    start_line = "=== relaunch: start 2026-12-01T00:00:00Z on box (checkpoint: none)"
    out = [Line(start - 0.05, host, start_line)] if mark else []
    return out + [Line(start + (s - first) * step, host, f"step {s} loss {loss_of(s)}") for s in range(first, last + 1)]


def record(host: str, cause: str, at: float, resumed: float | None, lost: int = 0) -> Interruption:
    entry = Interruption.start(host, cause, "x", at, None, None)
    entry.steps_lost = lost
    if resumed is not None:
        entry.resumed("next", resumed)
    return entry


def test_goodput_and_badput_add_up_to_the_wall_time() -> None:
    seen = [*lines("a", 1, 10, 0.1), *lines("b", 11, 25, 3.0), *lines("c", 21, 40, 8.0)]
    records = [record("a", "notice", 0.95, 3.1), record("b", "lost", 4.5, 8.1, 5)]
    report = measure(Measured("r", ["a"], ["notice", "lost"], 1e-4), seen, Metrics(), records)
    notice, lost = report.interruptions
    assert (notice.cause, notice.last_before, notice.first_after, notice.steps_lost) == ("notice", 10, 11, 0)
    assert (lost.cause, lost.last_before, lost.resumed_from, lost.steps_lost) == ("lost", 25, 20, 5)
    assert round(notice.seconds_without_training, 3) == 2.0 and round(lost.seconds_without_training, 3) == 3.6
    assert round(lost.redo_seconds, 3) == 0.5 and notice.redo_seconds == 0.0     # steps 21..25 on b
    assert report.wall_seconds == 9.8 and round(report.productive_seconds, 3) == 3.7
    assert round(report.goodput, 4) == round(3.7 / 9.8, 4) and report.passed
    assert [row["step"] for row in lost.rows] == [21, 22, 23, 24, 25]
    assert report.steps_trained == 10 + 15 + 20 and report.steps_lost == 5
    assert "goodput  37.8 %" in report.table()


def test_a_skipped_step_a_changed_loss_a_missed_deadline_and_no_recovery_each_fail() -> None:
    skipped = measure(Measured("r", ["a"], ["notice"], 1e-4), [*lines("a", 1, 10, 0.1), *lines("b", 12, 20, 3.0)],
                      Metrics(), [record("a", "notice", 0.95, 3.1)])
    assert not skipped.passed and "1 step(s) never trained" in skipped.failures()[0]
    changed = measure(Measured("r", ["a"], ["lost"], 1e-4),
                      [*lines("a", 1, 10, 0.1), *lines("b", 6, 20, 3.0, loss_of=lambda s: loss(s) * 1.01)],
                      Metrics(), [record("a", "lost", 1.0, 3.1)])
    assert not changed.passed and "differ by 9.9e-03 > 0.0001" in changed.failures()[0]
    late = record("a", "notice", 0.95, 3.1)
    late.made_deadline = False
    missed = measure(Measured("r", ["a"], ["notice"], 1e-4), [*lines("a", 1, 10, 0.1), *lines("b", 11, 20, 3.0)],
                     Metrics(), [late])
    assert missed.failures() == ["interruption 1: the save after the notice was NOT verified before its deadline"]
    never = measure(Measured("r", ["a"], ["notice", "lost"], 1e-4), [*lines("a", 1, 10, 0.1),
                                                                     *lines("b", 11, 20, 3.0)],
                    Metrics(), [record("a", "notice", 0.95, 3.1), record("b", "lost", 2.5 + 2, None)])
    assert "the lost was not followed by training again (no run after it in the logs)" in never.failures()
    assert any("recorded, but no training after it" in f for f in never.failures())


def test_after_a_recovery_the_drill_waits_for_a_step_of_the_run_after_it(tmp_path, ssh_key):
    """`up` may return on a run.ready line that is no step (a group's "node ready"): until the run
    after the recovery has trained a step, the run before is not taken for it (nothing is contacted)."""
    from relaunch.drill.follow import Follower
    from relaunch.drill.unattended import WatchedDrill
    from relaunch.host.spec import HostSpec
    from relaunch.recipe import load_recipe
    from relaunch.ui import UI

    recipe = load_recipe(drill_recipe(tmp_path / "work", "waits", ssh_key))
    node = HostSpec.parse("root@192.0.2.1")
    drill = WatchedDrill(recipe, [node], UI(quiet=True), [], ["lost"], past=3, after=5, tolerance=1e-4, deadline=60,
                         notice_seconds=120, keep=False)
    log = Follower(drill.recipe, node)                  # never started: its lines are given here
    drill.followers.by_host[str(node)] = log
    log.lines = lines(str(node), 1, 30, 0.1)
    assert [r.last for r in drill.runs() or []] == [30]
    drill.state.recovered.append({"event": "interruption", "cause": "lost", "resumed_epoch": 4.0})
    log.lines += [Line(4.0, str(node), "=== relaunch: start 2026-12-01T00:00:05Z on box (checkpoint: x)"),
                  Line(4.1, str(node), "node ready: ranks 0..1 of 4")]
    assert drill.runs() is None and drill.newest_run() is None
    log.lines += lines(str(node), 21, 21, 5.0, mark=False)
    assert [r.first for r in drill.runs() or []] == [1, 21]
