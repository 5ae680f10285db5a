"""A rollback end to end on sandbox instances (issue 36): training resumed from an older checkpoint
starts a new branch, and "newest" is that branch's everywhere.

On an instance whose run saved up to step 70 or more (the trainer keeping its newest 2 on its disk,
the store all it was sent: two early saves by `sync --once`, the last two by `evacuate --stop`),
`up --checkpoint` of the store's oldest: the later checkpoints go aside on the instance and in the
store, said where; the new branch trains and saves (its first save takes the name of a checkpoint
the store set aside, whose bytes then move to `.relaunch/aside/`); `evacuate --stop` verifies the
new branch's stop, not the old branch's higher steps; `up` on a second instance resumes there. No
save of the new branch is deleted by the trainer's rotation, and the old branch's checkpoints are
still where relaunch says (`status`). For the example trainer in each layout it writes (files,
hf-trainer, dcp) and for relaunch.train's Checkpointer (train_dist.py). Without the branch, each
run resumes the abandoned branch's newest (its step is higher): the rotation kept those and deleted
the new saves, and evacuate called the old newest the newest.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import host_side_address
from e2e import example_recipe, plain_recipe, run_cli, wait_for
from relaunch.layouts import LISTING_COMMAND, complete_checkpoints, parse_listing
from test_checkpointer_runs import recipe_for as dist_recipe
from test_faults import plant

# the old branch's saves reach this step before it is stopped: the new branch, resumed near step 10, must
# stop before the old branch's kept saves, and its first save plus `evacuate --stop` took 36 steps on a loaded CI
FIRST_RUN_UNTIL = 70
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
    out = ssh(inst, f"if [ -d ~/ckpt ]; then {LISTING_COMMAND.format(dir='~/ckpt')}; fi").stdout.encode()
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
    # two saves in a row into the store: the new branch's first save will take the second one's name
    wait_for("two saves", lambda: len(on_instance(ssh, first, layout)) >= 2)
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
    # a new save that took an old one's name (when the copies met one): the old bytes moved, never
    # overwritten (test_a_new_save_of_an_abandoned_name_moves_the_old_bytes_out_of_its_way: always)
    for name, where in moved_to.items():
        assert name in aside and ".relaunch/aside/" in where
        assert list((store / ".relaunch" / "aside").rglob(Path(name).name)), where
    status = run_cli("status", str(recipe), first.host, home=home)
    assert status.returncode == 4 and "training is not running" in status.stderr, status.stderr   # stopped
    assert "set aside (abandoned branches" in status.stdout and folder[1] in status.stdout, status.stdout

    second = sandbox(user="ubuntu", index_dir=package_index)
    again = run_cli("up", str(recipe), second.host, home=home)
    assert again.returncode == 0, again.stderr
    assert f"{newest['name']} (step {stop})" in again.stderr
    wait_for("the second instance resuming the new branch",
             lambda: re.search(rf"resumed from \S+ at step {stop}\b", log_of(ssh, second, kind)))


def read_back(kind: str, store: Path, server, path: str, revision: str = "main") -> bytes | None:
    """A store file's bytes, read where they are (the folder, the bucket's folder, the Hub's blobs)."""
    if kind == "hf":
        return server.read_files("acme/ckpts", revision).get(f"run1/{path}")
    found = (server.bucket_dir / "runs/a" / path) if kind == "rclone" else store / path
    return found.read_bytes() if found.exists() else None


@pytest.mark.parametrize("kind", ["local", "rclone", "hf"])
def test_a_new_save_of_an_abandoned_name_moves_the_old_bytes_out_of_its_way(kind, tmp_path, sandbox, ssh, ssh_key,
                                                                          package_index, s3_remote, hf_hub):
    """Every kind of store: `up --checkpoint` of the oldest of three sets the two later ones aside (on
    the instance and in the store); the new branch's save of step 20 (other bytes, the same name)
    is copied and verified as the newest, and the old step 20's bytes move out of its way, never
    overwritten (`.relaunch/aside/<branch>/`; a Hub repo keeps them in its history): where, the
    branch says. Step 30 stays aside where it was; `up --checkpoint` of it is refused; `status`
    names both; keep never counts them."""
    inst = sandbox(index_dir=package_index)
    home, store, env, server = tmp_path / "state", tmp_path / "store", {}, None
    checkpoint = {"keep": 3}
    if kind == "rclone":
        server = s3_remote(bind=host_side_address(inst))
        env, checkpoint["remote"] = server.env, f"rclone:{server.name}:{server.bucket}/runs/a"
    elif kind == "hf":
        server = hf_hub(bind=host_side_address(inst), lfs_threshold=1000)
        env, checkpoint["remote"] = server.env(tmp_path / "hfhome"), "hf:acme/ckpts/run1"
    secrets = sorted(env) if kind == "rclone" else ["HF_TOKEN"] if kind == "hf" else []
    recipe = plain_recipe(tmp_path, name=f"branch-{kind}", key=ssh_key, env={"index_url": inst.index_url,
                                                                              "secrets": secrets},
                          checkpoint=checkpoint)
    old = {step: plant(ssh, inst, step) for step in (10, 20, 30)}
    first = run_cli("evacuate", str(recipe), inst.host, home=home, env=env)
    assert first.returncode == 0, first.stderr

    rollback = run_cli("up", str(recipe), inst.host, "--checkpoint", "ckpt-00000010.pt", home=home, env=env)
    assert rollback.returncode == 0, rollback.stderr
    assert "set aside in the store: ckpt-00000020.pt, ckpt-00000030.pt" in rollback.stderr
    folder = re.search(r"set aside in (/\S+/\.relaunch-aside/\S+)", rollback.stderr)[1]
    assert sorted(ssh(inst, f"ls -1 {shlex.quote(folder)}").stdout.split()) == ["ckpt-00000020.pt",
                                                                                 "ckpt-00000030.pt"]
    new = plant(ssh, inst, 20)                        # the new branch's step 20
    assert new != old[20]
    again = run_cli("evacuate", str(recipe), inst.host, "--json", home=home, env=env)
    assert again.returncode == 0 and "safe to destroy" in again.stderr, again.stderr
    report = json.loads(again.stdout)
    assert report["verified_now"] == ["ckpt-00000020.pt"] and report["stored"] == "ckpt-00000020.pt"
    [displaced] = report["displaced"]
    assert displaced.startswith("ckpt-00000020.pt: ") and "makes way for the new branch's save" in again.stderr
    assert hashlib.sha256(read_back(kind, store, server, "ckpt-00000020.pt")).hexdigest() == new
    assert hashlib.sha256(read_back(kind, store, server, "ckpt-00000030.pt")).hexdigest() == old[30]
    if kind == "hf":                                   # in the history, at the commit the branch names
        commit = re.search(r"at commit ([0-9a-f]{12})", displaced)[1]
        full = next(c["sha"] for c in server.commits("acme/ckpts") if c["sha"].startswith(commit))
        kept = read_back(kind, store, server, "ckpt-00000020.pt", full)
    else:
        branch = re.search(r"\.relaunch-aside/(\S+)", folder)[1]
        assert f".relaunch/aside/{branch}" in displaced
        kept = read_back(kind, store, server, f".relaunch/aside/{branch}/ckpt-00000020.pt")
    assert kept is not None and hashlib.sha256(kept).hexdigest() == old[20]

    status = run_cli("status", str(recipe), inst.host, home=home, env=env)
    assert status.returncode == 0, status.stderr
    assert "set aside (abandoned branches" in status.stdout and "ckpt-00000030.pt" in status.stdout, status.stdout
    assert "ckpt-00000020.pt in the store at" in status.stdout
    ssh(inst, f"tmux kill-session -t =branch-{kind}")
    refused = run_cli("up", str(recipe), inst.host, "--checkpoint", "ckpt-00000030.pt", home=home, env=env)
    assert refused.returncode == 5 and "belongs to an abandoned branch" in refused.stderr, refused.stderr
    plant(ssh, inst, 40)
    plant(ssh, inst, 50)
    pruned = run_cli("evacuate", str(recipe), inst.host, "--json", home=home, env=env)
    assert pruned.returncode == 0, pruned.stderr
    assert json.loads(pruned.stdout)["pruned"] == ["ckpt-00000010.pt"]      # keep 3 of the new branch only
    assert hashlib.sha256(read_back(kind, store, server, "ckpt-00000030.pt")).hexdigest() == old[30]


def test_a_trainers_own_rollback_reaches_the_store_with_the_next_copy_round(tmp_path, sandbox, ssh, ssh_key):
    """A training that resumed an older save by itself (relaunch.train.set_aside, as its Checkpointer
    and callbacks call it; here from the run's command) while the store holds the later ones: the
    next `sync --once` reads the instance's lineage file, sets the store's later records aside and
    says so, and the new branch's save of an abandoned name is copied as the newest."""
    inst = sandbox()
    home, store = tmp_path / "state", tmp_path / "store"
    rollback = ("python -c 'from relaunch import train; train.set_aside(\"'$HOME'/ckpt\", "
                "[\"ckpt-00000020.pt\", \"ckpt-00000030.pt\"], \"ckpt-00000010.pt\", 10)'; sleep 600")
    recipe = plain_recipe(tmp_path, name="by-itself", key=ssh_key, command=rollback, checkpoint={"keep": 3})
    old = {step: plant(ssh, inst, step) for step in (10, 20, 30)}
    assert run_cli("evacuate", str(recipe), inst.host, home=home).returncode == 0
    up = run_cli("up", str(recipe), inst.host, home=home)
    assert up.returncode == 0, up.stderr
    wait_for("the training's rollback", lambda: "ckpt-00000030.pt" not in ssh(inst, "ls ~/ckpt").stdout)
    assert "set aside in the store" not in up.stderr            # up resumed the newest: no branch of its own
    new = plant(ssh, inst, 20)
    synced = run_cli("sync", str(recipe), inst.host, "--once", "--json", home=home)
    assert synced.returncode == 0, synced.stderr
    assert "set aside (training resumed an older checkpoint: an abandoned branch): ckpt-00000020.pt, " \
           "ckpt-00000030.pt" in synced.stderr
    report = json.loads(synced.stdout)
    assert list(report["branches"].values()) == [["ckpt-00000020.pt", "ckpt-00000030.pt"]]
    assert report["stored"] == "ckpt-00000020.pt" and hashlib.sha256((store / "ckpt-00000020.pt").read_bytes()
                                                                      ).hexdigest() == new
    [branch] = manifest_of(store)["branches"]
    assert (branch["resumed"], branch["step"], branch["by"]) == ("ckpt-00000010.pt", 10, "a training script")
    kept = store / ".relaunch" / "aside" / branch["id"] / "ckpt-00000020.pt"
    assert hashlib.sha256(kept.read_bytes()).hexdigest() == old[20]
    assert [c["name"] for c in manifest_of(store)["checkpoints"] if c.get("aside")] == ["ckpt-00000030.pt"]


def test_a_rollback_on_a_full_store_disk_says_so_and_the_same_up_completes_it_once_there_is_room(
        tmp_path, sandbox, ssh, ssh_key):
    """`up --checkpoint` of an older checkpoint while the store's disk is full (a local store on a
    small tmpfs): exit 5 naming the store and the full disk, no traceback, the store's manifest as it
    was and no training started; once there is room, the same `up` trains, and the next copy round
    sets the later records aside in the store. (The chaos long run, seed 1212: an internal error,
    exit 1.)"""
    inst = sandbox()
    home, store = tmp_path / "state", tmp_path / "store"
    store.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(store)], check=True)
    try:
        recipe = plain_recipe(tmp_path, name="full-aside", key=ssh_key, checkpoint={"keep": 3})
        for step in (10, 20, 30):
            plant(ssh, inst, step)
        assert run_cli("evacuate", str(recipe), inst.host, home=home).returncode == 0
        before = (store / ".relaunch" / "manifest.json").read_bytes()
        filler = store / "filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True)   # until it is full

        full = run_cli("up", str(recipe), inst.host, "--checkpoint", "ckpt-00000010.pt", home=home)
        assert full.returncode == 5, full.stderr
        assert f"in the store {store} failed: No space left on device" in full.stderr, full.stderr
        assert "internal error" not in full.stderr and "Traceback" not in full.stderr
        assert (store / ".relaunch" / "manifest.json").read_bytes() == before
        # the instance's own tmux (its /tmp is private; `ps` would list every instance's processes)
        assert ssh(inst, "tmux has-session -t =full-aside", check=False).returncode != 0

        filler.unlink()
        again = run_cli("up", str(recipe), inst.host, "--checkpoint", "ckpt-00000010.pt", home=home)
        assert again.returncode == 0, again.stderr
        assert wait_for("the training", lambda: ssh(inst, "tmux has-session -t =full-aside",
                                                    check=False).returncode == 0)
        # the instance's lineage file holds the branch: the next copy round tells the store
        assert run_cli("sync", str(recipe), inst.host, "--once", home=home).returncode == 0
        assert sorted(c["name"] for c in manifest_of(store)["checkpoints"] if c.get("aside")) == \
            ["ckpt-00000020.pt", "ckpt-00000030.pt"]
    finally:
        subprocess.run(["umount", "-l", str(store)], check=False)
