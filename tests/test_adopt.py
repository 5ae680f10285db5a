"""`relaunch adopt HOST`: a run started by hand (over ssh, in tmux, from a venv made by hand) on a
real sandbox instance becomes a recipe, read-only there; `evacuate` works with it at once and
`up` on another instance resumes from what was evacuated.
"""

from __future__ import annotations

import json
import os
import pty
import re
import shlex
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import yaml

from e2e import EXAMPLE, cli_env, run_cli, wait_for
from relaunch import sandbox as sb

# A trainer that needs nothing but the standard library (the venv stays empty): prints a step
# line, saves every --save-every steps (write NAME.tmp, then rename), resumes from --resume.
TINY_TRAINER = r'''
import argparse, os, time
from helpers import say

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=100000)
p.add_argument("--save-every", type=int, default=5)
p.add_argument("--sleep", type=float, default=0.2)
p.add_argument("--config", default="")
p.add_argument("--resume", default="", help="checkpoint to resume from")
p.add_argument("--hub-token", default="")
a = p.parse_args()
os.makedirs(a.out, exist_ok=True)
start = int(open(a.resume).read()) if a.resume else 0
for step in range(start + 1, a.steps + 1):
    time.sleep(a.sleep)
    say(f"step {step} loss 0.5")
    if step % a.save_every == 0:
        path = os.path.join(a.out, f"ckpt-{step:08d}.pt")
        with open(path + ".tmp", "w") as f:
            f.write(str(step))
        os.replace(path + ".tmp", path)
'''
HELPERS = "def say(text):\n    print(text, flush=True)\n"

# What the instance looks like, to show adopt changed nothing: every file under the home and /tmp
# (type, size, mtime, ctime, mode), the processes of this instance (its mount namespace, without
# sshd and this snapshot's own session) and the tmux sessions. Run with -I -S -B: it writes nothing.
SNAPSHOT = r'''
import os, subprocess
me = os.readlink("/proc/self/ns/mnt")
sid = os.getsid(0)
out = ["## files"]
for top in (os.environ["HOME"], "/tmp"):
    for folder, dirs, files in os.walk(top):
        for name in sorted(dirs + files):
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            out.append(f"{path} {st.st_mode:o} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}")
out.append("## processes")
for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
    try:
        if os.readlink(f"/proc/{pid}/ns/mnt") != me or os.getsid(pid) == sid:
            continue
        comm = open(f"/proc/{pid}/comm").read().strip()
        argv = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        continue
    if not comm.startswith("sshd"):
        out.append(f"{pid} {os.getpgid(pid)} {argv}")
out.append("## tmux")
sock = f"/tmp/tmux-{os.getuid()}/default"
out.append(subprocess.run(["tmux", "-S", sock, "ls", "-F", "#{session_name} #{session_created} #{session_windows}"],
                          capture_output=True, text=True).stdout)
print("\n".join(out))
'''


def snapshot(ssh, inst) -> str:
    return ssh(inst, f"python3 -I -S -B -c {shlex.quote(SNAPSHOT)}").stdout


def unwrap(logged: str) -> str:
    """relaunch sends `exec bash -c '<pgid line>\\n<command>'`; the command is the rest."""
    argv = shlex.split(logged)
    assert argv[:3] == ["exec", "bash", "-c"] and len(argv) == 4, logged[:200]
    return argv[3].partition("\n")[2]


def bare_venv(ssh, inst, trainer: str = TINY_TRAINER) -> None:
    """What a user does by hand: a venv, and the job's files in ~/work."""
    ssh(inst, "python3.11 -m venv --without-pip ~/venv && mkdir -p ~/work")
    ssh(inst, "cat > ~/work/train.py", input=trainer)
    ssh(inst, "cat > ~/work/helpers.py", input=HELPERS)
    ssh(inst, "printf 'lr: 0.1\\n' > ~/work/config.yaml")


def start_in_tmux(ssh, inst, session: str, command: str, prefix: str = "") -> None:
    ssh(inst, f"{prefix}tmux new-session -d -s {session} {shlex.quote('cd ~/work && ' + command)}")


def pane_pid(ssh, inst, session: str) -> int:
    return int(ssh(inst, f"tmux list-panes -t ={session} -F '#{{pane_pid}}'").stdout.split()[0])


def has_checkpoint(ssh, inst, folder: str, step: int) -> bool:
    names = ssh(inst, f"ls {folder} 2>/dev/null || true").stdout.split()
    return any(int(m.group(1)) >= step for n in names if (m := re.fullmatch(r"ckpt-(\d+)\.pt", n)))


def adopt(host: str, *args: str, home: Path, key: Path) -> subprocess.CompletedProcess[str]:
    return run_cli("adopt", host, "--set", f"ssh.key={key}", *args, home=home)


def recipe_notes(text: str) -> dict[str, str]:
    """key -> the comment lines right above it, in the recipe adopt wrote."""
    notes, comment = {}, []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped[1:].strip())
        elif ":" in stripped:
            notes[stripped.split(":", 1)[0].strip('"')] = " ".join(comment)
            comment = []
    return notes


# -- 1: the example training, started by hand --------------------------------------------------------
def test_the_example_training_started_by_hand_becomes_a_recipe_evacuate_and_up_work(
        tmp_path, sandbox, ssh, ssh_key, package_index):
    home = tmp_path / "state"
    first = sandbox(index_dir=package_index, command_log=True)
    ssh(first, "mkdir -p ~/work && python3.11 -m venv ~/venv")
    ssh(first, "cat > ~/work/train.py", input=(EXAMPLE / "train.py").read_text())
    ssh(first, "cat > ~/requirements.txt", input=(EXAMPLE / "requirements.lock").read_text())
    ssh(first, f"~/venv/bin/pip install -q --index-url {first.index_url} -r ~/requirements.txt", timeout=600)
    # a save every 10 s: evacuate's rounds catch the newest even on a loaded machine (a save every
    # 2 s could outrun them, as `evacuate` then says: stop training first)
    start_in_tmux(ssh, first, "example", "~/venv/bin/python train.py --out ~/ckpt --layout files --steps 2000 "
                                         "--save-every 50 --sleep 0.2; echo training ended")
    wait_for("a checkpoint of the hand-started run", lambda: has_checkpoint(ssh, first, "~/ckpt", 50), timeout=120)

    # the training holds still while adopt reads, so that any change on the instance is adopt's (the
    # trainer only: tmux would continue its pane's own process, the shell, if that stopped)
    trainer = int(ssh(first, f"ps -o pid= --ppid {pane_pid(ssh, first, 'example')}").stdout.split()[0])
    ssh(first, f"kill -STOP {trainer}")
    try:
        before = snapshot(ssh, first)
        sent_before = len(sb.commands(first.name))
        out = tmp_path / "adopted" / "recipe.yaml"
        out.parent.mkdir()
        result = adopt(first.host, "-o", str(out), "--json", "--set", f"env.index_url={first.index_url}",
                       home=home, key=ssh_key)
        sent = sb.commands(first.name)[sent_before:]
        after = snapshot(ssh, first)
    finally:
        ssh(first, f"kill -CONT {trainer}")
    assert result.returncode == 0, result.stderr
    assert after == before                                   # not one file, process or session changed
    report = json.loads(result.stdout)
    assert Counter(unwrap(c) for c in sent) == Counter(report["reads"])     # it ran only what it says it read
    assert all(r.startswith(("py=$(command -v python3", "printf %s", "if [ -d ")) for r in report["reads"])

    facts = {f["key"]: f for f in report["facts"]}
    assert facts["checkpoint.dir"]["value"] == "~/ckpt" and not facts["checkpoint.dir"]["guess"]
    assert facts["checkpoint.layout"]["value"] == "files" and facts["env.venv"]["value"] == "~/venv"
    assert "/root/venv/pyvenv.cfg" in facts["env.venv"]["evidence"]
    assert facts["env.python"]["value"] == "3.11"
    assert "tmux session example" in facts["training"]["evidence"]
    recipe = yaml.safe_load(out.read_text())
    assert recipe["name"] == "example" and recipe["run"]["workdir"] == "~/work"
    assert recipe["run"]["command"].startswith("python train.py --out ~/ckpt --layout files --steps 2000")
    assert '--resume "{{ checkpoint }}"' in recipe["run"]["command"]
    assert recipe["env"]["files"] == {"train.py": "~/work/train.py"}
    assert (out.parent / "train.py").read_text() == (EXAMPLE / "train.py").read_text()
    lock = (out.parent / "requirements.lock").read_text().splitlines()
    assert sorted(x for x in lock if not x.startswith("#")) == \
        sorted((EXAMPLE / "requirements.lock").read_text().split())   # the venv's pip freeze, pip itself left out
    assert run_cli("check", str(out), home=home).returncode == 0

    evacuated = run_cli("evacuate", str(out), first.host, home=home)
    assert evacuated.returncode == 0, evacuated.stderr
    assert f"safe to destroy {first.host}" in evacuated.stderr
    store = out.parent / "store" / "example"
    saved = json.loads((store / ".relaunch" / "manifest.json").read_text())["checkpoints"]
    newest = max(saved, key=lambda c: c["step"])

    second = sandbox(user="ubuntu", index_dir=package_index)
    up = run_cli("up", str(out), second.host, home=home)
    assert up.returncode == 0, up.stderr
    log = ssh(second, "cat ~/example.log").stdout
    assert f"resumed from /home/ubuntu/ckpt/{newest['name']} at step {newest['step']}" in log


# -- 2: two candidate sessions --------------------------------------------------------------------------
def run_on_a_terminal(args: list[str], home: Path, answer: str | None) -> tuple[int, str, str]:
    """`relaunch ARGS` with a terminal as its stdin (a pty); `answer` is typed once it asks."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "relaunch.cli", *args], stdin=slave, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=cli_env(home))
    os.close(slave)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(lambda: proc.stderr.read(1), "")), daemon=True)
    reader.start()
    try:
        if answer is not None:
            wait_for("the question", lambda: "which one?" in "".join(err), timeout=120, every=0.1)
            os.write(master, answer.encode() + b"\n")
        out = proc.stdout.read()
        proc.wait(timeout=120)
        reader.join(timeout=30)
    finally:
        proc.kill()
        os.close(master)
    return proc.returncode, out, "".join(err)


def test_two_candidate_sessions_it_asks_and_session_picks(tmp_path, sandbox, ssh, ssh_key):
    home, inst = tmp_path / "state", sandbox()
    bare_venv(ssh, inst)
    start_in_tmux(ssh, inst, "alpha", "~/venv/bin/python train.py --out ~/ckpt-a --save-every 2")
    start_in_tmux(ssh, inst, "beta", "~/venv/bin/python train.py --out ~/ckpt-b --save-every 2")
    key = ["--set", f"ssh.key={ssh_key}"]

    alone = run_cli("adopt", inst.host, "-o", str(tmp_path / "none.yaml"), *key, home=home)
    assert alone.returncode == 2, alone.stderr
    assert "2 runs on" in alone.stderr and "could be the training" in alone.stderr
    assert "tmux session alpha" in alone.stderr and "tmux session beta" in alone.stderr
    assert "--session" in alone.stderr and "Traceback" not in alone.stderr
    assert not (tmp_path / "none.yaml").exists()

    asked = tmp_path / "asked" / "recipe.yaml"
    asked.parent.mkdir()
    code, out, err = run_on_a_terminal(["adopt", inst.host, "-o", str(asked), *key], home, answer="2")
    assert code == 0, err
    assert "which one? [1-2]" in err and "1) tmux session alpha" in err and "2) tmux session beta" in err
    recipe = yaml.safe_load(asked.read_text())
    assert recipe["name"] == "beta" and "--out ~/ckpt-b" in recipe["run"]["command"]

    picked = tmp_path / "picked" / "recipe.yaml"
    picked.parent.mkdir()
    code, out, err = run_on_a_terminal(["adopt", inst.host, "-o", str(picked), "--session", "alpha", *key], home,
                                       answer=None)
    assert code == 0, err
    assert "which one?" not in err
    recipe = yaml.safe_load(picked.read_text())
    assert recipe["name"] == "alpha" and "--out ~/ckpt-a" in recipe["run"]["command"]


# -- 3: a run with no checkpoint yet ---------------------------------------------------------------------
def test_a_run_without_a_checkpoint_yet_still_gets_a_recipe_with_the_folder_as_a_guess(
        tmp_path, sandbox, ssh, ssh_key):
    home, inst = tmp_path / "state", sandbox()
    bare_venv(ssh, inst)
    start_in_tmux(ssh, inst, "fresh", "~/venv/bin/python train.py --out ~/runs/first --save-every 100000 "
                                      "--config config.yaml")
    wait_for("the run to start", lambda: "step 1 " in ssh(inst, "tmux capture-pane -p -t =fresh:").stdout)
    out = tmp_path / "recipe.yaml"
    result = adopt(inst.host, "-o", str(out), "--json", home=home, key=ssh_key)
    assert result.returncode == 0, result.stderr
    facts = {f["key"]: f for f in json.loads(result.stdout)["facts"]}
    assert facts["checkpoints"]["value"] == "none yet" and facts["checkpoints"]["guess"]
    assert facts["checkpoint.dir"]["value"] == "~/runs/first" and facts["checkpoint.dir"]["guess"]
    assert "--out" in facts["checkpoint.dir"]["evidence"]
    text = out.read_text()
    recipe = yaml.safe_load(text)
    assert recipe["checkpoint"]["dir"] == "~/runs/first"
    assert recipe_notes(text)["dir"].startswith("GUESS: the command's --out /root/runs/first; it holds nothing yet")
    assert recipe["env"]["files"] == {"train.py": "~/work/train.py", "helpers.py": "~/work/helpers.py",
                                      "config.yaml": "~/work/config.yaml"}     # the script, its import, its config
    assert (tmp_path / "config.yaml").read_text() == "lr: 0.1\n"
    checked = run_cli("check", str(out), home=home)
    assert checked.returncode == 0, checked.stderr
    # `relaunch check` lists the guesses the recipe marks, the folder among them
    assert re.search(r"\n  checkpoint.dir: ~/runs/first +# .*recipe.yaml:\d+, GUESS\n", checked.stdout), checked.stdout
    assert re.search(r"guess\(es\) left.*\n(  .*\n)*  checkpoint.dir \(.*\) +the command's --out /root/runs/first",
                     checked.stdout), checked.stdout
    # the report on the screen says so too, the guess marked
    (tmp_path / "again").mkdir()
    shown = adopt(inst.host, "-o", str(tmp_path / "again" / "recipe.yaml"), home=home, key=ssh_key)
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"checkpoints\s+none yet\n\s+GUESS: no complete checkpoint on the instance yet", shown.stdout)


# -- 4: nothing trains -----------------------------------------------------------------------------------
def test_an_instance_where_nothing_trains_is_a_clear_error_exit_2_and_unreachable_is_3(
        tmp_path, sandbox, ssh, ssh_key):
    home, inst = tmp_path / "state", sandbox()
    ssh(inst, "tmux new-session -d -s idle 'sleep 600'")
    out = tmp_path / "recipe.yaml"
    result = adopt(inst.host, "-o", str(out), home=home, key=ssh_key)
    assert result.returncode == 2, result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(error) == 1 and error[0].startswith(f"Error: root@{inst.address}: nothing is training there")
    assert "tmux session(s) idle run no Python process" in error[0]
    assert "Traceback" not in result.stderr and not out.exists()

    closed = adopt(f"root@{inst.address}:2", "-o", str(out), "--set", "ssh.wait=0", home=home, key=ssh_key)
    assert closed.returncode == 3, closed.stderr
    assert "Traceback" not in closed.stderr and not out.exists()


# -- 5: a secret in the training's environment -------------------------------------------------------------
def test_a_secret_in_the_environment_becomes_a_name_in_env_secrets_its_value_nowhere(tmp_path, sandbox, ssh, ssh_key):
    home, inst = tmp_path / "state", sandbox(command_log=True)
    token, key_value = "hf_adoptTestSecretValue0123456789", "wandbKeyThatMustNotLeave42"
    bare_venv(ssh, inst)
    ssh(inst, "cat > ~/work/private.yaml", input=f"hub_token: {token}\n")
    # a secret in the training's environment (set by the command that starts it) and on its command line,
    # another in the tmux server's environment, and a config file holding one
    start_in_tmux(ssh, inst, "secret", f"WANDB_MODE=offline HF_TOKEN={token} ~/venv/bin/python train.py "
                                       f"--out ~/ckpt --save-every 2 --config private.yaml --hub-token {token}",
                  prefix=f"WANDB_API_KEY={key_value} ")
    wait_for("a checkpoint", lambda: has_checkpoint(ssh, inst, "~/ckpt", 2))
    out = tmp_path / "adopted" / "recipe.yaml"
    out.parent.mkdir()
    sent_before = len(sb.commands(inst.name))
    result = adopt(inst.host, "-o", str(out), "--json", home=home, key=ssh_key)
    assert result.returncode == 0, result.stderr
    sent = sb.commands(inst.name)[sent_before:]
    recipe = yaml.safe_load(out.read_text())
    assert {"HF_TOKEN", "WANDB_API_KEY"} <= set(recipe["env"]["secrets"])
    assert recipe["env"]["vars"] == {"WANDB_MODE": "offline"}
    assert '--hub-token "${HF_TOKEN}"' in recipe["run"]["command"]       # the value, by the name it came under
    assert "private.yaml" not in recipe["env"]["files"] and not (out.parent / "private.yaml").exists()
    warnings = json.loads(result.stdout)["warnings"]
    assert any("private.yaml" in w and "holds the value of HF_TOKEN" in w for w in warnings)
    written = [p for p in out.parent.rglob("*") if p.is_file()]
    assert {p.name for p in written} >= {"recipe.yaml", "requirements.lock", "train.py", "helpers.py"}
    places = {"stdout": result.stdout, "stderr": result.stderr, "debug log": (home / "debug.log").read_text(),
              "adopt's commands on the instance": "\n".join(sent)}
    # and what the instance answered: each of adopt's reads again, its output as this machine received it
    for n, command in enumerate(json.loads(result.stdout)["reads"]):
        answer = ssh(inst, command)
        places[f"the answer to read {n}"] = answer.stdout + answer.stderr
    places |= {str(p): p.read_text(errors="replace") for p in written}
    for value in (token, key_value):
        leaked = [where for where, text in places.items() if value in text]
        assert leaked == [], f"{value} leaked into {leaked}"


# -- 6: a command line longer than one argument may be -------------------------------------------------
def test_a_command_line_of_many_long_arguments_is_read(tmp_path, sandbox, ssh, ssh_key):
    """Every path-like argument of the training's command line is looked at on the instance; read
    with the script as one argument, 100 arguments of 2000 characters were over the kernel's 128 KiB
    limit on one argument (E2BIG). The adopt script comes on stdin."""
    home, inst = tmp_path / "state", sandbox()
    bare_venv(ssh, inst, "import sys, time\nfrom helpers import say\nfor step in range(1, 100000):\n"
                         "    time.sleep(0.2)\n    say(f'step {step} loss 0.5')\n")
    many = " ".join(f"--data{n}=/root/data/{'x' * 1990}{n}" for n in range(100))
    # too long for one ssh command line too: the user's own script starts it
    ssh(inst, "cat > ~/work/long.sh", input=f"exec ~/venv/bin/python train.py {many}\n")
    start_in_tmux(ssh, inst, "long", "bash long.sh")
    wait_for("the long run to train", lambda: "step 3 " in ssh(inst, "tmux capture-pane -p -t =long:").stdout,
             timeout=120)
    out = tmp_path / "adopted" / "recipe.yaml"
    out.parent.mkdir()
    adopted = adopt(inst.host, "-o", str(out), home=home, key=ssh_key)
    assert adopted.returncode == 0, adopted.stderr[-3000:]
    assert "--data99={{ home }}/data/" in yaml.safe_load(out.read_text())["run"]["command"]
