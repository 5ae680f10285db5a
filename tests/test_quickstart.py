"""The README's quickstarts, run verbatim as a new user runs them: from a HOME whose only SSH key is
the one the README tells them to make (`ssh-keygen -t ed25519`), against RunPod-shaped boxes they
made with `relaunch sandbox create --image runpod` (which lets their key in, as RunPod does once it
is uploaded). No command names a key; relaunch is the one on PATH. The user's commands run with that
HOME bound over this machine's user's home (tests/e2e.py as_user: OpenSSH reads ~/.ssh from there,
not from $HOME); `sandbox create`, which mounts, runs outside with HOME set to the same folder.

Which README lines run where:
- "Quickstart", its first sh block (adopt, check, evacuate --stop, up), line for line:
  test_the_first_quickstart_adopts_evacuates_and_resumes_on_the_next_box, HOST a box where training
  was started by hand in tmux, NEXT a second box; with the key in ~/.ssh/id_ed25519 (no ssh-agent),
  and again with it in ssh-agent only.
- "Quickstart", its second sh block (init --provider runpod, $EDITOR, up, freeze), line for line:
  test_the_second_quickstart_starts_a_new_run_and_pins_its_env, EDITOR a script that writes
  run.command, checkpoint.remote and env.files as a user would.
- "Try it without renting anything": its `relaunch demo` in tests/test_demo.py (taken from the
  README's line); its `python -m pytest` is what CI runs (.ci/run; tests/test_docs.py checks both
  are the README's).
- "Install": `pipx install` and `uv tool install` in tests/test_install.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from e2e import REPO, as_user, new_user, wait_for
from relaunch.sandbox import Instance

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

# $EDITOR recipe.yaml: what a user writes into the starter recipe `relaunch init` made (each line it
# changes must be there once, or the starter changed under this test)
EDITOR = '''#!{python}
import sys
path = sys.argv[1]
text = open(path).read()
for old, new in [
    ('  command: python train.py --resume "{{{{ checkpoint }}}}"',
     '  command: python train.py --out {{{{ checkpoint_dir }}}} --resume "{{{{ checkpoint }}}}"'),
    ("  remote: ./store/my-run", "  remote: {store}"),
    ("  # files:", "  files:"),
    ("  #   train.py: ~/work/train.py", "    train.py: ~/work/train.py"),
]:
    assert text.count(old) == 1, f"the starter recipe has no line {{old!r}}"
    text = text.replace(old, new)
open(path, "w").write(text)
'''


def quickstarts() -> list[str]:
    """The sh blocks of the README's Quickstart section."""
    section = (REPO / "README.md").read_text().split("\n## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    assert len(blocks) == 2, "the README's quickstart has other sh blocks than these tests run"
    return blocks


def run_block(block: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """One README block in bash as the user runs it, line for line; stops at the first line that
    fails and names it."""
    argv, env = as_user(env, ["bash", "-c", "set -euxo pipefail\n" + block])
    run = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    ran = [line for line in run.stderr.splitlines() if line.startswith("+ ")]
    assert run.returncode == 0, f"README line failed (exit {run.returncode}): {ran[-1] if ran else '?'}\n" \
        + run.stdout[-3000:] + run.stderr[-5000:]
    return run


def on_box(env: dict[str, str], box: Instance, command: str, input: str | None = None, check: bool = True) -> str:
    """`ssh` as the user runs it: their key, their known_hosts (the `yes` to a new host key given by
    accept-new)."""
    argv, env = as_user(env, ["ssh", "-p", str(box.port), "-o", "BatchMode=yes", "-o",
                              "StrictHostKeyChecking=accept-new", f"{box.user}@{box.address}", command])
    run = subprocess.run(argv, env=env, input=input, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 or not check, f"ssh {box.host} {command}: {run.stderr}"
    return run.stdout


@pytest.mark.parametrize("key_in", ["home", "agent"])
def test_the_first_quickstart_adopts_evacuates_and_resumes_on_the_next_box(tmp_path, sandbox, agent, key_in):
    if key_in == "home":
        env = new_user(tmp_path / "home")
    else:  # the same key, only in ssh-agent: nothing in ~/.ssh
        key = tmp_path / "keys" / "id_ed25519"
        env = {**new_user(tmp_path / "home", key=key), "SSH_AUTH_SOCK": agent}
        subprocess.run(["ssh-add", str(key)], env=env, check=True, capture_output=True)
    box, _ = sandbox.by_cli("--image", "runpod", env=env)
    nxt, _ = sandbox.by_cli("--image", "runpod", env=env)
    # what the user did by hand on the box: a venv on the volume, the code, training in tmux
    on_box(env, box, "python3 -m venv /workspace/venv && mkdir -p /workspace/work")
    on_box(env, box, "cat > /workspace/work/train.py", input=TRAINER)
    on_box(env, box, "tmux new-session -d -s train 'cd /workspace/work && /workspace/venv/bin/python train.py "
                     "--out /workspace/ckpt > /workspace/train.log 2>&1'")
    wait_for("the hand-started run's first checkpoint",
             lambda: on_box(env, box, "ls /workspace/ckpt", check=False).strip() != "", timeout=120)

    work = tmp_path / "mine"
    work.mkdir()
    run = run_block(quickstarts()[0], work, {**env, "HOST": box.host, "NEXT": nxt.host})
    assert f"safe to destroy {box.host}" in run.stderr

    log = on_box(env, box, "cat /workspace/train.log")
    stopped = re.search(r"stopped at step (\d+)", log)
    assert stopped, f"the training on HOST did not stop when evacuate --stop asked it to\n{log[-500:]}\n{run.stderr}"
    step = int(stopped.group(1))
    assert max(int(p.name[5:13]) for p in (work / "store").glob("*/ckpt-*.pt")) == step
    # the next box trains on from the step the first one stopped at
    wait_for(f"training on NEXT resumed from step {step}", lambda: f"resumed from step {step}\n" in on_box(
        env, nxt, "cat /workspace/train.log", check=False), timeout=120)
    wait_for("a step past it", lambda: f"step {step + 3} " in on_box(env, nxt, "cat /workspace/train.log"),
             timeout=120)


def test_the_second_quickstart_starts_a_new_run_and_pins_its_env(tmp_path, sandbox):
    env = new_user(tmp_path / "home")
    box, _ = sandbox.by_cli("--image", "runpod", env=env)
    work = tmp_path / "mine"
    work.mkdir()
    (work / "train.py").write_text(TRAINER)
    editor = tmp_path / "edit-recipe"
    editor.write_text(EDITOR.format(python=sys.executable, store=tmp_path / "stores" / "my-run"))
    editor.chmod(0o755)

    run_block(quickstarts()[1], work, {**env, "HOST": box.host, "EDITOR": str(editor)})
    wait_for("the new run training on HOST", lambda: re.search(r"^fresh start\n(.*\n)*step 3 ", on_box(
        env, box, "cat ~/my-run.log"), re.M), timeout=120)
    assert (work / "requirements.lock").is_file()
    assert yaml.safe_load((work / "recipe.yaml").read_text())["env"]["lock"] == "requirements.lock"
