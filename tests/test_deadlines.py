"""Every wait has an end: a store that accepted the connection and never answers, and an SSH
peer that never answers a channel open, end in a clear error instead of a hang.

Real parts: a TCP server that accepts and then says nothing (what a wedged proxy or a hung Hub
front end looks like), huggingface_hub's real client, sandbox instances with a real sshd. Each
test's guard against a hang is a subprocess timeout or a bounded wait, never a timing assertion.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e import plain_recipe, run_cli, start_cli, wait_for
from relaunch import processes
from relaunch import sandbox as sb
from relaunch.errors import CheckpointError, Interrupted
from relaunch.transports.hf import HfStore
from test_faults import plant


@pytest.fixture
def silent_server() -> Iterator[str]:
    """http://127.0.0.1:PORT: accepts every connection, reads nothing, answers nothing."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except (TimeoutError, OSError):
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in held:
            conn.close()
        listener.close()


def test_a_silent_hub_ends_evacuate_with_exit_6_naming_the_store(tmp_path, sandbox, ssh, ssh_key, silent_server):
    home = tmp_path / "state"
    inst = sandbox()
    recipe = plain_recipe(tmp_path, name="silenthub", key=ssh_key, checkpoint={"remote": "hf:acme/ckpts/run1"})
    plant(ssh, inst, 10)
    env = {"HF_ENDPOINT": silent_server, "HF_TOKEN": "hf_notarealtoken0123", "HF_HOME": str(tmp_path / "hfhome"),
           "HF_HUB_DISABLE_TELEMETRY": "1", "RELAUNCH_STORE_WAIT": "3"}
    evac = run_cli("evacuate", str(recipe), inst.host, home=home, env=env, timeout=120)   # the guard: no hang
    assert evac.returncode == 6, evac.stderr
    assert "hf:acme/ckpts/run1" in evac.stderr and "no answer within 3s" in evac.stderr, evac.stderr
    assert "Traceback" not in evac.stderr and "safe to destroy" not in evac.stderr.replace("NOT safe", "")


def test_a_hub_call_in_an_action_ends_at_the_actions_deadline_and_with_its_lane(silent_server):
    """In-process: the Hub's client inside a `call` action's budget (what the executor sets)."""
    store = HfStore("acme/ckpts", "run1", "silenthub", "hf_notarealtoken0123", silent_server)
    with processes.budget(1.0, lambda: False), pytest.raises(CheckpointError) as failed:
        store.read()
    assert "hf:acme/ckpts/run1: reading the repo failed" in str(failed.value)
    assert "no answer within 1s" in str(failed.value)

    sibling_failed = threading.Event()
    threading.Timer(0.5, sibling_failed.set).start()
    with processes.budget(600.0, sibling_failed.is_set), pytest.raises(Interrupted):
        store.read()


def _sessions(inst) -> dict[int, bool]:
    """The instance's SSH session processes (`sshd: USER@notty`): pid -> whether an rsync runs
    under it. Sandbox instances share this machine's PID namespace; counted by network namespace."""
    ns = sb.run_in(inst.name, ["readlink", "/proc/self/ns/net"], capture_output=True, text=True).stdout.strip()
    found: dict[int, bool] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/ns/net") != ns or not Path(f"/proc/{pid}/cmdline").read_bytes().startswith(
                    f"sshd: {inst.user}@notty".encode()):
                continue
            children = subprocess.run(["pgrep", "-a", "-P", pid], capture_output=True, text=True).stdout
            found[int(pid)] = "rsync" in children
        except OSError:
            continue
    return found


def test_a_host_that_stops_answering_after_connect_ends_evacuate_with_the_connection_error(
        tmp_path, sandbox, ssh, ssh_key):
    """relaunch's own SSH connection stops answering (its sshd session stopped: TCP still
    acknowledged, so no TCP timeout helps) while rsync copies over another one; the next channel
    relaunch opens on it must end, not wait an hour."""
    home = tmp_path / "state"
    inst = sandbox(rate="8mbit")
    recipe = plain_recipe(tmp_path, name="stalled", key=ssh_key)
    size = 6_000_000
    plant(ssh, inst, 10, size=size)
    staged = tmp_path / "store" / ".relaunch" / "partial"
    err = tmp_path / "evacuate.err"
    stopped: list[int] = []
    proc = start_cli("evacuate", str(recipe), inst.host, home=home, err=err)
    try:
        wait_for("a sixth of the copy", lambda: sum(p.stat().st_size for p in staged.rglob("*") if p.is_file())
                 > size // 6, timeout=120, every=0.1)
        stopped = [pid for pid, copying in _sessions(inst).items() if not copying]
        assert len(stopped) == 1, _sessions(inst)          # relaunch's connection, idle while rsync copies
        os.kill(stopped[0], signal.SIGSTOP)
        proc.wait(timeout=180)                             # the guard: without a deadline it waits an hour
    finally:
        proc.kill()
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    text = err.read_text()
    assert proc.returncode == 6, text
    assert "the SSH connection was lost" in text and "did not answer opening an SSH channel" in text, text
    assert "safe to destroy" not in text.replace("NOT safe to destroy", "")
