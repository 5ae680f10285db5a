"""`relaunch interval`: the arithmetic against hand-computed values, units, the CLI, and
measuring step and save time from checkpoint timestamps on a real (sandbox) instance.

Every expected number below is worked out by hand in the comment beside it, never by calling
the code under test a second time.
"""

from __future__ import annotations

import json
import math
import shlex

import pytest

from e2e import plain_recipe, run_cli
from relaunch.errors import CheckpointError, UsageError
from relaunch.interval import (
    badput,
    best_interval,
    compute,
    measure,
    parse_duration,
    parse_fraction,
    young_daly,
)
from relaunch.layouts import Entry, complete_checkpoints


# -- units --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, seconds", [
    ("1.2s", 1.2), ("90s", 90), ("90", 90), ("250ms", 0.25), ("5m", 300), ("5min", 300), ("6h", 21600),
    ("2d", 172800), ("1h30m", 5400), ("1.5h", 5400), (" 6H ", 21600), ("1h 30m", 5400), ("0.5", 0.5),
    (".5s", 0.5), ("2m30s", 150),
])
def test_parse_duration(text, seconds):
    assert parse_duration(text, "--x") == pytest.approx(seconds, rel=1e-12)


@pytest.mark.parametrize("text", ["", "abc", "1h30", "-5s", "5 parsecs", "1e3", "nan", "inf", "h", "5y", "1..2s",
                                  "s5"])
def test_parse_duration_refuses_and_names_the_option(text):
    with pytest.raises(UsageError) as err:
        parse_duration(text, "--save-time")
    assert err.value.message.startswith("--save-time: ")
    assert err.value.exit_code == 2


@pytest.mark.parametrize("text, fraction", [("5%", 0.05), ("0.05", 0.05), ("12.5%", 0.125), (" 1 % ", 0.01)])
def test_parse_fraction(text, fraction):
    assert parse_fraction(text) == pytest.approx(fraction, rel=1e-12)


@pytest.mark.parametrize("text", ["5", "0", "0%", "100%", "x", "-1%", "", "1"])
def test_parse_fraction_refuses(text):
    with pytest.raises(UsageError) as err:
        parse_fraction(text, "--badput")
    assert "--badput" in err.value.message


# -- the model ------------------------------------------------------------------------------------
def test_best_interval_on_the_exact_boundary():
    # T=1.5s S=60s MTBI=6h=21600s B=5%: B*M = 1080; N = floor(2*(1080-60)/1.5) = floor(1360) = 1360
    # Badput(1360) = (60 + 1360*0.75)/21600 = (60 + 1020)/21600 = 0.05 exactly: the boundary counts
    iv = best_interval(1.5, 60, 21600, 0.05)
    assert iv.steps == 1360
    assert iv.seconds == pytest.approx(2040)
    assert iv.badput == pytest.approx(0.05)


def test_best_interval_rounds_down():
    # T=0.7s S=45s MTBI=4h=14400s B=3%: B*M = 432; 2*(432-45)/0.7 = 774/0.7 = 1105.71 -> N = 1105
    # Badput(1105) = (45 + 1105*0.35)/14400 = 431.75/14400 = 0.0299826...
    # Badput(1106) = (45 + 387.1)/14400 = 0.030007 > 3%: one more step would break the budget
    iv = best_interval(0.7, 45, 14400, 0.03)
    assert iv.steps == 1105
    assert iv.seconds == pytest.approx(773.5)
    assert iv.badput == pytest.approx(431.75 / 14400)
    assert badput(0.7, 45, 14400, 1106) == pytest.approx(432.1 / 14400)


def test_badput_of_a_given_interval():
    # every 120 steps at 1.5s, save 60s, MTBI 6h: (60 + 120*0.75)/21600 = 150/21600 = 0.0069444
    assert badput(1.5, 60, 21600, 120) == pytest.approx(150 / 21600)
    # saving costs nothing: only half the interval is lost, (0 + 10*2/2)/100 = 0.1
    assert badput(2, 0, 100, 10) == pytest.approx(0.1)


def test_young_daly_reference():
    # sqrt(2 * 50s * 14400s) = sqrt(1,440,000) = 1200s; at 1.5s a step that is 800 steps
    # Badput(800) = (50 + 800*0.75)/14400 = 650/14400
    yd = young_daly(1.5, 50, 14400)
    assert yd.seconds == pytest.approx(1200)
    assert yd.steps == 800
    assert yd.badput == pytest.approx(650 / 14400)


def test_impossible_budget_explains_why():
    # save 20 min, MTBI 6h: even N=1 gives (1200 + 0.75)/21600 = 0.05559 > 5%
    with pytest.raises(UsageError) as err:
        best_interval(1.5, 1200, 21600, 0.05)
    assert "saving takes too long for that MTBI" in err.value.message
    assert "5.56%" in err.value.message
    assert err.value.hint


@pytest.mark.parametrize("args", [(0, 60, 21600), (1.5, -1, 21600), (1.5, 60, 0)])
def test_model_refuses_values_it_cannot_use(args):
    with pytest.raises(UsageError):
        best_interval(*args, 0.05)


def test_the_blocking_time_adds_savings_own_cost():
    # T=1.5s S=60s MTBI=21600s B=5%, each save blocks C=2s:
    # Badput(N) = (60 + 0.75N)/21600 + 2/(1.5N); with x = 1.5N: x^2 - 2*1020x + 2*2*21600 <= 0
    # x <= 1020 + sqrt(1020^2 - 86400) = 1020 + sqrt(954000) = 1020 + 976.729 = 1996.729 -> N = floor(1331.15)
    iv = best_interval(1.5, 60, 21600, 0.05, blocking=2)
    assert iv.steps == 1331
    # Badput(1331) = 1058.25/21600 + 2/1996.5 = 0.0489931 + 0.0010018 = 0.0499949
    assert iv.badput == pytest.approx(1058.25 / 21600 + 2 / 1996.5)
    # one step more: 1059/21600 + 2/1998 = 0.0490278 + 0.0010010 = 0.0500288, over
    over = badput(1.5, 60, 21600, 1332, blocking=2)
    assert over == pytest.approx(1059 / 21600 + 2 / 1998) and over > 0.05
    # without it, the contract's formula: 1360 steps (test_best_interval_on_the_exact_boundary)
    assert best_interval(1.5, 60, 21600, 0.05, blocking=0).steps == 1360
    # Young/Daly with C: sqrt(2*2*21600) = sqrt(86400) = 293.94 s = 195.96 steps -> 196
    yd = young_daly(1.5, 60, 21600, blocking=2)
    assert yd.seconds == pytest.approx(math.sqrt(86400)) and yd.steps == 196


def test_a_blocking_time_that_leaves_no_interval_within_the_budget():
    # T=1s S=0 MTBI=100s B=10%, C=10s: 10^2 - 2*10*100 < 0, no N fits; N=1 costs 0.5/100 + 10/1 = 10.005
    with pytest.raises(UsageError) as err:
        best_interval(1, 0, 100, 0.1, blocking=10)
    assert "saving takes too long for that MTBI" in err.value.message and "blocking 10s" in err.value.message


def test_measured_from_metric_lines_fills_step_save_and_blocking():
    from relaunch.interval import measure_lines
    from relaunch.savecosts import saves_of, summarize

    log = ("relaunch.checkpoint: step=10 name=step-00000010 blocking_s=2 write_s=58 step_s=1.5 bytes=1 world_size=8\n"
           "relaunch.checkpoint: step=20 name=step-00000020 blocking_s=2 write_s=58 step_s=1.5 bytes=1 world_size=8\n")
    m = measure_lines(summarize(saves_of(log)))
    assert (m.step_time, m.save_time, m.blocking_time, m.write_time, m.samples, m.source) == (
        1.5, 60, 2, 58, 2, "metric lines")
    r = compute(None, None, 21600, 0.05, measured=m, host="h")
    # as in test_the_blocking_time_adds_savings_own_cost: 1331 steps
    assert r.interval.steps == 1331 and r.blocking_time == 2
    assert r.measured_fields == ("step_time", "save_time", "blocking_time")
    text = "\n".join(r.lines())
    assert "measured on h, the run's metric lines (medians of 2 saves): step 1.5s, save 60s, blocking 2s, " \
           "background write 58s" in text
    # saving's share: 2 / (1331*1.5) = 2/1996.5 = 0.100%
    assert "of which saving 0.1% (blocking / interval)" in text
    # a save time given keeps its own meaning: no blocking time taken from the lines
    given = compute(None, 60, 21600, 0.05, measured=m, host="h")
    assert given.blocking_time == 0 and given.interval.steps == 1360
    with pytest.raises(CheckpointError, match="no step time yet"):
        measure_lines(summarize(saves_of(log.replace("step_s=1.5", "step_s=-"))))


# -- measuring, pure ------------------------------------------------------------------------------
def hf_checkpoint(step: int, mtimes: list[float]) -> list[Entry]:
    """An HF Trainer folder whose files were written at `mtimes`; trainer_state.json last."""
    folder = f"checkpoint-{step}"
    entries = [Entry(folder, "d", 4096, mtimes[-1])]
    entries += [Entry(f"{folder}/shard-{i}.bin", "f", 1000, t) for i, t in enumerate(mtimes[:-1])]
    entries.append(Entry(f"{folder}/trainer_state.json", "f", 100, mtimes[-1]))
    return entries


def test_measure_folders_median_of_save_and_step_time():
    # Saving takes 20s (one checkpoint took 30s), training 100 steps between saves at 0.5s a step,
    # except before the last one (training stalled: 3.0s a step). Newest mtimes:
    #   step 100: 1000 (files 980, 1000)           save span 20
    #   step 200: 1000 + 100*0.5 + 20 = 1070       files 1040, 1055, 1070: span 30
    #   step 300: 1070 + 50 + 20 = 1140            files 1120, 1140: span 20
    #   step 400: 1140 + 100*3.0 + 20 = 1460       files 1440, 1460: span 20
    # save time = median(20, 30, 20, 20) = 20
    # step time = median((1070-1000-20)/100, (1140-1070-20)/100, (1460-1140-20)/100)
    #           = median(0.5, 0.5, 3.0) = 0.5
    entries = (hf_checkpoint(300, [1120, 1140]) + hf_checkpoint(100, [980, 1000])
               + hf_checkpoint(400, [1440, 1460]) + hf_checkpoint(200, [1040, 1055, 1070]))
    checkpoints = complete_checkpoints(entries, "auto")
    assert [c.step for c in checkpoints] == [100, 200, 300, 400]
    m = measure(checkpoints)
    assert m.save_time == 20
    assert m.step_time == 0.5
    assert m.samples == 3
    assert m.save_measured


def test_measure_single_files_needs_the_save_time():
    # ckpt files end at 1000, 1070, 1140 (100 steps apart); with save 20s:
    # step time = median((70-20)/100, (70-20)/100) = 0.5
    entries = [Entry(f"ckpt-{s:08d}.pt", "f", 5000, t) for s, t in ((100, 1000), (200, 1070), (300, 1140))]
    checkpoints = complete_checkpoints(entries, "files", "ckpt-*.pt")
    with pytest.raises(UsageError) as err:
        measure(checkpoints)
    assert "--save-time" in (err.value.hint or "")
    m = measure(checkpoints, save_time=20)
    assert (m.step_time, m.save_time, m.samples, m.save_measured) == (0.5, 20, 2, False)


def test_measure_needs_two_checkpoints():
    one = complete_checkpoints(hf_checkpoint(100, [980, 1000]), "hf-trainer")
    for checkpoints in ([], one):
        with pytest.raises(CheckpointError) as err:
            measure(checkpoints, save_time=20)
        assert err.value.exit_code == 5
        assert "at least 2 complete checkpoints" in err.value.message


def test_measure_leaves_out_pairs_that_go_back_in_time():
    # step 100 restored from a store keeps a late mtime (5000): (1070-5000-20)/100 < 0 is left out;
    # the remaining pair: (1140-1070-20)/100 = 0.5
    entries = [Entry(f"ckpt-{s}.pt", "f", 1, t) for s, t in ((100, 5000), (200, 1070), (300, 1140))]
    m = measure(complete_checkpoints(entries, "files", "ckpt-*.pt"), save_time=20)
    assert (m.step_time, m.samples) == (0.5, 1)
    backwards = [Entry(f"ckpt-{s}.pt", "f", 1, t) for s, t in ((100, 5000), (200, 1070))]
    with pytest.raises(CheckpointError, match="no two consecutive checkpoints"):
        measure(complete_checkpoints(backwards, "files", "ckpt-*.pt"), save_time=20)


def test_compute_fills_in_only_what_was_not_given():
    m = measure(complete_checkpoints(hf_checkpoint(100, [980, 1000]) + hf_checkpoint(200, [1040, 1070]),
                                     "hf-trainer"))
    # measured: save = median(1000-980, 1070-1040) = median(20, 30) = 25; step = (1070-1000-25)/100 = 0.45
    assert (m.save_time, m.step_time) == (25, pytest.approx(0.45))
    given_step = compute(1.5, None, 21600, 0.05, measured=m, host="h")
    assert (given_step.step_time, given_step.save_time, given_step.measured_fields) == (1.5, 25, ("save_time",))
    with pytest.raises(UsageError, match="RECIPE HOST"):
        compute(None, 60, 21600, 0.05)


# -- the command line -----------------------------------------------------------------------------
def test_cli_best_interval(tmp_path):
    r = run_cli("interval", "--step-time", "1.5s", "--save-time", "1m", "--mtbi", "6h", home=tmp_path)
    assert r.returncode == 0, r.stderr
    # as above: 1360 steps = 2040s = 34.0 min, Badput exactly the 5% budget
    assert "save every 1360 steps (34.0 min): Badput 5% with step 1.5s, save 60s, MTBI 6h (budget 5%)" in r.stdout
    # Young/Daly: sqrt(2*60*21600) = 1609.97s = 26.8 min = 1073.3 steps -> 1073
    assert "Young/Daly" in r.stdout and "26.8 min (1073 steps" in r.stdout


def test_cli_every_within_and_over_budget(tmp_path):
    r = run_cli("interval", "--step-time", "1.5", "--save-time", "60s", "--mtbi", "6h", "--every", "120",
                home=tmp_path)
    assert r.returncode == 0, r.stderr
    # (60 + 120*0.75)/21600 = 0.006944 -> 0.694%; 120 steps * 1.5s = 180s = 3.0 min
    assert "save every 120 steps (3.0 min): Badput 0.694%" in r.stdout and "within budget" in r.stdout
    r = run_cli("interval", "--step-time", "1.5", "--save-time", "60s", "--mtbi", "6h", "--every", "2000",
                "--badput", "0.05", home=tmp_path)
    # (60 + 2000*0.75)/21600 = 1560/21600 = 0.07222 -> 7.22%, over 5%: said, not an error
    assert r.returncode == 0, r.stderr
    assert "Badput 7.22%" in r.stdout and "OVER budget" in r.stdout


def test_cli_blocking_time(tmp_path):
    r = run_cli("interval", "--step-time", "1.5s", "--save-time", "1m", "--blocking-time", "2s", "--mtbi", "6h",
                "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    # see test_the_blocking_time_adds_savings_own_cost
    assert data["interval"]["steps"] == 1331 and data["blocking_time"] == 2
    assert data["young_daly"]["steps"] == 196


def test_cli_json(tmp_path):
    r = run_cli("interval", "--step-time", "700ms", "--save-time", "45", "--mtbi", "4h", "--badput", "3%",
                "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["interval"]["steps"] == 1105                      # see test_best_interval_rounds_down
    assert data["interval"]["seconds"] == pytest.approx(773.5)
    assert data["interval"]["badput"] == pytest.approx(431.75 / 14400)
    assert (data["step_time"], data["save_time"], data["mtbi"], data["budget"]) == (0.7, 45, 14400, 0.03)
    assert data["within_budget"] is True and data["given"] is False and data["measured"] is None
    assert data["young_daly"]["seconds"] == pytest.approx(math.sqrt(2 * 45 * 14400))   # 1138.4s


@pytest.mark.parametrize("args, says", [
    (["--step-time", "1.5x", "--save-time", "60", "--mtbi", "6h"], "--step-time: '1.5x' is not a duration"),
    (["--step-time", "1.5", "--save-time", "60"], "give --mtbi"),
    (["--step-time", "1.5", "--save-time", "60", "--mtbi", "6h", "--badput", "5"], "did you mean 5%?"),
    (["--step-time", "1.5", "--save-time", "60", "--mtbi", "6h", "--every", "0"], "--every"),
    (["--step-time", "0s", "--save-time", "60", "--mtbi", "6h"], "--step-time must be more than 0"),
    (["--mtbi", "6h"], "give --step-time and --save-time, or RECIPE HOST"),
    (["--step-time", "1.5", "--save-time", "20m", "--mtbi", "6h"], "saving takes too long for that MTBI"),
    (["--step-time", "1.5", "--save-time", "60", "--blocking-time", "-1", "--mtbi", "6h"],
     "--blocking-time: '-1' is not a duration"),
])
def test_cli_bad_options_exit_2(tmp_path, args, says):
    r = run_cli("interval", *args, home=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert says in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_recipe_without_host_or_last_up(tmp_path, ssh_key):
    recipe = plain_recipe(tmp_path, name="nohost", key=ssh_key)
    r = run_cli("interval", str(recipe), "--mtbi", "6h", home=tmp_path / "state")
    assert r.returncode == 2 and "no HOST given" in r.stderr


# -- measured on a real instance ----------------------------------------------------------------
def touch_at(ssh, inst, files: dict[str, int]) -> None:
    """Create each file (relative to ~) with that mtime (seconds since the epoch)."""
    lines = []
    for path, epoch in files.items():
        q = shlex.quote(path)
        lines.append(f"mkdir -p \"$(dirname ~/{q})\" && head -c 100 /dev/zero > ~/{q} && touch -d @{epoch} ~/{q}")
    ssh(inst, " && ".join(lines))


def test_cli_measures_on_the_instance(tmp_path, sandbox, ssh, ssh_key):
    inst = sandbox()
    home = tmp_path / "state"
    # HF Trainer folders: saving takes 20s, 100 steps at 0.5s between saves (see the pure test):
    #   checkpoint-100 files 980..1000, checkpoint-200 1050..1070, checkpoint-300 1120..1140
    # save = median(20, 20, 20) = 20; step = median((1070-1000-20)/100, (1140-1070-20)/100) = 0.5
    touch_at(ssh, inst, {
        "hf/checkpoint-100/model.bin": 980, "hf/checkpoint-100/trainer_state.json": 1000,
        "hf/checkpoint-200/model.bin": 1050, "hf/checkpoint-200/trainer_state.json": 1070,
        "hf/checkpoint-300/model.bin": 1120, "hf/checkpoint-300/trainer_state.json": 1140,
        "hf/checkpoint-400/model.bin": 5000,                 # still being written: not complete, not used
        "files/ckpt-00000100.pt": 1000, "files/ckpt-00000200.pt": 1070, "files/ckpt-00000300.pt": 1140,
        "one/ckpt-00000100.pt": 1000,
    })
    hf = plain_recipe(tmp_path / "hf", name="iv-hf", key=ssh_key, checkpoint={"dir": "~/hf", "layout": "hf-trainer"})
    r = run_cli("interval", str(hf), inst.host, "--mtbi", "6h", "--json", home=home)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert (data["step_time"], data["save_time"]) == (0.5, 20)
    assert data["measured"]["samples"] == 2 and data["measured_fields"] == ["step_time", "save_time"]
    # B*M = 1080; N = floor(2*(1080-20)/0.5) = 4240 steps = 2120s; Badput (20 + 1060)/21600 = 5%
    assert data["interval"]["steps"] == 4240 and data["interval"]["seconds"] == 2120
    assert "3 complete checkpoints" in r.stderr

    r = run_cli("interval", str(hf), inst.host, "--mtbi", "6h", "--step-time", "1.5s", home=home)
    assert r.returncode == 0, r.stderr
    # only the save time is taken from the instance: N = floor(2*(1080-20)/1.5) = 1413 (1413.33)
    assert f"measured on root@{inst.address}" in r.stdout and "save 20s" in r.stdout
    assert "save every 1413 steps" in r.stdout and "median of" not in r.stdout
    # both given: nothing to measure, the instance is not contacted
    r = run_cli("interval", str(hf), inst.host, "--mtbi", "6h", "--step-time", "1.5s", "--save-time", "60",
                home=home)
    assert r.returncode == 0 and "save every 1360 steps" in r.stdout
    assert "nothing to measure" in r.stderr and "connecting" not in r.stderr

    # single files: no start time, so --save-time is required; then the step time is measured
    files = plain_recipe(tmp_path / "files", name="iv-files", key=ssh_key, checkpoint={"dir": "~/files"})
    r = run_cli("interval", str(files), inst.host, "--mtbi", "6h", home=home)
    assert r.returncode == 2 and "cannot be measured" in r.stderr and "--save-time" in r.stderr
    r = run_cli("interval", str(files), inst.host, "--mtbi", "6h", "--save-time", "20s", home=home)
    assert r.returncode == 0, r.stderr
    assert "measured on" in r.stdout and "step 0.5s (median of 2 checkpoint pairs)" in r.stdout
    assert "save every 4240 steps (35.3 min)" in r.stdout        # 2120s / 60 = 35.33 min

    # one checkpoint, or none at all: no usable checkpoint, exit 5
    for folder in ("one", "missing"):
        recipe = plain_recipe(tmp_path / folder, name=f"iv-{folder}", key=ssh_key, checkpoint={"dir": f"~/{folder}"})
        r = run_cli("interval", str(recipe), inst.host, "--mtbi", "6h", "--save-time", "20s", home=home)
        assert r.returncode == 5, r.stderr
        assert "at least 2 complete checkpoints" in r.stderr
