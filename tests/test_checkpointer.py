"""relaunch.train.Checkpointer on this machine (one process; node groups and torchrun are in
tests/test_checkpointer_runs.py): what a relaunch layout counts while a write is in flight, after
it commits and after a `kill -9`; keep N; the metric lines; the cached save plan; a restore that
brings back everything a save holds; a stop whose notice deadline leaves no time for a save.

A write is held back by a gate in DCP's own FileSystemWriter.write_data (the write itself is
DCP's), so "in flight" is a state the test controls, not a race it hopes to win.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint.planner import SavePlanner  # noqa: E402

from relaunch import train  # noqa: E402
from relaunch.layouts import LISTING_COMMAND, complete_checkpoints, parse_listing  # noqa: E402
from relaunch.savecosts import parse_line  # noqa: E402


def complete(folder: Path, layout: str = "dcp") -> list[str]:
    """What relaunch counts as complete there: the real listing command and the layout."""
    out = subprocess.run(["bash", "-c", LISTING_COMMAND.format(dir=folder)], capture_output=True, check=True).stdout
    return [c.name for c in complete_checkpoints(parse_listing(out), layout)]


def quiet_stop(**kw) -> train.StopRequest:
    """A stop request this test owns: its handler is never installed in the test process."""
    return train.StopRequest(signals=["USR2"], notice_file=kw.pop("notice_file", ""), **kw)


class Job:
    """A tiny model, AdamW, a step scheduler and a sampler; `steps(n)` trains n optimizer steps."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, 3, 0.5)
        self.sampler = train.GlobalBatchSampler(64, 8, steps=100, seed=seed)
        self.xs = torch.randn(64, 8, generator=torch.Generator().manual_seed(7))

    def steps(self, n: int) -> None:
        for _ in range(n):
            loss = self.model(self.xs[:8]).pow(2).mean()
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()

    def checkpointer(self, folder: Path, **kw) -> train.Checkpointer:
        kw.setdefault("stop", quiet_stop())
        return train.Checkpointer(folder, self.model, self.optimizer, scheduler=self.scheduler, sampler=self.sampler,
                                  **kw)


class Gate:
    """Writes wait while the gate is shut (it starts open); `reached` is set once a write waits at it."""

    def __init__(self) -> None:
        self.open, self.reached = threading.Event(), threading.Event()
        self.open.set()

    def shut(self) -> None:
        self.reached.clear()
        self.open.clear()

    def wait_for_a_write(self) -> None:
        assert self.reached.wait(timeout=120), "no write reached the gate: the background save never started"


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Gate:
    found = Gate()
    original = FileSystemWriter.write_data

    def held(self, plan, planner):  # type: ignore[no-untyped-def]
        found.reached.set()
        assert found.open.wait(timeout=120), "the test never opened the gate"
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", held)
    return found


def test_a_save_in_flight_is_not_counted_until_every_write_finished(tmp_path, gate: Gate):
    job, folder = Job(0), tmp_path / "ckpt"
    with job.checkpointer(folder) as ckpt:
        job.steps(2)
        ckpt.save(10)
        ckpt.wait()
        assert complete(folder) == ["step-00000010"]
        gate.shut()
        job.steps(2)
        assert ckpt.save(20)                   # returned: the state is copied, the write is held
        gate.wait_for_a_write()
        held = folder / "tmp-step-00000020"
        assert held.is_dir() and not (folder / "step-00000020").exists()
        for layout in ("dcp", "auto"):
            assert complete(folder, layout) == ["step-00000010"]
        assert ckpt.newest() == str(folder / "step-00000010")
        job.steps(2)                           # training goes on meanwhile
        gate.open.set()
        ckpt.wait()
    assert complete(folder) == complete(folder, "auto") == ["step-00000010", "step-00000020"]
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000010", "step-00000020"]
    assert (folder / "step-00000020" / ".metadata").stat().st_size > 0


@pytest.mark.parametrize("async_save", [True, False])
def test_keep_n_metric_lines_and_the_cached_plan(tmp_path, capsys, async_save):
    job, folder = Job(1), tmp_path / "ckpt"
    with job.checkpointer(folder, keep=2, async_save=async_save) as ckpt:
        for step in (10, 20, 30, 40):
            job.steps(2)
            assert ckpt.save(step)
        assert not ckpt.save(40)               # saved already: nothing to do
        ckpt.wait()
        assert SavePlanner._cached_save_plan.get(ckpt._planner._cached_plans_key) is not None
    assert complete(folder) == ["step-00000030", "step-00000040"]
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000030", "step-00000040"]
    out = capsys.readouterr()
    saves = [parse_line(line) for line in out.out.splitlines() if line.startswith(train.CHECKPOINT_METRIC)]
    assert [s.step for s in saves if s] == [10, 20, 30, 40] and [c["step"] for c in ckpt.costs] == [10, 20, 30, 40]
    assert all(s and s.blocking > 0 and s.step_time and s.step_time > 0 and s.world_size == 1 and s.bytes > 0
               for s in saves)
    if async_save:
        assert all(s and s.write > 0 for s in saves)
        assert "step-00000020: state copied in" in out.err
    else:
        assert all(s and s.write == 0 for s in saves)    # blocking: the write is in the blocking time


def test_restore_brings_back_model_optimizer_scheduler_rng_data_and_extra(tmp_path):
    job, folder = Job(2), tmp_path / "ckpt"
    with job.checkpointer(folder, keep=3) as ckpt:
        job.steps(4)
        ckpt.save(20)
        job.steps(3)
        ckpt.save(30, extra={"tokens": 1234})
        after = torch.rand(4)                  # the RNG right after the save
        ckpt.wait()
    saved_params = [p.detach().clone() for p in job.model.parameters()]
    saved_optim = job.optimizer.state_dict()
    other = Job(99)                            # other weights, a fresh optimizer and scheduler
    other.steps(1)
    with other.checkpointer(folder) as again:
        assert again.restore() == 30           # the newest complete one here
        assert torch.equal(torch.rand(4), after)
        assert all(torch.equal(a, b) for a, b in zip(other.model.parameters(), saved_params, strict=True))
        state = other.optimizer.state_dict()["state"]
        assert all(torch.equal(state[k]["exp_avg"], saved_optim["state"][k]["exp_avg"]) for k in state)
        assert other.scheduler.state_dict()["last_epoch"] == job.scheduler.state_dict()["last_epoch"] == 7
        assert other.sampler.start_step == 30 and again.extra == {"tokens": 1234}
        assert again.restored == str(folder / "step-00000030")
        assert not again.save(30)              # restored: not saved again
    with Job(5).checkpointer(folder) as older:
        assert older.restore(str(folder / "step-00000020")) == 20
    with Job(5).checkpointer(tmp_path / "empty") as fresh:
        assert fresh.restore("") == 0


def test_a_stop_flushes_the_write_in_flight_and_skips_a_save_its_deadline_has_no_room_for(tmp_path, gate: Gate,
                                                                                          capfd):
    notice = tmp_path / "notice.json"
    job, folder = Job(3), tmp_path / "ckpt"
    stop = quiet_stop(notice_file=str(notice), started=time.time() - 60)
    with job.checkpointer(folder, stop=stop) as ckpt:
        job.steps(1)
        ckpt.save(10)
        ckpt.wait()                            # one save measured: what the next would need
        gate.shut()
        job.steps(1)
        ckpt.save(20)                          # in flight when the notice comes
        gate.wait_for_a_write()
        notice.write_text(json.dumps({"source": "aws", "detail": "spot", "seen_at": time.time(),
                                      "deadline": time.time() + 0.001}))
        assert ckpt.stop_requested()
        job.steps(1)
        threading.Timer(0.5, gate.open.set).start()   # the write finishes while finish() waits for it
        newest = ckpt.finish(21)
    assert newest == str(folder / "step-00000020")
    assert complete(folder) == ["step-00000010", "step-00000020"]
    assert "no save of step 21: it would not be written before the notice's deadline" in capfd.readouterr().err
    # with room before the deadline the stop's own step is saved and committed
    notice.write_text(json.dumps({"source": "aws", "detail": "spot", "seen_at": time.time(),
                                  "deadline": time.time() + 3600}))
    job2 = Job(3)
    with job2.checkpointer(folder, stop=quiet_stop(notice_file=str(notice), started=time.time() - 60)) as ckpt:
        ckpt.restore()
        job2.steps(1)
        assert ckpt.stop_requested()
        assert ckpt.finish(21) == str(folder / "step-00000021")
    assert complete(folder)[-1] == "step-00000021"


KILLED = textwrap.dedent("""
    import sys, time, torch
    from torch.distributed.checkpoint import FileSystemWriter
    from relaunch import train

    original = FileSystemWriter.write_data
    def write_data(self, plan, planner):
        if "00000020" in str(self.path):
            print("writing", flush=True)       # in the write itself: its folder is there
            time.sleep(600)                    # never finishes: killed meanwhile
        return original(self, plan, planner)
    FileSystemWriter.write_data = write_data

    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = train.Checkpointer(sys.argv[1], model, optimizer)
    ckpt.save(10)
    ckpt.wait()
    ckpt.save(20)
    time.sleep(600)
""")


def test_a_kill_9_mid_write_leaves_nothing_counted_and_the_next_start_resumes_from_the_save_before(tmp_path):
    folder = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(folder)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout is not None
        assert "writing\n" in iter(proc.stdout.readline, ""), "the save of step 20 never started"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (folder / "tmp-step-00000020").is_dir()
    for layout in ("dcp", "auto"):
        assert complete(folder, layout) == ["step-00000010"]
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with train.Checkpointer(folder, model, optimizer, stop=quiet_stop()) as ckpt:
        assert not (folder / "tmp-step-00000020").exists()     # the killed run's leftover, removed
        assert ckpt.restore() == 10


PROCESS = textwrap.dedent("""
    import sys

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import _async_process_executor as executor

    from relaunch import train


    def main():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=0, world_size=1)
        model = torch.nn.Linear(16, 16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ckpt = train.Checkpointer(sys.argv[1], model, optimizer, background="process",
                                  stop=train.StopRequest(signals=["USR2"], notice_file=""))
        for step in (1, 2, 3):
            model(torch.randn(2, 16)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            ckpt.save(step)
        writer = executor._CHECKPOINT_PROCESS
        print("written by a process:", writer is not None and writer._save_process.is_alive(), flush=True)
        ckpt.finish(3)
        ckpt.close()
        dist.destroy_process_group()


    if __name__ == "__main__":         # the writing process is spawned: it imports this file again
        main()
""")


def test_the_write_in_a_background_process_commits_the_same_way(tmp_path):
    import socket

    script, folder = tmp_path / "process_save.py", tmp_path / "ckpt"
    script.write_text(PROCESS)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run([sys.executable, str(script), str(folder), str(port)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "written by a process: True" in done.stdout
    assert [s.step for s in map(parse_line, done.stdout.splitlines()) if s] == [1, 2, 3]
    assert complete(folder) == ["step-00000002", "step-00000003"]
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000002", "step-00000003"]


# -- deletion is the last step of a proof ----------------------------------------------------------
def whole(folder: Path, layout: str = "dcp") -> dict[str, bool]:
    """Each checkpoint relaunch counts there -> whether every file its `.metadata` names is in it."""
    from relaunch.layouts.dcp import required_files

    return {name: required_files((folder / name / ".metadata").read_bytes()) <= {p.name for p in
                                                                                (folder / name).iterdir()}
            for name in complete(folder, layout)}


def run_script(tmp_path: Path, script: str, *args: object) -> subprocess.CompletedProcess[str]:
    """One Python process running `script` (its faults installed in its own process), to its end."""
    path = tmp_path / "faulty_training.py"
    path.write_text(textwrap.dedent(script))
    return subprocess.run([sys.executable, str(path), *map(str, args)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def digests(folder: Path) -> dict[str, str]:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


KILLED_IN_A_PRUNE = """
    import os, shutil, signal, sys, torch
    from relaunch import train

    rmtree = shutil.rmtree
    def cut_short(path, *args, **kwargs):
        # the removal of step 10's folder (whatever it is called by then): one file goes, then a kill
        if os.path.basename(path).endswith("step-00000010") and os.path.isfile(os.path.join(path, "__0_0.distcp")):
            os.remove(os.path.join(path, "__0_0.distcp"))
            os.kill(os.getpid(), signal.SIGKILL)
        return rmtree(path, *args, **kwargs)
    shutil.rmtree = cut_short

    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = train.Checkpointer(sys.argv[1], model, optimizer, keep=1,
                              stop=train.StopRequest(signals=["USR2"], notice_file=""))
    ckpt.save(10)
    ckpt.wait()
    ckpt.save(20)                        # keep=1: its commit removes step 10
    ckpt.wait()
    print("the prune was never killed")
"""


def test_a_kill_9_part_way_through_a_prune_leaves_no_counted_checkpoint_missing_a_file(tmp_path):
    folder = tmp_path / "ckpt"
    killed = run_script(tmp_path, KILLED_IN_A_PRUNE, folder)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr[-3000:]
    for layout in ("dcp", "auto"):
        assert whole(folder, layout) == {"step-00000020": True}
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with train.Checkpointer(folder, model, optimizer, keep=1, stop=quiet_stop()) as ckpt:
        assert sorted(p.name for p in folder.iterdir()) == ["step-00000020"]   # the prune's leftover, removed
        assert ckpt.restore() == 20


SAVED_AGAIN = """
    import os, signal, sys, torch
    from relaunch import train

    folder, fault = sys.argv[1], sys.argv[2]
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stop = train.StopRequest(signals=["USR2"], notice_file="")
    ckpt = train.Checkpointer(folder, model, optimizer, keep=3, stop=stop)
    def step(x):
        model(torch.full((4, 64), x)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    if fault == "none":
        ckpt.save(10)
        ckpt.wait()
        step(1.0)
        ckpt.save(20)
        ckpt.wait()
        sys.exit(0)
    # a run that starts over without restoring (a resume from an older one sets 20 aside first, see
    # test_rollback): step 20 is saved again, with other weights than the first step 20's
    step(2.0)
    rename = os.rename
    def into_place(src, dst, *args, **kwargs):
        if os.path.basename(src) == "tmp-step-00000020":  # the new step 20 into place: the earlier one is aside
            os.kill(os.getpid(), signal.SIGKILL)
        return rename(src, dst, *args, **kwargs)
    os.rename = into_place
    ckpt.save(20)
    ckpt.wait()
    print("never killed")
"""


def test_a_kill_9_between_the_two_renames_of_a_step_saved_again_loses_neither(tmp_path):
    folder = tmp_path / "ckpt"
    first = run_script(tmp_path, SAVED_AGAIN, folder, "none")
    assert first.returncode == 0, first.stderr[-3000:]
    earlier = digests(folder / "step-00000020")
    killed = run_script(tmp_path, SAVED_AGAIN, folder, "kill")
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr[-3000:]
    assert whole(folder) == {"step-00000010": True}          # the earlier 20 aside, the new one not in place
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with train.Checkpointer(folder, model, optimizer, keep=3, stop=quiet_stop()) as ckpt:
        assert sorted(p.name for p in folder.iterdir()) == ["step-00000010", "step-00000020"]
        assert digests(folder / "step-00000020") == earlier  # the earlier step 20 is back, byte for byte
        assert ckpt.restore() == 20


def test_a_step_saved_again_whose_rename_fails_puts_the_earlier_one_back_and_finish_saves_it_anew(
        tmp_path, monkeypatch):
    job, folder = Job(6), tmp_path / "ckpt"
    with job.checkpointer(folder, keep=3) as ckpt:
        ckpt.save(10)
        job.steps(1)
        ckpt.save(20)
        ckpt.wait()
    earlier = digests(folder / "step-00000020")
    job.steps(2)
    with job.checkpointer(folder, keep=3) as ckpt:      # a run that starts over without restoring: 20 saved again
        rename, refused = os.rename, []

        def into_place(src, dst, *args, **kwargs):   # type: ignore[no-untyped-def]
            if os.path.basename(src) == "tmp-step-00000020" and not refused:
                refused.append(src)
                raise OSError(5, "Input/output error", src)
            return rename(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "rename", into_place)
        ckpt.save(20)
        with pytest.raises(RuntimeError, match="a checkpoint save failed: OSError: .*Input/output error"):
            ckpt.wait()
        assert refused
        assert sorted(p.name for p in folder.iterdir()) == ["step-00000010", "step-00000020"]
        assert digests(folder / "step-00000020") == earlier
        assert ckpt.finish(20) == str(folder / "step-00000020")   # not saved: saved now
    assert digests(folder / "step-00000020") != earlier
    assert whole(folder) == {"step-00000010": True, "step-00000020": True}


def fill(disk: Path) -> Path:
    """A file taking every byte still free on `disk`."""
    ballast = disk / "ballast"
    with open(ballast, "wb", buffering=0) as out:
        try:
            while True:
                out.write(b"\0" * (1 << 16))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return ballast


def test_a_save_that_failed_on_a_full_disk_does_not_keep_the_stop_from_saving_once_there_is_room(
        tmp_path, capfd, monkeypatch):
    folder, notice = tmp_path / "ckpt", tmp_path / "notice.json"
    written, write_data = threading.Event(), FileSystemWriter.write_data

    def writes(self, plan, planner):  # type: ignore[no-untyped-def]
        try:
            return write_data(self, plan, planner)
        finally:
            written.set()                      # DCP's own write is over (its files met the disk)

    monkeypatch.setattr(FileSystemWriter, "write_data", writes)
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], check=True)
    try:
        job = Job(7)
        with job.checkpointer(folder, stop=quiet_stop(notice_file=str(notice), started=time.time() - 60)) as ckpt:
            ckpt.save(10)
            ckpt.wait()
            ballast = fill(folder)
            job.steps(1)
            written.clear()
            ckpt.save(20)                      # its write meets the full disk
            assert written.wait(timeout=120), "the write of step 20 never ran"
            notice.write_text(json.dumps({"source": "aws", "detail": "spot", "seen_at": time.time(),
                                          "deadline": time.time() + 3600}))
            ballast.unlink()                   # room again (an evacuation's pins let go)
            job.steps(1)
            assert ckpt.stop_requested()
            assert ckpt.finish(21) == str(folder / "step-00000021")
        err = capfd.readouterr().err
        assert "a checkpoint save failed: " in err and "No space left on device" in err
        assert "step-00000021 saved and committed" in err
        assert sorted(p.name for p in folder.iterdir()) == ["step-00000010", "step-00000021"]   # nothing of 20 left
        assert whole(folder) == {"step-00000010": True, "step-00000021": True}
    finally:
        subprocess.run(["umount", str(folder)], check=True)


GROUP = """
    import os, signal, sys
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from relaunch import train

    folder, port, rank, phase = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    keep = 1 if phase.startswith("keep1") else 3
    stop = train.StopRequest(signals=["USR2"], notice_file="")
    ckpt = train.Checkpointer(folder, model, optimizer, keep=keep, stop=stop)
    print("leader of its folder:", ckpt.leader, flush=True)

    def step(x):
        model(torch.full((4, 64), x)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    if phase == "start":
        sys.exit(0)
    if phase == "resume":               # a start without a path: the newest whole across the nodes
        print("resumed at step", ckpt.restore(None), flush=True)
        sys.exit(0)
    if phase.startswith("again"):        # a start over without restoring: 20 saved again, other weights
        step(2.0)
    else:
        ckpt.save(10)
        ckpt.wait()
        step(1.0)
    if rank == 0 and phase != "first":
        rename = os.rename
        def into_place(src, dst, *args, **kwargs):
            if os.path.basename(src) == "tmp-step-00000020":  # rank 0's commit: every other node's part is in place
                if not phase.endswith("raise"):
                    os.kill(os.getpid(), signal.SIGKILL)
                raise OSError(5, "Input/output error", src)
            return rename(src, dst, *args, **kwargs)
        os.rename = into_place
    ckpt.save(20)
    try:
        ckpt.wait()
    except Exception as exc:
        print("the save of step 20 failed:", exc, flush=True)
        sys.exit(3)
"""


def group_complete(folders: list[Path]) -> list[str]:
    """What `up` on the group counts as complete (steps/checkpoint.py, instance_checkpoints): the
    nodes' listings merged, each DCP checkpoint with every file its `.metadata` names on some node."""
    from relaunch.layouts.dcp import required_files

    merged = {e.path: e for f in folders for e in parse_listing(subprocess.run(
        ["bash", "-c", LISTING_COMMAND.format(dir=f)], capture_output=True, check=True).stdout)}
    found = complete_checkpoints(list(merged.values()), "dcp")
    return [c.name for c in found if all(f"{c.name}/{p}" in merged for p in required_files(
        next(f / c.name / ".metadata" for f in folders if (f / c.name / ".metadata").exists()).read_bytes()))]


def run_group(tmp_path: Path, nodes: list[Path], phase: str, *args: object) -> list[tuple[int, str]]:
    """Two "nodes" on this machine, a checkpoint folder each (no shared disk): GROUP's `phase` on
    both, to their end; (exit status, output) of each."""
    import socket

    script = tmp_path / "group.py"
    script.write_text(textwrap.dedent(GROUP))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(nodes[rank]), str(port), str(rank), phase,
                               *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for rank in (0, 1)]
    try:
        out = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all("leader of its folder: True" in o for o in out), out       # two nodes: a disk each
    return [(p.returncode, o) for p, o in zip(procs, out, strict=True)]


@pytest.mark.parametrize("fault", ["kill", "raise"])
def test_a_node_group_with_keep_1_keeps_its_checkpoint_when_rank_0_fails_to_commit_the_next(tmp_path, fault):
    nodes = [tmp_path / "node0" / "ckpt", tmp_path / "node1" / "ckpt"]
    (zero, out0), (one, out1) = run_group(tmp_path, nodes, f"keep1-{fault}")
    assert zero == (-signal.SIGKILL if fault == "kill" else 3), out0[-3000:]
    assert one == 3 and "the save of step 20 failed" in out1, out1[-3000:]
    # node 1's part of step 10 is still there: the group still has its checkpoint, whole
    assert (nodes[1] / "step-00000010").is_dir()
    assert group_complete(nodes) == ["step-00000010"]


def test_a_node_group_killed_while_saving_a_step_again_gets_the_earlier_one_back_on_every_node(tmp_path):
    nodes = [tmp_path / "node0" / "ckpt", tmp_path / "node1" / "ckpt"]
    assert [code for code, _ in run_group(tmp_path, nodes, "first")] == [0, 0]
    earlier = [digests(node / "step-00000020") for node in nodes]
    (zero, out0), (one, out1) = run_group(tmp_path, nodes, "again")
    assert zero == -signal.SIGKILL, out0[-3000:]
    assert one == 3 and "the save of step 20 failed" in out1, out1[-3000:]
    # node 1's new part is in place, rank 0's earlier step 20 aside: nothing counts step 20 meanwhile
    assert group_complete(nodes) == ["step-00000010"]
    assert digests(nodes[1] / "step-00000020") != earlier[1]
    assert [code for code, _ in run_group(tmp_path, nodes, "start")] == [0, 0]
    # the next start: the earlier step 20 back on both nodes (never rank 0's earlier with node 1's new)
    assert group_complete(nodes) == ["step-00000010", "step-00000020"]
    assert [digests(node / "step-00000020") for node in nodes] == earlier
    assert not [p for node in nodes for p in node.iterdir() if p.name.startswith("tmp-")]


def test_a_failed_commit_of_a_step_saved_again_takes_the_new_part_off_a_node_that_had_none(tmp_path):
    """Node 1 replaced since step 20 was first saved (its disk holds no part of it): the new part it
    puts in place goes when rank 0's rename fails, never left beside rank 0's earlier step 20."""
    nodes = [tmp_path / "node0" / "ckpt", tmp_path / "node1" / "ckpt"]
    assert [code for code, _ in run_group(tmp_path, nodes, "first")] == [0, 0]
    shutil.rmtree(nodes[1] / "step-00000020")
    earlier = digests(nodes[0] / "step-00000020")
    results = run_group(tmp_path, nodes, "again-raise")
    assert [code for code, _ in results] == [3, 3], results
    assert digests(nodes[0] / "step-00000020") == earlier
    assert not (nodes[1] / "step-00000020").exists()
    assert group_complete(nodes) == ["step-00000010"]
    assert not [p for node in nodes for p in node.iterdir() if p.name.startswith("tmp-")]


def test_a_group_start_passes_over_a_checkpoint_a_replaced_node_held_part_of(tmp_path):
    """Node 1 replaced (its disk with it) since step 20 was saved: a start without a path (what `up`
    runs when the store holds nothing verified) resumes step 10, whole on both nodes, and says why
    not step 20, a file of which is on no node; it took rank 0's step 20 by its `.metadata` and
    failed loading it, at every start (the chaos long run, seed 1224)."""
    nodes = [tmp_path / "node0" / "ckpt", tmp_path / "node1" / "ckpt"]
    assert [code for code, _ in run_group(tmp_path, nodes, "first")] == [0, 0]
    whole = tmp_path / "step-00000010"                       # step 10 whole on every node, as `up` restores it
    for node in nodes:
        shutil.copytree(node / "step-00000010", whole, dirs_exist_ok=True)
    shutil.rmtree(nodes[1])                                  # a new node 1: nothing of step 20 on it
    for node in nodes:
        shutil.copytree(whole, node / "step-00000010", dirs_exist_ok=True)
    (zero, out0), (one, out1) = run_group(tmp_path, nodes, "resume")
    assert (zero, one) == (0, 0), out0[-3000:] + out1[-3000:]
    assert "resumed at step 10" in out0 and "resumed at step 10" in out1
    assert "step-00000020 is not resumed: 1 of its files are on no node (__1_0.distcp)" in out0, out0
    # rank 0's part of step 20 is kept, set aside with the branch it no longer is
    assert group_complete(nodes) == ["step-00000010"]
    assert list((nodes[0] / train.ASIDE_DIR).rglob("step-00000020"))
