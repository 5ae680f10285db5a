"""Node groups end to end: torchrun with gloo on sandbox nodes, FSDP2 + PyTorch DCP shards on each
node's own disk, evacuated from every node, resumed on another number of nodes.

The tolerance: a resumed step's loss equals the uninterrupted run's to 1e-4 (relative). Both
runs see the same samples in every global batch; only the order of float additions differs
between world sizes (gradient reductions), which moves the sixth digit at most.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from e2e import run_cli, wait_for, whole
from relaunch import sandbox as sb

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pytorch"
TOLERANCE = 1e-4


def dist_recipe(folder: Path, key: Path, index_url: str, steps: int = 400, sleep: float = 0.3) -> Path:
    """examples/pytorch/recipe-dist.yaml with its files, the store under `folder`, a tiny run."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("train_dist.py", "requirements.lock"):
        shutil.copy(EXAMPLE / name, folder / name)
    text = (EXAMPLE / "recipe-dist.yaml").read_text()
    text = text.replace("--steps 60", f"--steps {steps}").replace("--sleep 0.3", f"--sleep {sleep}")
    text = text.replace("--save-every 10", "--save-every 10 --keep 4")     # a step the test looks at stays a while
    text += f"ssh: {{key: {key}, wait: 30}}\n"
    text = text.replace("  lock: requirements.lock", f"  index_url: {index_url}\n  lock: requirements.lock")
    path = folder / "recipe.yaml"
    path.write_text(text)
    return path


def losses(log: str) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad_norm) of a log's whole lines (`$` also matches where a line being written stops)."""
    return {int(m[1]): (float(m[2]), float(m[3])) for m in re.finditer(r"^step (\d+) loss ([\d.]+) grad_norm ([\d.]+)$",
                                                                       whole(log), re.M)}


def reference(tmp: Path, steps: int) -> dict[int, tuple[float, float]]:
    """The uninterrupted run, here: 1 node x 2 processes (grad_accum 4), no checkpoint in between."""
    # torchrun as this Python's module: its ranks then import this relaunch (a torchrun script found
    # beside it may belong to another Python, with another relaunch.train)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(EXAMPLE / "train_dist.py"),
                          "--out", str(tmp / "reference"), "--steps", str(steps), "--save-every", "100000",
                          "--global-batch", "32", "--micro", "4", "--grad-accum", "4"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return losses(out.stdout)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b), 1e-9)


def node_files(ssh, inst, step: int) -> list[str]:
    return ssh(inst, f"ls -A ~/ckpt/step-{step:08d} 2>/dev/null || true").stdout.split()


def test_two_nodes_of_two_evacuated_then_resumed_on_one_node_keep_the_global_batch(
        tmp_path, sandbox, ssh, ssh_key, package_index):
    home = tmp_path / "state"
    n0, n1 = sandbox(index_dir=package_index), sandbox(index_dir=package_index)
    recipe = dist_recipe(tmp_path / "work", ssh_key, n0.index_url)
    up = run_cli("up", str(recipe), n0.host, n1.host, home=home)
    assert up.returncode == 0, up.stderr
    assert "2 node(s) x 2 process(es): world size 4, grad_accum 2" in up.stderr
    wait_for("step 20 saved on both nodes", lambda: ".metadata" in node_files(ssh, n0, 20)
             and node_files(ssh, n1, 20), timeout=300)
    # each node holds its own ranks' shards: 0 and 1 on node 0, 2 and 3 on node 1
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(node_files(ssh, n0, 20))
    assert set(node_files(ssh, n1, 20)) == {"__2_0.distcp", "__3_0.distcp"}

    evac = run_cli("evacuate", str(recipe), n0.host, n1.host, "--stop", "--json", home=home)
    assert evac.returncode == 0, evac.stderr
    assert "safe to destroy" in evac.stderr
    report = json.loads(evac.stdout)
    stopped = report["newest_step"]
    first_log = ssh(n0, "cat ~/example-dist.log").stdout
    assert f"stopped at step {stopped}" in first_log
    manifest = json.loads((tmp_path / "work" / "store" / "example-dist" / ".relaunch" / "manifest.json").read_text())
    newest = max(manifest["checkpoints"], key=lambda c: c["step"])
    assert newest["step"] == stopped and newest["saved_with"]["world_size"] == 4
    held = {Path(p).name: f["node"] for p, f in newest["files"].items()}
    assert held["__2_0.distcp"] == held["__3_0.distcp"] == n1.host.rsplit(":", 1)[0]
    assert held["__0_0.distcp"] == held[".metadata"] == n0.host.rsplit(":", 1)[0]

    one = sandbox(index_dir=package_index)               # a new address (made before the old ones go)
    sb.destroy(n0.name)
    sb.destroy(n1.name)
    again = run_cli("up", str(recipe), one.host, home=home)
    assert again.returncode == 0, again.stderr
    assert "world size 4 -> 2: grad_accum 2 -> 4, global batch 32 kept" in again.stderr
    log = wait_for("five steps after the resume", lambda: (lambda text: text if f"step {stopped + 5} " in text
                                                           else "")(ssh(one, "cat ~/example-dist.log").stdout),
                   timeout=300)
    assert f"at step {stopped} (world size 2, grad_accum 4)" in log
    ref = reference(tmp_path, stopped + 5)
    resumed, before = losses(log), losses(first_log)
    for step in range(stopped + 1, stopped + 6):          # the step counter continues
        assert close(resumed[step][0], ref[step][0]) and close(resumed[step][1], ref[step][1]), (step, resumed[step],
                                                                                              ref[step])
    for step in range(1, stopped + 1):                     # and 4 ranks trained what 2 would have
        assert close(before[step][0], ref[step][0]), (step, before[step], ref[step])


def test_a_shard_lost_on_one_node_leaves_the_previous_checkpoint_newest_and_fans_out_to_a_new_group(
        tmp_path, sandbox, ssh, ssh_key, package_index):
    home = tmp_path / "state"
    n0, n1 = sandbox(index_dir=package_index), sandbox(index_dir=package_index)
    recipe = dist_recipe(tmp_path / "work", ssh_key, n0.index_url)
    assert run_cli("up", str(recipe), n0.host, n1.host, home=home).returncode == 0
    wait_for("step 30 saved on both nodes", lambda: ".metadata" in node_files(ssh, n0, 30)
             and node_files(ssh, n1, 30), timeout=300)
    for inst in (n0, n1):
        ssh(inst, "tmux kill-session -t =example-dist")
    saved = sorted(int(n.split("-")[1]) for n in ssh(n0, "ls ~/ckpt").stdout.split()   # not a tmp-step-N in flight
                   if n.startswith("step-") and ".metadata" in node_files(ssh, n0, int(n.split("-")[1])))
    lost, kept = saved[-1], saved[-2]
    ssh(n1, f"rm ~/ckpt/step-{lost:08d}/__3_0.distcp")      # a shard lost with its node's disk
    evac = run_cli("evacuate", str(recipe), n0.host, n1.host, "--json", home=home)
    assert evac.returncode == 0, evac.stderr
    report = json.loads(evac.stdout)
    assert report["newest"] == f"step-{kept:08d}"            # complete across the group: the one before
    assert f"step-{lost:08d}" not in report["copied"] + report["already"]
    store = tmp_path / "work" / "store" / "example-dist"
    names = [c["name"] for c in json.loads((store / ".relaunch" / "manifest.json").read_text())["checkpoints"]]
    assert f"step-{lost:08d}" not in names and f"step-{kept:08d}" in names

    # a new group of two: the bytes go to node 0 once, then node 0 copies them to node 1
    m0, m1 = sandbox(index_dir=package_index), sandbox(index_dir=package_index, command_log=True)
    sb.destroy(n0.name)
    sb.destroy(n1.name)
    planned = run_cli("plan", str(recipe), m0.host, m1.host, "--json", home=home)
    assert planned.returncode == 0, planned.stderr
    actions = json.loads(planned.stdout)["actions"]
    local_copies = [a for a in actions if a["argv"] and a["argv"][0] == "rsync"]
    assert len(local_copies) == 1 and m0.address in local_copies[0]["argv"][-1]
    up = run_cli("up", str(recipe), m0.host, m1.host, home=home)
    assert up.returncode == 0, up.stderr
    step = kept
    for inst in (m0, m1):
        assert set(node_files(ssh, inst, step)) >= {".metadata", "__0_0.distcp", "__3_0.distcp"}
        assert "relaunch-fanout" not in ssh(inst, "cat ~/.ssh/authorized_keys 2>/dev/null || true").stdout
        assert ssh(inst, "ls ~/.relaunch/example-dist/").stdout.count("fanout") == 0
    received = [c for c in sb.commands(m1.name) if c.startswith("rsync --server")]
    assert received, "node 1 got the checkpoint from node 0"
    log = wait_for("the resumed group", lambda: ssh(m0, "cat ~/example-dist.log").stdout
                   if f"at step {step} (world size 4" in ssh(m0, "cat ~/example-dist.log").stdout else "",
                   timeout=300)
    assert "grad_accum 2" in log


@pytest.fixture(autouse=True)
def _no_stray_torchrun(tmp_path):
    yield
    # this test's reference run only: another worker's (test_checkpointer_runs has one too) is
    # its own, and a pattern wider than this test's folder ended it with SIGTERM in CI
    subprocess.run(["pkill", "-f", f"train_dist.py --out {re.escape(str(tmp_path))}/reference"], capture_output=True)


def test_drill_on_two_nodes_resumed_on_one_prints_its_table_and_a_record(tmp_path, sandbox, ssh_key, package_index):
    home = tmp_path / "state"
    n0, n1, n2 = (sandbox(index_dir=package_index) for _ in range(3))
    recipe = dist_recipe(tmp_path / "work", ssh_key, n0.index_url)
    drill = run_cli("drill", str(recipe), n0.host, n1.host, "--resume-on", n2.host, "--json", home=home,
                    timeout=1200)
    assert drill.returncode == 0, drill.stderr
    result = json.loads(drill.stdout)
    assert result["continuous"] and result["rows"] and result["worst"] <= 1e-4
    assert result["steps_lost"] == result["interrupted_at"] - result["resumed_at"] >= 3
    assert result["seconds_to_resume"] > 0 and result["throughput_before"] > 0 and result["throughput_after"] > 0
    assert "drill of example-dist: 2 node(s) -> 1 node(s), interrupted (kill)" in drill.stderr
    assert "continuous: the largest relative difference" in drill.stderr
    # the blocking save time beside the steps lost, from the Checkpointer's metric lines
    assert result["blocking_save"] > 0 and result["saves"] >= 1
    assert f"steps lost                   {result['steps_lost']} (a save blocked training " in drill.stderr
    store = tmp_path / "work" / "store" / "example-dist" / ".relaunch"
    record = json.loads(next(store.glob("drill-*.json")).read_text())
    assert record["rows"] == result["rows"]


def test_a_stop_save_that_outlasts_torchruns_own_30_s_still_finishes(tmp_path, sandbox, ssh, ssh_key, package_index):
    """torchrun SIGKILLs its ranks 30 s after the stop signal reaches it (it gets the signal with
    them: the process group), while `evacuate --stop` waits run.stop.timeout. A save that takes
    40 s (a big model's DCP checkpoint) was killed half-way and the run's newest step lost."""
    from e2e import write_recipe

    inst = sandbox(index_dir=package_index)
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(EXAMPLE / "requirements.lock", work / "requirements.lock")
    shutil.copy(Path(__file__).with_name("slow_stop_trainer.py"), work / "slow_stop_trainer.py")
    recipe = write_recipe(work, {
        "name": "slowstop",
        "ssh": {"key": str(ssh_key), "wait": 30},
        "env": {"python": "3.11", "venv": "~/venvs/example", "installer": "uv", "lock": "requirements.lock",
                "index_url": inst.index_url, "files": {"slow_stop_trainer.py": "~/work/slow_stop_trainer.py"}},
        "checkpoint": {"dir": "~/ckpt", "layout": "files", "pattern": "ckpt-*.pt", "keep": 3,
                       "remote": str(tmp_path / "store")},
        "run": {"command": "torchrun --standalone --nproc-per-node 2 slow_stop_trainer.py ~/ckpt 40",
                "workdir": "~/work", "ready": r"^step \d+", "stop": {"signal": "TERM", "timeout": 90}},
    })
    home = tmp_path / "state"
    up = run_cli("up", str(recipe), inst.host, home=home)
    assert up.returncode == 0, up.stderr
    wait_for("a first save", lambda: ssh(inst, "ls ~/ckpt 2>/dev/null", check=False).stdout.strip(), timeout=120)
    evac = run_cli("evacuate", str(recipe), inst.host, "--stop", "--json", home=home, timeout=600)
    assert evac.returncode == 0 and "safe to destroy" in evac.stderr, evac.stderr
    log = ssh(inst, "cat ~/slowstop.log").stdout
    stopped = re.search(r"^stopped at step (\d+)$", log, re.M)
    assert stopped, f"the ranks were killed before their save finished:\n{log[-2000:]}"
    step = int(stopped[1])
    assert json.loads(evac.stdout)["newest_step"] == step
    assert (tmp_path / "store" / f"ckpt-{step:08d}.pt").read_bytes() == f"step {step}\n".encode() * 200
