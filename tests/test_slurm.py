"""`relaunch run` inside a real Slurm (tests/slurm.py, started by the session's fixture): a job whose
command is relaunch run is requeued, preempted, signalled before its time limit, killed with
SIGKILL in the middle of a save, and run on two nodes then requeued onto one; each time the next
run resumes from the newest verified checkpoint in the store.

The trainer of the one-node jobs is tests/spot_trainer.py (standard library only): a step every
0.1 s, a checkpoint every 10 steps whose bytes depend only on its step (a resume checks them, and
fails on any other bytes), a save of the step it is at on SIGTERM. Each run of a job gets an empty
home folder (`home-RESTARTS`): a requeued job lands on a fresh node as far as its disk goes, and
can only resume from the store.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from e2e import REPO, wait_for, write_recipe
from relaunch.manifest import StoreManifest

HERE = Path(__file__).resolve().parent
RELAUNCH = Path(sys.executable).parent / "relaunch"
# the 2-node job's steps, and its uninterrupted reference's: its stop may come late (CI: step 171, when
# the copies of both nodes' parts were slow to succeed), and the steps after the resume are compared
DIST_STEPS = 400


def one_node_job(folder: Path, *trainer_args: str) -> tuple[Path, Path]:
    """The recipe and the batch script of a one-node job (exec: relaunch run is the batch shell, so
    `--signal=B:...` reaches it); returns (script, store)."""
    store = folder / "store"
    write_recipe(folder, {
        "name": "slurmjob",
        "env": {"python": "3.11"},
        "checkpoint": {"dir": "~/ckpt", "layout": "files", "pattern": "ckpt-*.pt", "keep": 2, "remote": str(store)},
        "run": {"command": f"python3 {HERE / 'spot_trainer.py'} \"{{{{ checkpoint }}}}\" --out ~/ckpt --every 10 "
                           f"--sleep 0.1 --size 50000 --keep 2 {' '.join(trainer_args)}",
                "workdir": "~/work", "log": str(folder / "train.log"), "stop": {"signal": "TERM", "timeout": 10}},
        "guard": {"enabled": False},
    })
    script = folder / "job.sh"
    script.write_text("#!/bin/bash\n"
                      f"export HOME={folder}/home-${{SLURM_RESTART_COUNT:-0}}\n"
                      "mkdir -p \"$HOME\"\n"
                      f"exec {RELAUNCH} run {folder / 'recipe.yaml'}\n")
    script.chmod(0o755)
    return script, store


def stored(store: Path) -> StoreManifest | None:
    path = store / ".relaunch" / "manifest.json"
    return StoreManifest.from_json(path.read_text(), str(path)) if path.exists() else None


def newest_step(store: Path) -> int:
    manifest = stored(store)
    newest = manifest.newest() if manifest else None
    return newest.step if newest else 0


def history(store: Path) -> list[dict[str, object]]:
    path = store / ".relaunch" / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def log(folder: Path) -> str:
    path = folder / "train.log"
    return path.read_text() if path.exists() else ""


def output(folder: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(folder.glob("out-*.txt")))


def resumes(folder: Path) -> list[int]:
    return [int(step) for step in re.findall(r"resumed from \S+ at step (\d+)", log(folder))]


def stops(folder: Path) -> list[int]:
    return [int(step) for step in re.findall(r"stopped at step (\d+)", log(folder))]


def submit(cluster, folder: Path, script: Path, *options: str) -> str:  # type: ignore[no-untyped-def]
    return cluster.sbatch(script, "--requeue", "-N1", "-p", "main", f"--chdir={folder}",
                          f"--output={folder}/out-%j.txt", "--open-mode=append", *options)


def check_resumed_whole(folder: Path, store: Path, cluster, job: str, runs: int) -> None:  # type: ignore[no-untyped-def]
    """The run after the stop resumed from the stop's save, the newest verified in the store, and
    trains on; the stop's interruption is in the store's history with no step lost."""
    wait_for("the requeued run to resume", lambda: len(resumes(folder)) >= runs - 1, timeout=120,
             explain=lambda: f"{output(folder)}\n{cluster.job(job)}\n{cluster.run('sinfo', '-N', check=False).stdout}")
    saved = stops(folder)[-1]
    assert resumes(folder)[-1] == saved, output(folder)          # no step lost after a signal with time to save
    wait_for("a step after the resume", lambda: f"step {saved + 1} " in log(folder), timeout=60)
    entry = history(store)[-1]
    assert entry["cause"] == "signal" and entry["steps_lost"] == 0 and entry["made_deadline"] is True, entry
    wait_for("the history to say training ran again", lambda: history(store)[-1].get("resumed_epoch"), timeout=60)


@pytest.fixture
def job_folder(tmp_path: Path, slurm_cluster):  # type: ignore[no-untyped-def]
    """A folder every node sees (this machine's disk); the jobs of the test cancelled at its end."""
    folder = tmp_path / "job"
    folder.mkdir()
    yield folder
    slurm_cluster.cancel_all()


def test_requeued_job_resumes_from_the_save_its_stop_made(slurm_cluster, job_folder: Path) -> None:
    cluster, folder = slurm_cluster, job_folder
    script, store = one_node_job(folder)
    job = submit(cluster, folder, script)
    wait_for("a checkpoint verified in the store", lambda: newest_step(store) >= 20, timeout=120,
             explain=lambda: output(folder))
    cluster.run("scontrol", "requeue", job)          # SIGTERM to every process of the job, then requeue
    cluster.requeued(job, 1)
    check_resumed_whole(folder, store, cluster, job, runs=2)
    first_exit = re.findall(r"exiting 75 \(requeue\)", output(folder))
    assert first_exit, output(folder)
    assert newest_step(store) >= stops(folder)[-1]


def test_preempted_job_resumes_from_the_save_its_stop_made(slurm_cluster, job_folder: Path) -> None:
    cluster, folder = slurm_cluster, job_folder
    script, store = one_node_job(folder)
    job = submit(cluster, folder, script, "--exclusive")
    wait_for("a checkpoint verified in the store", lambda: newest_step(store) >= 20, timeout=120,
             explain=lambda: output(folder))
    node = cluster.job(job)["NodeList"]
    # a job of the higher tier that needs that very node: Slurm preempts ours (SIGTERM, GraceTime, requeue)
    urgent = folder / "urgent.sh"
    urgent.write_text("#!/bin/bash\nsleep 1\n")
    cluster.sbatch(urgent, "-p", "urgent", "-w", node, "--exclusive", "--output=/dev/null")
    cluster.requeued(job, 1)
    assert "preempted" in (cluster.folder / "log" / "slurmctld.log").read_text()
    check_resumed_whole(folder, store, cluster, job, runs=2)


def test_time_limited_job_of_the_example_sbatch_saves_before_its_limit_and_is_requeued(
        slurm_cluster, job_folder: Path) -> None:
    """examples/schedulers/slurm.sbatch as a user submits it (its #SBATCH lines; a shorter time
    limit and signal here): the batch shell becomes srun, which passes the time limit's SIGUSR1 on
    to relaunch run; relaunch run saves, copies, exits 75, and slurm.conf's RequeueExit requeues.
    Slurm checks time limits on a period of its own and may send the signal up to a minute early:
    with a 1-minute limit and @40 it came 1 s into the job, before the batch shell became srun (it
    died of the USR1, exit 138); a 2-minute limit and @40 send it between 20 s and 80 s in."""
    cluster, folder = slurm_cluster, job_folder
    _, store = one_node_job(folder)
    example = REPO / "examples" / "schedulers" / "slurm.sbatch"
    job = cluster.sbatch(example, "-N1", "-p", "main", f"--chdir={folder}", f"--output={folder}/out-%j.txt",
                         "--time=2", "--signal=B:USR1@40",   # 20-80 s in: the training runs by then
                         env={"HOME": str(folder / "home"), "PATH": f"{RELAUNCH.parent}:{os.environ['PATH']}"})
    cluster.requeued(job, 1, timeout=240)
    assert "SIGUSR1" in output(folder), output(folder)
    assert "task 0: Exited with exit code 75" in output(folder), output(folder)   # srun's exit: the job's
    check_resumed_whole(folder, store, cluster, job, runs=2)


def test_kill_mid_save_resumes_from_the_save_before_whole(slurm_cluster, job_folder: Path) -> None:
    cluster, folder = slurm_cluster, job_folder
    script, store = one_node_job(folder, "--save-for", "3")
    job = submit(cluster, folder, script)
    wait_for("a checkpoint verified in the store", lambda: newest_step(store) >= 10, timeout=120,
             explain=lambda: output(folder))
    ckpt = folder / "home-0" / "ckpt"
    before = newest_step(store)
    # the next save half written (its temp file growing), and the one before verified in the store
    wait_for("a save in the middle of its writing", lambda: any(p.stat().st_size for p in ckpt.glob(".*.tmp"))
             and newest_step(store) == before, timeout=60, every=0.1)
    saving = max(int(re.search(r"(\d+)", p.name).group(1)) for p in ckpt.glob(".*.tmp"))  # type: ignore[union-attr]
    assert cluster.kill(job)                  # kill -9, relaunch run and the training alike, mid-save
    cluster.wait_state(job, "FAILED")
    assert newest_step(store) == before < saving
    cluster.run("scontrol", "requeue", job)
    cluster.requeued(job, 1)
    wait_for("the requeued run to resume", lambda: resumes(folder), timeout=120, explain=lambda: output(folder))
    # from the save before, whole: spot_trainer exits 3 on any other bytes, and says the step it read
    assert resumes(folder) == [before], output(folder)
    wait_for("a step after the resume", lambda: f"step {before + 1} " in log(folder), timeout=60)
    lost = [e for e in history(store) if e["cause"] == "lost"]
    assert lost and lost[-1]["newest_verified_step"] == before, history(store)


def dist_job(folder: Path) -> tuple[Path, Path]:
    """examples/pytorch/train_dist.py under torchrun on every node of the allocation (srun, one
    relaunch run per node), DCP shards on each node's own disk, a global batch of 8 whatever the
    world size; returns (script, store)."""
    store = folder / "store"
    bin_dir = Path(sys.executable).parent
    write_recipe(folder, {
        "name": "slurmdist",
        "env": {"python": "3.11"},
        "checkpoint": {"dir": "~/ckpt", "layout": "dcp", "keep": 3, "remote": str(store)},
        "run": {"command": f"{bin_dir / 'torchrun'} --nnodes {{{{ nnodes }}}} --node-rank {{{{ node_rank }}}} "
                           "--nproc-per-node {{ nproc_per_node }} --master-addr {{ master_addr }} --master-port 29533 "
                           f"{REPO / 'examples' / 'pytorch' / 'train_dist.py'} --out ~/ckpt --steps {DIST_STEPS} "
                           "--save-every 5 --sleep 0.2 --global-batch 8 --micro 2 --grad-accum {{ grad_accum }} "
                           "--resume \"{{ checkpoint }}\"",
                "workdir": "~/work", "log": f"{folder}/train-{{{{ node_rank }}}}.log", "nproc_per_node": 1,
                "batch": {"global": 8, "micro": 2}, "stop": {"signal": "TERM", "timeout": 15}},
        "guard": {"enabled": False},
    })
    script = folder / "job.sh"
    node = (f"export HOME={folder}/home-$SLURMD_NODENAME-${{SLURM_RESTART_COUNT:-0}}; mkdir -p \"$HOME\"; "
            f"exec {RELAUNCH} run {folder / 'recipe.yaml'}")
    script.write_text(f"#!/bin/bash\nexec srun --ntasks-per-node=1 bash -c '{node}'\n")
    script.chmod(0o755)
    return script, store


def uninterrupted(folder: Path, steps: int) -> subprocess.Popen[str]:
    """train_dist.py on one process, never interrupted (the run every resume must reproduce), started
    now: its losses are read at the end (`losses(proc.communicate()[0])`)."""
    return subprocess.Popen([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "1",
                             str(REPO / "examples" / "pytorch" / "train_dist.py"), "--out", str(folder / "reference"),
                             "--steps", str(steps), "--save-every", "1000", "--global-batch", "8", "--micro", "2",
                             "--grad-accum", "4"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def losses(text: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^step (\d+) loss ([\d.]+)", text, re.M)}


def test_two_node_job_requeued_onto_one_node_keeps_the_global_batch(slurm_cluster, job_folder: Path) -> None:
    cluster, folder = slurm_cluster, job_folder
    script, store = dist_job(folder)
    reference = uninterrupted(folder, DIST_STEPS)        # meanwhile, on this machine
    try:
        check_two_nodes_onto_one(cluster, folder, script, store, reference)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait()


def check_two_nodes_onto_one(cluster, folder: Path, script: Path, store: Path,  # type: ignore[no-untyped-def]
                             reference: subprocess.Popen[str]) -> None:
    job = cluster.sbatch(script, "--requeue", "-N", "1-2", "-p", "main", f"--chdir={folder}",
                         f"--output={folder}/out-%j.txt", "--open-mode=append")
    first = folder / "train-0.log"

    def from_both_nodes() -> bool:
        manifest = stored(store)
        newest = manifest.newest() if manifest else None
        return bool(newest and len({f.node for f in newest.files.values()}) == 2)

    wait_for("a checkpoint of both nodes' shards verified in the store", from_both_nodes, timeout=240,
             explain=lambda: output(folder))
    try:
        cluster.run("scontrol", "update", "NodeName=n1", "State=DRAIN", "Reason=relaunch-test")
        cluster.run("scontrol", "requeue", job)         # both nodes: SIGTERM, save, each copies its part
        cluster.requeued(job, 1)
        cluster.wait_state(job, "RUNNING")
        assert cluster.job(job)["NumNodes"] == "1", cluster.job(job)
        wait_for("the run on one node to resume", lambda: "world size 1, grad_accum 4" in first.read_text(),
                 timeout=180, explain=lambda: output(folder))
        records = stored(store).checkpoints.values()        # type: ignore[union-attr]
    finally:
        cluster.run("scontrol", "update", "NodeName=n1", "State=RESUME", check=False)
    text = first.read_text()
    saved = [int(s) for s in re.findall(r"stopped at step (\d+)", text)]
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+) \(world size 1", text)]
    assert saved and resumed == [saved[-1]], output(folder)      # the stop's save, both nodes' parts
    record = next(r for r in records if r.step == saved[-1])
    assert len({f.node for f in record.files.values()}) == 2, record
    assert record.saved_with and record.saved_with["world_size"] == 2, record
    entry = history(store)[-1]
    assert entry["cause"] == "signal" and entry["steps_lost"] == 0 and entry["nodes_before"] == 2, entry
    # the same global batch: the steps after the resume, at world size 1, are what an uninterrupted
    # run trains (every loss of train_dist.py's deterministic run, from the same checkpoint on)
    wait_for("three steps after the resume", lambda: saved[-1] + 3 in losses(first.read_text()), timeout=120)
    after = losses(first.read_text().split(f"at step {saved[-1]} (world size 1")[1])
    expected = losses(reference.communicate(timeout=300)[0])
    for step in range(saved[-1] + 1, saved[-1] + 4):
        assert abs(after[step] - expected[step]) <= 1e-4 * max(abs(expected[step]), 1e-6), (step, after, expected)
