"""The history of interruptions lives in the store, beside the manifest, whatever the store is (a
folder here, an S3 bucket through rclone, a Hugging Face repo), and `relaunch interval` measures
the mean time between interruptions from it and checks saving plus copying against the
provider's notice window. Real stores: `rclone serve s3` and the fake Hub (tests/hubserver.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from e2e import plain_recipe, run_cli

T0 = 1_800_000_000.0
# lost at T0 (running again 300 s later), a notice one hour after that (copy 40 s, running again
# 200 s later), lost again two hours after that: gaps of running 3600 s and 7200 s, mean 5400 s
WRITE = """
import json, sys
from relaunch.history import Interruption, read_history, record
from relaunch.recipe import load_recipe
from relaunch.transports import open_store
from relaunch.ui import UI

recipe, ui, t0 = load_recipe(sys.argv[1]), UI(quiet=True), float(sys.argv[2])
store = open_store(recipe)
first = Interruption.start("root@192.0.2.1:22", "lost", "no answer for 130s", t0, 120, 100)
record(store, first, ui)
first.resumed("root@192.0.2.2:22", t0 + 300)
record(store, first, ui)                       # completed in place, not a second line
second = Interruption.start("root@192.0.2.2:22", "notice", "aws: spot terminate", t0 + 3900, 500, 500)
second.made_deadline, second.copy_seconds = True, 40.0
record(store, second, ui)
second.resumed("root@192.0.2.3:22", t0 + 4100)
record(store, second, ui)
record(store, Interruption.start("root@192.0.2.3:22", "lost", "no answer for 125s", t0 + 11300, 900, 880), ui)
print(json.dumps([e.as_dict() for e in read_history(open_store(load_recipe(sys.argv[1])))]))
"""


def write_history(recipe: Path, env: dict[str, str]) -> list[dict]:
    import os

    out = subprocess.run([sys.executable, "-c", WRITE, str(recipe), str(T0)], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.sandbox  # minutes: a training run per store
@pytest.mark.parametrize("kind", ["local", "rclone", "hf"])
def test_history_in_the_store_gives_interval_its_mtbi(kind, tmp_path, ssh_key, s3_remote, hf_hub):
    home = tmp_path / "state"
    if kind == "local":
        remote, env = str(tmp_path / "store"), {}
    elif kind == "rclone":
        s3 = s3_remote()
        remote, env = f"rclone:{s3.name}:{s3.bucket}/runs/a", s3.env
    else:
        hub = hf_hub()
        remote, env = "hf:acme/ckpts/run1", hub.env(tmp_path / "hfhome")
    recipe = plain_recipe(tmp_path, name="hist", key=ssh_key, checkpoint={"remote": remote})
    recipe.write_text(recipe.read_text() + "provider: aws\n")        # its notice window: 120 s
    entries = write_history(recipe, env)
    assert [e["cause"] for e in entries] == ["lost", "notice", "lost"]
    assert entries[0]["resumed_host"] == "root@192.0.2.2:22" and entries[0]["time_to_resume"] == 300
    assert entries[0]["steps_lost"] == 20 and entries[2]["resumed_host"] is None
    if kind == "local":
        lines = (tmp_path / "store" / ".relaunch" / "history.jsonl").read_text().splitlines()
        assert len(lines) == 3 and json.loads(lines[1])["copy_seconds"] == 40
    elif kind == "rclone":
        assert len((s3.bucket_dir / "runs/a/.relaunch/history.jsonl").read_text().splitlines()) == 3

    # no --mtbi: the mean of the two running times between the three interruptions, 90 min
    r = run_cli("interval", str(recipe), "--step-time", "1s", "--save-time", "60s", "--json", home=home, env=env)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["mtbi"] == 5400 and data["mtbi_from"] == "history" and data["mtbi_gaps"] == 2
    # aws gives 120 s: 60 s of saving plus the 40 s copy measured after the notice fit
    assert data["notice"] == {"provider": "aws", "window": 120, "save_time": 60, "copy_time": 40, "needed": 100,
                              "fits": True}
    text = run_cli("interval", str(recipe), "--step-time", "1s", "--save-time", "90s", home=home, env=env)
    assert text.returncode == 0, text.stderr
    assert "MTBI 90 min: measured from 3 interruptions in the store's history" in text.stdout
    assert "warning: save 90s + copy 40s = 2.17 min does NOT fit in the 2 min reclaim notice of aws" in text.stdout
    given = run_cli("interval", str(recipe), "--step-time", "1s", "--save-time", "60s", "--mtbi", "6h",
                    "--copy-time", "10s", "--json", home=home, env=env)
    data = json.loads(given.stdout)
    assert data["mtbi"] == 21600 and data["mtbi_from"] == "given" and data["notice"]["copy_time"] == 10


def test_interval_without_mtbi_needs_two_interruptions(tmp_path, ssh_key):
    recipe = plain_recipe(tmp_path, name="young", key=ssh_key)
    r = run_cli("interval", str(recipe), "--step-time", "1s", "--save-time", "60s", home=tmp_path / "state")
    assert r.returncode == 2 and "give --mtbi: the store's history of recipe young holds 0 interruption(s)" in r.stderr
    assert "Traceback" not in r.stderr
