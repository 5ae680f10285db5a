"""Real trainers end to end on sandbox instances: Hugging Face Trainer, PyTorch Lightning, Accelerate.

For each example in examples/ (hf-trainer, lightning, accelerate), exactly as a user runs
it: `relaunch up` on a first instance, a reclaim notice mid-run through the guard's `file:` source
(a file that appears on the instance), the guard's run.stop.signal to the training, the trainer's
save at the step it was at, `relaunch evacuate`, then `relaunch up` on a second instance, which
restores that checkpoint through the recipe's layout and resumes it through the trainer's own
resume argument. The training scripts import `relaunch.train` from the file `up` puts on their
PYTHONPATH; their venvs hold only the pinned locks.

The tolerance: every step's loss and grad norm, before and after the resume, equals the
uninterrupted run's (run here with the same package versions, on the same CPU) to 1e-4 relative.
The Hugging Face and Lightning runs repeat the same arithmetic and match to the printed digits;
the Accelerate run resumes on 1 process instead of 2 (grad_accum 2 -> 4, the global batch kept),
whose gradient sums add in another order, which moves the sixth digit at most.

One package index serves every instance (the example lock plus the three trainer locks), built
once per session. The three uninterrupted runs start at once when the module does, and run here
while the instances train.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e import run_cli, wait_for, whole
from relaunch import sandbox as sb

pytestmark = pytest.mark.sandbox  # trains with torch, transformers, lightning

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TRAINERS = ("hf-trainer", "lightning", "accelerate")
LOCKS = [EXAMPLES / name / "requirements.lock" for name in TRAINERS]
EXAMPLE_LOCK = REPO / "examples" / "pytorch" / "requirements.lock"
TOLERANCE = 1e-4
STEPS, SAVE_EVERY, SLEEP = 40, 10, 0.25
NOTICE_AFTER = 12          # the notice comes once the log shows this step (after the save at 10)
NOTICE_FILE = "~/reclaim"
MANIFEST = Path(".relaunch") / "manifest.json"
PACKAGES = {"hf-trainer": "transformers", "lightning": "lightning", "accelerate": "accelerate"}
# each script's arguments, named as its trainer's own examples name them
ARGS = {"hf-trainer": {"dir": "--output_dir", "resume": "--resume_from_checkpoint", "steps": "--max_steps",
                       "every": "--save_steps"},
        "lightning": {"dir": "--ckpt_dir", "resume": "--ckpt_path", "steps": "--max_steps",
                      "every": "--every_n_train_steps"},
        "accelerate": {"dir": "--output_dir", "resume": "--resume_from_checkpoint", "steps": "--max_train_steps",
                       "every": "--checkpointing_steps"}}


@pytest.fixture(scope="session")
def trainer_index() -> Path:
    """One local PEP 503 index for every trainer test: the example lock and the three trainer locks."""
    return sb.build_index([EXAMPLE_LOCK, *LOCKS])


def train_module_dir(folder: Path) -> Path:
    """What `up` puts on the training's PYTHONPATH: a folder holding relaunch/train.py alone."""
    target = folder / "python" / "relaunch"
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "relaunch" / "train.py", target / "train.py")
    return folder / "python"


def pinned(lock: Path) -> dict[str, str]:
    pins = {}
    for line in lock.read_text().splitlines():
        name, _, version = line.partition("==")
        pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def local_command(trainer: str, out: Path, final: Path) -> list[str]:
    """The uninterrupted run on this machine: the example's own train.py, as its recipe runs it."""
    script, names = EXAMPLES / trainer / "train.py", ARGS[trainer]
    args = [names["dir"], str(out), names["steps"], str(STEPS), names["every"], str(SAVE_EVERY), "--final", str(final)]
    if trainer == "accelerate":
        launcher = Path(sys.executable).parent / "accelerate"
        return [str(launcher), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no", str(script), *args,
                "--global_batch", "16", "--micro_batch", "4", "--gradient_accumulation_steps", "2"]
    return [sys.executable, str(script), *args]


class Baselines:
    """The three uninterrupted runs, started at once in the background; `log(trainer)` waits for one."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        python_path = train_module_dir(folder)
        env = {**os.environ, "PYTHONPATH": str(python_path), "OMP_NUM_THREADS": "1"}
        for key in ("RELAUNCH_NOTICE", "RELAUNCH_STOP_SIGNAL", "RELAUNCH_STARTED"):
            env.pop(key, None)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for trainer in TRAINERS:
            with open(folder / f"{trainer}.log", "wb") as log:
                self.procs[trainer] = subprocess.Popen(
                    local_command(trainer, folder / trainer, folder / f"{trainer}.sha256"),
                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def log(self, trainer: str) -> str:
        rc = self.procs[trainer].wait(timeout=600)
        text = (self.folder / f"{trainer}.log").read_text()
        assert rc == 0, text[-3000:]
        assert f"done step {STEPS}" in text, text[-3000:]
        return text

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=30)


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory) -> Any:
    for trainer in TRAINERS:     # the same versions here as in the locks, or the losses mean nothing
        pins = pinned(EXAMPLES / trainer / "requirements.lock")
        for package in ("torch", PACKAGES[trainer]):
            here = importlib.metadata.version(package)
            assert here == pins[package], f"{package} {here} here, {pins[package]} in {trainer}'s lock: " \
                                          "pip install -e '.[test]'"
    runs = Baselines(tmp_path_factory.mktemp("baselines"))
    try:
        yield runs
    finally:
        runs.stop()


def metrics(log: str) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad_norm) of a log's whole lines (`$` also matches where a line being written stops)."""
    return {int(m[1]): (float(m[2]), float(m[3]))
            for m in re.finditer(r"^step (\d+) loss ([\d.]+) grad_norm ([\d.]+)$", whole(log), re.M)}


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b), 1e-9)


def assert_matches(run: dict[int, tuple[float, float]], reference: dict[int, tuple[float, float]],
                   steps: range) -> None:
    for step in steps:
        assert step in run, f"step {step} missing from the run's log"
        got, want = run[step], reference[step]
        assert close(got[0], want[0]) and close(got[1], want[1]), (step, got, want)


def example_recipe(trainer: str, folder: Path, key: Path, index_url: str) -> Path:
    """examples/TRAINER with its files, copied as a user would; shorter, with a file notice source."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("recipe.yaml", "train.py", "requirements.lock"):
        shutil.copy(EXAMPLES / trainer / name, folder / name)
    data = yaml.safe_load((folder / "recipe.yaml").read_text())
    data["ssh"] = {"key": str(key), "wait": 30}
    data["env"]["index_url"] = index_url
    command, names = data["run"]["command"], ARGS[trainer]
    for old, new in ((f"{names['steps']} 60", f"{names['steps']} {STEPS}"),
                     (f"{names['every']} 10", f"{names['every']} {SAVE_EVERY}"), ("--sleep 0.3", f"--sleep {SLEEP}")):
        assert old in command, (old, command)
        command = command.replace(old, new)
    data["run"]["command"] = command
    data["guard"] = {"sources": [f"file:{NOTICE_FILE}"], "every": 1}
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def read_log(ssh: Any, inst: sb.Instance, name: str) -> str:
    return ssh(inst, f"cat ~/{name}.log 2>/dev/null || true").stdout


def log_until(ssh: Any, inst: sb.Instance, name: str, what: str, done: Any) -> str:
    """The training log once `done(log)` holds; an AssertionError with the log as soon as the
    training ended without it (its tmux session gone), not only when the wait times out."""
    def look() -> str:
        text = read_log(ssh, inst, name)
        if done(text):
            return text
        if ssh(inst, f"tmux has-session -t ={name}", check=False).returncode != 0 and not done(
                text := read_log(ssh, inst, name)):
            raise AssertionError(f"training ended before {what}:\n{text[-3000:]}")
        return ""
    return wait_for(what, look, timeout=300)


def guard_notice(ssh: Any, inst: sb.Instance, name: str) -> dict[str, Any] | None:
    out = ssh(inst, f"cat ~/.relaunch/{name}/guard/notice.json 2>/dev/null || true").stdout
    return json.loads(out) if out.strip() else None


@dataclass
class Interrupted:
    """What the first instance did: trained, got the notice, saved, was evacuated."""

    log: str
    noticed_at: int            # the newest step in the log when the notice was raised
    stopped: int               # `stopped at step N`
    notice: dict[str, Any]
    evacuated: dict[str, Any]  # evacuate --json
    manifest: dict[str, Any]
    store: Path


def train_and_interrupt(recipe: Path, inst: sb.Instance, home: Path, ssh: Any) -> Interrupted:
    name = yaml.safe_load(recipe.read_text())["name"]
    up = run_cli("up", str(recipe), inst.host, home=home)
    assert up.returncode == 0, up.stderr
    instance_home = ssh(inst, "echo ~").stdout.strip()
    source = f"file:{NOTICE_FILE.replace('~', instance_home)}"
    assert f"guard: watching {source} every 1s" in up.stderr, up.stderr
    # the venv holds the lock only: relaunch.train comes from the file up put on PYTHONPATH
    venv = yaml.safe_load(recipe.read_text())["env"]["venv"]
    bare = ssh(inst, f"{venv}/bin/python -c 'import relaunch.train'", check=False)
    assert bare.returncode != 0 and "No module named 'relaunch'" in bare.stderr, bare
    log = log_until(ssh, inst, name, f"step {NOTICE_AFTER} on the first instance",
                    lambda text: max(metrics(text), default=0) >= NOTICE_AFTER)
    noticed_at = max(metrics(log))
    ssh(inst, f"touch {NOTICE_FILE}")
    notice = wait_for("the guard to see training save and exit", lambda: (
        lambda n: n if n and n["save"]["state"] != "asking" else None)(guard_notice(ssh, inst, name)), timeout=300)
    log = read_log(ssh, inst, name)
    found = re.search(r"^stopped at step (\d+)$", log, re.M)
    assert found, log[-3000:]
    assert notice["source"] == source
    evac = run_cli("evacuate", str(recipe), inst.host, "--json", home=home)
    assert evac.returncode == 0, evac.stderr
    assert "safe to destroy" in evac.stderr, evac.stderr
    store = recipe.parent / "store" / name
    return Interrupted(log, noticed_at, int(found[1]), notice, json.loads(evac.stdout),
                       json.loads((store / MANIFEST).read_text()), store)


def resume_elsewhere(recipe: Path, inst: sb.Instance, home: Path, ssh: Any, *extra: str) -> tuple[str, str]:
    """`up` on a new instance; returns its stderr and, once the run is done, the training log."""
    name = yaml.safe_load(recipe.read_text())["name"]
    up = run_cli("up", str(recipe), inst.host, *extra, home=home)
    assert up.returncode == 0, up.stderr
    log = log_until(ssh, inst, name, "the resumed run to finish", lambda text: f"done step {STEPS}" in text)
    return up.stderr, log


def test_hf_trainer_jit_checkpoint_on_a_notice_resumes_on_a_new_instance(
        tmp_path, sandbox, ssh, ssh_key, trainer_index, baselines):
    home = tmp_path / "state"
    first = sandbox(index_dir=trainer_index)
    recipe = example_recipe("hf-trainer", tmp_path / "work", ssh_key, first.index_url)
    done = train_and_interrupt(recipe, first, home, ssh)

    # transformers' JIT checkpoint made the save, at the step training was at: it saves before the
    # optimizer step of the step under way (or at a step's end), so at most that one step ran
    # after it; the regular save_steps checkpoint is older
    jit = re.search(r"Saving JIT checkpoint at step (\d+)", done.log)
    assert jit, done.log[-3000:]
    jit_step = int(jit[1])
    assert done.noticed_at <= jit_step <= done.stopped <= jit_step + 1
    assert done.notice["save"]["state"] == "saved" and done.notice["save"]["exit"] == "0"
    # the one step after the JIT save may end on a save_steps boundary: that regular save is then
    # the newest checkpoint, and the one evacuated (a loaded machine lands there now and then)
    saved = done.stopped if done.stopped > jit_step and done.stopped % SAVE_EVERY == 0 else jit_step
    assert done.evacuated["newest"] == f"checkpoint-{saved}" and done.evacuated["newest_step"] == saved
    # the store keeps 2: the JIT save and a regular one (older, or that boundary's save after it)
    steps = [c["step"] for c in done.manifest["checkpoints"]]
    assert steps[-1] == saved and jit_step in steps, steps
    assert any(s % SAVE_EVERY == 0 and s != jit_step for s in steps), steps
    state = json.loads((done.store / f"checkpoint-{saved}" / "trainer_state.json").read_text())
    assert state["global_step"] == saved

    second = sandbox(user="ubuntu", index_dir=trainer_index)
    sb.destroy(first.name)
    up, log = resume_elsewhere(recipe, second, home, ssh)
    assert f"newest verified in the store: checkpoint-{saved} (step {saved})" in up
    assert f"resumed from /home/ubuntu/ckpt/checkpoint-{saved}" in log      # resume_from_checkpoint
    resumed, reference = metrics(log), metrics(baselines.log("hf-trainer"))
    assert min(resumed) == saved + 1                                          # the step counter goes on
    assert_matches(resumed, reference, range(saved + 1, STEPS + 1))
    assert_matches(metrics(done.log), reference, range(1, done.stopped + 1))


def test_lightning_callback_saves_on_a_notice_and_resumes_on_a_new_instance(
        tmp_path, sandbox, ssh, ssh_key, trainer_index, baselines):
    home = tmp_path / "state"
    first = sandbox(index_dir=trainer_index)
    recipe = example_recipe("lightning", tmp_path / "work", ssh_key, first.index_url)
    done = train_and_interrupt(recipe, first, home, ssh)

    # relaunch.train's callback saved at the end of the step training was at, in ModelCheckpoint's
    # folder and name, and nothing trained after it
    name = f"epoch=0-step={done.stopped}.ckpt"
    assert f"saved /root/ckpt/{name} at step {done.stopped}; stopping" in done.log, done.log[-3000:]
    assert done.stopped >= done.noticed_at and max(metrics(done.log)) == done.stopped
    assert done.notice["save"]["state"] == "saved" and done.notice["save"]["exit"] == "0"
    assert done.evacuated["newest"] == name and done.evacuated["newest_step"] == done.stopped
    # keep: 2, the stop's save and the newest regular one before it (under load the notice may land after 20)
    regular = [s for s in range(SAVE_EVERY, done.stopped, SAVE_EVERY)]
    assert [c["step"] for c in done.manifest["checkpoints"]] == [regular[-1], done.stopped]

    second = sandbox(index_dir=trainer_index)
    sb.destroy(first.name)
    up, log = resume_elsewhere(recipe, second, home, ssh)
    assert f"newest verified in the store: {name} (step {done.stopped})" in up
    assert f"resumed from /root/ckpt/{name}" in log                         # trainer.fit(ckpt_path=...)
    resumed, reference = metrics(log), metrics(baselines.log("lightning"))
    assert min(resumed) == done.stopped + 1
    # the same samples at every step after the resume: GlobalBatchSampler continued at the step
    assert_matches(resumed, reference, range(done.stopped + 1, STEPS + 1))
    assert_matches(metrics(done.log), reference, range(1, done.stopped + 1))


def test_accelerate_save_state_on_a_notice_resumes_on_fewer_processes(
        tmp_path, sandbox, ssh, ssh_key, trainer_index, baselines):
    home = tmp_path / "state"
    first = sandbox(index_dir=trainer_index)
    recipe = example_recipe("accelerate", tmp_path / "work", ssh_key, first.index_url)
    done = train_and_interrupt(recipe, first, home, ssh)

    # both processes agreed on the step, saved it with the marker, and nothing trained after it;
    # `accelerate launch` (torchrun underneath) exits 1 after passing a signal on, whatever its
    # processes did: the guard records that exit status as it is
    assert done.stopped >= done.noticed_at and max(metrics(done.log)) == done.stopped
    assert done.log.count("relaunch.train: got SIGTERM") == 2, done.log[-3000:]
    assert done.notice["save"]["state"] == "exited" and done.notice["save"]["exit"] == "1"
    newest = done.manifest["checkpoints"][-1]
    # checkpoint_N counts saves: checkpoint_0 at step 10 (and more if training got past the next
    # save before the notice came, on a loaded machine), then the notice's: the newest, its step
    found = re.fullmatch(r"checkpoints/checkpoint_(\d+)", newest["name"])
    assert found and done.evacuated["newest"] == newest["name"] and int(found[1]) >= 1, newest["name"]
    number = int(found[1])
    marker = json.loads((done.store / newest["name"] / "relaunch-complete.json").read_text())
    assert marker["step"] == done.stopped and marker["processes"] == 2
    assert {Path(p).name for p in newest["files"]} >= {"model.safetensors", "optimizer.bin", "random_states_0.pkl",
                                                        "random_states_1.pkl", "custom_checkpoint_0.pkl"}

    second = sandbox(index_dir=trainer_index)
    sb.destroy(first.name)
    up, log = resume_elsewhere(recipe, second, home, ssh, "--set", "run.nproc_per_node=1")
    assert "world size 2 -> 1: grad_accum 2 -> 4, global batch 16 kept" in up, up
    assert f"resumed from /root/ckpt/{newest['name']} at step {done.stopped} (processes 1, grad_accum 4)" \
        in log, log[-3000:]
    # the resumed run's saves go on after the restored folder's number
    assert f"saved /root/ckpt/checkpoints/checkpoint_{number + 1}" in log
    resumed, reference = metrics(log), metrics(baselines.log("accelerate"))
    assert min(resumed) == done.stopped + 1
    # 1 process and 4 micro-batches see what 2 processes and 2 each saw: the same global batches
    assert_matches(resumed, reference, range(done.stopped + 1, STEPS + 1))
    assert_matches(metrics(done.log), reference, range(1, done.stopped + 1))


def test_relaunch_trainer_callback_saves_at_the_step_without_the_jit_checkpoint(tmp_path, baselines):
    """relaunch.train.TrainerCallback's own save, as with a transformers that has no JIT checkpoint
    (here: `--no-jit`), run here as the recipe runs it: SIGTERM ends in checkpoint-N at the step
    training was at, nothing trained after it, and resume_from_checkpoint continues the losses."""
    env = {**os.environ, "PYTHONPATH": str(train_module_dir(tmp_path)), "OMP_NUM_THREADS": "1"}
    script, out = EXAMPLES / "hf-trainer" / "train.py", tmp_path / "out"
    args = [sys.executable, str(script), "--output_dir", str(out), "--max_steps", str(STEPS), "--save_steps",
            str(SAVE_EVERY)]
    proc = subprocess.Popen([*args, "--sleep", str(SLEEP), "--no-jit"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(f"step {NOTICE_AFTER} "):
                proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, "".join(lines[-40:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = "".join(lines)
    stopped = int(re.search(r"^stopped at step (\d+)$", log, re.M)[1])
    assert f"relaunch.train: signal SIGTERM: saving checkpoint-{stopped}, then stopping" in log, log[-3000:]
    assert "JIT checkpoint" not in log
    assert stopped >= NOTICE_AFTER and max(metrics(log)) == stopped
    assert json.loads((out / f"checkpoint-{stopped}" / "trainer_state.json").read_text())["global_step"] == stopped
    assert (out / f"checkpoint-{SAVE_EVERY}").is_dir()                      # save_steps before it
    again = subprocess.run([*args, "--resume_from_checkpoint", str(out / f"checkpoint-{stopped}")],
                           capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    resumed = metrics(again.stdout)
    assert min(resumed) == stopped + 1
    assert_matches(resumed, metrics(baselines.log("hf-trainer")), range(stopped + 1, STEPS + 1))


def exit_report(folder: Path) -> Path:
    """A folder for PYTHONPATH whose sitecustomize says, as the process exits (its atexit handler
    runs after the program's own), when torch.distributed's process group is still up then, and
    when gloo's threads still run: one of them letting go of a tensor once Python has begun to
    shut down aborts the process ("terminate called without an active exception"), a race that
    only load makes likely, while the threads being there is certain."""
    target = folder / "exit-report"
    target.mkdir(exist_ok=True)
    (target / "sitecustomize.py").write_text(
        "import atexit, os, sys\n\n"
        "def report():\n"
        "    rank = os.environ.get('RANK')\n"
        "    dist = sys.modules.get('torch.distributed')\n"
        "    if dist is not None and dist.is_available() and dist.is_initialized():\n"
        "        print(f'process group still up at exit (rank {rank})', flush=True)\n"
        "    names = []\n"
        "    for task in os.listdir('/proc/self/task'):\n"
        "        try:\n"
        "            with open(f'/proc/self/task/{task}/comm') as comm:\n"
        "                names.append(comm.read().strip())\n"
        "        except OSError:\n"
        "            pass\n"
        "    gloo = sorted(name for name in names if 'gloo' in name)\n"
        "    if gloo:\n"
        "        print(f'gloo threads still running at exit (rank {rank}): {gloo}', flush=True)\n\n"
        "atexit.register(report)\n")
    return target


def worker_pids(launcher: int) -> dict[int, int]:
    """torchrun's worker processes by their RANK, read from their environment."""
    found = {}
    for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ranks = [v for v in environ if v.startswith(b"RANK=")]
        if ranks:
            found[int(ranks[0][5:])] = int(child)
    return found


def test_hf_trainer_under_torchrun_with_one_rank_signalled_saves_on_every_rank_at_one_step(tmp_path):
    """The JIT checkpoint is decided per process: when SIGTERM reaches one rank only (the guard or a
    user signalling one process, torchrun passing it on late), that rank must not leave the save to
    it while the others save. Every rank saves checkpoint-N at the step they agree on, and stops."""
    # ACCELERATE_USE_CPU: the Trainer wraps the model in DDP over gloo (a real two-process run)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(train_module_dir(tmp_path)), str(exit_report(tmp_path))]),
           "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    for key in ("RELAUNCH_NOTICE", "RELAUNCH_STOP_SIGNAL", "RELAUNCH_STARTED"):
        env.pop(key, None)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(EXAMPLES / "hf-trainer" / "train.py"), "--output_dir", str(out), "--max_steps", str(STEPS),
         "--save_steps", str(SAVE_EVERY), "--sleep", str(SLEEP)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
    reader.start()
    workers: dict[int, int] = {}
    try:
        wait_for(f"step {NOTICE_AFTER} under torchrun", lambda: any(
            line.startswith(f"step {NOTICE_AFTER} ") for line in list(lines)) or proc.poll() is not None)
        assert proc.poll() is None, "".join(lines[-40:])
        workers = worker_pids(proc.pid)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGTERM)
        try:
            rc = proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            raise AssertionError("the run hangs after SIGTERM reached rank 1 only:\n" + "".join(lines[-40:])) from None
    finally:
        for pid in [*workers.values(), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        reader.join(timeout=30)
    log = "".join(lines)
    assert rc == 0, log[-3000:]
    # the group ended and its threads joined before Python shuts down: a gloo thread still running
    # then can abort a rank after a good save (now and then; more often under load)
    assert "process group still up at exit" not in log, log[-3000:]
    assert "gloo threads still running at exit" not in log, log[-3000:]
    assert log.count("relaunch.train: got SIGTERM") == 1, log[-3000:]      # rank 1's alone
    assert "JIT checkpoint after" not in log, log[-3000:]                 # transformers' handler not called
    saving = re.findall(r"^relaunch\.train: (.+): saving checkpoint-(\d+), then stopping$", log, re.M)
    assert sorted(reason for reason, _ in saving) == ["signal SIGTERM", "stop requested"], log[-3000:]
    step = int(saving[0][1])
    assert {int(n) for _, n in saving} == {step} and step >= NOTICE_AFTER
    assert re.findall(r"^stopped at step (\d+)$", log, re.M) == [str(step)] * 2, log[-3000:]
    assert max(metrics(log)) == step                                        # nothing trained after it
    # one checkpoint at that step, written by both ranks (each saves its own RNG state)
    assert max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")) == step
    saved = out / f"checkpoint-{step}"
    files = {p.name for p in saved.iterdir()}
    assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors", "optimizer.pt"} <= files, files
    assert json.loads((saved / "trainer_state.json").read_text())["global_step"] == step


MONITORED_RUN = """
import os, signal, sys
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from relaunch import train as relaunch_train

ckpt_dir, signal_at, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.log("worse", float(self.global_step + 1))      # mode min: never improves; max: always
        if self.global_step + 1 == signal_at:                 # the step under way ends at signal_at
            os.kill(os.getpid(), signal.SIGTERM)
        return ((self.net(x) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
        return torch.utils.data.DataLoader(data, batch_size=4)

torch.manual_seed(0)
checkpoints = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}-{step}-{worse:.0f}", monitor="worse", mode=mode,
                              save_top_k=1, every_n_train_steps=5)
trainer = pl.Trainer(max_steps=40, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=[checkpoints, relaunch_train.LightningCallback()])
stop = relaunch_train.install()
trainer.fit(Tiny())
print(f"stopped at step {trainer.global_step}" if stop.requested() else f"done step {trainer.global_step}")
"""


@pytest.mark.parametrize("mode", ["min", "max"])
def test_lightning_callback_saves_the_step_a_monitored_model_checkpoint_skips(tmp_path, mode):
    """ModelCheckpoint with a `monitor` saves a step only when its metric enters the top k: at a
    step on its every_n_train_steps whose metric got worse (mode min) it saves nothing, so the
    stop's save is the callback's own, under the name ModelCheckpoint gives (its metric in it).
    When the metric improved (mode max) ModelCheckpoint's save is the stop's: one file, no `-v1`."""
    script, ckpt = tmp_path / "monitored.py", tmp_path / "ckpt"
    script.write_text(MONITORED_RUN)
    env = {**os.environ, "PYTHONPATH": str(train_module_dir(tmp_path)), "OMP_NUM_THREADS": "1"}
    for key in ("RELAUNCH_NOTICE", "RELAUNCH_STOP_SIGNAL", "RELAUNCH_STARTED"):
        env.pop(key, None)
    run = subprocess.run([sys.executable, str(script), str(ckpt), "10", mode], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "stopped at step 10" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    assert "relaunch.train: got SIGTERM" in run.stderr
    saved = ckpt / "epoch=0-step=10-worse=10.ckpt"
    # save_top_k=1: min keeps step 5's (ModelCheckpoint's best) beside the stop's; max replaced it
    kept = ["epoch=0-step=10-worse=10.ckpt"] + (["epoch=0-step=5-worse=5.ckpt"] if mode == "min" else [])
    assert sorted(p.name for p in ckpt.iterdir()) == kept
    assert f"saved {saved} at step 10; stopping" in run.stderr
    import torch
    assert torch.load(saved, map_location="cpu", weights_only=False)["global_step"] == 10


@pytest.mark.parametrize("trainer", TRAINERS)
def test_example_recipe_runs_its_train_py_where_its_layout_looks(trainer: str, tmp_path: Path) -> None:
    """Each example recipe loads and renders; its command, as the instance's shell splits it on a
    fresh start, runs its own train.py with its checkpoint folder argument at checkpoint.dir and
    an empty resume argument; the Accelerate one passes --multi_gpu only for more than one process."""
    from relaunch.recipe import check_recipe, load_recipe, render_context, render_shell_at

    recipe = load_recipe(EXAMPLES / trainer / "recipe.yaml")
    check_recipe(recipe)
    assert recipe.checkpoint.layout == trainer and recipe.name == f"example-{trainer}"
    assert recipe.env.lock == EXAMPLES / trainer / "requirements.lock"
    assert recipe.env.files == {EXAMPLES / trainer / "train.py": f"{recipe.run.workdir}/train.py"}
    for world in (1, 2):
        text, env = render_shell_at(recipe, "run.command", render_context(recipe, checkpoint="", nproc_per_node=world,
                                                                      grad_accum=16 // (4 * world)))
        argv = subprocess.run(["bash", "-c", "printf '%s\\0' " + text], capture_output=True, check=True,
                              env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env}).stdout
        words = argv.decode().split("\0")[:-1]
        names = ARGS[trainer]
        assert "train.py" in words and words[words.index(names["resume"]) + 1] == ""
        assert words[words.index(names["dir"]) + 1] == recipe.checkpoint.dir.replace("~", str(tmp_path), 1)
        if trainer == "accelerate":
            assert words[:2] == ["accelerate", "launch"] and ("--multi_gpu" in words) == (world > 1)
            assert words[words.index("--num_processes") + 1] == str(world)
            assert words[words.index("--gradient_accumulation_steps") + 1] == str(16 // (4 * world))
        else:
            assert words[:2] == ["python", "train.py"]
