"""What must never go wrong: host keys, shell injection, half-copied checkpoints, bad recipes.

All against real sshd instances (sandbox) through the real CLI, except where no host is needed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from e2e import plain_recipe, run_cli, start_cli, wait_for
from relaunch import sandbox as sb


def test_changed_host_key_is_refused_until_accepted(tmp_path, sandbox, ssh_key):
    home = tmp_path / "state"
    first = sandbox()
    recipe = plain_recipe(tmp_path, name="keys", key=ssh_key)
    ok = run_cli("plan", str(recipe), first.host, home=home)
    assert ok.returncode == 0, ok.stderr
    assert f"first contact with {first.address}" in ok.stderr and first.host_key_fingerprint in ok.stderr
    recorded = (home / "known_hosts").read_text()

    sb.destroy(first.name)                      # the provider gives the address to a new instance
    second = sandbox(address=first.address)
    assert second.address == first.address and second.host_key_fingerprint != first.host_key_fingerprint

    for command in (["plan", str(recipe), second.host], ["up", str(recipe), second.host]):
        refused = run_cli(*command, home=home)
        assert refused.returncode == 3, refused.stderr
        assert "HOST KEY CHANGED" in refused.stderr
        assert first.host_key_fingerprint in refused.stderr and second.host_key_fingerprint in refused.stderr
        assert "Traceback" not in refused.stderr
    evac = run_cli("evacuate", str(recipe), second.host, home=home)
    assert evac.returncode == 6 and "DO NOT destroy" in evac.stderr
    assert (home / "known_hosts").read_text() == recorded      # nothing was replaced behind the user's back

    accepted = run_cli("up", "--dry-run", "--accept-new-host-key", str(recipe), second.host, home=home)
    assert accepted.returncode == 0, accepted.stderr
    assert f"first contact with {second.address}" in accepted.stderr
    assert run_cli("plan", str(recipe), second.host, home=home).returncode == 0    # the new key is the recorded one

    # a pin from the provider's console wins: a wrong one is refused even on first contact
    pinned = run_cli("plan", str(recipe), second.host, "--set", f"ssh.host_key={first.host_key_fingerprint}",
                     home=tmp_path / "fresh-state")
    assert pinned.returncode == 3 and "does not match the pinned" in pinned.stderr
    right = run_cli("plan", str(recipe), second.host, "--set", f"ssh.host_key={second.host_key_fingerprint}",
                    home=tmp_path / "fresh-state")
    assert right.returncode == 0, right.stderr


HOSTILE = "it's \"$(touch /tmp/pwned-var)\" `touch /tmp/pwned-tick`; touch /tmp/pwned-semi & echo $HOME"


def test_shell_metacharacters_in_recipe_values_stay_data(tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    first, second = sandbox(), sandbox(user="ubuntu")
    recipe = plain_recipe(
        tmp_path, name="quoting", key=ssh_key,
        command='printf %s "$WEIRD" > ~/weird.txt; printf %s "{{ checkpoint }}" > ~/ckpt.txt; sleep 600',
        env={"vars": {"WEIRD": HOSTILE}},
        checkpoint={"dir": "~/ck pt/$(touch pwned-dir)"},
        run={"workdir": "~/work dir;touch pwned-wd"},
    )
    # a checkpoint whose very name is an attack, written by "training" on the first instance
    name = "ckpt-$(touch pwned-name) `id`-00000005.pt"
    ssh(first, "mkdir -p ~/'ck pt/$(touch pwned-dir)' && head -c 4096 /dev/urandom > "
               f"~/'ck pt/$(touch pwned-dir)'/'{name}'")
    evac = run_cli("evacuate", str(recipe), first.host, home=home)
    assert evac.returncode == 0, evac.stderr
    assert (tmp_path / "store" / name).exists()

    up = run_cli("up", str(recipe), second.host, home=home)
    assert up.returncode == 0, up.stderr
    wait_for("the command to write its files", lambda: ssh(second, "cat ~/ckpt.txt 2>/dev/null", check=False).stdout)
    assert ssh(second, "cat ~/weird.txt").stdout == HOSTILE
    assert ssh(second, "cat ~/ckpt.txt").stdout == f"/home/ubuntu/ck pt/$(touch pwned-dir)/{name}"
    for inst in (first, second):
        assert ssh(inst, "find ~ /tmp -name 'pwned-*'").stdout == ""
    assert not list(Path("/tmp").glob("pwned-*")) and not list(Path.cwd().glob("pwned-*"))


def test_instance_vanishing_mid_evacuate_exits_6_and_trusts_nothing_partial(tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    inst = sandbox(rate="2mbit")
    recipe = plain_recipe(tmp_path, name="vanish", key=ssh_key)
    ssh(inst, "mkdir -p ~/ckpt && head -c 2000 /dev/urandom > ~/ckpt/ckpt-00000005.pt")
    assert run_cli("evacuate", str(recipe), inst.host, home=home).returncode == 0
    ssh(inst, "head -c 12000000 /dev/urandom > ~/ckpt/ckpt-00000010.pt")

    store = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-m", "relaunch.cli", "evacuate", str(recipe), inst.host],
                            env={**__import__("os").environ, "RELAUNCH_HOME": str(home)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for("the copy to be under way", lambda: any(
            p.is_file() or p.name.startswith(".") for p in (store / ".relaunch" / "partial").rglob("*")), timeout=60,
            every=0.1)
        partial = store / ".relaunch" / "partial"
        wait_for("half a megabyte copied", lambda: sum(f.stat().st_size for f in partial.rglob("*") if f.is_file())
                 >= 500_000, timeout=60, every=0.1)
        sb.destroy(inst.name)                     # preempted mid-copy
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 6, err
    assert "DO NOT destroy" in err and "safe to destroy" not in err
    manifest = json.loads((store / ".relaunch" / "manifest.json").read_text())
    assert [c["name"] for c in manifest["checkpoints"]] == ["ckpt-00000005.pt"]
    assert not (store / "ckpt-00000010.pt").exists()


BROKEN = {
    "typo.yaml": ("name: t\nenv:\n  python: '3.11'\n  lokc: x.lock\ncheckpoint: {remote: ./s}\nrun: {command: x}\n",
                  "typo.yaml:4", "lock"),
    "tabs.yaml": ("name: t\nenv:\n\tpython: '3.11'\n", "tabs.yaml:3", None),
    "name.yaml": ("name: 'my run'\nenv: {python: '3.11'}\ncheckpoint: {remote: ./s}\nrun: {command: x}\n",
                  "name.yaml:1", "name"),
    "undefined.yaml": ("name: t\nenv: {python: '3.11'}\ncheckpoint: {remote: ./s}\n"
                       "run:\n  command: python train.py --resume {{ chekpoint }}\n", "undefined.yaml:5", "chekpoint"),
    "float.yaml": ("name: t\nenv: {python: 3.10}\ncheckpoint: {remote: ./s}\nrun: {command: x}\n",
                   "float.yaml:2", '"3.10"'),
}


@pytest.mark.sandbox  # a minute of CLI runs: one per broken recipe
def test_broken_recipes_exit_2_with_file_line_before_any_connection(tmp_path):
    for filename, (text, where, mention) in BROKEN.items():
        path = tmp_path / filename
        path.write_text(text)
        for command in (["up", str(path), "root@127.0.0.1:9"], ["evacuate", str(path), "127.0.0.1:9"],
                        ["plan", str(path), "127.0.0.1:9"], ["check", str(path)]):
            result = run_cli(*command, home=tmp_path / "state", timeout=60)
            assert result.returncode == 2, (filename, command, result.stderr)
            assert where in result.stderr, (filename, result.stderr)
            if mention:
                assert mention in result.stderr, (filename, result.stderr)
            assert "connecting" not in result.stderr and "Traceback" not in result.stderr


def test_up_waits_while_the_instance_boots_then_gives_up_with_exit_3(tmp_path, sandbox, ssh_key):
    home = tmp_path / "state"
    recipe = plain_recipe(tmp_path, name="boot", key=ssh_key)
    # refused, then sshd without our key, then ready: sshd starts 15 s after creation (a loaded
    # machine's `relaunch` start still finds it not up), the key once relaunch was refused for want of it
    booting = sandbox(boot_delay=15, key_delay=3600)
    err = tmp_path / "up.err"
    up = start_cli("up", str(recipe), booting.host, "--set", "ssh.wait=60", home=home, err=err)
    try:
        wait_for("relaunch refused for want of its key", lambda: "authentication failed" in err.read_text(),
                 timeout=120, every=0.1)
        sb.release_key(booting.name)
        up.wait(timeout=300)
    finally:
        up.kill()
    assert up.returncode == 0, err.read_text()
    assert "connection refused" in err.read_text() and "retrying" in err.read_text()
    assert "authentication failed" in err.read_text()
    assert "training is running" in err.read_text()

    never = sandbox(boot_delay=3600)
    result = run_cli("up", str(recipe), never.host, "--set", "ssh.wait=3", home=home)
    assert result.returncode == 3
    assert "could not connect within ssh.wait=3s: connection refused" in result.stderr


def test_a_wait_says_every_15s_what_it_waits_for_how_long_is_left_and_how_to_stop(tmp_path, sandbox, ssh_key):
    home = tmp_path / "state"
    recipe = plain_recipe(tmp_path, name="stopped", key=ssh_key)
    inst = sandbox()
    sb.stop(inst.name)                           # its address refuses until it is started: a booting instance
    err = tmp_path / "up.err"
    up = start_cli("up", str(recipe), inst.host, "--set", "ssh.wait=600", home=home, err=err)
    try:
        wait_for("two progress lines", lambda: err.read_text().count("still waiting for SSH") >= 2,
                 timeout=120, every=0.2, explain=err.read_text)
        ticks = err.read_text()
        sb.start(inst.name)
        up.wait(timeout=300)
    finally:
        up.kill()
    assert up.returncode == 0, err.read_text()
    line = next(ln for ln in ticks.splitlines() if "still waiting for SSH" in ln)
    assert line.startswith(f"{inst.user}@{inst.address}: still waiting for SSH: connection refused"), line
    assert "s left of ssh.wait=600s, Ctrl-C stops" in line, line
    # the reason once, then the progress lines: not a line per attempt
    assert ticks.count("connection refused (sshd not listening yet?); retrying") == 1, ticks
    assert "training is running" in err.read_text()


def test_store_without_a_verified_checkpoint_is_exit_5(tmp_path, sandbox, ssh_key):
    home = tmp_path / "state"
    inst = sandbox()
    recipe = plain_recipe(tmp_path, name="nockpt", key=ssh_key)
    store = tmp_path / "store"
    (store / ".relaunch").mkdir(parents=True)
    (store / ".relaunch" / "manifest.json").write_text(json.dumps({"format": 1, "recipe": "nockpt",
                                                                    "checkpoints": []}))
    (store / "ckpt-00000100.pt").write_bytes(b"unverified")
    result = run_cli("up", str(recipe), inst.host, home=home)
    assert result.returncode == 5, result.stderr
    assert "no verified checkpoint" in result.stderr


def test_plan_shows_exact_commands_and_changes_nothing(tmp_path, sandbox, ssh, ssh_key):
    inst = sandbox()
    recipe = plain_recipe(tmp_path, name="planned", key=ssh_key, env={"lock": str(Path(__file__).parents[1] /
                                                                                   "examples/pytorch/requirements.lock"),
                                                                      "index_url": "http://127.0.0.1:8765/simple/"})
    result = run_cli("plan", str(recipe), inst.host, home=tmp_path / "state")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "export PIP_INDEX_URL=http://127.0.0.1:8765/simple/" in out
    assert '-m pip install --progress-bar off -r "$lock"' in out
    assert "tmux new-session -d -s planned" in out
    assert "empty: fresh start" in out
    assert "GPUs: none (fine for a CPU run)" in result.stderr
    assert ssh(inst, "ls -A ~").stdout == ""


def test_wrong_python_is_exit_4_before_any_change(tmp_path, sandbox, ssh, ssh_key):
    """With pip (uv would provide the Python: tests/test_python_indexes.py)."""
    inst = sandbox()
    recipe = plain_recipe(tmp_path, name="py", key=ssh_key, env={"python": "3.9", "installer": "pip"})
    result = run_cli("up", str(recipe), inst.host, home=tmp_path / "state")
    assert result.returncode == 4
    assert "env.python is 3.9" in result.stderr and "python3 is 3.11" in result.stderr
    assert "env.installer: uv" in result.stderr
    assert ssh(inst, "ls -A ~").stdout == ""


def test_preflight_refuses_a_disk_too_small_for_the_checkpoint(tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    big, small = sandbox(), sandbox(disk="2M")
    recipe = plain_recipe(tmp_path, name="disk", key=ssh_key)
    ssh(big, "mkdir -p ~/ckpt && head -c 3000000 /dev/urandom > ~/ckpt/ckpt-00000005.pt")
    assert run_cli("evacuate", str(recipe), big.host, home=home).returncode == 0
    result = run_cli("up", str(recipe), small.host, home=home)
    assert result.returncode == 4, result.stderr
    assert "the checkpoint needs 2.9 MiB but only" in result.stderr
    assert ssh(small, "ls -A ~").stdout == ""                     # refused before changing anything


def test_up_on_several_hosts_gives_each_its_rank(tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    hosts = [sandbox(), sandbox(user="ubuntu")]
    recipe = plain_recipe(tmp_path, name="multi", key=ssh_key,
                          command='echo "{{ node_rank }}/{{ nnodes }} {{ master_addr }}" > ~/rank.txt; sleep 600')
    result = run_cli("up", str(recipe), *[h.host for h in hosts], home=home)
    assert result.returncode == 0, result.stderr
    for rank, inst in enumerate(hosts):
        text = wait_for("the rank file", lambda inst=inst: ssh(inst, "cat ~/rank.txt 2>/dev/null", check=False).stdout)
        assert text.strip() == f"{rank}/2 {hosts[0].address}"


@pytest.mark.parametrize("installer, named", [("uv", False), ("pip", False), ("uv", True)])
def test_an_index_token_is_never_on_a_command_line_in_plan_output_or_in_readable_files(
        tmp_path, sandbox, ssh, ssh_key, package_index, installer, named):
    """env.index_url may carry a token (`https://user:token@host/simple`), written in the recipe or
    (named) taken from a variable of this machine that the recipe names (`${NAME}`): pip and uv get
    it through their environment, never as an argument any user of the instance can read in `ps`,
    and relaunch shows it as `https://***@host/simple`."""
    home = tmp_path / "state"
    inst = sandbox(index_dir=package_index)
    # one token per run: the instances share this machine's process table, and the other
    # installer's run greps its own token (on a command line, for this test's `ps`) meanwhile
    token = f"SECRET{uuid.uuid4().hex[:12]}"
    # the sandbox's index ignores userinfo, so the install works with it as with a real one's token
    url = inst.index_url.replace("http://", f"http://tok:{token}@")
    lock = tmp_path / "requirements.lock"
    lock.write_text("mpmath==1.3.0\n")
    recipe = plain_recipe(tmp_path, name="tokenindex", key=ssh_key,
                          env={"lock": str(lock), "index_url": "${TEAM_INDEX_URL}" if named else url,
                               "installer": installer})
    env = {"TEAM_INDEX_URL": url} if named else {}
    assert named == (token not in recipe.read_text())

    shown = [run_cli("plan", str(recipe), inst.host, *extra, home=home, env=env) for extra in ((), ("--json",))]
    assert all(p.returncode == 0 for p in shown), shown[0].stderr + shown[1].stderr
    # a URL from a variable shows as *** whole: only its owner knows which part of it is secret
    assert ("export PIP_INDEX_URL=***" if named else "http://***@127.0.0.1") in shown[0].stdout

    # every command line on the machine (the instance shares its process table) while `up` runs
    recorder = ssh(inst, "nohup bash -c 'while :; do ps -eo args >> /tmp/ps.log; sleep 0.1; done' "
                         ">/dev/null 2>&1 & echo $!").stdout.strip()
    try:
        wait_for("the recorder", lambda: ssh(inst, "test -s /tmp/ps.log", check=False).returncode == 0, timeout=30)
        up = run_cli("up", str(recipe), inst.host, "-v", home=home, env=env)
    finally:
        ssh(inst, f"kill {recorder}")
    assert up.returncode == 0, up.stderr
    assert ssh(inst, "~/venvs/plain/bin/python -c 'import mpmath; print(mpmath.__version__)'").stdout.strip() == "1.3.0"
    recorded = ssh(inst, "cat /tmp/ps.log").stdout
    assert "relaunch.cli up" in recorded                     # it recorded while `up` ran
    assert token not in recorded
    for out in (*shown, up):
        assert token not in out.stdout + out.stderr
    readable = [p for p in home.rglob("*") if p.is_file() and p.stat().st_mode & 0o004 and
                token.encode() in p.read_bytes()]
    assert not readable
    on_instance = ssh(inst, f"find ~/.relaunch -type f -perm -o=r -exec grep -l {token} {{}} + || true").stdout
    assert not on_instance.strip()
