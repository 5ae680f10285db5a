"""The executor's lanes, in-process: what runs at the same time, what waits for what, and that
every wait ends (a result that never comes, a lane that failed) with the error that matters."""

from __future__ import annotations

import io
import re
import sys
import threading

import pytest
from rich.console import Console

from e2e import wait_for
from relaunch.errors import CheckpointError, RelaunchError
from relaunch.executor import Executor
from relaunch.plan import LOCAL, Action, Ref
from relaunch.ui import UI


class Calls:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.both = threading.Barrier(2, timeout=10)
        self.executor: Executor | None = None

    def until_waited_on(self, name: str) -> None:
        """Until another lane of the executor waits for the result `name`: the order a test needs,
        made to happen rather than hoped for."""
        wait_for(f"a lane waiting for {name}", lambda: any(
            name in names for names in dict(self.executor._waits).values()), timeout=10, every=0.005)  # type: ignore[union-attr]

    def mark(self, name: str) -> str:
        self.log.append(name)
        return name

    def meet(self, name: str) -> str:
        self.both.wait()        # returns only when the other lane is here too
        return self.mark(name)

    def fail(self) -> None:
        self.until_waited_on("verified")
        raise CheckpointError("the copy did not verify")

    def slow(self, name: str, waited_on: str) -> str:
        self.until_waited_on(waited_on)
        return self.mark(name)


def call(title: str, method: str, lane: str, **kw: object) -> Action:
    args = kw.pop("args", {"name": title})
    return Action("checkpoint", title, where=LOCAL, call=f"calls.{method}", args=args, lane=lane,  # type: ignore[arg-type]
                  fails_as="checkpoint", **kw)  # type: ignore[arg-type]


def run(actions: list[Action]) -> tuple[Calls, dict]:
    calls = Calls()
    calls.executor = Executor(UI(quiet=True), "test", handlers={"calls": calls})
    return calls, calls.executor.run(actions)


def test_lanes_run_at_the_same_time_and_a_result_is_waited_for():
    calls, results = run([
        call("copy", "meet", "copy", produces="copied"),
        call("hash", "meet", "hash"),
        call("move", "mark", "hash", needs=("copied",)),
    ])
    assert results["copied"] == "copy" and calls.log.index("move") > calls.log.index("copy")


def test_a_result_no_step_produces_is_an_error_not_a_hang():
    with pytest.raises(RelaunchError, match="waiting for never, which no step produces"):
        run([call("copy", "mark", "copy"), call("move", "mark", "hash", needs=("never",))])


def test_a_lane_waiting_on_a_failed_lane_gives_way_to_its_error():
    with pytest.raises(CheckpointError, match="the copy did not verify"):
        run([call("move", "mark", "copy", needs=("verified",)),        # listed first: its error would win
             call("verify", "fail", "verify", args={}, produces="verified")])


def test_concurrent_phases_share_one_display_on_a_terminal(tmp_path):
    """A copy that reports its bytes and an install that says nothing, at the same time, on a
    terminal: one display (rich refuses two), the copy's bar in bytes, the install's in time so far."""
    ui = UI()
    ui.console = Console(file=io.StringIO(), force_terminal=True, width=120)
    half = "import sys, time; print('  536,870,912  50%  40.00MB/s  0:00:13', flush=True); time.sleep(1.5)"
    Executor(ui, "test").run([
        Action("checkpoint", "copying ckpt-100", where=LOCAL, argv=(sys.executable, "-c", half), lane="copy",
               progress="rsync", size=1 << 30, fails_as="checkpoint"),
        Action("env", "installing 10 pinned packages", where=LOCAL, argv=(sys.executable, "-c", "import time; "
               "time.sleep(1.5)"), lane="env", progress="time", fails_as="env"),
    ])
    shown = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", ui.console.file.getvalue())  # type: ignore[attr-defined]
    copy = [line for line in shown.splitlines() if "copying ckpt-100" in line]
    install = [line for line in shown.splitlines() if "installing 10 pinned packages" in line]
    assert copy and "0.5/1.0 GiB" in copy[-1]
    assert install and re.search(r"0:00:0\d\s*$", install[-1]) and "GiB" not in install[-1]


class Attempts:
    """A copy's two attempts: `prepare` makes this attempt's staging (its result), `use` reads it."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.used = threading.Event()

    def prepare(self, attempt: int) -> int:
        if attempt > 1:
            # the second attempt's staging is slow to come: a lane that does not wait for it gets
            # there first (bounded: with the wait in place, nothing sets this)
            self.used.wait(2)
        return attempt

    def use(self, staging: int) -> None:
        self.seen.append(staging)
        self.used.set()


def test_a_second_attempt_of_a_plan_waits_for_its_own_results_not_the_firsts():
    """A re-copy after a mismatch runs the same plan again on the same executor: the names it
    produces are the same, and the first attempt's results must not stand in for them."""
    attempts = Attempts()
    executor = Executor(UI(quiet=True), "test", handlers={"calls": attempts})

    def plan(attempt: int) -> list[Action]:
        return [call("prepare the staging", "prepare", "copy", args={"attempt": attempt}, produces="staging:ckpt"),
                call("hash it as it lands", "use", "hash-here", args={"staging": Ref("staging:ckpt")},
                     needs=("staging:ckpt",))]

    executor.run(plan(1))
    attempts.used.clear()
    executor.run(plan(2))
    assert attempts.seen == [1, 2]


def test_two_lanes_that_wait_on_each_other_in_turn_are_no_deadlock():
    """A node group's restore whose env lanes have nothing to do: node 0's lane produces its copy,
    then waits for node 1's; node 1's lane was waiting for node 0's copy and has not woken yet. Both
    wait for an instant, but node 1's wait is already met: not a plan that waits for nothing."""
    for _ in range(5):                     # the moment is short: give it every chance to show
        calls, results = run([
            call("env 0", "mark", "env@0"),
            call("env 1", "mark", "env@1"),
            call("copy to 0", "slow", "checkpoint", args={"name": "copy to 0", "waited_on": "ckpt@0"},
                 produces="ckpt@0"),
            call("move on 0", "mark", "checkpoint", needs=("ckpt@0", "ckpt@1")),
            call("copy to 1", "mark", "checkpoint@1", needs=("ckpt@0",), produces="ckpt@1"),
            call("move on 1", "mark", "checkpoint@1", needs=("ckpt@0", "ckpt@1")),
        ])
        assert {"move on 0", "move on 1"} <= set(calls.log) and results["ckpt@1"] == "copy to 1"
