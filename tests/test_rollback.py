"""A rollback end to end on sandbox instances (issue 36): training resumed from an older checkpoint
starts a new branch, and "newest" is that branch's everywhere.

On an instance whose run saved up to step 40 or more (the trainer keeping its newest 2 on its disk,
the store every save), `up --checkpoint` of the store's oldest (step 5): the later checkpoints go
aside on the instance and in the store, said where; the new branch trains and saves; `evacuate
--stop` verifies the new branch's stop, not the old branch's higher steps; `up` on a second
instance resumes there. No save of the new branch is deleted by the trainer's rotation, and the old
branch's checkpoints are still where relaunch says (`status`). For the example trainer in each
layout it writes (files, hf-trainer, dcp) and for relaunch.train's Checkpointer (train_dist.py).
On main each run resumes the abandoned branch's newest (its step is higher): the rotation kept
those and deleted the new saves, and evacuate called the old newest the newest.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from e2e import example_recipe, run_cli, wait_for
from relaunch.layouts import LISTING_COMMAND, complete_checkpoints, parse_listing
from test_checkpointer_runs import recipe_for as dist_recipe

FIRST_RUN_UNTIL = 40          # the old branch's saves reach this step before it is stopped
SAVE_EVERY, SLEEP = 5, 0.5


def make_recipe(folder: Path, kind: str, key: Path, index_url: str) -> Path:
    """The example's recipe: a save every 5 steps, the newest 2 kept by the trainer on its disk,
    every checkpoint kept in the store (keep 10)."""
    if kind == "checkpointer":
        path = dist_recipe(folder, key, index_url, steps=400, sleep=SLEEP, save_every=SAVE_EVERY, nproc=1)
        data = yaml.safe_load(path.read_text())
        data["run"]["command"] += " --keep 2"
    else:
        path = example_recipe(folder, name=f"rollback-{kind}", layout=kind, key=key, index_url=index_url, steps=400,
                              save_every=SAVE_EVERY, sleep=SLEEP, keep=10)
        data = yaml.safe_load(path.read_text())
        data["run"]["command"] += " --keep-last 2"
    data["checkpoint"]["keep"] = 10
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def on_instance(ssh, inst, layout: str) -> dict[str, int]:
    """The complete checkpoints relaunch sees there (its own listing and layout): name -> step."""
    out = ssh(inst, LISTING_COMMAND.format(dir="~/ckpt")).stdout.encode()
    return {c.name: c.step for c in complete_checkpoints(parse_listing(out), layout)}


def manifest_of(store: Path) -> dict:
    return json.loads((store / ".relaunch" / "manifest.json").read_text())


def log_of(ssh, inst, kind: str) -> str:
    name = "example-dist" if kind == "checkpointer" else f"rollback-{kind}"
    return ssh(inst, f"cat ~/{name}.log").stdout


def saves_after_the_resume(log: str, kind: str, step: int) -> list[int]:
    """The steps the new branch saved (its log after `resumed from ... at step <step>`)."""
    after = log[[m.end() for m in re.finditer(rf"resumed from \S+ at step {step}\b", log)][-1]:]
    found = (r"^relaunch\.checkpoint: step=(\d+) " if kind == "checkpointer" else r"^saved \S*?(\d+)(?:\.pt)?$")
    return [int(s) for s in re.findall(found, after, re.M)]


@pytest.mark.parametrize("kind", ["files", "hf-trainer", "dcp", "checkpointer"])
def test_a_rollback_keeps_the_new_branch_and_up_elsewhere_resumes_it(kind, tmp_path, sandbox, ssh, ssh_key,
                                                                    package_index):
    layout = "dcp" if kind == "checkpointer" else kind
    first = sandbox(user="root", index_dir=package_index)
    home, work = tmp_path / "state", tmp_path / "work"
    recipe = make_recipe(work, kind, ssh_key, first.index_url)
    store = work / "store"

    up = run_cli("up", str(recipe), first.host, home=home)
    assert up.returncode == 0, up.stderr
    wait_for("the first save", lambda: on_instance(ssh, first, layout))
    synced = run_cli("sync", str(recipe), first.host, "--once", home=home)
    assert synced.returncode == 0, synced.stderr
    wait_for(f"saves up to step {FIRST_RUN_UNTIL}",
             lambda: max(on_instance(ssh, first, layout).values()) >= FIRST_RUN_UNTIL, timeout=600)
    stopped = run_cli("evacuate", str(recipe), first.host, "--stop", home=home)
    assert stopped.returncode == 0 and "safe to destroy" in stopped.stderr, stopped.stderr
    old = on_instance(ssh, first, layout)                   # the trainer kept its newest 2
    back = min(manifest_of(store)["checkpoints"], key=lambda c: c["step"])
    assert back["step"] < min(old.values())

    rollback = run_cli("up", str(recipe), first.host, "--checkpoint", back["name"], home=home)
    assert rollback.returncode == 0, rollback.stderr
    # the instance's later checkpoints are aside (and said where); the store's later records too
    folder = re.search(r"set aside in (/\S+/\.relaunch-aside/\S+)", rollback.stderr)
    assert folder and all(name in rollback.stderr for name in old), rollback.stderr
    moved = ssh(first, f"ls -1 {shlex.quote(folder[1])}").stdout.split()
    assert sorted(moved) == sorted(old)
    aside = {c["name"] for c in manifest_of(store)["checkpoints"] if c.get("aside")}
    assert aside == {c["name"] for c in manifest_of(store)["checkpoints"] if c["step"] > back["step"]}
    assert set(old) <= aside

    resumed = rf"resumed from \S+ at step {back['step']}\b"
    wait_for("the new branch's first save", lambda: re.search(resumed, text := log_of(ssh, first, kind)) and
             saves_after_the_resume(text, kind, back["step"]))
    stopped = run_cli("evacuate", str(recipe), first.host, "--stop", home=home)
    assert stopped.returncode == 0 and "safe to destroy" in stopped.stderr, stopped.stderr
    log = log_of(ssh, first, kind)
    stop = int(re.findall(r"^stopped at step (\d+)$", log, re.M)[-1])
    assert stop < min(old.values()), "the new branch went past the old one: this run proves nothing"
    new_saves = sorted(set(saves_after_the_resume(log, kind, back["step"])) | {stop})
    # the trainer's rotation kept the new branch's newest 2 (never the old branch's higher steps)
    here = on_instance(ssh, first, layout)
    assert sorted(here.values()) == new_saves[-2:], (here, new_saves)
    current = [c for c in manifest_of(store)["checkpoints"] if not c.get("aside")]
    newest = max(current, key=lambda c: c["step"])
    assert newest["step"] == stop and newest["name"] in here
    # the old branch's checkpoints: in the store (by their bytes), where the manifest says
    doc = manifest_of(store)
    moved_to = {name: where for b in doc["branches"] for name, where in b.get("moved", {}).items()}
    for record in [c for c in doc["checkpoints"] if c.get("aside")]:
        for path in record["files"]:
            assert (store / path).is_file(), path
    for name, where in moved_to.items():
        assert name in {n for n in aside} and ".relaunch/aside/" in where
        assert list((store / ".relaunch" / "aside").rglob(f"{Path(name).name}*")), where
    status = run_cli("status", str(recipe), first.host, home=home)
    assert status.returncode == 4 and "training is not running" in status.stderr, status.stderr   # stopped
    assert "set aside (abandoned branches" in status.stdout and folder[1] in status.stdout, status.stdout

    second = sandbox(user="ubuntu", index_dir=package_index)
    again = run_cli("up", str(recipe), second.host, home=home)
    assert again.returncode == 0, again.stderr
    assert f"{newest['name']} (step {stop})" in again.stderr
    wait_for("the second instance resuming the new branch",
             lambda: re.search(rf"resumed from \S+ at step {stop}\b", log_of(ssh, second, kind)))
