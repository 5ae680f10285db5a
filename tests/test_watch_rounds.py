"""The watch's copy-off rounds as the loop sees them, with real children (no instance): a child
that exits 1 is an internal error, said once and never tried again; a round that worked heard
from the nodes when it began, not when it ended; a save starts a round, never two at once."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from e2e import plain_recipe, wait_for
from relaunch import processes
from relaunch.errors import RelaunchError
from relaunch.host.spec import HostSpec
from relaunch.layouts import Checkpoint, Entry
from relaunch.recipe.loader import load_recipe
from relaunch.steps.evacuate import Report
from relaunch.ui import UI
from relaunch.watch import Watch
from relaunch.watch.looks import Looker
from relaunch.watch.rounds import InternalError, Rounds, child_argv, parse


def test_a_round_whose_child_exits_1_ends_with_an_internal_error_and_is_not_tried_again(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    code = ("import sys; open(sys.argv[1], 'a').write('run\\n'); "
            "print('Traceback (most recent call last):', file=sys.stderr); "
            "print(\"ModuleNotFoundError: No module named 'relaunch.recipes'\", file=sys.stderr); sys.exit(1)")
    child = [sys.executable, "-c", code, str(runs)]
    said: list[tuple[str, str]] = []
    rounds = Rounds(lambda: child, lambda kind, text: said.append((kind, text)))
    assert rounds.start()
    try:
        outcome = wait_for("the round's outcome", rounds.take, timeout=30, every=0.1)
    finally:
        rounds.abort()
    assert outcome.error is not None and outcome.error.exit_code == 1      # an internal error: exit 1
    assert "internal error (exit 1): ModuleNotFoundError: No module named 'relaunch.recipes'" in outcome.error.message
    assert runs.read_text().split() == ["run"]                   # once: no retry
    assert not any("trying again" in text for _, text in said)


def test_a_rounds_child_does_not_import_relaunch_from_the_current_folder() -> None:
    argv = child_argv("recipe.yaml", ["root@10.0.0.9:22"], [])
    assert argv[:4] == [sys.executable, "-P", "-m", "relaunch.cli"]


def _watch_with_a_round(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seconds: float):
    """A Watch of one node (no instance: its looker is never started) whose round is a real child
    that says when it began, takes `seconds`, then reports as `relaunch sync --once --json` does."""
    monkeypatch.setenv("RELAUNCH_HOME", str(tmp_path / "state"))
    recipe = load_recipe(str(plain_recipe(tmp_path, name="hidden", key=tmp_path / "key")))
    spec = HostSpec.parse("root@203.0.113.7")
    watch = Watch(recipe, [spec], UI(quiet=True))
    watch.lookers = {str(spec): Looker(watch.current(), spec, 1.0, watch.wake)}
    began = tmp_path / "began"
    report = json.dumps(Report(store=str(tmp_path / "store")).as_dict())
    code = "import sys, time; open(sys.argv[1], 'w').close(); time.sleep(float(sys.argv[2])); print(sys.argv[3])"
    watch.rounds = Rounds(lambda: [sys.executable, "-c", code, str(began), str(seconds), report], watch._post)
    return watch, watch.lookers[str(spec)], began


def test_a_node_that_went_silent_while_a_round_ran_stays_silent_when_the_round_ends(tmp_path, monkeypatch) -> None:
    """A look fails after the round began (the node went silent during a long copy): the round that
    then ends well heard from the node only when it began, so the silence stands, and counts from
    no later than the round's start."""
    watch, looker, began = _watch_with_a_round(tmp_path, monkeypatch, 1.0)
    assert watch.rounds.start()
    wait_for("the round's child to begin", began.exists, timeout=30, every=0.05)
    looker._silent("the look did not answer")
    failed = looker.view().looked_at
    wait_for("the round to end", lambda: not watch.rounds.busy, timeout=30, every=0.05)
    ended = time.monotonic()
    watch.drain()
    view = looker.view()
    assert view.silent_since is not None
    assert view.answered_at == view.silent_since < failed       # heard from when the round began, not when it ended
    assert view.silent_for(ended, hang_after=5.0) > ended - failed


def test_a_round_that_began_after_a_failed_look_clears_the_silence(tmp_path, monkeypatch) -> None:
    """The look failed (its own connection broke), then a round connected to the node and worked:
    the node answered after the failed look."""
    watch, looker, began = _watch_with_a_round(tmp_path, monkeypatch, 0.1)
    looker._silent("the SSH connection was lost")
    failed = time.monotonic()
    wait_for("the clock to pass the failed look", lambda: time.monotonic() > failed, timeout=5, every=0.001)
    assert watch.rounds.start()
    wait_for("the round to end", lambda: not watch.rounds.busy and began.exists(), timeout=30, every=0.05)
    watch.drain()
    assert looker.view().silent_since is None


def test_a_real_rounds_failure_document_is_read_as_its_error(tmp_path, monkeypatch, ssh_key) -> None:
    """The child as the watch runs it (`relaunch sync ... --once --json`), against an address where
    nothing listens: its one JSON document (indented, the error a field of it) is read as the
    round's error, a failure worth another try, not an internal error."""
    monkeypatch.setenv("RELAUNCH_HOME", str(tmp_path / "state"))
    recipe = plain_recipe(tmp_path, name="refused", key=ssh_key)
    done = processes.run(child_argv(str(recipe), ["root@127.0.0.1:9"], ["ssh.wait=1"]), deadline=120)
    assert done.status == 6 and done.stdout.startswith(b"{\n"), done.err      # one indented document
    answer = parse(done.status, done.stdout, done.stderr)
    assert isinstance(answer, RelaunchError) and not isinstance(answer, InternalError), answer
    assert "127.0.0.1" in answer.message and not answer.refused


def test_a_round_document_with_its_report_and_its_error_is_the_report() -> None:
    """A round that copied but did not verify the instance's newest (exit 6): the report travels with
    the error in the one document; the watch takes the report (its lag), as a round that worked."""
    document = {**Report(store="/s", copied=["ckpt-2.pt"]).as_dict(), "error": "ckpt-3.pt is not verified",
                "hint": None, "exit": 6, "refused": False}
    answer = parse(6, json.dumps(document, indent=2).encode(), b"")
    assert isinstance(answer, Report) and answer.copied == ["ckpt-2.pt"]


def test_a_save_starts_a_round_at_once_and_a_burst_of_saves_one_round_after_the_running_one(tmp_path,
                                                                                             monkeypatch) -> None:
    """checkpoint.every at its default (600 s): a new complete checkpoint in node 0's look starts a
    round on the next tick; saves while it runs start none beside it, and one after it, which copies
    whatever is newest then; no new checkpoint, no round."""
    monkeypatch.setenv("RELAUNCH_HOME", str(tmp_path / "state"))
    recipe = load_recipe(str(plain_recipe(tmp_path, name="assaved", key=tmp_path / "key")))
    spec = HostSpec.parse("root@203.0.113.7")
    watch = Watch(recipe, [spec], UI(quiet=True))
    looker = Looker(watch.current(), spec, 1.0, watch.wake)       # never started: the test says what it sees
    watch.lookers = {str(spec): looker}
    runs, answer, go = tmp_path / "runs", tmp_path / "report.json", tmp_path / "go"
    # each round: one line in `runs`, then waits for `go`, then reports what `report.json` says
    code = ("import os, sys, time; open(sys.argv[1], 'a').write('round\\n')\n"
            "while not os.path.exists(sys.argv[2]): time.sleep(0.02)\n"
            "os.unlink(sys.argv[2]); print(open(sys.argv[3]).read())")
    watch.rounds = Rounds(lambda: [sys.executable, "-c", code, str(runs), str(go), str(answer)], watch._post,
                          ended=watch.wake.set)

    def sees(*steps: int) -> None:
        complete = tuple(Checkpoint(f"ckpt-{s}.pt", s, (Entry(f"ckpt-{s}.pt", "f", 1, float(s)),)) for s in steps)
        looker._view = replace(looker.view(), complete=complete, answered_at=time.monotonic())

    def rounds_begun() -> int:
        return len(runs.read_text().split()) if runs.exists() else 0

    def copies(step: int, newest: int) -> None:
        """The running round ends, having verified `step`, the instance's newest then being `newest`
        (saved while it copied); the loop takes it."""
        answer.write_text(json.dumps(Report(store=str(tmp_path / "store"), newest=f"ckpt-{newest}.pt",
                                            newest_step=newest, stored=f"ckpt-{step}.pt", stored_step=step,
                                            safe=True).as_dict()))
        go.touch()
        wait_for("the round to end", lambda: not watch.rounds.busy, timeout=30, every=0.02)
        watch.drain()

    try:
        sees(25)
        watch.tick()                                    # the first round, as the watch starts
        wait_for("the first round", lambda: rounds_begun() == 1, timeout=30, every=0.02)
        copies(25, 25)
        watch.tick()
        assert not watch.rounds.busy and rounds_begun() == 1            # nothing new: no round
        sees(25, 50)
        watch.tick()                                    # a save: a round at once, not after 600 s
        wait_for("a round for the save", lambda: rounds_begun() == 2, timeout=30, every=0.02)
        for burst in ((25, 50, 75), (50, 75, 100), (75, 100, 125)):
            sees(*burst)
            watch.tick()
        assert rounds_begun() == 2                      # not doubled while it runs
        copies(50, 125)
        watch.tick()                                    # one round after it, for the newest
        wait_for("one round after the burst", lambda: rounds_begun() == 3, timeout=30, every=0.02)
        copies(125, 125)
        watch.tick()
        assert not watch.rounds.busy and rounds_begun() == 3
    finally:
        go.touch()
        watch.rounds.abort()
