"""The README's quickstart, run verbatim: its first `sh` block, line for line, with HOST a RunPod-shaped
sandbox instance where a training was started by hand in tmux, and NEXT a second one. The user's
key is in an ssh-agent (the README's commands name no key), relaunch is the one on PATH.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from e2e import REPO, wait_for
from test_ssh_config import agent  # noqa: F401  (the fixture)

# the user's trainer: standard library only, saves every 10 steps and when asked to stop (SIGTERM),
# resumes from --resume
TRAINER = r'''
import argparse, os, signal, time
p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--resume", default="", help="checkpoint to resume from")
a = p.parse_args()
os.makedirs(a.out, exist_ok=True)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
step = int(open(a.resume).read()) if a.resume else 0
print(f"resumed from step {step}" if a.resume else "fresh start", flush=True)


def save(step):
    path = os.path.join(a.out, f"ckpt-{step:08d}.pt")
    with open(path + ".tmp", "w") as f:
        f.write(str(step))
    os.replace(path + ".tmp", path)


while not stop:
    step += 1
    time.sleep(0.1)
    print(f"step {step} loss 0.5", flush=True)
    if step % 10 == 0:
        save(step)
save(step)
print(f"stopped at step {step}", flush=True)
'''


def quickstart() -> str:
    """The README's first `sh` block under its Quickstart heading."""
    text = (REPO / "README.md").read_text().split("## Quickstart", 1)[1]
    found = re.search(r"```sh\n(.*?)```", text, re.S)
    assert found, "the README's quickstart has no sh block"
    return found.group(1)


def test_the_readmes_quickstart_runs_verbatim(tmp_path, sandbox, ssh, ssh_key, agent):  # noqa: F811
    subprocess.run(["ssh-add", str(ssh_key)], env={**os.environ, "SSH_AUTH_SOCK": agent}, check=True,
                   capture_output=True)
    box, nxt = sandbox(image="runpod"), sandbox(image="runpod")
    # what the user did by hand on the box: a venv on the volume, the code, training in tmux
    ssh(box, "python3 -m venv /workspace/venv && mkdir -p /workspace/work")
    ssh(box, "cat > /workspace/work/train.py", input=TRAINER)
    ssh(box, "tmux new-session -d -s train 'cd /workspace/work && /workspace/venv/bin/python train.py "
             "--out /workspace/ckpt'")
    wait_for("the hand-started run's first checkpoint",
             lambda: ssh(box, "ls /workspace/ckpt", check=False).stdout.strip() != "", timeout=120)

    work = tmp_path / "mine"
    work.mkdir()
    env = {**os.environ, "HOST": box.host, "NEXT": nxt.host, "SSH_AUTH_SOCK": agent,
           "RELAUNCH_HOME": str(tmp_path / "state"), "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    run = subprocess.run(["bash", "-c", "set -euo pipefail\n" + quickstart()], cwd=work, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert f"safe to destroy {box.host}" in run.stderr

    store = sorted((work / "store").glob("*/ckpt-*.pt"))
    newest = max(int(p.name[5:13]) for p in store)
    # the next box trains on from the newest checkpoint the store holds
    wait_for("training on NEXT", lambda: f"resumed from step {newest}" in ssh(
        nxt, "cat ~/*.log 2>/dev/null", check=False).stdout, timeout=120)
    wait_for("a step past it", lambda: f"step {newest + 3} " in ssh(nxt, "cat ~/*.log", check=False).stdout,
             timeout=120)
