"""A copy that rotation cannot waste (issue 17, item 2), against sandbox instances.

A checkpoint chosen for a copy is pinned on the instance for the copy's length: hard links of its
files, which the copy and the hash beside it read (templates/pin.py). The trainer's rotation is
played here as a careful trainer does it (the new save written under a temp name and renamed,
then the old one deleted), from inside the instance (`sb.run_in`), so that it does not queue
behind the copy on the shaped link. Every test ends with no pin left on the instance.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from e2e import cli_env, plain_recipe, run_cli, wait_for
from relaunch import sandbox as sb

MANIFEST = Path(".relaunch") / "manifest.json"
BIG = 4_000_000           # over an 8 Mbit/s link: a copy of several seconds


def records(store: Path) -> dict[str, dict]:
    path = store / MANIFEST
    return {c["name"]: c for c in json.loads(path.read_text())["checkpoints"]} if path.exists() else {}


def on(inst, script: str) -> str:
    """A shell line run inside the instance as root (its console: not over the shaped link)."""
    done = sb.run_in(inst.name, ["sh", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{script}: {done.stderr}"
    return done.stdout


def save(inst, folder: str, step: int, size: int) -> str:
    """The trainer's save (as root: the files are root's): a temp name, then a rename; its sha256."""
    name = f"{folder}/ckpt-{step:08d}.pt"
    on(inst, f"mkdir -p {folder} && head -c {size} /dev/urandom > {name}.tmp && mv {name}.tmp {name}")
    return on(inst, f"sha256sum {name}").split()[0]


def pins(inst, recipe: str) -> list[str]:
    """What is pinned for `recipe` on the instance, wherever relaunch may have put it."""
    return on(inst, f"cd / && ls -d {inst.home}/.relaunch/{recipe}/pinned {inst.home}/.relaunch-pins-{recipe} "
                    f"/tmp/.relaunch-pins-{recipe} 2>/dev/null; find {inst.home}/.relaunch/{recipe}/pinned/ "
                    f"/tmp/.relaunch-pins-{recipe}/ -type f 2>/dev/null; true").split()


def start(tmp_path: Path, *args: str, home: Path) -> tuple[subprocess.Popen[str], Path, Path]:
    out, err = tmp_path / f"{args[0]}.out", tmp_path / f"{args[0]}.err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "relaunch.cli", *args], stdout=o, stderr=e, text=True,
                                env=cli_env(home))
    return proc, out, err


def copying(store: Path) -> bool:
    """rsync is writing a checkpoint into the store's staging right now (its temp file is there)."""
    staged = store / ".relaunch" / "partial"
    return any(p.name.startswith(".") and p.stat().st_size > 0 for p in staged.rglob(".ckpt-*.pt.*") if p.is_file())


def local_processes(pattern: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if pattern in line and "ps -eo" not in line]


# -- 1. the trainer rotates away the checkpoint being copied ----------------------------------------
@pytest.mark.parametrize("ckpt_dir, pinned", [
    ("~/ckpt", "{home}/.relaunch/rotated/pinned"),          # relaunch's folder is on checkpoint.dir's disk
    ("/tmp/ckpt", "/tmp/.relaunch-pins-rotated"),           # it is not: the pins go beside checkpoint.dir
], ids=["pins-in-relaunchs-folder", "pins-beside-checkpoint-dir"])
def test_a_checkpoint_rotated_away_mid_copy_is_verified_and_recorded(tmp_path, sandbox, ssh_key, ckpt_dir, pinned):
    home, inst = tmp_path / "state", sandbox(rate="8mbit")
    store = tmp_path / "store"
    recipe = plain_recipe(tmp_path, name="rotated", key=ssh_key, checkpoint={"dir": ckpt_dir})
    folder = ckpt_dir.replace("~", inst.home)
    want = save(inst, folder, 10, BIG)
    proc, out, err = start(tmp_path, "evacuate", str(recipe), inst.host, "--json", home=home)
    try:
        wait_for("the copy to start", lambda: copying(store), timeout=120, every=0.05)
        held = pins(inst, "rotated")
        save(inst, folder, 15, 2000)                                  # the trainer saves, keep: 1 ...
        on(inst, f"rm {folder}/ckpt-00000010.pt")                     # ... and deletes the one being copied
        mid_copy = copying(store)
        proc.wait(timeout=180)
    finally:
        proc.kill()
    said = err.read_text()
    assert mid_copy, "the rotation came after the copy: this run tested nothing"
    assert proc.returncode == 0, said
    assert "rotated away" not in said and "safe to destroy" in said
    report = json.loads(out.read_text())
    assert report["skipped"] == [] and {"ckpt-00000010.pt", "ckpt-00000015.pt"} <= set(report["copied"])
    assert "ckpt-00000010.pt" in report["pinned"] and report["unpinned"] == []
    assert records(store)["ckpt-00000010.pt"]["files"]["ckpt-00000010.pt"]["sha256"] == want
    assert hashlib.sha256((store / "ckpt-00000010.pt").read_bytes()).hexdigest() == want
    assert on(inst, f"ls {folder}").split() == ["ckpt-00000015.pt"]  # it really was deleted on the instance
    expected = pinned.format(home=inst.home)
    assert expected in held and f"{expected}/ckpt-00000010.pt" in held     # where the copy read it from
    assert pins(inst, "rotated") == []


# -- 2. a copy that fails midway ---------------------------------------------------------------------
def test_a_copy_into_a_full_store_leaves_no_pin(tmp_path, sandbox, ssh_key):
    home, inst = tmp_path / "state", sandbox()
    store = tmp_path / "store"
    store.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(store)], check=True)
    try:
        recipe = plain_recipe(tmp_path, name="fullstore", key=ssh_key)
        save(inst, f"{inst.home}/ckpt", 10, 3_000_000)
        full = run_cli("evacuate", str(recipe), inst.host, home=home)
        assert full.returncode == 6, full.stderr
        assert "no room in the store" in full.stderr and "pinned for its copy" in full.stderr
        assert pins(inst, "fullstore") == []
    finally:
        subprocess.run(["umount", str(store)], check=True)


def test_ctrl_c_mid_copy_leaves_no_pin(tmp_path, sandbox, ssh_key):
    home, inst = tmp_path / "state", sandbox(rate="8mbit")
    store = tmp_path / "store"
    recipe = plain_recipe(tmp_path, name="ctrlc", key=ssh_key)
    save(inst, f"{inst.home}/ckpt", 10, BIG)
    proc, _, err = start(tmp_path, "evacuate", str(recipe), inst.host, home=home)
    try:
        wait_for("the copy to start", lambda: copying(store), timeout=120, every=0.05)
        held = pins(inst, "ctrlc")
        proc.send_signal(signal.SIGINT)
        status = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert status == 130, err.read_text()
    assert f"{inst.home}/.relaunch/ctrlc/pinned/ckpt-00000010.pt" in held
    assert pins(inst, "ctrlc") == []
    assert records(store) == {}


# -- 3. kill -9 mid-copy: the pin stays, the next round removes it ------------------------------------
@pytest.mark.parametrize("rerun", ["evacuate", "sync-after-rotation"])
def test_a_pin_left_by_kill_9_is_removed_by_the_next_round(tmp_path, sandbox, ssh_key, rerun):
    home, inst = tmp_path / "state", sandbox(rate="8mbit")
    store = tmp_path / "store"
    folder = f"{inst.home}/ckpt"
    recipe = plain_recipe(tmp_path, name="killed", key=ssh_key)
    save(inst, folder, 5, 2000)
    assert run_cli("sync", str(recipe), inst.host, "--once", home=home).returncode == 0
    want = save(inst, folder, 10, BIG)
    proc, _, _ = start(tmp_path, "evacuate", str(recipe), inst.host, home=home)
    try:
        wait_for("the copy to start", lambda: copying(store), timeout=120, every=0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    wait_for("the orphaned copy to end", lambda: not local_processes(f"{inst.address}:"), timeout=30)
    left = pins(inst, "killed")
    assert f"{inst.home}/.relaunch/killed/pinned/ckpt-00000010.pt" in left     # nothing could remove it

    if rerun == "evacuate":
        # the next copy removes it first, then copies (pinned) and reaches its verdict
        again = run_cli("evacuate", str(recipe), inst.host, "--json", home=home)
        assert again.returncode == 0, again.stderr
        assert pins(inst, "killed") == []
        assert "removed 1 pinned file(s) an earlier copy left" in again.stderr
        assert "safe to destroy" in again.stderr
        assert json.loads(again.stdout)["pinned"] == ["ckpt-00000010.pt"]       # the leftover did not get in the way
        assert records(store)["ckpt-00000010.pt"]["files"]["ckpt-00000010.pt"]["sha256"] == want
    else:
        # the trainer rotated it away meanwhile: the next round has nothing to copy, and still
        # removes the pin (it holds the disk space the rotation meant to free)
        on(inst, f"rm {folder}/ckpt-00000010.pt")
        again = run_cli("sync", str(recipe), inst.host, "--once", "--json", home=home)
        assert again.returncode == 0, again.stderr
        report = json.loads(again.stdout)
        assert report["copied"] == [] and report["newest"] == "ckpt-00000005.pt" and report["safe"]
    assert pins(inst, "killed") == []


# -- 4. links impossible: the copy goes ahead unpinned and says why -----------------------------------
PROTECTED = Path("/proc/sys/fs/protected_hardlinks")


def _another_users_files(sandbox, request):
    # the setting of most distributions; switched on here (we are root) where a machine has it
    # off, and put back as it was after the test
    was = PROTECTED.read_text().strip()
    if was != "1":
        PROTECTED.write_text("1\n")
        request.addfinalizer(lambda: PROTECTED.write_text(f"{was}\n"))
    inst = sandbox(user="ubuntu")
    return inst, "belongs to root, and fs.protected_hardlinks lets only its owner (or root) link it"


def _a_filesystem_of_its_own(sandbox, request):
    inst = sandbox()
    on(inst, f"mkdir -p {inst.home}/ckpt && mount -t tmpfs -o size=16m relaunch-test-ckpt {inst.home}/ckpt")
    return inst, "checkpoint.dir is a filesystem of its own, and relaunch's folder"


def _too_little_room(sandbox, request):
    inst = sandbox(disk="5M")
    return inst, "free on checkpoint.dir's disk, less than the checkpoint's"


@pytest.mark.parametrize("setting", [_another_users_files, _a_filesystem_of_its_own, _too_little_room],
                         ids=["another-users-files", "a-filesystem-of-its-own", "too-little-room"])
def test_a_checkpoint_that_cannot_be_pinned_is_copied_unpinned_and_said_why(tmp_path, sandbox, ssh_key, setting,
                                                                           request):
    home, store = tmp_path / "state", tmp_path / "store"
    inst, why = setting(sandbox, request)
    recipe = plain_recipe(tmp_path, name="nopin", key=ssh_key)
    want = save(inst, f"{inst.home}/ckpt", 10, 3_000_000)
    evac = run_cli("evacuate", str(recipe), inst.host, "--json", home=home)
    assert evac.returncode == 0, evac.stderr
    lines = [ln for ln in evac.stderr.splitlines() if "copied unpinned" in ln]
    assert len(lines) == 1 and why in lines[0], evac.stderr
    assert "if the trainer's rotation deletes it during the copy, the copy is skipped" in lines[0]
    assert "safe to destroy" in evac.stderr
    report = json.loads(evac.stdout)
    assert report["copied"] == ["ckpt-00000010.pt"] and report["pinned"] == []
    assert [u.split(":", 1)[0] for u in report["unpinned"]] == ["ckpt-00000010.pt"]
    assert records(store)["ckpt-00000010.pt"]["files"]["ckpt-00000010.pt"]["sha256"] == want
    assert pins(inst, "nopin") == []
