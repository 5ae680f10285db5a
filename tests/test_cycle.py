"""The resume cycle end to end: real sshd instances (sandbox), real rsync, tmux and uv.

An instance is evacuated mid-training and destroyed; a new instance with another address and
another SSH user resumes from the newest complete checkpoint, and the final weights equal an
uninterrupted run's bit for bit.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from e2e import example_recipe, local_final_hash, run_cli, wait_for

STEPS, SAVE_EVERY = 30, 5


def newest_step(ssh, inst, ckpt: str = "~/ckpt") -> int:
    out = ssh(inst, f"ls -1a {ckpt} 2>/dev/null || true").stdout
    steps = [int(m.group(1)) for m in re.finditer(r"(\d+)", out)]
    return max(steps, default=0)


def trainers(inst) -> int:
    """train.py processes inside this instance (its network namespace; PIDs are shared)."""
    pids = subprocess.run(["ip", "netns", "pids", f"rl-{inst.name}"], capture_output=True, text=True).stdout.split()
    count = 0
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        count += any(arg.endswith(b"train.py") for arg in cmdline[:2]) and b"python" in cmdline[0]
    return count


@pytest.mark.parametrize("layout", ["files", "hf-trainer", "dcp"])
def test_evacuate_destroy_up_elsewhere_resumes_bit_identical(layout, tmp_path, sandbox, ssh, ssh_key,
                                                            package_index):
    expected = local_final_hash(tmp_path, layout, STEPS, SAVE_EVERY)
    first = sandbox(user="root", index_dir=package_index)
    second = sandbox(user="ubuntu", index_dir=package_index)
    assert first.address != second.address
    home = tmp_path / "state"
    recipe = example_recipe(tmp_path / "work", name=f"ex-{layout}", layout=layout, key=ssh_key,
                            index_url=first.index_url, steps=STEPS, save_every=SAVE_EVERY, sleep=0.4)

    up = run_cli("up", str(recipe), first.host, home=home)
    assert up.returncode == 0, up.stderr
    assert "first contact with" in up.stderr and first.host_key_fingerprint in up.stderr
    assert "empty: fresh start" in up.stderr
    wait_for("two checkpoints on the first instance", lambda: newest_step(ssh, first) >= 2 * SAVE_EVERY)

    # Debris a crash could leave: never complete, never copied, never resumed from.
    debris = {"files": "ckpt-00009999.pt.tmp", "hf-trainer": "checkpoint-9999/model.pt",
              "dcp": "step-9999/__0_0.distcp"}[layout]
    ssh(first, f"mkdir -p ~/ckpt/{shlex.quote(str(Path(debris).parent))} && "
               f"head -c 1000 /dev/urandom > ~/ckpt/{debris}")

    evac = run_cli("evacuate", str(recipe), first.host, home=home)
    assert evac.returncode == 0, evac.stderr
    assert "safe to destroy" in evac.stderr
    store = tmp_path / "work" / "store"
    manifest = json.loads((store / ".relaunch" / "manifest.json").read_text())
    names = [c["name"] for c in manifest["checkpoints"]]
    assert names and all("9999" not in n for n in names)
    assert not (store / Path(debris).parts[0]).exists()
    assert (store / ".relaunch" / "freeze.txt").read_text().lower().count("torch==2.13.0") == 1
    evacuated_step = max(c["step"] for c in manifest["checkpoints"])

    sandbox_destroy = first.name
    from relaunch import sandbox as sb
    sb.destroy(sandbox_destroy)

    up2 = run_cli("up", str(recipe), second.host, home=home)
    assert up2.returncode == 0, up2.stderr
    assert f"step {evacuated_step}" in up2.stderr
    # env and checkpoint run at the same time: the copy starts before the install is done
    out = up2.stderr
    assert out.index("checkpoint: newest verified") < out.index("pip freeze matches the lock")

    # a second `up` while it trains leaves exactly one trainer
    again = run_cli("up", str(recipe), second.host, home=home)
    assert again.returncode == 0, again.stderr
    if "already running" in again.stderr:
        # never two; none only when the training finished between that look and this count
        count = trainers(second)
        assert count == 1 or (count == 0 and ssh(second, "cat ~/final.sha256 2>/dev/null || true").stdout.strip()), \
            again.stderr
    else:   # a loaded machine: the few steps left were done before this `up` looked; none is started
        assert "the command already finished (exit 0)" in again.stderr and trainers(second) == 0, again.stderr

    wait_for("training to finish on the second instance",
             lambda: ssh(second, "cat ~/final.sha256 2>/dev/null || true").stdout.strip(), timeout=300)
    log = ssh(second, f"cat ~/ex-{layout}.log").stdout
    assert re.search(rf"resumed from \S+ at step {evacuated_step}\b", log), log
    assert "9999" not in log
    assert ssh(second, "cat ~/final.sha256").stdout.strip() == expected
