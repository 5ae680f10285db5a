"""A Ctrl-C lands wherever the main thread is, between any two bytecodes: inside `CANCEL.wait()`
with CANCEL's lock held, half way through a Condition's wait, between a wait and the check after
it. Wherever it lands, relaunch ends: the wait it lands in, or the next one, ends with
KeyboardInterrupt or Interrupted. Before, a Ctrl-C inside `CANCEL.wait()` made the handler wait
for CANCEL's lock, which its own thread held: the process hung for good (a `watch` in a CI run
under load); one landing half way through a wait raised "release unlocked lock" (exit 1); one landing in
paramiko's read right after it took its lock left that lock held, and the next close hung.

The landing points are searched, not guessed: a trace function raises SIGINT at the k-th line the
main thread runs in `threading` and `relaunch.processes` (or, for paramiko's read, in paramiko),
for every k until the wait runs out of lines. One child process per wait tries every k, with the
CLI's own handlers (`install_signal_handlers`); a hang ends at the test's timeout."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from e2e import plain_recipe, stacks, start_cli, wait_for

CHILD = r"""
import importlib, signal, sys, threading
from paramiko.buffered_pipe import BufferedPipe
from relaunch import processes
main = importlib.import_module("relaunch.cli.main")

how = sys.argv[1]
event = threading.Event()
pipe = BufferedPipe()
# short: the landing points after the block are reached only once the wait has run out
waits = {"sleep": lambda: processes.sleep(0.05), "wait": lambda: processes.wait(event, 0.05),
         "paramiko-read": lambda: pipe.read(65536, timeout=1)}
traced = ("paramiko",) if how == "paramiko-read" else ("threading", "relaunch.processes")


def landing_at(k):
    seen = [0]

    def tracer(frame, kind, arg):
        name = str(frame.f_globals.get("__name__"))
        if not any(name == t or name.startswith(t + ".") for t in traced):
            return None
        if kind == "line":
            seen[0] += 1
            if seen[0] == k:
                signal.raise_signal(signal.SIGINT)
        return tracer
    return tracer, seen


for k in range(1, 200):
    main.install_signal_handlers()
    processes.CANCEL.clear()
    pipe = BufferedPipe()
    pipe.feed(b"output")                 # what remote.exec reads once recv_ready() said so
    tracer, seen = landing_at(k)
    sys.settrace(tracer)
    try:
        waits[how]()
        ended = "wait returned"
    except (KeyboardInterrupt, processes.Interrupted) as exc:
        ended = type(exc).__name__
    finally:
        sys.settrace(None)
    if seen[0] < k:
        print("past the last line", k, flush=True)
        break
    if how == "paramiko-read":
        closer = threading.Thread(target=pipe.close, daemon=True)     # paramiko's transport, as the channel ends
        closer.start()
        closer.join(10)
        if closer.is_alive():
            print("HUNG", k, ended, flush=True)
            sys.exit(1)
    if ended == "wait returned":       # landed after the wait had ended: the next wait ends with it
        try:
            processes.sleep(30)
            print("LOST", k, flush=True)
            sys.exit(1)
        except processes.Interrupted:
            ended = "the next wait: Interrupted"
    print(k, ended, flush=True)
"""


def landings(how: str, timeout: float) -> list[str]:
    """The child's line for every landing point it tried, once it went past the wait's last line;
    a hang (the old handler) ends at the timeout, with what the child had printed by then."""
    try:
        child = subprocess.run([sys.executable, "-c", CHILD, how], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        printed = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"a Ctrl-C hung relaunch: the landing point after the last line here never ended\n{printed}")
    lines = child.stdout.splitlines()
    assert child.returncode == 0 and lines and lines[-1].startswith("past the last line"), \
        child.stdout + child.stderr
    assert "Traceback" not in child.stderr, child.stderr
    return lines


@pytest.mark.parametrize("how", ["sleep", "wait"])
def test_a_ctrl_c_anywhere_in_a_wait_of_the_main_thread_ends_it(how: str) -> None:
    lines = landings(how, timeout=60)
    assert len(lines) > 10, lines                         # the search went through the wait's own lines


# paramiko's pipes take their lock with `acquire()` and only then enter `try`: a KeyboardInterrupt
# between the two leaves it held, and paramiko's transport thread, closing the pipe as the channel
# ends, waits for it forever while holding the channel's lock, which relaunch's own `chan.close()`
# then waits for (an `evacuate` that hung after its Ctrl-C in a CI run under load)
def test_a_ctrl_c_anywhere_in_a_read_of_paramiko_leaves_its_lock_free_and_ends_relaunch() -> None:
    lines = landings("paramiko-read", timeout=120)
    assert len(lines) > 5, lines                          # the search went through the read's own lines


def test_a_command_that_waits_prints_its_threads_on_sigusr1_and_ends_on_ctrl_c(tmp_path) -> None:
    """`kill -USR1` on a relaunch that seems hung prints where each of its threads is and changes
    nothing else; a Ctrl-C then ends it with 130. The command: `up` to an address nobody answers at,
    waiting for it to boot (ssh.wait)."""
    recipe = plain_recipe(tmp_path, name="usr1", key=tmp_path / "none", ssh={"wait": 120})
    err = tmp_path / "err"
    proc = start_cli("up", str(recipe), "203.0.113.9", "--set", "ssh.key=", home=tmp_path / "state", err=err)
    try:
        wait_for("up waiting for the host", lambda: "waiting up to 120s" in err.read_text(), timeout=60)
        text = stacks(proc, err, 30)
        assert "most recent call first" in text, err.read_text()
        assert "Current thread" in text or "Thread 0x" in text, text
        assert "relaunch" in text and proc.poll() is None, text        # its own frames; and it goes on
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "interrupted" in err.read_text()
