"""`relaunch run` on this machine, as the command of a job no scheduler runs (no root): the stop
signal and its verified save (exit 75), a notice, a training that fails, one that finishes, a run
killed without a word, and the drill that measures all of it. The scheduler's side is
tests/test_slurm.py (a real Slurm) and tests/test_engines.py (the others' stop semantics)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from e2e import cli_env, wait_for
from injob_helpers import (  # noqa: F401  (end_what_was_started: the autouse fixture)
    HERE,
    descendants,
    end_what_was_started,
    history,
    job_recipe,
    kill_all,
    log,
    newest_step,
    resumes,
    said,
    start,
    stops,
    stored,
    wait_saved,
)
from relaunch.injob import EXIT_REQUEUE
from relaunch.manifest import StoreManifest


def test_a_stop_signal_saves_copies_verifies_and_exits_75_then_the_next_run_resumes_there(tmp_path: Path) -> None:
    job_recipe(tmp_path, "--steps", "150")
    proc = start(tmp_path)
    wait_saved(tmp_path, proc=proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == EXIT_REQUEUE, said(tmp_path)
    saved = stops(tmp_path)[-1]
    assert newest_step(tmp_path) == saved                    # the stop's own save, verified in the store
    entry = history(tmp_path)[-1]
    assert (entry["cause"], entry["steps_lost"], entry["made_deadline"], entry["resumed_epoch"]) == \
        ("signal", 0, True, None), entry
    # the next run, on a fresh disk: from the store, at the step the stop saved, to the end
    second = start(tmp_path, home="home2")
    assert second.wait(120) == 0, said(tmp_path)
    assert resumes(tmp_path) == [saved]
    assert "done at step 150" in log(tmp_path) and newest_step(tmp_path) == 150
    entry = history(tmp_path)[-1]
    assert entry["resumed_host"] and entry["time_to_resume"] is not None, entry


def test_usr1_to_every_process_of_the_job_reaches_the_training_as_its_stop_signal(tmp_path: Path) -> None:
    """Slurm's --signal without B: signals every process of the job: the training, which does not
    handle SIGUSR1, must not die of it; relaunch run turns it into run.stop.signal (TERM)."""
    job_recipe(tmp_path)
    proc = start(tmp_path)
    wait_saved(tmp_path, proc=proc)
    for pid in [proc.pid, *descendants(proc.pid)]:
        subprocess.run(["kill", "-USR1", str(pid)], check=False)
    assert proc.wait(60) == EXIT_REQUEUE, said(tmp_path)
    assert stops(tmp_path) and newest_step(tmp_path) == stops(tmp_path)[-1], said(tmp_path)
    assert "SIGUSR1" in said(tmp_path)


def test_a_notice_is_a_stop_with_its_deadline(tmp_path: Path) -> None:
    notice = tmp_path / "notice"
    job_recipe(tmp_path, guard={"enabled": True, "sources": [f"file:{notice}"], "every": 0.5})
    proc = start(tmp_path)
    wait_saved(tmp_path, proc=proc)
    notice.write_text(json.dumps({"seconds": 30}))
    assert proc.wait(60) == EXIT_REQUEUE, said(tmp_path)
    entry = history(tmp_path)[-1]
    assert entry["cause"] == "notice" and f"file:{notice}" in entry["detail"] and entry["made_deadline"], entry
    assert newest_step(tmp_path) == stops(tmp_path)[-1]


def test_a_training_that_fails_is_exit_4_with_its_status(tmp_path: Path) -> None:
    job_recipe(tmp_path, run={"command": f"{sys.executable} -c \"print('step 1 loss 1.0'); raise SystemExit(3)\"",
                              "workdir": "~/work", "log": str(tmp_path / "train.log")})
    proc = start(tmp_path)
    assert proc.wait(60) == 4, said(tmp_path)
    assert "the training exited with status 3 (no stop was asked for)" in said(tmp_path)


def test_a_run_killed_without_a_word_is_recorded_lost_and_the_next_resumes_from_the_store(tmp_path: Path) -> None:
    job_recipe(tmp_path)
    proc = start(tmp_path)
    wait_saved(tmp_path, step=20, proc=proc)
    kill_all(proc)                                  # kill -9: no stop, no save, no word
    before = newest_step(tmp_path)
    second = start(tmp_path, home="home2")
    wait_for("the next run to train", lambda: len(resumes(tmp_path)) == 1, timeout=120,
             explain=lambda: said(tmp_path))
    assert resumes(tmp_path) == [before]
    lost = [e for e in history(tmp_path) if e["cause"] == "lost"]
    assert lost and lost[0]["newest_verified_step"] == before, history(tmp_path)
    wait_for("the history to say training ran again", lambda: history(tmp_path)[0].get("resumed_epoch"))
    second.send_signal(signal.SIGTERM)
    assert second.wait(60) == EXIT_REQUEUE, said(tmp_path)


def test_drill_job_measures_the_goodput_of_the_runs_and_their_interruptions(tmp_path: Path) -> None:
    job_recipe(tmp_path, "--steps", "150")
    first = start(tmp_path)
    wait_saved(tmp_path, step=20, proc=first)
    first.send_signal(signal.SIGTERM)
    assert first.wait(60) == EXIT_REQUEUE, said(tmp_path)
    time.sleep(0.5)                              # a gap without training the drill must see
    assert start(tmp_path, home="home2").wait(120) == 0, said(tmp_path)
    done = subprocess.run([sys.executable, "-m", "relaunch.cli", "drill", str(tmp_path / "recipe.yaml"), "--job",
                           "--timeline", str(tmp_path / "train.log.timeline"), "--json"],
                          capture_output=True, text=True, env=cli_env(tmp_path / "state"), timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["passed"] and report["steps_lost"] == 0 and len(report["interruptions"]) == 1, report
    gap = report["interruptions"][0]
    assert gap["cause"] == "signal" and gap["resumed_from"] == stops(tmp_path)[0] and gap["recovered"], gap
    assert 0 < report["goodput"] < 1 and gap["seconds_without_training"] >= 0.5, report
    assert "drill --job" in done.stderr



def test_an_rclone_store_from_the_node_itself(tmp_path: Path, s3_remote) -> None:  # type: ignore[no-untyped-def]
    """The store is an rclone remote (S3 here, `rclone serve s3`) the node reaches with relaunch's own
    rclone and the remote's variables in the job's environment: the stop's save uploaded and
    verified, and the next run, on a fresh disk, downloads it and resumes there."""
    s3 = s3_remote()
    # a checkpoint every second, six kept: each is there longer than a copy to S3 takes here
    store = {"dir": "~/ckpt", "layout": "files", "pattern": "ckpt-*.pt", "keep": 2,
             "remote": f"rclone:{s3.remote('job')}"}
    job_recipe(tmp_path, "--sleep", "0.1", "--keep", "6", checkpoint=store)
    proc = start(tmp_path, env=s3.env)
    wait_for("a checkpoint in the remote", lambda: list((s3.bucket_dir / "job").glob("ckpt-*.pt")), timeout=120,
             explain=lambda: said(tmp_path))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == EXIT_REQUEUE, said(tmp_path)
    saved = stops(tmp_path)[-1]
    path = s3.bucket_dir / "job" / ".relaunch" / "manifest.json"
    newest = StoreManifest.from_json(path.read_text(), str(path)).newest()
    assert newest is not None and newest.step == saved, newest
    second = start(tmp_path, home="home2", env=s3.env)
    wait_for("the next run to resume", lambda: resumes(tmp_path), timeout=120, explain=lambda: said(tmp_path))
    assert resumes(tmp_path) == [saved]
    second.send_signal(signal.SIGTERM)
    assert second.wait(60) == EXIT_REQUEUE, said(tmp_path)


def test_a_damaged_newest_in_the_store_is_passed_over_for_the_one_before_it(tmp_path: Path) -> None:
    """A byte of the store's newest checkpoint flipped after it was verified (a bad disk, a bad
    copy by hand): the next run finds it by its sha256, says so, and resumes the one before it,
    whole; the damaged file stays as it is (nothing in the store is deleted on a suspicion)."""
    job_recipe(tmp_path, "--steps", "400")
    proc = start(tmp_path)
    wait_saved(tmp_path, step=30, proc=proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == EXIT_REQUEUE, said(tmp_path)
    manifest = stored(tmp_path)
    assert manifest is not None
    records = manifest.ordered()
    assert len(records) >= 2, records              # keep: 2, the stop's save and one before it
    before, newest = records[-2:]
    assert newest.step == stops(tmp_path)[-1]
    damaged = tmp_path / "store" / newest.name
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    second = start(tmp_path, home="home2")
    wait_for("the next run to resume", lambda: resumes(tmp_path), timeout=120, explain=lambda: said(tmp_path))
    assert resumes(tmp_path) == [before.step], said(tmp_path)
    assert f"{newest.name} in the store" in said(tmp_path) and "damaged" in said(tmp_path), said(tmp_path)
    assert damaged.read_bytes() == bytes(data)     # kept as it is, for the user to look at
    second.send_signal(signal.SIGTERM)
    assert second.wait(60) == EXIT_REQUEUE, said(tmp_path)


def test_a_hub_store_from_the_node_itself(tmp_path: Path, hf_hub) -> None:  # type: ignore[no-untyped-def]
    """The store is a Hugging Face repo (a stand-in speaking the Hub's HTTP API to the real `hf`
    client: no real Hub is reachable here), the token only in the job's environment: the stop's save
    uploaded and verified, and the next run, on a fresh disk, downloads it and resumes there."""
    hub = hf_hub()
    hub.create_repo("acme/ckpts", private=True)
    env = hub.env(tmp_path / "hfhome")
    store = {"dir": "~/ckpt", "layout": "files", "pattern": "ckpt-*.pt", "keep": 2, "remote": "hf:acme/ckpts/job"}
    job_recipe(tmp_path, "--sleep", "0.1", "--keep", "6", checkpoint=store,
               env={"python": "3.11", "secrets": ["HF_TOKEN"]})
    proc = start(tmp_path, env=env)

    def manifest() -> dict | None:
        try:
            return json.loads(hub.read_files("acme/ckpts").get("job/.relaunch/manifest.json", b"null"))
        except Exception:        # no repo yet
            return None

    wait_for("a checkpoint in the repo", lambda: (manifest() or {}).get("checkpoints") or proc.poll() is not None,
             timeout=120, explain=lambda: said(tmp_path))
    assert proc.poll() is None, said(tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(90) == EXIT_REQUEUE, said(tmp_path)
    saved = stops(tmp_path)[-1]
    assert max(c["step"] for c in manifest()["checkpoints"]) == saved, manifest()
    assert hub.token not in said(tmp_path) and hub.token not in (tmp_path / "recipe.yaml").read_text()
    second = start(tmp_path, home="home2", env=env)
    wait_for("the next run to resume", lambda: resumes(tmp_path), timeout=120, explain=lambda: said(tmp_path))
    assert resumes(tmp_path) == [saved]
    second.send_signal(signal.SIGTERM)
    assert second.wait(90) == EXIT_REQUEUE, said(tmp_path)


def test_a_stop_whose_save_cannot_reach_the_store_is_exit_6_before_the_grace_ends(tmp_path: Path, s3_remote) -> None:  # type: ignore[no-untyped-def]
    """The store goes silent (its server gone) before the stop: the save is made on the node but
    never verified in the store, so the job says NOT verified, exit 6 (never 75: "requeue me, my
    save is safe"), within the grace the engine gives, and the store still holds what it verified."""
    s3 = s3_remote()
    store = {"dir": "~/ckpt", "layout": "files", "pattern": "ckpt-*.pt", "keep": 2,
             "remote": f"rclone:{s3.remote('job')}"}
    job_recipe(tmp_path, "--sleep", "0.1", "--keep", "6", checkpoint=store)
    proc = start(tmp_path, "--grace", "40", env=s3.env)
    wait_for("a checkpoint in the remote", lambda: list((s3.bucket_dir / "job").glob("ckpt-*.pt")), timeout=120,
             explain=lambda: said(tmp_path))
    s3.stop()
    before = sorted(p.name for p in (s3.bucket_dir / "job").glob("ckpt-*.pt"))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 6, said(tmp_path)
    assert "is NOT verified in the store" in said(tmp_path) and stops(tmp_path), said(tmp_path)
    assert sorted(p.name for p in (s3.bucket_dir / "job").glob("ckpt-*.pt")) == before


def test_with_env_lock_the_run_makes_the_venv_from_it_and_trains_in_it(tmp_path: Path, package_index: Path) -> None:
    """env.lock in the recipe: the node's venv is made from the lock (from the index the recipe
    names, here a local one), as `up` makes it, and the training runs with that venv's Python."""
    lock = tmp_path / "requirements.lock"
    lock.write_text("mpmath==1.3.0\n")
    probe = "import mpmath, sys; print('venv', sys.prefix, 'mpmath', mpmath.__version__, flush=True)"
    job_recipe(tmp_path, env={"python": "3.11", "lock": str(lock), "index_url": f"file://{package_index}/simple/"},
               run={"command": f"python -c \"{probe}\"", "workdir": "~/work", "log": str(tmp_path / "train.log")})
    proc = start(tmp_path)
    assert proc.wait(300) == 0, said(tmp_path)
    venv = tmp_path / "home" / "venvs" / "injob"
    assert f"venv {venv} mpmath 1.3.0" in log(tmp_path), log(tmp_path) + said(tmp_path)
    frozen = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze"], capture_output=True, text=True)
    assert "mpmath==1.3.0" in frozen.stdout, frozen


def test_a_training_that_logs_steps_and_saves_nowhere_relaunch_looks_is_exit_6_naming_checkpoint_dir(
        tmp_path: Path) -> None:
    """It finished (exit 0) after logging a step, and checkpoint.dir holds nothing: its progress
    would be lost, so never 0, and the hint is about where it saves, not evacuate's --allow-empty."""
    job_recipe(tmp_path, run={"command": "echo 'step 1 loss 1.0'", "workdir": "~/work",
                              "log": str(tmp_path / "train.log")})
    proc = start(tmp_path)
    assert proc.wait(120) == 6, said(tmp_path)
    assert "destroying loses 1 steps" in said(tmp_path) and "checkpoint.dir" in said(tmp_path), said(tmp_path)
    assert "--allow-empty" not in said(tmp_path) and "relaunch evacuate" not in said(tmp_path), said(tmp_path)


def test_a_launcher_that_ends_before_its_workers_is_waited_for_until_their_stop_save_is_made(tmp_path: Path) -> None:
    """The command's first process (a shell here; torchrun's agent under Slurm, which a second
    SIGTERM ends at once) exits as the stop comes, while the process that trains, in the same
    session, still writes the stop's save: the training has ended only when its whole session has,
    so the save copied and verified is the stop's own, not the one before it (CI: torchrun's agent
    died 1.2 s after Slurm's and relaunch's SIGTERMs, and the copy did not wait for the workers)."""
    trainer = (f"{sys.executable} {HERE / 'spot_trainer.py'} \"{{{{ checkpoint }}}}\" --out ~/ckpt --every 10 "
               "--sleep 0.05 --size 20000 --keep 2 --stop-save 8")
    job_recipe(tmp_path, run={"command": f"{trainer} & wait", "workdir": "~/work", "log": str(tmp_path / "train.log"),
                              "stop": {"signal": "TERM", "timeout": 20}})
    proc = start(tmp_path, "--grace", "60")
    wait_saved(tmp_path, step=20, proc=proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(90) == EXIT_REQUEUE, said(tmp_path)
    assert stops(tmp_path) and newest_step(tmp_path) == stops(tmp_path)[-1], said(tmp_path) + log(tmp_path)
