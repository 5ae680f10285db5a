"""The engines `relaunch run` works inside that cannot be installed here (SkyPilot, dstack and
Kubernetes need clouds or a cluster): their task files in examples/schedulers/ read as the engines
read them, and their stop semantics played by a harness that behaves as each one documents
(docs/schedulers.md): who gets which signal, how long until the SIGKILL, or a cloud's notice and
its deadline. Slurm is the real one (tests/test_slurm.py submits examples/schedulers/slurm.sbatch).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from e2e import REPO
from injob_helpers import (  # noqa: F401  (end_what_was_started: the autouse fixture)
    descendants,
    end_what_was_started,
    history,
    job_recipe,
    kill_all,
    newest_step,
    said,
    start,
    stops,
    wait_saved,
)
from relaunch.injob import EXIT_REQUEUE

EXAMPLES = REPO / "examples" / "schedulers"


def test_each_task_file_runs_relaunch_run_and_is_restarted_on_its_exit_75() -> None:
    sky = yaml.safe_load((EXAMPLES / "skypilot.yml").read_text())
    assert "relaunch run schedulers/recipe.yaml" in sky["run"]
    assert sky["resources"]["job_recovery"]["recover_on_exit_codes"] == [EXIT_REQUEUE]
    assert (REPO / sky["workdir"] / "schedulers" / "recipe.yaml").is_file()      # sky runs from the repository

    dstack = yaml.safe_load((EXAMPLES / "task.dstack.yml").read_text())
    assert dstack["type"] == "task" and "relaunch run examples/schedulers/recipe.yaml" in dstack["commands"]
    assert {"interruption", "error"} <= set(dstack["retry"]["on_events"])     # dstack restarts on any failure

    job = yaml.safe_load((EXAMPLES / "kubernetes-job.yml").read_text())
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"][:2] == ["relaunch", "run"] and pod["restartPolicy"] == "Never"
    # the pod cannot see its grace period: --grace says it, and says the same
    assert float(container["command"][container["command"].index("--grace") + 1]) == \
        pod["terminationGracePeriodSeconds"]
    ignored = [rule["onExitCodes"]["values"] for rule in job["spec"]["podFailurePolicy"]["rules"]
               if rule["action"] == "Ignore" and "onExitCodes" in rule]
    assert ignored == [[EXIT_REQUEUE]] and ignored[0] and job["spec"]["podFailurePolicy"]["rules"][0][
        "onExitCodes"]["containerName"] == container["name"]

    sbatch = (EXAMPLES / "slurm.sbatch").read_text()
    assert re.search(r"^#SBATCH --requeue", sbatch, re.M) and re.search(r"^#SBATCH --signal=B:USR1@\d+", sbatch, re.M)
    assert sbatch.rstrip().endswith("exec srun relaunch run recipe.yaml")


def stop_like(tmp_path: Path, env: dict[str, str], grace: float, *args: str, signal_to: int | None = None,
              everyone: bool = False, notice: Path | None = None) -> float:
    """Train until a checkpoint is in the store, then stop as the engine does: `signal_to` relaunch
    run (and with `everyone` every process of the job), or a notice with `grace` seconds in it; at
    the end of the grace, SIGKILL to everything that is left. relaunch run must have exited 75 by
    then with the save its stop asked for verified in the store. Returns the seconds it took."""
    proc = start(tmp_path, *args, env=env)
    wait_saved(tmp_path, proc=proc)
    began = time.monotonic()
    if notice is not None:
        notice.write_text(json.dumps({"seconds": grace}))
    else:
        assert signal_to is not None
        for pid in [proc.pid, *(descendants(proc.pid) if everyone else [])]:
            subprocess.run(["kill", f"-{signal.Signals(signal_to).name[3:]}", str(pid)], check=False)
    try:
        code = proc.wait(grace)
    except subprocess.TimeoutExpired:
        kill_all(proc)
        pytest.fail(f"relaunch run was still there at the end of the {grace:g}s grace:\n{said(tmp_path)}")
    took = time.monotonic() - began
    assert code == EXIT_REQUEUE, said(tmp_path)
    assert stops(tmp_path) and newest_step(tmp_path) == stops(tmp_path)[-1], said(tmp_path)
    entry = history(tmp_path)[-1]
    assert entry["steps_lost"] == 0 and entry["made_deadline"] is True, entry
    return took


def test_kubernetes_sigterm_to_pid_1_alone_then_sigkill_after_the_grace(tmp_path: Path) -> None:
    """Kubernetes: SIGTERM to PID 1 of the container only (relaunch run), SIGKILL to all of it after
    terminationGracePeriodSeconds; the training gets its stop signal from relaunch run."""
    job_recipe(tmp_path)
    stop_like(tmp_path, {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, 15, "--grace", "15", signal_to=signal.SIGTERM)
    assert "15s until the end" in said(tmp_path) or "14s until the end" in said(tmp_path), said(tmp_path)


def test_dstack_sigint_then_sigkill_ten_seconds_later(tmp_path: Path) -> None:
    """dstack: SIGINT to the job, SIGKILL 10 s later (its issue #2233); relaunch run knows the 10 s
    from dstack's variables, without --grace."""
    job_recipe(tmp_path)
    stop_like(tmp_path, {"DSTACK_RUN_NAME": "example-job"}, 10, signal_to=signal.SIGINT)
    assert "SIGINT from dstack run example-job" in said(tmp_path), said(tmp_path)


def test_skypilot_spot_notice_then_the_node_gone_at_its_deadline(tmp_path: Path) -> None:
    """SkyPilot's managed job on a spot node: the cloud's reclaim notice (a `file:` source stands
    for the metadata server here), then the node is gone at the deadline, SIGKILL to everything;
    SkyPilot recovers the job on new nodes (recover_on_exit_codes: [75])."""
    notice = tmp_path / "notice"
    job_recipe(tmp_path, guard={"enabled": True, "sources": [f"file:{notice}"], "every": 0.5})
    stop_like(tmp_path, {"SKYPILOT_TASK_ID": "sky-managed-1", "SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_NODES": "1"},
              15, notice=notice)
    assert history(tmp_path)[-1]["cause"] == "notice"


def test_slurm_signal_to_every_process_reaches_a_training_that_handles_only_sigterm(tmp_path: Path) -> None:
    """Slurm's scancel, requeue and --signal without B: signal every process of the job at once; a
    SIGTERM to the training and relaunch run alike is one stop, the save copied before KillWait."""
    job_recipe(tmp_path)
    stop_like(tmp_path, {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0"}, 30, signal_to=signal.SIGTERM,
              everyone=True)
