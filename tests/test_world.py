"""Verdicts checked against the world, end to end: `safe to destroy`, `sync --once`'s exit 0 and
what `up` restores come from the bytes in the store and what the instance shows at that moment,
never from the manifest alone. Each test has the fault that made a verdict false before.

Real sandbox instances, the real CLI, real rsync and tmux; a local store on this machine.
"""

from __future__ import annotations

import hashlib
import json
import signal

import pytest

from conftest import host_side_address
from e2e import plain_recipe, run_cli, start_cli, wait_for
from relaunch.sandbox.console import anchor_pid
from test_faults import plant, records


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_checkpoint_deleted_from_the_store_is_copied_again_not_taken_on_the_manifests_word(
        tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    inst = sandbox()
    recipe = plain_recipe(tmp_path, name="gone", key=ssh_key)
    store = tmp_path / "store"
    older, newest = plant(ssh, inst, 10), plant(ssh, inst, 20)
    assert run_cli("evacuate", str(recipe), inst.host, home=home).returncode == 0
    (store / "ckpt-00000020.pt").unlink()                 # a cleanup by hand, a lifecycle rule

    again = run_cli("evacuate", str(recipe), inst.host, "--json", home=home)
    assert again.returncode == 0, again.stderr
    assert "ckpt-00000020.pt is in the store's manifest, but the store" in again.stderr
    assert "missing from the store; copying it again" in again.stderr
    report = json.loads(again.stdout)
    assert report["copied"] == ["ckpt-00000020.pt"] and report["verified_now"] == ["ckpt-00000020.pt"]
    assert sha(store / "ckpt-00000020.pt") == newest
    assert sha(store / "ckpt-00000010.pt") == older


def test_a_flipped_byte_in_the_store_is_set_aside_and_copied_again(tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    inst = sandbox()
    recipe = plain_recipe(tmp_path, name="flipped", key=ssh_key)
    store = tmp_path / "store"
    newest = plant(ssh, inst, 20)
    assert run_cli("evacuate", str(recipe), inst.host, home=home).returncode == 0
    damaged = bytearray((store / "ckpt-00000020.pt").read_bytes())
    damaged[7] ^= 0xFF                                    # a disk fault: same size, other bytes
    (store / "ckpt-00000020.pt").write_bytes(bytes(damaged))

    again = run_cli("evacuate", str(recipe), inst.host, home=home)
    assert again.returncode == 0, again.stderr
    assert "does not hold it: ckpt-00000020.pt: sha256" in again.stderr
    assert "safe to destroy" in again.stderr
    assert sha(store / "ckpt-00000020.pt") == newest
    # the damaged bytes are kept aside, never deleted, and never where a later run would trust them
    aside = list((store / ".relaunch" / "damaged").rglob("ckpt-00000020.pt"))
    assert len(aside) == 1 and aside[0].read_bytes() == bytes(damaged)
    assert records(store)["ckpt-00000020.pt"]["files"]["ckpt-00000020.pt"]["sha256"] == newest


def test_up_does_not_restore_a_listed_checkpoint_the_store_no_longer_holds(tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    first, second = sandbox(), sandbox()
    recipe = plain_recipe(tmp_path, name="listed", key=ssh_key, command='echo "resume {{ checkpoint }}"; sleep 600')
    store = tmp_path / "store"
    older = plant(ssh, first, 10)
    plant(ssh, first, 20)
    assert run_cli("evacuate", str(recipe), first.host, home=home).returncode == 0
    (store / "ckpt-00000020.pt").unlink()

    up = run_cli("up", str(recipe), second.host, home=home)
    assert up.returncode == 0, up.stderr
    assert "ckpt-00000020.pt is in the store's manifest, but the store" in up.stderr
    assert "falling back to the next verified checkpoint" in up.stderr
    assert "restored ckpt-00000010.pt" in up.stderr
    assert ssh(second, "sha256sum ~/ckpt/ckpt-00000010.pt").stdout.split()[0] == older
    log = wait_for("the command", lambda: ssh(second, "cat ~/listed.log 2>/dev/null", check=False).stdout)
    assert f"resume {second.home}/ckpt/ckpt-00000010.pt" in log

    asked = run_cli("up", str(recipe), sandbox().host, "--checkpoint", "ckpt-00000020.pt", home=home)
    assert asked.returncode == 5, asked.stderr
    assert "does not hold it: ckpt-00000020.pt: missing from the store" in asked.stderr


def test_nothing_to_copy_while_the_log_shows_progress_is_not_safe(tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    inst = sandbox()
    # training that saves somewhere else than checkpoint.dir
    recipe = plain_recipe(tmp_path, name="elsewhere", key=ssh_key,
                          command='i=0; while true; do i=$((i+1)); echo "step $i loss 1.0"; sleep 0.2; done',
                          checkpoint={"dir": "~/checkpoints"})
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    wait_for("step 10 in the log", lambda: "step 10 " in ssh(inst, "cat ~/elsewhere.log", check=False).stdout)

    evac = run_cli("evacuate", str(recipe), inst.host, home=home)
    assert evac.returncode == 6, evac.stderr
    assert "the log says step" in evac.stderr
    assert "/root/checkpoints does not exist: destroying loses" in evac.stderr
    assert "DO NOT destroy" in evac.stderr and "safe to destroy" not in evac.stderr

    allowed = run_cli("evacuate", str(recipe), inst.host, "--allow-empty", home=home)
    assert allowed.returncode == 0, allowed.stderr
    assert "accepted with --allow-empty" in allowed.stderr and "safe to destroy" in allowed.stderr


def test_nothing_to_copy_after_run_grace_without_step_lines_is_not_safe(tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    inst = sandbox()
    recipe = plain_recipe(tmp_path, name="quiet", key=ssh_key, command="sleep 600")     # run.grace: 3
    fresh = run_cli("evacuate", str(recipe), inst.host, home=home)
    assert fresh.returncode == 0, fresh.stderr           # nothing ran there: nothing to lose
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    wait_for("the session to outlive run.grace", lambda: int(ssh(
        inst, "echo $(( $(date +%s) - $(tmux display-message -p -t '=quiet:' '#{session_created}') ))").stdout) > 4)

    evac = run_cli("evacuate", str(recipe), inst.host, home=home)
    assert evac.returncode == 6, evac.stderr
    assert "training has run for" in evac.stderr and "longer than run.grace" in evac.stderr


def test_nothing_to_copy_when_how_long_training_ran_cannot_be_read_is_not_safe(tmp_path, sandbox, ssh, ssh_key):
    """No step in the log, no checkpoint, and a tmux that does not give its session's start (an old
    one: no #{session_created}): how long training has run is unknown, and unknown is not "no
    progress". Evacuate says what it could not read and the way out, and exits 6."""
    home, inst = tmp_path / "state", sandbox()
    recipe = plain_recipe(tmp_path, name="ageless", key=ssh_key, command="sleep 600")
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    real = ssh(inst, "command -v tmux").stdout.strip()
    wrapper = f'#!/bin/sh\ncase "$*" in *session_created*) exit 0;; esac\nexec {real} "$@"\n'
    ssh(inst, "mkdir -p ~/bin && cat > ~/bin/tmux && chmod +x ~/bin/tmux && "
              "echo 'export PATH=$HOME/bin:$PATH' >> ~/.bashrc", input=wrapper)
    assert ssh(inst, "tmux display-message -p -t =ageless: '#{session_created}'").stdout.strip() == ""

    evac = run_cli("evacuate", str(recipe), inst.host, home=home)
    assert evac.returncode == 6, evac.stderr
    assert ("no step in the log, and how long training has run could not be read (the tmux session's start or "
            "the instance's clock); /root/ckpt does not exist: destroying may lose all of it") in evac.stderr
    assert "`relaunch evacuate --allow-empty` accepts it" in evac.stderr
    assert "DO NOT destroy" in evac.stderr and "safe to destroy" not in evac.stderr


def test_a_record_whose_bytes_are_gone_does_not_count_towards_keep(tmp_path, sandbox, ssh, ssh_key):
    """keep: 2, and the store's ckpt-20 lost its bytes (a lifecycle rule) while the trainer rotated
    it away on the instance. Evacuating ckpt-30 must not prune ckpt-10: the store would then hold
    one checkpoint by its bytes, and a record of nothing."""
    home, inst = tmp_path / "state", sandbox()
    recipe = plain_recipe(tmp_path, name="ghost", key=ssh_key)
    store = tmp_path / "store"
    older = plant(ssh, inst, 10)
    plant(ssh, inst, 20)
    assert run_cli("evacuate", str(recipe), inst.host, home=home).returncode == 0
    (store / "ckpt-00000020.pt").unlink()
    ssh(inst, "rm ~/ckpt/ckpt-00000010.pt ~/ckpt/ckpt-00000020.pt")
    plant(ssh, inst, 30)

    evac = run_cli("evacuate", str(recipe), inst.host, home=home)
    assert evac.returncode == 0, evac.stderr
    assert ("ckpt-00000020.pt is in the store's manifest, but the store" in evac.stderr
            and "missing from the store; it does not count towards checkpoint.keep" in evac.stderr)
    assert "pruned ckpt-00000010.pt" not in evac.stderr
    assert sha(store / "ckpt-00000010.pt") == older
    assert set(records(store)) == {"ckpt-00000010.pt", "ckpt-00000020.pt", "ckpt-00000030.pt"}


# training saves again right after evacuate found the newest, ckpt-20, already in the store by its
# record (its store check left for the verdict's, which is then the newer one's)
SAVES_AFTER_THE_NEWEST = """
import os
import sys
from relaunch.cli.main import main
from relaunch.cycle import evacuation

one = evacuation._evacuate_one

def then_training_saves(jobs, store, executor, cp, *args, **kwargs):
    copied = one(jobs, store, executor, cp, *args, **kwargs)
    new = os.path.join(CKPT, "ckpt-00000030.pt")
    if cp.name == "ckpt-00000020.pt" and not os.path.exists(new):
        with open(new + ".tmp", "wb") as handle:
            handle.write(os.urandom(3000))
        os.replace(new + ".tmp", new)
    return copied

evacuation._evacuate_one = then_training_saves
sys.exit(main(sys.argv[1:]))
"""


def test_a_newest_that_training_overtakes_is_checked_in_the_store_before_it_counts(tmp_path, sandbox, ssh, ssh_key):
    """keep: 2. The store's ckpt-20 lost its bytes; evacuate finds ckpt-20 the instance's newest and
    in the store by its record, and training saves ckpt-30 meanwhile. ckpt-20 is checked in the store
    like any other and copied again: it was reported already there, and counted towards keep, with
    its bytes gone (the chaos long run, seed 1216)."""
    home, inst = tmp_path / "state", sandbox()
    recipe = plain_recipe(tmp_path, name="overtaken", key=ssh_key)
    store = tmp_path / "store"
    plant(ssh, inst, 10)
    newest = plant(ssh, inst, 20)
    assert run_cli("evacuate", str(recipe), inst.host, home=home).returncode == 0
    (store / "ckpt-00000020.pt").unlink()                 # a lifecycle rule

    ckpt = f"/proc/{anchor_pid(inst.name)}/root{inst.home}/ckpt"
    evac = run_cli("evacuate", str(recipe), inst.host, "--json", home=home,
                   script=f"CKPT = {ckpt!r}\n" + SAVES_AFTER_THE_NEWEST)
    assert evac.returncode == 0, evac.stderr
    assert "training wrote ckpt-00000030.pt meanwhile" in evac.stderr
    assert "ckpt-00000020.pt is in the store's manifest, but the store" in evac.stderr
    report = json.loads(evac.stdout)
    assert "ckpt-00000020.pt" in report["copied"] and "ckpt-00000020.pt" not in report["already"]
    assert sha(store / "ckpt-00000020.pt") == newest
    assert set(records(store)) == {"ckpt-00000010.pt", "ckpt-00000020.pt", "ckpt-00000030.pt"}


# the store loses the newest's bytes each time right after its copy was verified and committed (a
# failing disk, another process): its check in the store fails, copied again or not
LOSES_THE_NEWEST = """
import sys
from relaunch.cli.main import main
from relaunch.transports.local import LocalPathStore

accept = LocalPathStore.accept

def accept_then_lose(self, cp, *args, **kwargs):
    said = accept(self, cp, *args, **kwargs)
    if cp.name == "ckpt-00000030.pt":
        (self.root / cp.name).unlink()
    return said

LocalPathStore.accept = accept_then_lose
sys.exit(main(sys.argv[1:]))
"""


def test_nothing_is_pruned_before_the_newest_is_checked_in_the_store(tmp_path, sandbox, ssh, ssh_key):
    """keep: 1. ckpt-30 is copied and verified, then its bytes are gone from the store before the
    check the verdict rests on. Evacuate refuses (exit 6), and ckpt-20, the store's last checkpoint
    it does hold, must still be there: pruning it after the copy and before that check left the
    store with nothing."""
    home, inst = tmp_path / "state", sandbox()
    recipe = plain_recipe(tmp_path, name="proof", key=ssh_key, checkpoint={"keep": 1})
    store = tmp_path / "store"
    kept = plant(ssh, inst, 20)
    assert run_cli("evacuate", str(recipe), inst.host, home=home).returncode == 0
    ssh(inst, "rm ~/ckpt/ckpt-00000020.pt")
    plant(ssh, inst, 30)

    evac = run_cli("evacuate", str(recipe), inst.host, home=home, script=LOSES_THE_NEWEST)
    assert evac.returncode == 6, evac.stderr
    assert "ckpt-00000030.pt, is not verified in the store" in evac.stderr and "DO NOT destroy" in evac.stderr
    assert "pruned ckpt-" not in evac.stderr
    assert sha(store / "ckpt-00000020.pt") == kept and "ckpt-00000020.pt" in records(store)


def test_a_sync_round_is_verified_by_the_newest_of_when_it_began(tmp_path, sandbox, ssh, ssh_key):
    """Training saves again while the round copies: the round verified the newest of its start, so it
    is verified (exit 0: a cron job on `sync --once` must not alarm on every run); the newer one is
    the next round's, and evacuate still insists on the very newest."""
    home = tmp_path / "state"
    inst = sandbox(rate="8mbit")
    recipe = plain_recipe(tmp_path, name="behind", key=ssh_key)
    store = tmp_path / "store"
    first = plant(ssh, inst, 10, size=4_000_000)
    proc = start_cli("sync", str(recipe), inst.host, "--once", "--json", home=home, err=tmp_path / "sync.err")
    try:
        staged = store / ".relaunch" / "partial"
        wait_for("the copy to start", lambda: staged.is_dir() and any(p.is_file() for p in staged.rglob("*")),
                 timeout=120, every=0.1)
        plant(ssh, inst, 20, size=1000)                  # training saves again while the round copies
        status = proc.wait(timeout=300)
    finally:
        proc.kill()
    err = (tmp_path / "sync.err").read_text()
    assert status == 0, err
    assert "sync round NOT verified" not in err
    assert "ckpt-00000010.pt" in records(store) and sha(store / "ckpt-00000010.pt") == first
    assert "ckpt-00000020.pt" not in records(store)      # the next round's
    evac = run_cli("evacuate", str(recipe), inst.host, "--json", home=home)
    assert evac.returncode == 0, evac.stderr
    assert json.loads(evac.stdout)["verified_now"] == ["ckpt-00000020.pt"]


def test_nothing_to_copy_is_compared_with_what_the_store_holds_not_its_records(tmp_path, sandbox, ssh, ssh_key):
    """The store's record of step 200 whose file is gone holds no step: an instance whose log shows
    step 150 and that has no checkpoint left loses 150 steps when destroyed."""
    home = tmp_path / "state"
    inst = sandbox()
    recipe = plain_recipe(tmp_path, name="held", key=ssh_key)
    store = tmp_path / "store"
    plant(ssh, inst, 200)
    assert run_cli("evacuate", str(recipe), inst.host, home=home).returncode == 0
    (store / "ckpt-00000200.pt").unlink()                 # the record stays, the bytes are gone
    ssh(inst, "rm -f ~/ckpt/* && echo 'step 150 loss 1.0' >> ~/held.log")
    evac = run_cli("evacuate", str(recipe), inst.host, home=home)
    assert evac.returncode == 6, evac.stderr
    assert "the log says step 150" in evac.stderr and "destroying loses 150 steps" in evac.stderr


def test_nothing_to_copy_reads_the_logs_whole_lines_only(tmp_path, sandbox, ssh, ssh_key):
    """The log's last line is still being written: `step 2` of `step 202` says no step at all. The
    whole line before it, step 201, is past the store's 200: destroying the instance loses a step."""
    home = tmp_path / "state"
    inst = sandbox()
    recipe = plain_recipe(tmp_path, name="midline", key=ssh_key)
    plant(ssh, inst, 200)
    assert run_cli("evacuate", str(recipe), inst.host, home=home).returncode == 0
    ssh(inst, "rm -f ~/ckpt/* && printf 'step 201 loss 1.0\\nstep 2' >> ~/midline.log")
    evac = run_cli("evacuate", str(recipe), inst.host, home=home)
    assert evac.returncode == 6, evac.stderr
    assert "the log says step 201" in evac.stderr and "destroying loses 1 steps" in evac.stderr


def test_nothing_to_copy_reads_this_runs_log_lines_only(tmp_path, sandbox, ssh, ssh_key):
    """An earlier run's higher steps above this run's start line are not this run's progress."""
    home = tmp_path / "state"
    inst = sandbox()
    recipe = plain_recipe(tmp_path, name="again", key=ssh_key, command="sleep 600")
    ssh(inst, "printf '%s\\n' '=== relaunch: start 2026-12-01T00:00:00Z on old (checkpoint: none)' "
              "'step 500 loss 1.0' '=== relaunch: exit 0 2026-12-01T01:00:00Z' > ~/again.log")
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    evac = run_cli("evacuate", str(recipe), inst.host, "--set", "run.grace=600", home=home)
    assert evac.returncode == 0, evac.stderr
    assert "training has made no progress beyond the store's newest checkpoint" in evac.stderr


def test_ctrl_c_during_evacuate_exits_130_and_says_do_not_destroy(tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    inst = sandbox(rate="8mbit")
    recipe = plain_recipe(tmp_path, name="ctrlc-evac", key=ssh_key)
    store = tmp_path / "store"
    want = plant(ssh, inst, 10, size=6_000_000)
    proc = start_cli("evacuate", str(recipe), inst.host, home=home, err=tmp_path / "evac.err")
    try:
        staged = store / ".relaunch" / "partial"
        wait_for("the copy to start", lambda: staged.is_dir() and any(p.is_file() for p in staged.rglob("*")),
                 timeout=120, every=0.1)
        proc.send_signal(signal.SIGINT)
        status = proc.wait(timeout=60)
    finally:
        proc.kill()
    err = (tmp_path / "evac.err").read_text()
    assert status == 130, err
    assert "DO NOT destroy" in err and "safe to destroy" not in err.replace("NOT destroy", "")
    assert records(store) == {}
    rerun = run_cli("evacuate", str(recipe), inst.host, home=home)
    assert rerun.returncode == 0, rerun.stderr
    assert sha(store / "ckpt-00000010.pt") == want


@pytest.mark.parametrize("kind,via", [("rclone", "local"), ("rclone", "instance"), ("hf", "local"),
                                      ("hf", "instance")])
def test_a_checkpoint_the_remote_lost_is_copied_again(kind, via, tmp_path, sandbox, ssh, ssh_key, package_index,
                                                      s3_remote, hf_hub):
    """An S3 bucket's lifecycle rule, a file deleted from a Hub repo: the next evacuation sees it in
    the remote's own listing (rclone: size and hash; the Hub: the head's file list), not in the
    manifest, and copies it again."""
    inst = sandbox(index_dir=package_index)
    home = tmp_path / "state"
    if kind == "rclone":
        server = s3_remote(bind=host_side_address(inst))
        env, remote = server.env, f"rclone:{server.name}:{server.bucket}/runs/a"
        secrets = sorted(env)
    else:
        server = hf_hub(bind=host_side_address(inst), lfs_threshold=1000)
        env, remote = server.env(tmp_path / "hfhome"), "hf:acme/ckpts/run1"
        secrets = ["HF_TOKEN"]
    recipe = plain_recipe(tmp_path, name=f"lost-{kind}-{via}", key=ssh_key,
                          env={"index_url": inst.index_url, "secrets": secrets},
                          checkpoint={"remote": remote, "via": via})
    plant(ssh, inst, 10)
    newest = plant(ssh, inst, 20)
    first = run_cli("evacuate", str(recipe), inst.host, home=home, env=env)
    assert first.returncode == 0, first.stderr

    if kind == "rclone":
        (server.bucket_dir / "runs/a/ckpt-00000020.pt").unlink()
    else:
        from huggingface_hub import HfApi

        HfApi(endpoint=server.url, token=server.token).delete_file("run1/ckpt-00000020.pt", "acme/ckpts")

    again = run_cli("evacuate", str(recipe), inst.host, "--json", home=home, env=env)
    assert again.returncode == 0, again.stderr
    assert "ckpt-00000020.pt is in the store's manifest, but the store" in again.stderr
    assert "missing from the store; copying it again" in again.stderr
    assert json.loads(again.stdout)["verified_now"] == ["ckpt-00000020.pt"]
    if kind == "rclone":
        held = (server.bucket_dir / "runs/a/ckpt-00000020.pt").read_bytes()
    else:
        held = server.read_files("acme/ckpts")["run1/ckpt-00000020.pt"]
    assert hashlib.sha256(held).hexdigest() == newest


def test_a_sync_round_does_not_call_unchanged_what_the_remote_holds_differently(tmp_path, sandbox, ssh, ssh_key,
                                                                                  s3_remote):
    """A sync round skips a checkpoint whose sizes match its record, but only after the remote's
    listing (sizes and the remote's own hash, free with the listing) agrees: a byte flipped in the
    bucket is seen there and copied again. Found by the chaos test (schedule 5)."""
    home = tmp_path / "state"
    inst = sandbox()
    server = s3_remote()
    recipe = plain_recipe(tmp_path, name="flipsync", key=ssh_key,
                          checkpoint={"remote": f"rclone:{server.name}:{server.bucket}/runs/a"})
    older, _ = plant(ssh, inst, 10), plant(ssh, inst, 20)
    assert run_cli("evacuate", str(recipe), inst.host, home=home, env=server.env).returncode == 0
    path = server.bucket_dir / "runs/a/ckpt-00000010.pt"
    damaged = bytearray(path.read_bytes())
    damaged[3] ^= 0xFF
    path.write_bytes(bytes(damaged))

    sync = run_cli("sync", str(recipe), inst.host, "--once", "--json", home=home, env=server.env)
    assert sync.returncode == 0, sync.stderr
    assert "ckpt-00000010.pt is in the store's manifest, but the store" in sync.stderr
    report = json.loads(sync.stdout)
    assert "ckpt-00000010.pt" not in report["unchanged"] and "ckpt-00000010.pt" in report["copied"]
    assert sha(path) == older
    aside = list((server.bucket_dir / "runs/a/.relaunch/damaged").rglob("ckpt-00000010.pt"))
    assert len(aside) == 1 and aside[0].read_bytes() == bytes(damaged)


def test_store_credentials_do_not_outlive_a_copy_whose_relaunch_was_killed(tmp_path, sandbox, ssh, ssh_key,
                                                                            package_index, s3_remote):
    """kill -9 of relaunch while the instance uploads: relaunch cannot run its cleanup, so the copy
    itself removes the credentials file as soon as it has read it."""
    from test_faults import in_instance

    home = tmp_path / "state"
    anchor = sandbox()
    server = s3_remote(bind=host_side_address(anchor))
    inst = sandbox(rate="8mbit", index_dir=package_index)
    recipe = plain_recipe(tmp_path, name="killed-creds", key=ssh_key, env={"index_url": inst.index_url},
                          checkpoint={"remote": f"rclone:{server.name}:{server.bucket}/c", "via": "instance"})
    plant(ssh, inst, 10, size=8_000_000)
    proc = start_cli("evacuate", str(recipe), inst.host, home=home, env=server.env, err=tmp_path / "evac.err")
    try:
        wait_for("the instance's upload to run", lambda: in_instance(inst, "copy --immutable"),
                 timeout=180, every=0.1)
        proc.kill()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    left = ssh(inst, f"grep -rl -- {server.secret_key} ~ /tmp 2>/dev/null; true").stdout.split()
    assert left == [], (tmp_path / "evac.err").read_text()
