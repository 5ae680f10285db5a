"""What saving costs a run, from the Checkpointer's metric lines: parsing, medians, the Badput
`status` shows. Pure: every expected number is worked out by hand in the comment beside it."""

from __future__ import annotations

import subprocess

import pytest

from relaunch.history import Interruption
from relaunch.interval import BadputNow, badput_now
from relaunch.savecosts import parse_line, read_command, saves_of, summarize

LOG = """\
=== relaunch: start 2026-01-01T00:00:00Z on box1 (checkpoint: none)
step 1 loss 1.0 grad_norm 2.0
relaunch.checkpoint: step=10 name=step-00000010 blocking_s=9.0 write_s=9.0 step_s=9.0 bytes=1 world_size=1
=== relaunch: exit 0 2026-01-01T00:01:00Z
=== relaunch: start 2026-01-01T00:02:00Z on box2 (checkpoint: /root/ckpt/step-00000010)
relaunch.train: step-00000020: state copied in 0.020s, writing in the background
relaunch.checkpoint: step=20 name=step-00000020 blocking_s=0.020 write_s=0.50 step_s=0.30 bytes=3000000 world_size=2
step 21 loss 0.5 grad_norm 1.0
relaunch.checkpoint: step=30 name=step-00000030 blocking_s=0.010 write_s=0.40 step_s=0.32 bytes=3000000 world_size=2
relaunch.checkpoint: step=40 name=step-00000040 blocking_s=0.030 write_s=0.70 step_s=0.31 bytes=3100000 world_size=2
relaunch.checkpoint: step=43 name=step-00000043 blocking_s=0.015 write_s=0.45 step_s=- bytes=3100000 world_size=2
relaunch.checkpoint: step=oops blocking_s=1
"""


def test_a_metric_line_parses_and_other_lines_do_not():
    save = parse_line("[rank0]: relaunch.checkpoint: step=20 name=step-00000020 blocking_s=0.02 write_s=0.5 "
                      "step_s=0.3 bytes=7 world_size=4")
    assert save is not None and (save.step, save.name, save.blocking, save.write, save.step_time, save.bytes,
                                 save.world_size) == (20, "step-00000020", 0.02, 0.5, 0.3, 7, 4)
    assert save.save_time == pytest.approx(0.52)
    assert parse_line("step 20 loss 1.0") is None
    assert parse_line("relaunch.checkpoint: step=oops blocking_s=1") is None


def test_the_newest_run_that_saved_and_its_medians():
    saves = saves_of(LOG)
    assert [s.step for s in saves] == [20, 30, 40, 43]          # the first run's save is an earlier run's
    costs = summarize(saves)
    assert costs is not None
    # blocking median(0.020, 0.010, 0.030, 0.015) = (0.015 + 0.020)/2 = 0.0175
    # write median(0.50, 0.40, 0.70, 0.45) = (0.45 + 0.50)/2 = 0.475
    # save time per save: 0.52, 0.41, 0.73, 0.465 -> median (0.465 + 0.52)/2 = 0.4925
    # step time median of the known ones (0.30, 0.32, 0.31) = 0.31; steps between saves 10, 10, 3 -> 10
    assert costs.saves == 4
    assert costs.blocking == pytest.approx(0.0175) and costs.write == pytest.approx(0.475)
    assert costs.save_time == pytest.approx(0.4925) and costs.step_time == pytest.approx(0.31)
    assert (costs.every, costs.bytes, costs.world_size) == (10, 3100000, 2)
    assert summarize(saves_of("step 1 loss 2\n")) is None


def test_the_command_reads_starts_and_metric_lines_only(tmp_path):
    log = tmp_path / "run's log"
    log.write_text(LOG)
    out = subprocess.run(["bash", "-c", read_command(str(log))], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [line for line in LOG.splitlines()
                                if line.startswith("=== relaunch: start ") or "relaunch.checkpoint:" in line]
    assert saves_of(out) == saves_of(LOG)


def test_a_metric_line_still_being_written_is_not_read(tmp_path):
    """The log ends inside a metric line, `write_s=0.5` of `write_s=0.5310` (grep would end it with a
    newline of its own): neither the command on the instance nor the parse of a log read whole (the
    drill's) takes it; once its newline is there, both do."""
    line = ("relaunch.checkpoint: step=50 name=step-00000050 blocking_s=0.010 write_s=0.5310 step_s=0.30 "
            "bytes=3000000 world_size=2\n")
    cut = line[:line.index("write_s=0.5") + len("write_s=0.5")]
    log = tmp_path / "run's log"
    for written, steps in ((cut, [20, 30, 40, 43]), (line, [20, 30, 40, 43, 50])):
        log.write_text(LOG + written)
        out = subprocess.run(["bash", "-c", read_command(str(log))], capture_output=True, text=True,
                             check=True).stdout
        assert [s.step for s in saves_of(out)] == steps, out
        assert [s.step for s in saves_of(LOG + written)] == steps
    assert saves_of(out)[-1].write == 0.531


def interruption(at: float, resumed: float) -> Interruption:
    entry = Interruption.start("h", "notice", "aws", at, 5, 5)
    entry.resumed("h", resumed)
    return entry


def test_badput_now_splits_saving_and_failures():
    costs = summarize(saves_of(LOG))
    assert costs is not None
    alone = badput_now(costs, [])
    # interval 10 steps x 0.31 s = 3.1 s; saving = 0.0175 / 3.1 = 0.0056452; failures unknown
    assert alone.interval_seconds == pytest.approx(3.1) and alone.saving == pytest.approx(0.0175 / 3.1)
    assert alone.failures is None and alone.total is None and alone.interruptions == 0
    assert "Badput now: saving 0.565%; failures not known: 0 interruption(s)" in "\n".join(alone.lines())
    # two gaps of running: 1000 s (100 -> 1100) and 2000 s (1200 -> 3200): MTBI 1500 s
    # failures = (0.4925 + 3.1/2) / 1500 = 2.0425 / 1500 = 0.00136167
    entries = [interruption(0, 100), interruption(1100, 1200), interruption(3200, 3300)]
    known = badput_now(costs, entries)
    assert (known.interruptions, known.mtbi, known.mtbi_gaps) == (3, 1500, 2)
    assert known.failures == pytest.approx(2.0425 / 1500)
    assert known.total == pytest.approx(0.0175 / 3.1 + 2.0425 / 1500)
    text = "\n".join(known.lines())
    assert "every 10 steps (3.1s of training), blocking 17.5ms + background write 0.475s" in text
    # total 0.0056452 + 0.0013617 = 0.0070069: 0.701%
    assert "Badput now: 0.701% = saving 0.565% + failures 0.136% (MTBI 25 min from 3 interruption(s)" in text
    assert known.as_dict()["badput"] == pytest.approx(known.total)
    one = BadputNow(summarize(saves_of(LOG.split("relaunch.checkpoint: step=30")[0])), 0)   # a single save
    assert one.saving is None and "interval not known yet" in one.lines()[0]
