"""The watch's pure decisions, from values (no instance): what a recover.command's output allows,
what counts as a HOST, which log lines are this run's, when a node counts as silent, what the
exposure is and when it is worth a line."""

from __future__ import annotations

import os
import subprocess

import pytest

from e2e import plain_recipe
from relaunch.host.facts import HostFacts
from relaunch.host.spec import HostSpec, Target
from relaunch.job import Facts, Job, Lag, Node
from relaunch.layouts import Checkpoint, Entry
from relaunch.recipe import load_recipe
from relaunch.steps.guard import look_command, newest_logged_step, parse_look
from relaunch.watch.exposure import Exposure, Meter
from relaunch.watch.looks import View, this_run
from relaunch.watch.recover import Rented, looks_like_host, parse_rented

FINGERPRINT = "SHA256:" + "A" * 43


@pytest.mark.parametrize("printed, host, pin", [
    ("renting...\nubuntu@203.0.113.7\n", "ubuntu@203.0.113.7", None),
    (f"ubuntu@203.0.113.7 {FINGERPRINT}\n", "ubuntu@203.0.113.7", FINGERPRINT),
    ("root@[2001:db8::7]:2222\n", "root@[2001:db8::7]:2222", None),
    ("gpu-17.us-east.example.net\n\n", "gpu-17.us-east.example.net", None),
])
def test_a_host_on_the_last_line_is_a_new_instance(printed: str, host: str, pin: str | None) -> None:
    found = parse_rented(printed)
    assert found == Rented(HostSpec.parse(host), pin)


@pytest.mark.parametrize("printed, why", [
    ("", "it printed nothing"),
    ("instance i-0abc requested\nOK\n", "'OK' is neither an address, nor a name with a dot"),
    ("done\n", "'done' is neither an address"),
    ("ubuntu@203.0.113.7 SHA256:short\n", "is not HOST [SHA256:FINGERPRINT]"),
    ("launched ubuntu@203.0.113.7 in us-east-1\n", "is more than HOST [SHA256:FINGERPRINT]"),
    ("-oProxyCommand=evil\n", "is not HOST [SHA256:FINGERPRINT]"),
])
def test_anything_else_on_the_last_line_is_not_a_host(printed: str, why: str) -> None:
    found = parse_rented(printed)
    assert isinstance(found, str) and why in found


def test_a_bare_word_is_a_host_only_as_an_ssh_config_alias(tmp_path, monkeypatch) -> None:
    config = tmp_path / "config"
    config.write_text("Host gpubox\n  HostName 198.51.100.4\n")
    monkeypatch.setenv("RELAUNCH_SSH_CONFIG", str(config))
    assert looks_like_host("gpubox") and not looks_like_host("OK")
    assert looks_like_host("10.0.0.5") and looks_like_host("fe80::1%eth0")


def test_the_newest_step_seen_counts_the_lines_of_this_run_only() -> None:
    tail = ["step 93 loss 0.1", "step 94 loss 0.1", "=== relaunch: start 2026-12-02T00:21:30Z on vm (checkpoint: x)",
            "resumed from /root/ckpt/step-00000020 at step 20", "step 21 loss 0.2"]
    assert this_run(tail) == tail[3:]
    assert this_run(tail[:2]) == tail[:2]            # a tail of one run only: all of it


@pytest.mark.parametrize("listing", [False, True])
def test_the_newest_step_seen_is_never_read_from_a_line_still_being_written(tmp_path, listing: bool) -> None:
    """The look the watch runs on the instance, run here on a log whose last line is still being
    written: `step 1` of `step 150` is no step; the newest is 149 (also with checkpoint.dir listed)."""
    recipe = load_recipe(plain_recipe(tmp_path, name="midline", key=tmp_path / "key"))
    job = Job(recipe, Node(Target("203.0.113.7", "root", 22)), Facts(host=HostFacts(home=str(tmp_path))))
    (tmp_path / "midline.log").write_text("step 148 loss 0.1\nstep 149 loss 0.1\nstep 1")
    out = subprocess.run(["bash", "-c", look_command(job, listing)], capture_output=True, timeout=60,
                         env={**os.environ, "TMUX_TMPDIR": str(tmp_path)}).stdout
    look = parse_look(out)
    assert look.log_tail == ["step 148 loss 0.1", "step 149 loss 0.1"], out
    assert newest_logged_step(this_run(look.log_tail), recipe.run.metrics.step) == 149
    assert (look.listing is not None) == listing and not look.training
    (tmp_path / "midline.log").write_text("step 148 loss 0.1\nstep 149 loss 0.1\nstep 150 loss 0.1\n")
    look = parse_look(subprocess.run(["bash", "-c", look_command(job, listing)], capture_output=True, timeout=60,
                                     env={**os.environ, "TMUX_TMPDIR": str(tmp_path)}).stdout)
    assert newest_logged_step(this_run(look.log_tail), recipe.run.metrics.step) == 150


def test_a_node_is_silent_once_a_look_failed_or_one_under_way_is_late() -> None:
    spec = HostSpec.parse("root@203.0.113.7")
    answered = View(spec, answered_at=100.0)
    assert answered.silent_for(104.0, hang_after=5.0) == 0.0          # a look under way, not late yet
    assert answered.silent_for(106.0, hang_after=5.0) == 6.0          # the look under way is late: silent since 100
    failed = View(spec, answered_at=100.0, silent_since=100.0)
    assert failed.silent_for(101.0, hang_after=5.0) == 1.0


def listed(*steps: int) -> tuple[Checkpoint, ...]:
    """Complete checkpoints as node 0's look lists them: ckpt-STEP.pt, saved at second STEP."""
    return tuple(Checkpoint(f"ckpt-{s}.pt", s, (Entry(f"ckpt-{s}.pt", "f", 10, float(s)),)) for s in steps)


def stored_at(step: int) -> Lag:
    """The last round's report: the store's newest verified is `step` (the instance's newest then too)."""
    return Lag(newest=f"ckpt-{step}.pt", newest_step=step, newest_mtime=float(step), stored=f"ckpt-{step}.pt",
               stored_step=step, stored_written_at=float(step))


def test_the_exposure_is_said_when_the_copies_fall_behind_the_saves_and_once_when_they_catch_up() -> None:
    meter = Meter()
    said = []

    def look(complete: tuple[Checkpoint, ...], stored: Lag) -> Exposure | None:
        now = meter.measure(complete, stored)
        said.append(meter.news())
        return now

    now = look(listed(25), stored_at(25))
    assert now is not None and (now.lag_steps, now.lag_seconds, now.behind) == (0, 0.0, 0)
    now = look(listed(25, 50), stored_at(25))          # a save a round is copying: not worth a line
    assert now is not None and (now.lag_steps, now.lag_seconds, now.behind) == (25, 25.0, 1)
    now = look(listed(25, 50, 75), stored_at(25))      # the next save before it was verified
    assert now is not None and (now.lag_steps, now.behind) == (50, 2)
    look(listed(25, 50, 75), stored_at(25))           # the same again: not every look
    look(listed(50, 75, 100), stored_at(50))          # a round verified one, a save came: still behind
    look(listed(75, 100, 125), stored_at(50))         # and another; ckpt-75 rotated away unverified still counts
    assert meter.now is not None and meter.now.behind == 3
    now = look(listed(75, 100, 125), stored_at(125))
    assert now is not None and now.lag_steps == 0
    look(listed(100, 125), stored_at(125))
    assert said == [None, None, "behind", None, "behind", "behind", "caught up", None]
    assert meter.worst is not None and (meter.worst.lag_steps, meter.worst.newest_step) == (75, 125)


def test_a_save_only_the_round_saw_counts_as_unverified() -> None:
    """The round copying ckpt-25 saw ckpt-75, a save made after the look that listed 25 and 50:
    two saves are unverified, so the copies are still behind, never "caught up" at a lag of two
    saves (CI: "caught up" said at lag 50 with a save every 25)."""
    meter = Meter()
    meter.measure(listed(25, 50, 75), stored_at(0))
    assert meter.news() == "behind"
    report = Lag(newest="ckpt-100.pt", newest_step=100, newest_mtime=100.0, stored="ckpt-50.pt", stored_step=50,
                 stored_written_at=50.0)
    now = meter.measure(listed(50, 75), report)
    assert now is not None and (now.newest_step, now.lag_steps, now.behind) == (100, 50, 2)
    assert meter.news() == "behind"


def test_the_exposure_takes_the_rounds_newest_when_the_look_before_it_is_older() -> None:
    """A save came between the look and the round that copied it: the instance's newest is the
    round's, never a store ahead of the instance."""
    now = Meter().measure(listed(25), stored_at(50))
    assert now is not None and (now.newest_step, now.lag_steps, now.behind) == (50, 0, 0)
    assert Exposure.from_dict(now.as_dict()) == now
