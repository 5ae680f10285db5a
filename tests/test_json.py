"""`relaunch COMMAND --json` prints exactly one JSON document on stdout, on success and on every
exit code: the result, and on failure the same document with error, hint, exit and refused (the
contract). Progress stays on stderr. Rootless cases first, then a sandbox instance."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from e2e import plain_recipe, run_cli, wait_for
from test_faults import plant


def one_document(out: subprocess.CompletedProcess[str]) -> Any:
    """The whole stdout is one JSON document (json.loads of all of it), whose exit matches."""
    doc = json.loads(out.stdout)
    if out.returncode != 0:
        assert isinstance(doc, dict) and doc["exit"] == out.returncode and doc["error"], doc
        assert set(doc) >= {"error", "hint", "exit", "refused"}
    return doc


# (arguments, exit code); {recipe} is a recipe whose ssh.key names no file, {bad} one that fails check
WITHOUT_A_HOST = [
    (["check", "{recipe}"], 2),                       # ssh.key names a file that does not exist
    (["check", "{recipe}", "--set", "ssh.key="], 0),
    (["check", "{bad}"], 2),
    (["init", "{new}", "--provider", "runpod"], 0),
    (["init", "{recipe}"], 2),                        # exists: never overwritten
    (["providers"], 0),
    (["interval", "--step-time", "1s", "--save-time", "30s", "--mtbi", "6h"], 0),
    (["interval", "--step-time", "soon"], 2),
    (["sandbox", "list"], 0),
    (["up", "{bad}", "203.0.113.9"], 2),
    (["watch", "{bad}"], 2),
    (["status", "{recipe}", "127.0.0.1:1", "--set", "ssh.key=", "--set", "ssh.wait=0"], 3),
    (["evacuate", "{recipe}", "127.0.0.1:1", "--set", "ssh.key=", "--set", "ssh.wait=0"], 6),
]


@pytest.mark.parametrize("args,code", WITHOUT_A_HOST, ids=[" ".join(a[:2]) + f" -> {c}" for a, c in WITHOUT_A_HOST])
def test_commands_without_a_host_print_one_document(args: list[str], code: int, tmp_path: Path) -> None:
    home = tmp_path / "state"
    recipe = plain_recipe(tmp_path / "work", name="docs", key=tmp_path / "none")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: b\nenv: {python: 3.10}\n")
    args = [a.format(recipe=recipe, bad=bad, new=tmp_path / "new.yaml") for a in args]
    out = run_cli(*args, "--json", home=home, timeout=120)
    assert out.returncode == code, (args, out.stderr)
    one_document(out)


def test_commands_on_an_instance_print_one_document_on_each_exit(tmp_path, sandbox, ssh, ssh_key):
    home, inst = tmp_path / "state", sandbox()
    loop = "i=0; while true; do i=$((i+1)); echo \"step $i loss 1.0\"; sleep 0.2; done"
    recipe = plain_recipe(tmp_path / "work", name="jsondocs", key=ssh_key, command=f"bash -c '{loop}'")
    lock = tmp_path / "work" / "requirements.lock"
    lock.write_text("")
    assert one_document(run_cli("up", str(recipe), inst.host, "--json", home=home)) is not None
    assert one_document(run_cli("plan", str(recipe), inst.host, "--json", home=home))
    assert one_document(run_cli("status", str(recipe), "--json", home=home))["alive"] is True
    # training made progress and left no checkpoint: exit 6, the report with the error in it
    wait_for("step 5 in the log", lambda: "step 5 " in ssh(inst, "cat ~/jsondocs.log", check=False).stdout)
    refused = run_cli("evacuate", str(recipe), "--json", home=home)
    assert refused.returncode == 6, refused.stderr
    assert one_document(refused)["copied"] == []
    once = run_cli("sync", str(recipe), "--once", "--json", home=home)
    one_document(once)
    plant(ssh, inst, 10)
    synced = run_cli("sync", str(recipe), "--once", "--json", home=home)
    assert synced.returncode == 0 and one_document(synced)["copied"] == ["ckpt-00000010.pt"]
    frozen = run_cli("freeze", str(recipe), "--set", f"env.lock={lock}", "--yes", "--json", home=home)
    assert frozen.returncode == 0, frozen.stderr
    one_document(frozen)
    stopped = run_cli("evacuate", str(recipe), "--stop", "--allow-empty", "--json", home=home)
    assert stopped.returncode == 0, stopped.stderr
    one_document(stopped)
    gone = run_cli("status", str(recipe), "--json", home=home)
    assert gone.returncode == 4 and one_document(gone)["alive"] is False

    # Ctrl-C of a sync loop: exit 130, one document with the rounds it made and the error
    err = tmp_path / "sync.err"
    with err.open("w") as handle:
        proc = subprocess.Popen([sys.executable, "-m", "relaunch.cli", "sync", str(recipe), "--every", "600",
                                 "--json"], stdout=subprocess.PIPE, stderr=handle, text=True,
                                env={**__import__("os").environ, "RELAUNCH_HOME": str(home)})
    try:
        wait_for("the first round", lambda: '"copied"' in err.read_text(), timeout=120, every=0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130
    doc = one_document(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    assert len(doc["rounds"]) == 1 and "interrupted" in doc["error"]
