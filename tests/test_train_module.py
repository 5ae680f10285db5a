"""relaunch.train without instances: the sampler's data order, the stop request, the completion marker.

The data order: the samples of each global step depend on the seed, the step and the global batch
only. A run on 4 ranks interrupted at step k and resumed on 2 (grad_accum doubled, the global
batch kept) trains every step on exactly the multiset of samples the uninterrupted run does.
"""

from __future__ import annotations

import ast
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e import wait_for
from relaunch import train
from relaunch.layouts import LISTING_COMMAND, complete_checkpoints, parse_listing
from relaunch.train import COMPLETE_MARKER, GlobalBatchSampler, StopRequest

REPO = Path(__file__).resolve().parents[1]
MODULE = REPO / "relaunch" / "train.py"
GUARD = REPO / "templates" / "guard.py"


def rank_batches(sampler: GlobalBatchSampler) -> dict[int, list[int]]:
    """What one rank's DataLoader draws, cut into its share of each global step."""
    drawn = list(sampler)
    share = sampler.per_rank
    steps = range(sampler.start_step + 1, sampler.steps + 1)
    assert len(drawn) == share * len(steps)
    return {step: drawn[i * share:(i + 1) * share] for i, step in enumerate(steps)}


def per_step(world: int, global_batch: int, steps: int, start: int = 0, n: int = 200,
             seed: int = 0) -> dict[int, Counter[int]]:
    """The multiset of samples every global step trains on, all ranks of `world` together."""
    seen: dict[int, Counter[int]] = {}
    for rank in range(world):
        sampler = GlobalBatchSampler(n, global_batch, steps=steps, seed=seed, rank=rank, world_size=world,
                                     start_step=start)
        for step, ids in rank_batches(sampler).items():
            seen.setdefault(step, Counter()).update(ids)
    return seen


def test_four_ranks_resumed_on_two_see_the_uninterrupted_runs_samples_every_step() -> None:
    steps, k, global_batch = 30, 11, 16
    uninterrupted = per_step(4, global_batch, steps)
    before = per_step(4, global_batch, k)                 # 4 ranks until the checkpoint at step k
    after = per_step(2, global_batch, steps, start=k)     # 2 ranks from there, twice the accumulation
    assert sorted(before) == list(range(1, k + 1)) and sorted(after) == list(range(k + 1, steps + 1))
    resumed = {**before, **after}
    assert resumed == uninterrupted
    assert all(sum(c.values()) == global_batch for c in resumed.values())
    # none twice, none skipped: over the run the stream is whole epochs of every sample once each
    stream = Counter()
    for c in resumed.values():
        stream.update(c)
    assert len(stream) == 200 and set(stream.values()) <= {2, 3}        # 480 positions = 2.4 epochs
    # and the world size never mattered: 1, 2, 4 and 8 ranks, resumed anywhere
    for world in (1, 2, 8):
        assert per_step(world, global_batch, steps) == uninterrupted
        assert {**per_step(world, global_batch, 7), **per_step(4, global_batch, steps, start=7)} == uninterrupted


def test_every_sample_once_per_epoch_and_epochs_differ() -> None:
    n, g = 100, 16          # not a multiple: a global batch spans two epochs
    s = GlobalBatchSampler(n, g, steps=25, seed=3)
    positions = [s.sample(p) for p in range(3 * n)]
    epochs = [positions[e * n:(e + 1) * n] for e in range(3)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert s.global_batch_of(7) == positions[6 * g:7 * g]                # step 7 straddles epochs 0 and 1
    assert s.global_batch_of(7) == s.indices(7)
    # ranks split a step into disjoint contiguous shares
    ranks = [GlobalBatchSampler(n, g, steps=25, seed=3, rank=r, world_size=4).indices(7) for r in range(4)]
    assert sum(ranks, []) == s.global_batch_of(7)


def test_the_order_is_the_seeds_and_the_same_everywhere() -> None:
    a = GlobalBatchSampler(1000, 8, steps=5, seed=0)
    assert a.global_batch_of(1) == GlobalBatchSampler(1000, 8, steps=99, seed=0, world_size=2).global_batch_of(1)
    assert a.global_batch_of(1) != GlobalBatchSampler(1000, 8, steps=5, seed=1).global_batch_of(1)
    # pinned: a resume after an upgrade of relaunch must see the order the run began with
    assert a.global_batch_of(1) == [323, 492, 976, 392, 217, 653, 742, 457]
    assert GlobalBatchSampler(1000, 8, steps=5, shuffle=False).global_batch_of(2) == list(range(8, 16))
    # no list of every sample is made: a billion samples cost nothing
    big = GlobalBatchSampler(10**9, 64, steps=10, seed=5)
    ids = big.global_batch_of(10)
    assert len(set(ids)) == 64 and all(0 <= i < 10**9 for i in ids)


def test_len_is_the_whole_runs_and_bad_shapes_are_refused() -> None:
    s = GlobalBatchSampler(100, 16, steps=10, rank=1, world_size=2, start_step=4, micro_batch=4)
    assert len(s) == 80 and len(list(s)) == 48 and s.grad_accum == 2
    with pytest.raises(ValueError, match="does not split over world size 3"):
        GlobalBatchSampler(100, 16, steps=10, world_size=3)
    with pytest.raises(ValueError, match="micro batch 3 does not divide"):
        GlobalBatchSampler(100, 16, steps=10, world_size=2, micro_batch=3)
    with pytest.raises(ValueError, match="rank 2 is not one of world size 2"):
        GlobalBatchSampler(100, 16, steps=10, rank=2, world_size=2)
    with pytest.raises(ValueError, match="start_step 11"):
        GlobalBatchSampler(100, 16, steps=10, start_step=11)


def test_a_torch_dataloader_draws_the_steps_micro_batches() -> None:
    torch = pytest.importorskip("torch")
    data = torch.utils.data.TensorDataset(torch.arange(200))
    s = GlobalBatchSampler(200, 16, steps=6, rank=1, world_size=2, start_step=2, micro_batch=4)
    batches = [b[0].tolist() for b in torch.utils.data.DataLoader(data, batch_size=4, sampler=s)]
    assert len(batches) == 4 * 2                                       # steps 3..6, grad_accum 2
    assert sum(batches[:2], []) == s.indices(3) and sum(batches[-2:], []) == s.indices(6)


def test_the_module_needs_nothing_but_the_standard_library(tmp_path: Path) -> None:
    """As `up` delivers it: relaunch/train.py alone on PYTHONPATH, a venv without relaunch."""
    tree = ast.parse(MODULE.read_text())
    top = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    top |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    assert top - {"__future__"} <= set(sys.stdlib_module_names), top
    (tmp_path / "relaunch").mkdir()
    shutil.copy(MODULE, tmp_path / "relaunch" / "train.py")
    code = ("import sys; from relaunch import train; "
            "train.GlobalBatchSampler(10, 2, steps=3).indices(1); train.StopRequest().requested(); "
            "print(train.__file__, sorted(m for m in ('torch', 'transformers', 'lightning', 'accelerate', "
            "'relaunch.cli', 'fabric') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); {code}"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(tmp_path / "relaunch" / "train.py"), "[]"]


@pytest.fixture
def usr1(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[StopRequest, list[int]]]:
    """A StopRequest on SIGUSR1, over a handler a script set before it (its calls listed)."""
    calls: list[int] = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    monkeypatch.setenv(train.STOP_SIGNAL_ENV, "USR1")
    monkeypatch.delenv(train.NOTICE_ENV, raising=False)
    stop = StopRequest()
    try:
        yield stop, calls
    finally:
        stop.uninstall()
        signal.signal(signal.SIGUSR1, before)


def test_the_stop_signal_is_seen_and_the_handler_before_it_still_runs(usr1) -> None:
    stop, calls = usr1
    assert stop.signals == [signal.SIGUSR1]
    stop.install()
    stop.install()                                  # twice: still one handler, no loop
    assert not stop.requested() and stop.reason == ""
    os.kill(os.getpid(), signal.SIGUSR1)
    assert stop.requested() and stop.reason == "signal SIGUSR1" and calls == [signal.SIGUSR1]


def test_letting_go_of_chained_handlers_frees_their_owners_and_the_stop_still_counts(usr1) -> None:
    """The HF callback lets go of transformers' JIT handler as training ends: chained, that bound
    method kept the Trainer alive (its DDP model, its process group's gloo threads) into Python's
    shutdown. A handler of a signal a library took over since can never be chained to: let go too."""
    stop, calls = usr1

    class Owner:
        def handle(self, signum: int, frame: object) -> None:
            calls.append(-signum)

    owner = Owner()
    signal.signal(signal.SIGUSR1, owner.handle)
    stop.install()
    chained = weakref.ref(owner)
    del owner
    gc.collect()
    assert chained() is not None                      # chained: alive
    stop.let_go(lambda handler: False)
    assert chained() is not None                      # not picked, still on top: still chained
    stop.let_go(lambda handler: type(getattr(handler, "__self__", None)) is Owner)
    gc.collect()
    assert chained() is None
    os.kill(os.getpid(), signal.SIGUSR1)
    assert stop.requested() and calls == []          # seen, passed on to nobody
    stop.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL

    other = Owner()
    signal.signal(signal.SIGUSR1, other.handle)
    stop.install()
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)   # a library takes the signal over
    chained = weakref.ref(other)
    del other
    stop.let_go(lambda handler: False)
    gc.collect()
    assert chained() is None


def test_installing_again_with_chain_false_stops_passing_the_signal_on(usr1) -> None:
    """The Lightning callback installs chained in setup() and unchained in on_train_start(), the HF
    one unchained under torchrun over a handler a script already installed: the second call counts."""
    stop, calls = usr1
    stop.install()
    stop.install(chain=False)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert stop.requested() and calls == []
    stop.install(chain=True)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert calls == [signal.SIGUSR1]


def test_the_stop_signal_during_a_write_to_stderr_is_said_and_training_goes_on() -> None:
    """The signal lands while the main thread is inside a write to sys.stderr, holding its buffer's
    lock (a notice's line, a progress bar): the handler's own line must not go through that buffer
    again (RuntimeError "reentrant call", which ended a Lightning training in a CI run instead of
    saving it). The child's stderr sends its bytes on through Python code that sends the signal,
    so the handler runs inside that write every time."""
    code = """
import io, os, signal, sys
from relaunch import train

class Raw(io.RawIOBase):
    landed = False

    def writable(self):
        return True

    def write(self, data):
        if not Raw.landed:
            Raw.landed = True
            os.kill(os.getpid(), signal.SIGUSR1)     # handled before the next line: inside this write
        return os.write(2, bytes(data))

sys.stderr = io.TextIOWrapper(io.BufferedWriter(Raw()), line_buffering=True)
stop = train.StopRequest(signals=["USR1"], notice_file="", started=0.0).install()
train._line(sys.stderr, "a line the signal interrupts")
print("requested" if stop.requested() else "not requested", flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    assert proc.stdout == b"requested\n"
    assert sorted(proc.stderr.decode().splitlines()) == [
        "a line the signal interrupts", "relaunch.train: got SIGUSR1: training is asked to save and exit"]


def test_the_guards_notice_record_counts_only_for_this_run(tmp_path: Path) -> None:
    record = tmp_path / "notice.json"
    stop = StopRequest(signals=["USR2"], notice_file=str(record), started=1000.0)
    assert not stop.requested()
    record.write_text("not json")
    assert not StopRequest(signals=["USR2"], notice_file=str(record), started=1000.0).requested()
    record.write_text(json.dumps({"source": "aws", "detail": "spot terminate", "seen_at": 999.0, "deadline": 1100.0}))
    assert not StopRequest(signals=["USR2"], notice_file=str(record), started=1000.0).requested()   # an older run's
    record.write_text(json.dumps({"source": "aws", "detail": "spot terminate", "seen_at": 1001.0,
                                  "deadline": 1100.0}))
    fresh = StopRequest(signals=["USR2"], notice_file=str(record), started=1000.0)
    assert fresh.requested() and fresh.reason == "notice from aws: spot terminate" and fresh.deadline() == 1100.0


def test_a_record_written_by_the_real_guard_stops_a_training_that_got_no_signal(tmp_path: Path) -> None:
    """templates/guard.py as `up` runs it, with a `file:` source: its notice.json alone (the signal
    goes nowhere here) makes a loop using relaunch.train stop, and the record of a guard that ran
    before this training started does not."""
    (tmp_path / "python" / "relaunch").mkdir(parents=True)
    shutil.copy(MODULE, tmp_path / "python" / "relaunch" / "train.py")
    folder, source = tmp_path / "guard", tmp_path / "reclaim"
    config = {"name": "t", "host": "root@test", "folder": str(folder), "session": f"no-such-session-{os.getpid()}",
              "pgid_file": str(tmp_path / "pgid"), "status_file": str(tmp_path / "status"),
              "sources": [f"file:{source}"], "every": 0.2, "signal": "TERM", "stop_timeout": 5, "windows": {}}
    (tmp_path / "guard.json").write_text(json.dumps(config))
    env = {**os.environ, "TMUX_TMPDIR": str(tmp_path), "PYTHONPATH": str(tmp_path / "python"),
           train.NOTICE_ENV: str(folder / "notice.json"), train.STOP_SIGNAL_ENV: "USR2"}

    def guard() -> None:
        subprocess.run([sys.executable, str(GUARD), str(tmp_path / "guard.json")], env=env, timeout=60, check=True)

    source.touch()
    guard()                                     # an earlier run's notice, left on the instance
    assert json.loads((folder / "notice.json").read_text())["save"]["state"] == "not running"
    loop = ("import time; from relaunch import train\n"
            "stop = train.install()\n"
            "for step in range(1, 600):\n"
            "    if stop.requested(): print('stopped at step', step, stop.reason, flush=True); break\n"
            "    if step == 3: print('running', flush=True)\n"
            "    time.sleep(0.05)\n")
    started = int(time.time()) + 1              # this run started a second after the old record
    training = subprocess.Popen([sys.executable, "-c", loop], stdout=subprocess.PIPE, text=True,
                                env={**env, train.STARTED_ENV: str(started)})
    try:
        assert training.stdout is not None and training.stdout.readline() == "running\n"   # the old record: no stop
        # the guard stamps its record with this machine's clock: a record of this run comes after its start
        wait_for(f"the clock to pass the run's start ({started})", lambda: time.time() > started, timeout=10,
                 every=0.05)
        guard()
        out = training.communicate(timeout=60)[0]
    finally:
        if training.poll() is None:
            training.kill()
            training.wait()
    assert out.startswith("stopped at step ") and f"notice from file:{source}: {source} appeared" in out, out


def test_a_sigterm_landing_inside_the_guards_wait_is_recorded_as_the_notice(tmp_path: Path) -> None:
    """templates/guard.py with the `sigterm` source (a shutdown sends every process SIGTERM). The
    SIGTERM lands at the one moment its handler could hang on: the main thread inside
    `noticed.wait()` holding that Event's lock. A trace function sends it there, so that moment
    comes every time; the guard must still record the notice and end."""
    folder = tmp_path / "guard"
    session = f"relaunch-test-guard-{os.getpid()}"
    config = {"name": "t", "host": "root@test", "folder": str(folder), "session": session,
              "pgid_file": str(tmp_path / "pgid"), "status_file": str(tmp_path / "status"),
              "sources": ["sigterm"], "every": 0.2, "signal": "TERM", "stop_timeout": 2, "windows": {}}
    (tmp_path / "guard.json").write_text(json.dumps(config))
    env = {**os.environ, "TMUX_TMPDIR": str(tmp_path)}
    wrapper = f"""
import inspect, os, runpy, signal, sys, threading

lines, first = inspect.getsourcelines(threading.Event.wait)
held = first + next(i for i, line in enumerate(lines) if "signaled = self._flag" in line)   # the lock is held
sent = []

def at_line(frame, event, arg):
    caller = frame.f_back
    if (event == "line" and frame.f_lineno == held and not sent and caller is not None
            and caller.f_code.co_name == "main" and caller.f_code.co_filename == {str(GUARD)!r}):
        sent.append(1)
        os.kill(os.getpid(), signal.SIGTERM)
    return at_line

sys.settrace(lambda frame, event, arg: at_line if frame.f_code is threading.Event.wait.__code__ else None)
sys.argv = [{str(GUARD)!r}, {str(tmp_path / "guard.json")!r}]
runpy.run_path({str(GUARD)!r}, run_name="__main__")
"""
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "sleep 600"], env=env, check=True, timeout=30)
    guard = subprocess.Popen([sys.executable, "-c", wrapper], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        out, err = guard.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        guard.kill()
        out, err = guard.communicate()
        pytest.fail("the guard hung after a SIGTERM inside its wait: no notice recorded in 60 s")
    finally:
        subprocess.run(["tmux", "kill-server"], env=env, capture_output=True, timeout=30)
    assert guard.returncode == 0, err
    record = json.loads((folder / "notice.json").read_text())
    assert record["source"] == "sigterm" and record["kind"] == "sigterm", record
    assert "notice from sigterm handled" in (folder / "guard.log").read_text()


def test_marked_folders_are_complete_for_the_accelerate_layout(tmp_path: Path) -> None:
    """The marker as written, read back through the real listing command and the layout."""
    ckpt = tmp_path / "ckpt"
    for n in (0, 1):
        (ckpt / "checkpoints" / f"checkpoint_{n}").mkdir(parents=True)
        (ckpt / "checkpoints" / f"checkpoint_{n}" / "model.safetensors").write_bytes(b"w" * 100)
    listing = subprocess.run(["bash", "-c", LISTING_COMMAND.format(dir=ckpt)], capture_output=True, check=True)
    assert [c.name for c in complete_checkpoints(parse_listing(listing.stdout), "accelerate")] == [
        "checkpoints/checkpoint_0"]                    # the newest waits for a newer save
    path = train.mark_complete(ckpt / "checkpoints" / "checkpoint_1", step=13, processes=2)
    assert Path(path).name == COMPLETE_MARKER and json.loads(Path(path).read_text())["step"] == 13
    assert train.is_marked_complete(ckpt / "checkpoints" / "checkpoint_1")
    assert not (ckpt / "checkpoints" / "checkpoint_1" / f"{COMPLETE_MARKER}.tmp").exists()
    listing = subprocess.run(["bash", "-c", LISTING_COMMAND.format(dir=ckpt)], capture_output=True, check=True)
    assert [c.name for c in complete_checkpoints(parse_listing(listing.stdout), "accelerate")] == [
        "checkpoints/checkpoint_0", "checkpoints/checkpoint_1"]
