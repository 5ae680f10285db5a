"""The example training job (examples/pytorch/train.py), run for real as a subprocess.

What relaunch promises rests on these: resuming from any checkpoint the job wrote gives
bit-identical final weights, every checkpoint it reports is complete by its layout's marker,
SIGTERM saves and exits 0, --keep-last rotates.

Importing torch is most of each run's cost, so a module fixture per layout starts every run that
does not depend on another at once (reacting to their output from threads that only record what
they saw), then every resume at once; the tests assert on what was recorded.
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
import threading
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest

from relaunch.recipe import check_recipe, load_recipe, render_context, render_shell_at

pytestmark = pytest.mark.sandbox  # trains with torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pytorch"
TRAIN = EXAMPLE / "train.py"
LAYOUTS = ("files", "hf-trainer", "dcp")
RECIPES = {"recipe.yaml": "files", "recipe-hf-trainer.yaml": "hf-trainer", "recipe-dcp.yaml": "dcp"}
NAME = {"files": "ckpt-{:08d}.pt", "hf-trainer": "checkpoint-{}", "dcp": "step-{}"}
NAME_RE = {"files": r"ckpt-(\d+)\.pt", "hf-trainer": r"checkpoint-(\d+)", "dcp": r"step-(\d+)"}
STEPS, EVERY = 16, 8  # the reference run saves at 8 and 16
TIMEOUT = 120


@dataclass
class Result:
    rc: int
    out: str
    err: str

    def lines(self, prefix: str) -> list[str]:
        return [ln for ln in self.out.splitlines() if ln.startswith(prefix)]


def start(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(TRAIN), *map(str, args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finish(*procs: subprocess.Popen[str]) -> list[Result]:
    results = []
    for p in procs:
        out, err = p.communicate(timeout=TIMEOUT)
        results.append(Result(p.returncode, out, err))
    return results


def is_complete(path: Path, layout: str, step: int) -> bool:
    """Complete by the layout's own rule, as relaunch judges it (FACTS.md)."""
    if layout == "files":  # no marker: the whole zip under its final name, no .tmp left behind
        return path.is_file() and zipfile.is_zipfile(path) and not Path(f"{path}.tmp").exists()
    if layout == "hf-trainer":
        # written in place, last: a run killed between creating and writing it leaves it empty (not complete)
        state = path / "trainer_state.json"
        try:
            saved = json.loads(state.read_text())["global_step"] if state.is_file() else None
        except ValueError:
            return False
        return saved == step and all((path / f).is_file() for f in ("model.pt", "optimizer.pt", "rng_state.pth"))
    return (path / ".metadata").is_file() and any(path.glob("*.distcp"))


def checkpoints(out: Path, layout: str) -> dict[int, Path]:
    found = {}
    for entry in out.iterdir():
        m = re.fullmatch(NAME_RE[layout], entry.name)
        if m:
            found[int(m.group(1))] = entry
    return dict(sorted(found.items()))


def final_hash(path: Path) -> str:
    text = path.read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", text), text
    return text


@dataclass
class Live:
    """A run whose stdout is read line by line as it is printed, by a thread that may signal it."""

    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    # For each "saved <path>" line, seen while the run went on: the path, whether it was complete
    # at that moment, and which checkpoints were in --out then.
    saved: list[tuple[Path, bool, list[int]]] = field(default_factory=list)
    err: str = ""
    rc: int | None = None


def watch(live: Live, layout: str, out: Path, *, term_after: str = "", kill_after_saves: int = 0
          ) -> threading.Thread:
    def read() -> None:
        assert live.proc.stdout is not None and live.proc.stderr is not None
        for raw in live.proc.stdout:
            line = raw.rstrip("\n")
            live.lines.append(line)
            if line.startswith("saved "):
                path = Path(line.split(" ", 1)[1])
                step = int(re.findall(r"\d+", path.name)[-1])
                live.saved.append((path, is_complete(path, layout, step), list(checkpoints(out, layout))))
                if len(live.saved) == kill_after_saves:
                    live.proc.kill()  # like a preempted instance: no chance to clean up
            if term_after and line.startswith(term_after):
                live.proc.send_signal(signal.SIGTERM)
        live.err = live.proc.stderr.read()
        live.rc = live.proc.wait(timeout=TIMEOUT)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


@dataclass
class Runs:
    layout: str
    tmp: Path
    ref: Result             # uninterrupted, every checkpoint kept
    final: str              # its --final hash
    seed1: str | None       # the same run with --seed 1 (files layout only)
    stopped: Live           # SIGTERM after step 3, no regular saves before the end
    killed: Live            # --save-every 2 --keep-last 2, SIGKILL after the third save (step 6)
    resumed: dict[str, tuple[Result, str]]   # resume path -> (run, its --final hash)


@pytest.fixture(scope="module", params=LAYOUTS)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    layout = request.param
    tmp = tmp_path_factory.mktemp(layout)
    train = ("--layout", layout, "--steps", STEPS)

    # Phase 1: everything that starts from scratch, at once.
    ref_proc = start("--out", tmp / "ref", *train, "--save-every", EVERY, "--final", tmp / "ref.sha256")
    seed_proc = None
    if layout == "files":  # the hash does not depend on the layout; one check is enough
        seed_proc = start("--out", tmp / "seed1", *train, "--save-every", EVERY, "--seed", 1,
                          "--final", tmp / "seed1.sha256")
    # --save-every beyond --steps: the only checkpoint before the end is the one SIGTERM asks for.
    stopped = Live(start("--out", tmp / "stop", *train, "--save-every", 1000, "--sleep", 0.2))
    killed = Live(start("--out", tmp / "kill", *train, "--save-every", 2, "--sleep", 0.2, "--keep-last", 2))
    threads = [watch(stopped, layout, tmp / "stop", term_after="step 3 "),
               watch(killed, layout, tmp / "kill", kill_after_saves=3)]
    (ref,) = finish(ref_proc)
    seed1 = None
    if seed_proc is not None:
        (seed_run,) = finish(seed_proc)
        assert seed_run.rc == 0, seed_run.err
        seed1 = final_hash(tmp / "seed1.sha256")
    for t, live in zip(threads, (stopped, killed), strict=True):
        t.join(TIMEOUT)
        if live.proc.poll() is None:  # hung: leave no stray process behind (the tests will fail)
            live.proc.kill()
    assert ref.rc == 0, ref.err

    # Phase 2: resume from every checkpoint the reference run kept, and from the SIGTERM one.
    sources = list(checkpoints(tmp / "ref", layout).values()) + list(checkpoints(tmp / "stop", layout).values())
    procs = [start("--out", tmp / f"resume{i}", *train, "--save-every", EVERY, "--resume", src,
                   "--final", tmp / f"resume{i}.sha256") for i, src in enumerate(sources)]
    resumed = {}
    for i, (src, r) in enumerate(zip(sources, finish(*procs), strict=True)):
        assert r.rc == 0, r.err
        resumed[str(src)] = (r, final_hash(tmp / f"resume{i}.sha256"))
    return Runs(layout, tmp, ref, final_hash(tmp / "ref.sha256"), seed1, stopped, killed, resumed)


def test_uninterrupted_run(runs: Runs) -> None:
    out, lines = runs.tmp / "ref", runs.ref.out.splitlines()
    assert lines[0] == "fresh start"
    assert runs.ref.lines("saved ") == [f"saved {out / NAME[runs.layout].format(s)}" for s in (8, 16)]
    assert lines[-1] == f"done step {STEPS}"
    assert len(runs.ref.lines("step ")) == STEPS
    assert "Traceback" not in runs.ref.err and "Warning" not in runs.ref.err, runs.ref.err
    found = checkpoints(out, runs.layout)
    assert list(found) == [8, 16]
    assert all(is_complete(p, runs.layout, s) for s, p in found.items())
    assert [p.name for p in out.iterdir() if p.name.endswith(".tmp")] == []
    if runs.seed1 is not None:  # another seed gives other weights: the hash really depends on them
        assert runs.seed1 != runs.final


def test_resume_from_each_checkpoint_is_bit_identical(runs: Runs) -> None:
    ref_losses = runs.ref.lines("step ")
    assert len(runs.resumed) == 3  # steps 8 and 16 of the reference, and the SIGTERM checkpoint
    for src, (r, final) in runs.resumed.items():
        m = re.fullmatch(rf"resumed from {re.escape(src)} at step (\d+)", r.out.splitlines()[0])
        assert m, r.out.splitlines()[0]
        step = int(m.group(1))
        # The steps after the checkpoint are replayed exactly, loss for loss.
        assert r.lines("step ") == ref_losses[step:]
        assert r.out.splitlines()[-1] == f"done step {STEPS}"
        assert final == runs.final, f"resumed from {src}"


def test_sigterm_finishes_the_step_saves_and_exits_0(runs: Runs) -> None:
    live, out = runs.stopped, runs.tmp / "stop"
    assert live.rc == 0, live.err
    m = re.fullmatch(r"stopped at step (\d+)", live.lines[-1])
    assert m, live.lines[-3:]
    stopped = int(m.group(1))
    assert 3 <= stopped < STEPS
    path = out / NAME[runs.layout].format(stopped)
    assert live.lines[-2] == f"saved {path}"
    assert list(checkpoints(out, runs.layout)) == [stopped]
    assert is_complete(path, runs.layout, stopped)
    assert not any(ln.startswith("done") for ln in live.lines)
    # (test_resume_from_each_checkpoint_is_bit_identical resumes from it.)


def test_reported_checkpoints_are_complete_and_keep_last_rotates(runs: Runs) -> None:
    live, out = runs.killed, runs.tmp / "kill"
    assert live.rc == -signal.SIGKILL, live.err
    assert [p for p, _, _ in live.saved] == [out / NAME[runs.layout].format(s) for s in (2, 4, 6)]
    for (path, complete, present), step in zip(live.saved, (2, 4, 6), strict=True):
        # Read while training went on: "saved" is printed only once the marker is there, and
        # after --keep-last 2 removed everything older than the previous checkpoint. (A newer
        # one may already be on its way; the two steps of --sleep between saves make it rare.)
        assert complete, path
        assert min(present) >= step - 2, present
    # What a preempted instance leaves: the two newest complete checkpoints, and maybe a partial
    # one (or, killed between writing a checkpoint and rotating, three complete ones).
    left = [s for s, p in checkpoints(out, runs.layout).items() if is_complete(p, runs.layout, s)]
    assert 2 <= len(left) <= 3 and left[0] >= 4, left
    assert left == list(range(left[0], left[-1] + 1, 2)), left


def test_bad_resume_is_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "checkpoint-5").mkdir()  # a folder without its marker: not complete
    (tmp_path / "checkpoint-5" / "model.pt").write_bytes(b"")
    (tmp_path / "ckpt-00000005.pt").write_bytes(b"PK\x03\x04 truncated")
    cases = [tmp_path / "missing.pt", tmp_path / "checkpoint-5", tmp_path / "ckpt-00000005.pt"]
    results = finish(*(start("--out", tmp_path / "out", "--resume", c) for c in cases))
    for case, r in zip(cases, results, strict=True):
        assert r.rc == 2
        assert "Traceback" not in r.err
        assert r.err.startswith(f"error: --resume {case}: "), r.err
        assert len(r.err.strip().splitlines()) == 1, r.err
        assert "step " not in r.out


def _load_train_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_train", TRAIN)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("recipe_file", sorted(RECIPES))
def test_example_recipe_matches_train_py(recipe_file: str, tmp_path: Path) -> None:
    recipe = load_recipe(EXAMPLE / recipe_file)
    check_recipe(recipe)  # every template renders
    layout = RECIPES[recipe_file]
    assert recipe.checkpoint.layout == layout
    assert recipe.name == {"files": "example", "hf-trainer": "example-hf", "dcp": "example-dcp"}[layout]
    assert Path(recipe.checkpoint.remote) == EXAMPLE / "store" / recipe.name
    assert recipe.env.lock == EXAMPLE / "requirements.lock"
    assert recipe.env.files == {TRAIN: f"{recipe.run.workdir}/train.py"}
    # The command as the instance's shell would split it on a fresh start (empty checkpoint),
    # parsed by train.py's own parser: it writes where relaunch looks, in the layout it expects,
    # and the empty checkpoint arrives as an empty --resume (a fresh start), not a missing one.
    text, env = render_shell_at(recipe, "run.command", render_context(recipe, checkpoint=""))
    argv = subprocess.run(["bash", "-c", "printf '%s\\0' " + text], capture_output=True, check=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env}).stdout
    words = argv.decode().split("\0")[:-1]
    assert words[:2] == ["python", "train.py"]
    args = _load_train_module().build_parser().parse_args(words[2:])
    assert args.layout == layout
    assert args.resume == ""
    assert args.out == recipe.checkpoint.dir.replace("~", str(tmp_path), 1)
