"""Every wait has an end: a store that accepted the connection and never answers, and an SSH
peer that never answers a channel open, end in a clear error instead of a hang.

Real parts: a TCP server that accepts and then says nothing (what a wedged proxy or a hung Hub
front end looks like), huggingface_hub's real client, sandbox instances with a real sshd. Each
test's guard against a hang is a subprocess timeout or a bounded wait, never a timing assertion.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
from e2e import plain_recipe, run_cli
from test_faults import plant

from relaunch import processes
from relaunch.errors import CheckpointError, Interrupted
from relaunch.transports.hf import HfStore


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
