"""relaunch.train.Checkpointer end to end: the example job (examples/pytorch/train_dist.py, FSDP2 under
torchrun, gloo) on sandbox instances, driven by the real `relaunch up`, `evacuate --stop`, `watch`,
`interval` and `status`.

- A stop that comes while a save's background write is in flight: the write is flushed and
  committed, the stop's own step is saved, committed and verified in the store (by `evacuate
  --stop`, and by `watch` on a notice).
- `kill -9` in the middle of a write: no folder a layout counts as complete, and the next `up`
  resumes from the save before.
- 2 ranks -> 4 -> 2: every step matches an uninterrupted 2-rank run to 1e-4 (relative). Both see
  the same samples in every global batch; only the order of float additions differs between
  world sizes (gradient reductions), which moves the sixth digit at most.
- `interval` and `status` report exactly what the run's metric lines say.

Writes are held back by tests/slow_write.py (in DCP's own FileSystemWriter.write_data) so that
a write is in flight long enough for the stop or the kill to land in it; the log then shows that
it did, in order.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from e2e import run_cli, wait_for, whole
from relaunch.layouts import LISTING_COMMAND, complete_checkpoints, parse_listing
from test_guard import guard_file, watching

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "pytorch"
NAME = "example-dist"
TOLERANCE = 1e-4
METRIC = re.compile(r"^relaunch\.checkpoint: step=(\d+) \S+ blocking_s=([\d.]+) write_s=([\d.]+) step_s=(\S+)", re.M)


def recipe_for(folder: Path, key: Path, index_url: str, *, slow: float = 0.0, steps: int = 400, sleep: float = 0.2,
               save_every: int = 10, nproc: int = 2, guard_every: float | None = None) -> Path:
    """examples/pytorch/recipe-dist.yaml on one node, each write held `slow` seconds, a store under `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for source in (EXAMPLE / "train_dist.py", EXAMPLE / "requirements.lock", Path(__file__).with_name("slow_write.py")):
        shutil.copy(source, folder / source.name)
    data = yaml.safe_load((EXAMPLE / "recipe-dist.yaml").read_text())
    data["ssh"] = {"key": str(key), "wait": 30}
    data["env"].update(index_url=index_url, vars={"SLOW_WRITE_SECONDS": str(slow), "OMP_NUM_THREADS": "1"})
    data["env"]["files"]["slow_write.py"] = "~/work/slow_write.py"
    data["checkpoint"]["remote"] = str(folder / "store")
    run = data["run"]
    run["command"] = (run["command"].replace("train_dist.py --out", "slow_write.py train_dist.py --out")
                      .replace("--steps 60", f"--steps {steps}").replace("--sleep 0.3", f"--sleep {sleep}")
                      .replace("--save-every 10", f"--save-every {save_every}"))
    run["nproc_per_node"] = nproc
    run["stop"] = {"signal": "TERM", "timeout": 180}
    if guard_every is not None:
        data["guard"] = {"every": guard_every}
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def log_of(ssh, inst) -> str:
    return ssh(inst, f"cat ~/{NAME}.log").stdout


def committed(log: str) -> dict[int, int]:
    """step -> the index of its metric line (the save committed) in the log's lines."""
    lines = log.splitlines()
    return {int(m[1]): i for i, line in enumerate(lines) if (m := METRIC.match(line))}


def staged(log: str) -> dict[int, int]:
    """step -> the index of its `state copied ..., writing in the background` line."""
    found = {}
    for i, line in enumerate(log.splitlines()):
        m = re.match(r"relaunch\.train: step-(\d+): state copied in .*writing in the background", line)
        if m:
            found[int(m[1])] = i
    return found


def in_flight_write(ssh, inst) -> int:
    """Wait until a save is written in the background and not committed yet; its step."""
    def pending() -> int | None:
        log = log_of(ssh, inst)
        waiting = set(staged(log)) - set(committed(log))
        return max(waiting) if waiting and committed(log) else None      # after a first commit
    return wait_for("a save in flight after a first committed one", pending, timeout=300, every=0.2)


def assert_stopped_during_a_write(log: str) -> tuple[int, int]:
    """The stop signal came between a save's start and its commit; that save and the stop's own
    step were committed after it. Returns (the step in flight, the step stopped at)."""
    lines = log.splitlines()
    signalled = next(i for i, line in enumerate(lines) if "relaunch.train: got SIGTERM" in line)
    started, done = staged(log), committed(log)
    flying = [step for step, i in started.items() if i < signalled and done.get(step, -1) > signalled]
    assert flying, f"no write was in flight when the stop came:\n{log[-3000:]}"
    stopped = int(re.findall(r"^stopped at step (\d+)$", log, re.M)[-1])
    assert stopped in done and done[stopped] > signalled, "the stop's own step was not committed"
    assert f"relaunch.train: signal SIGTERM: step-{stopped:08d} saved and committed" in log
    return flying[0], stopped


def assert_verified(store: Path, ssh, inst, stopped: int) -> None:
    manifest = json.loads((store / ".relaunch" / "manifest.json").read_text())
    newest = max(manifest["checkpoints"], key=lambda c: c["step"])
    assert (newest["name"], newest["step"]) == (f"step-{stopped:08d}", stopped)
    for path, record in newest["files"].items():
        assert ssh(inst, f"sha256sum ~/ckpt/{path}").stdout.split()[0] == record["sha256"], path
    assert {Path(p).name for p in newest["files"]} >= {".metadata", "__0_0.distcp", "__1_0.distcp"}


def test_evacuate_stop_during_an_async_write_commits_it_and_the_stop_step_is_verified(
        tmp_path, sandbox, ssh, ssh_key, package_index):
    home, inst = tmp_path / "state", sandbox(index_dir=package_index)
    recipe = recipe_for(tmp_path / "work", ssh_key, inst.index_url, slow=15, save_every=20, sleep=0.1)
    up = run_cli("up", str(recipe), inst.host, home=home)
    assert up.returncode == 0, up.stderr
    in_flight_write(ssh, inst)
    evac = run_cli("evacuate", str(recipe), inst.host, "--stop", "--json", home=home, timeout=600)
    assert evac.returncode == 0 and "safe to destroy" in evac.stderr, evac.stderr
    log = log_of(ssh, inst)
    flying, stopped = assert_stopped_during_a_write(log)
    assert json.loads(evac.stdout)["newest_step"] == stopped >= flying
    assert_verified(tmp_path / "work" / "store", ssh, inst, stopped)


def test_a_notice_during_an_async_write_ends_with_the_stop_step_verified_by_watch(
        tmp_path, sandbox, ssh, ssh_key, package_index):
    home, inst = tmp_path / "state", sandbox(index_dir=package_index)
    recipe = recipe_for(tmp_path / "work", ssh_key, inst.index_url, slow=15, save_every=20, sleep=0.1, guard_every=1)
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    state = wait_for("the guard to run", lambda: guard_file(ssh, inst, "state.json", NAME), timeout=120)
    with watching(recipe, home, tmp_path) as watch:
        in_flight_write(ssh, inst)
        ssh(inst, f"kill -TERM {state['pid']}")          # the guard's own SIGTERM: a notice (source sigterm)
        watch.wait(timeout=600)
    assert watch.returncode == 0, (tmp_path / "watch.err").read_text()
    _, stopped = assert_stopped_during_a_write(log_of(ssh, inst))
    notice = guard_file(ssh, inst, "notice.json", NAME)
    # torchrun exits 1 after the TERM it passes on to its ranks, even when each saved and exited 0
    # (docs/trainers.md, Accelerate): the guard's record says `exited`; the checkpoint is whole all the same
    assert notice is not None and notice["source"] == "sigterm" and notice["save"]["state"] in ("saved", "exited")
    assert notice["copy"]["verified"] is True and notice["copy"]["checkpoint"] == f"step-{stopped:08d}"
    assert_verified(tmp_path / "work" / "store", ssh, inst, stopped)
    history = [json.loads(line) for line in
               (tmp_path / "work" / "store" / ".relaunch" / "history.jsonl").read_text().splitlines()]
    assert history[-1]["steps_lost"] == 0 and history[-1]["newest_verified_step"] == stopped


def instance_complete(ssh, inst, layout: str) -> list[str]:
    listing = ssh(inst, LISTING_COMMAND.format(dir="~/ckpt")).stdout.encode()
    return [c.name for c in complete_checkpoints(parse_listing(listing), layout)]


def test_kill_9_during_a_write_leaves_nothing_complete_and_up_resumes_from_the_save_before(
        tmp_path, sandbox, ssh, ssh_key, package_index):
    home, inst = tmp_path / "state", sandbox(index_dir=package_index)
    recipe = recipe_for(tmp_path / "work", ssh_key, inst.index_url, slow=60, save_every=10)
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    flying = in_flight_write(ssh, inst)
    before = max(committed(log_of(ssh, inst)))
    # every process of this run, torchrun and its ranks; only in this instance (one PID namespace, many networks)
    ssh(inst, "for p in $(pgrep -f '[s]low_write.py train_dist.py'); do "
              "[ \"$(readlink /proc/$p/ns/net)\" = \"$(readlink /proc/self/ns/net)\" ] && kill -9 $p; done; true")
    wait_for("the run to end", lambda: ssh(inst, f"tmux has-session -t ={NAME}", check=False).returncode != 0,
             timeout=60)
    assert flying not in committed(log_of(ssh, inst))
    assert ssh(inst, f"test -d ~/ckpt/tmp-step-{flying:08d}", check=False).returncode == 0
    for layout in ("dcp", "auto"):
        assert instance_complete(ssh, inst, layout)[-1] == f"step-{before:08d}"

    again = run_cli("up", str(recipe), inst.host, "--set", "env.vars.SLOW_WRITE_SECONDS=0", home=home)
    assert again.returncode == 0, again.stderr
    log = wait_for("the resumed run", lambda: (lambda text: text if "resumed from" in text.split(
        "=== relaunch: start ")[-1] else "")(log_of(ssh, inst)), timeout=300)
    assert f"resumed from /root/ckpt/step-{before:08d} at step {before} (world size 2" in log
    wait_for("the killed run's leftover removed",
             lambda: ssh(inst, f"test -e ~/ckpt/tmp-step-{flying:08d}", check=False).returncode != 0, timeout=60)


def losses(log: str) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad_norm) of a log's whole lines (`$` also matches where a line being written stops)."""
    return {int(m[1]): (float(m[2]), float(m[3])) for m in re.finditer(r"^step (\d+) loss ([\d.]+) grad_norm ([\d.]+)$",
                                                                       whole(log), re.M)}


def reference(tmp: Path, steps: int) -> dict[int, tuple[float, float]]:
    """The uninterrupted run, here: 2 processes (grad_accum 4), no checkpoint in between."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(EXAMPLE / "train_dist.py"), "--out", str(tmp / "reference"), "--steps", str(steps),
                          "--save-every", "100000", "--global-batch", "32", "--micro", "4", "--grad-accum", "4"],
                         capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return losses(out.stdout)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b), 1e-9)


def stop(recipe: Path, inst, home: Path) -> int:
    evac = run_cli("evacuate", str(recipe), inst.host, "--stop", "--json", home=home, timeout=600)
    assert evac.returncode == 0 and "safe to destroy" in evac.stderr, evac.stderr
    return int(json.loads(evac.stdout)["newest_step"])


def test_resumes_from_2_ranks_on_4_and_back_match_an_uninterrupted_run_and_interval_reads_the_log(
        tmp_path, sandbox, ssh, ssh_key, package_index):
    home, inst = tmp_path / "state", sandbox(index_dir=package_index)
    recipe = recipe_for(tmp_path / "work", ssh_key, inst.index_url, save_every=5, sleep=0.2)
    up = run_cli("up", str(recipe), inst.host, home=home)
    assert up.returncode == 0, up.stderr
    wait_for("four saves", lambda: len(committed(log_of(ssh, inst))) >= 4, timeout=300)
    first = stop(recipe, inst, home)

    # what the run logged, read here with the test's own pattern; `interval` and `status` must say the same
    logged = [(float(b), float(w), None if s == "-" else float(s)) for _, b, w, s in METRIC.findall(log_of(ssh, inst))]
    blocking = statistics.median(b for b, _, _ in logged)
    save = statistics.median(b + w for b, w, _ in logged)
    step = statistics.median(s for _, _, s in logged if s)
    iv = run_cli("interval", str(recipe), inst.host, "--mtbi", "6h", "--json", home=home)
    assert iv.returncode == 0, iv.stderr
    data = json.loads(iv.stdout)
    assert (data["step_time"], data["save_time"], data["blocking_time"]) == (step, save, blocking)
    assert data["measured"]["source"] == "metric lines" and data["measured"]["samples"] == len(logged)
    assert data["measured_fields"] == ["step_time", "save_time", "blocking_time"]
    status = run_cli("status", str(recipe), inst.host, "--json", home=home)
    assert status.returncode == 4 and "training is not running" in status.stderr, status.stderr   # stopped
    badput = json.JSONDecoder().raw_decode(status.stdout)[0]["badput"]
    assert (badput["saves"], badput["blocking"], badput["save_time"], badput["step_time"], badput["every"]) == (
        len(logged), blocking, save, step, 5)
    assert badput["saving"] == blocking / (5 * step) and badput["interruptions"] == 0
    text = run_cli("status", str(recipe), inst.host, home=home).stdout
    assert "saving: every 5 steps" in text and "Badput now: saving" in text

    four = run_cli("up", str(recipe), inst.host, "--set", "run.nproc_per_node=4", home=home)
    assert four.returncode == 0, four.stderr
    assert "world size 2 -> 4: grad_accum 4 -> 2, global batch 32 kept" in four.stderr
    wait_for("ten steps on 4 ranks", lambda: f"step {first + 10} " in log_of(ssh, inst), timeout=300)
    second = stop(recipe, inst, home)
    log = log_of(ssh, inst)
    assert f"resumed from /root/ckpt/step-{first:08d} at step {first} (world size 4, grad_accum 2)" in log
    assert f"resumed from /root/ckpt/step-{first:08d} at step {first} (world size 2 -> 4)" in log

    two = run_cli("up", str(recipe), inst.host, home=home)
    assert two.returncode == 0, two.stderr
    assert "world size 4 -> 2: grad_accum 2 -> 4, global batch 32 kept" in two.stderr
    wait_for("five steps on 2 ranks again", lambda: f"step {second + 5} " in log_of(ssh, inst), timeout=300)
    log = log_of(ssh, inst)
    assert f"at step {second} (world size 4 -> 2)" in log

    ref, seen = reference(tmp_path, second + 5), losses(log)
    assert set(range(1, second + 6)) <= set(seen)
    for n in range(1, second + 6):                      # 2 ranks, then 4, then 2 again: one run
        assert close(seen[n][0], ref[n][0]) and close(seen[n][1], ref[n][1]), (n, seen[n], ref[n])
