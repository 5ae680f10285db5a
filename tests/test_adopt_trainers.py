"""`relaunch adopt` on the three real trainers (examples/hf-trainer, lightning, accelerate),
each run started by hand as docs/trainers.md tells a user to run it without relaunch.

On a first sandbox instance, over ssh, as a user would: a venv made with uv, the example's lock
installed from the instance's package index, the example's train.py started in tmux with its own
arguments (no resume argument: a fresh start), `from relaunch import train` served from wherever
that user put relaunch: installed in the venv (`pip install relaunch` brings fabric, paramiko ...),
the file copied beside train.py, or a folder on PYTHONPATH. Once the first save is behind it, the
run is held still (SIGSTOP to every process below its tmux pane, walked by parent pid: the
accelerate launcher's processes run in sessions of their own) while `relaunch adopt` reads it,
which changes nothing there (a listing of every file, process and tmux session before and after;
sshd's log of the commands it ran is exactly what adopt says it read). The recipe it wrote is used
without an edit: `relaunch evacuate` says `safe to destroy`, then `relaunch up` on a second instance
(another user: another home) restores that checkpoint, resumes it through the trainer's own resume
argument, and imports relaunch.train from the file `up` puts on PYTHONPATH. The first run goes on
to its end uninterrupted: it is the run the resumed one is compared with, every step's loss and
grad norm to the tolerance of tests/test_trainers.py (1e-4 relative), on the same package versions
and CPU.

The two instances serve the three trainers one after the other (uv's cache on each makes the
second and third installs fast); the package index is the trainers' one (plus relaunch's own
dependencies, which `pip install relaunch` pulls in).
"""

from __future__ import annotations

import base64
import importlib.metadata
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from conftest import SSH, SandboxFactory
from e2e import run_cli, wait_for
from relaunch import sandbox as sb
from test_adopt import snapshot, unwrap
from test_trainers import ARGS, EXAMPLE_LOCK, EXAMPLES, LOCKS, TOLERANCE, close, metrics

REPO = Path(__file__).resolve().parents[1]
STEPS, SAVE_EVERY, SLEEP = 40, 10, 0.1


@dataclass(frozen=True)
class Hand:
    """How the user started one trainer's run on the first instance."""

    trainer: str
    name: str             # the tmux session (and so the recipe's name)
    relaunch: str         # where its `from relaunch import train` comes from: venv | beside | pythonpath
    layout: str
    resume: str           # the trainer's own resume argument, which adopt must add

    @property
    def workdir(self) -> str:
        return f"~/{self.name}"

    @property
    def venv(self) -> str:
        return f"~/venvs/{self.name}"

    @property
    def out(self) -> str:
        return f"~/runs/{self.name}"

    def command(self) -> str:
        """What the user typed in the tmux session: the example's train.py with its own arguments."""
        names = ARGS[self.trainer]
        args = f"{names['dir']} {self.out} {names['steps']} {STEPS} {names['every']} {SAVE_EVERY} --sleep {SLEEP}"
        env = "PYTHONPATH=~/lib " if self.relaunch == "pythonpath" else ""
        if self.trainer == "accelerate":
            program = (f"{self.venv}/bin/accelerate launch --multi_gpu --num_processes 2 --num_machines 1 "
                       "--mixed_precision no --dynamo_backend no train.py "
                       f"{args} --global_batch 16 --micro_batch 4 --gradient_accumulation_steps 2")
        elif self.trainer == "lightning":     # this one activates its venv first
            program = f". {self.venv}/bin/activate && python train.py {args}"
        else:
            program = f"{self.venv}/bin/python train.py {args}"
        return f"cd {self.workdir} && {env}{program} 2>&1 | tee train.log"


RUNS = [Hand("hf-trainer", "hf", "venv", "hf-trainer", "--resume_from_checkpoint"),
        Hand("lightning", "lit", "beside", "lightning", "--ckpt_path"),
        Hand("accelerate", "acc", "pythonpath", "accelerate", "--resume_from_checkpoint")]


def relaunch_requirements() -> list[str]:
    """What `pip install relaunch` brings besides relaunch (as installed here, pinned), leaving out
    what a trainer lock pins already."""
    def normal(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    locked = {normal(line.split("==")[0]) for lock in LOCKS for line in lock.read_text().split()}
    seen, todo, pins = set(), ["relaunch"], []
    while todo:
        key = normal(todo.pop())
        if key in seen:
            continue
        seen.add(key)
        dist = importlib.metadata.distribution(key)
        if key != "relaunch" and key not in locked:
            pins.append(f"{dist.metadata['Name']}=={dist.version}")
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return sorted(pins)


@dataclass
class Boxes:
    first: sb.Instance      # where the runs are started by hand (root)
    second: sb.Instance     # where `up` resumes them (ubuntu)
    wheel: Path             # relaunch's wheel, for the run that installs relaunch in its venv


@pytest.fixture(scope="module")
def boxes(ssh_key: Path, ssh: SSH, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Boxes]:
    index = sb.build_index([EXAMPLE_LOCK, *LOCKS], extra=relaunch_requirements())
    src, wheels = tmp_path_factory.mktemp("relaunch-src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("relaunch", "recipes", "examples", "templates"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "store"))
    # built while the instances boot and the user's uv is installed
    build = subprocess.Popen([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                              str(wheels), str(src)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    factory = SandboxFactory(ssh_key, index)
    try:
        first = factory(index_dir=index, command_log=True, disk="6G")
        second = factory(user="ubuntu", index_dir=index, disk="6G")
        # the user's uv, from the index (as `pip install uv` would bring it)
        ssh(first, f"python3.11 -m venv ~/tools && ~/tools/bin/pip install -q --index-url {first.index_url} uv",
            timeout=300)
        output, _ = build.communicate(timeout=300)
        assert build.returncode == 0, output.decode(errors="replace")
        yield Boxes(first, second, next(wheels.glob("relaunch-*.whl")))
    finally:
        if build.poll() is None:
            build.kill()
            build.wait()
        factory.destroy_all()


def start_by_hand(ssh: SSH, boxes: Boxes, run: Hand) -> None:
    """A venv, the example's lock from the instance's index, train.py, relaunch.train, tmux."""
    inst, uv = boxes.first, "~/tools/bin/uv"
    lock = EXAMPLES / run.trainer / "requirements.lock"
    ssh(inst, f"mkdir -p {run.workdir} && cat > {run.workdir}/requirements.txt", input=lock.read_text())
    ssh(inst, f"cat > {run.workdir}/train.py", input=(EXAMPLES / run.trainer / "train.py").read_text())
    index = f"--index-url {inst.index_url}"
    ssh(inst, f"{uv} venv -q --python /usr/bin/python3.11 {run.venv} && {uv} pip install -q --python "
              f"{run.venv}/bin/python {index} -r {run.workdir}/requirements.txt", timeout=300)
    module = (REPO / "relaunch" / "train.py").read_text()
    if run.relaunch == "venv":              # relaunch itself, with every dependency it has
        ssh(inst, f"base64 -d > ~/{boxes.wheel.name}", input=base64.b64encode(boxes.wheel.read_bytes()).decode())
        ssh(inst, f"{uv} pip install -q --python {run.venv}/bin/python {index} ~/{boxes.wheel.name}", timeout=300)
    elif run.relaunch == "beside":
        ssh(inst, f"mkdir -p {run.workdir}/relaunch && cat > {run.workdir}/relaunch/train.py", input=module)
    else:
        ssh(inst, "mkdir -p ~/lib/relaunch && cat > ~/lib/relaunch/train.py", input=module)
    ssh(inst, f"tmux new-session -d -s {run.name} {shlex.quote(run.command())}")


def tree(ssh: SSH, inst: sb.Instance, session: str) -> list[int]:
    """Every process below the tmux pane of `session`, by parent pid (not by process group or
    session: torchrun's workers have sessions of their own)."""
    found = ssh(inst, f"tmux list-panes -t ={session} -F '#{{pane_pid}}'", check=False).stdout.split()
    if not found:
        return []
    children: dict[int, list[int]] = {}
    for line in ssh(inst, "ps -e -o pid= -o ppid=").stdout.splitlines():
        pid, ppid = map(int, line.split())
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(children.get(int(found[0]), []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return sorted(out)


def hold_after(ssh: SSH, inst: sb.Instance, session: str, log: str, step: int) -> list[int]:
    """SIGSTOP every process below the pane of `session` as soon as `log` shows a step past `step`
    (watched on the instance, every 50 ms, for at most 300 s); their pids."""
    script = (
        f"n=0; until awk '/^step [0-9]+ loss/ {{ if ($2 > {step}) f = 1 }} END {{ exit !f }}' {log} 2>/dev/null; do "
        "n=$((n+1)); [ $n -gt 6000 ] && exit 1; sleep 0.05; done; "
        f"todo=$(tmux list-panes -t ={session} -F '#{{pane_pid}}'); all=; "
        "while [ -n \"$todo\" ]; do next=; for p in $todo; do next=\"$next $(pgrep -P $p)\"; done; "
        "todo=$(echo $next); all=\"$all $todo\"; kill -STOP $todo 2>/dev/null; done; echo $all")
    return sorted(int(pid) for pid in ssh(inst, script, timeout=330).stdout.split())


def signal_all(ssh: SSH, inst: sb.Instance, signal: str, pids: list[int]) -> None:
    if pids:
        ssh(inst, f"kill -{signal} {' '.join(map(str, pids))} 2>/dev/null || true")


def log_of(ssh: SSH, inst: sb.Instance, path: str) -> str:
    return ssh(inst, f"cat {path} 2>/dev/null || true").stdout


def finished(ssh: SSH, inst: sb.Instance, path: str, what: str, session: str) -> str:
    """The log once it says `done step STEPS`; fails at once when the run's session ended without."""
    def look() -> str:
        text = log_of(ssh, inst, path)
        if f"done step {STEPS}" in text:
            return text
        if ssh(inst, f"tmux has-session -t ={session}", check=False).returncode != 0:
            text = log_of(ssh, inst, path)
            if f"done step {STEPS}" not in text:
                raise AssertionError(f"{what} ended before step {STEPS}:\n{text[-3000:]}")
            return text
        return ""
    return wait_for(f"{what} to finish", look, timeout=300)


@pytest.mark.parametrize("run", RUNS, ids=[r.trainer for r in RUNS])
def test_a_trainer_run_started_by_hand_is_adopted_evacuated_and_resumed_elsewhere_without_edits(
        run: Hand, boxes: Boxes, ssh: SSH, ssh_key: Path, tmp_path: Path) -> None:
    first, second, home = boxes.first, boxes.second, tmp_path / "state"
    held: list[int] = []
    try:
        start_by_hand(ssh, boxes, run)
        hand_log = f"{run.workdir}/train.log"
        # the first save (step SAVE_EVERY) is whole once the next step ran; held there, before the
        # next save, by a loop on the instance (from here a loaded machine lets the run finish first)
        held = hold_after(ssh, first, run.name, hand_log, SAVE_EVERY)
        assert held and max(metrics(log_of(ssh, first, hand_log))) < STEPS

        # -- adopt: read-only --------------------------------------------------------------------------
        before = snapshot(ssh, first)
        sent_before = len(sb.commands(first.name))
        out = tmp_path / "adopted" / "recipe.yaml"
        adopted = run_cli("adopt", first.host, "-o", str(out), "--json", "--set", f"ssh.key={ssh_key}",
                          "--set", f"env.index_url={first.index_url}", home=home)
        sent = sb.commands(first.name)[sent_before:]
        assert snapshot(ssh, first) == before               # not one file, process or session changed
        assert adopted.returncode == 0, adopted.stderr
        report = json.loads(adopted.stdout)
        assert Counter(unwrap(c) for c in sent) == Counter(report["reads"])

        recipe = yaml.safe_load(out.read_text())
        facts = {f["key"]: f for f in report["facts"]}
        assert recipe["name"] == run.name and recipe["env"]["venv"] == run.venv
        assert recipe["checkpoint"]["dir"] == run.out and not facts["checkpoint.dir"]["guess"]
        assert recipe["checkpoint"]["layout"] == run.layout
        # the trainer's own resume argument, which the hand-started run did not pass
        command = recipe["run"]["command"]
        assert f'{{% if checkpoint %}}{run.resume} "{{{{ checkpoint }}}}"{{% endif %}}' in command
        # relaunch.train: not in the lock (nor relaunch's dependencies), not among the files; `up` gives it
        lock = (out.parent / "requirements.lock").read_text().split("\n")
        assert sorted(x for x in lock if x and not x.startswith("#")) == \
            sorted((EXAMPLES / run.trainer / "requirements.lock").read_text().split())
        assert recipe["env"]["files"] == {"train.py": f"{run.workdir}/train.py"}
        assert facts["relaunch.train"]["value"] == "from `up`"
        came = {"venv": f"relaunch {importlib.metadata.version('relaunch')} in the venv",
                "beside": f"{run.workdir}/relaunch/train.py, a copy beside the program",
                "pythonpath": "its PYTHONPATH (~/lib)"}[run.relaunch]
        assert came in facts["relaunch.train"]["evidence"], facts["relaunch.train"]
        if run.relaunch == "venv":
            assert "fabric" in facts["relaunch.train"]["evidence"] and "paramiko" in facts["relaunch.train"]["evidence"]
        if run.trainer == "accelerate":
            # --num_processes counts every process of every machine; --multi_gpu refuses one process
            assert command.startswith("accelerate launch {% if world_size > 1 %}--multi_gpu{% endif %} "
                                      "--num_processes {{ world_size }} --num_machines 1 ")
            assert recipe["run"]["nproc_per_node"] == 2
            assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in recipe["env"].get("vars", {})
            for world in (1, 2):
                words = rendered_words(out, world)
                assert ("--multi_gpu" in words) == (world > 1)
                assert words[words.index("--num_processes") + 1] == str(world)

        # -- evacuate: safe to destroy -----------------------------------------------------------------
        evacuated = run_cli("evacuate", str(out), first.host, "--json", home=home)
        assert evacuated.returncode == 0, evacuated.stderr
        assert f"safe to destroy {first.host}" in evacuated.stderr
        newest = json.loads(evacuated.stdout)["newest"]
        signal_all(ssh, first, "CONT", held)
        held = []

        # -- up on another instance: resumes through the trainer's own argument -------------------------
        up = run_cli("up", str(out), second.host, home=home)
        assert up.returncode == 0, up.stderr
        resumed_log = finished(ssh, second, f"~/{run.name}.log", "the resumed run", run.name)
        assert f"resumed from {second.home}/runs/{run.name}/{newest}" in resumed_log, resumed_log[-3000:]
        # its relaunch.train is the file `up` put on PYTHONPATH: the venv (rebuilt from the lock) has
        # none, and no copy of the first instance's came along
        bare = ssh(second, f"{run.venv}/bin/python -c 'import relaunch'", check=False)
        assert bare.returncode != 0 and "No module named 'relaunch'" in bare.stderr, bare
        assert ssh(second, f"test -e {run.workdir}/relaunch", check=False).returncode != 0
        assert ssh(second, f"test -f ~/.relaunch/{run.name}/python/relaunch/train.py", check=False).returncode == 0

        # -- the losses: equal to the uninterrupted run's (the hand-started one, left to finish) ------
        reference = metrics(finished(ssh, first, hand_log, "the hand-started run", run.name))
        resumed = metrics(resumed_log)
        start = min(resumed)
        assert SAVE_EVERY < start <= STEPS                  # it resumed: no fresh start at step 1
        for step in range(start, STEPS + 1):
            got, want = resumed[step], reference[step]
            assert close(got[0], want[0]) and close(got[1], want[1]), (step, got, want, TOLERANCE)
    finally:
        signal_all(ssh, first, "CONT", held)
        for inst in (first, second):                      # this run's processes, whatever state they are in
            signal_all(ssh, inst, "KILL", tree(ssh, inst, run.name))
            ssh(inst, f"tmux kill-session -t ={run.name}; tmux kill-session -t ={run.name}-guard; true",
                check=False)


def rendered_words(recipe_path: Path, world: int) -> list[str]:
    """run.command as the instance's shell splits it on a fresh start with `world` processes."""
    from relaunch.recipe import load_recipe, render_context, render_shell_at

    recipe = load_recipe(recipe_path)
    text, env = render_shell_at(recipe, "run.command", render_context(recipe, checkpoint="", nproc_per_node=world))
    argv = subprocess.run(["bash", "-c", "printf '%s\\0' " + text], capture_output=True, check=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/home/u", **env}).stdout
    return argv.decode().split("\0")[:-1]
