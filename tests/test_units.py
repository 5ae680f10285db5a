"""Pure pieces of the core: HOST parsing, facts, lock drift, shell quoting of scripts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from relaunch.errors import UsageError
from relaunch.host.facts import HostFacts, facts_script, parse_facts
from relaunch.host.spec import HostSpec
from relaunch.job import drift, pins
from relaunch.steps.preflight import apt_command


@pytest.mark.parametrize(
    "text, address, user, port",
    [
        ("1.2.3.4", "1.2.3.4", None, None),
        ("ubuntu@1.2.3.4", "1.2.3.4", "ubuntu", None),
        ("root@1.2.3.4:2222", "1.2.3.4", "root", 2222),
        ("gpu-box.example", "gpu-box.example", None, None),
        ("root@[2001:db8::1]:22", "2001:db8::1", "root", 22),
        ("[::1]", "::1", None, None),
    ],
)
def test_host_spec_forms(text: str, address: str, user: str | None, port: int | None) -> None:
    spec = HostSpec.parse(text)
    assert (spec.address, spec.user, spec.port) == (address, user, port)


@pytest.mark.parametrize("text", ["", "root@", "a@b@c:", "1.2.3.4:0", "1.2.3.4:99999", "1.2.3.4:x",
                                  "2001:db8::1", "[2001:db8::1", "h;rm -rf /", "$(id)@host"])
def test_host_spec_rejects(text: str) -> None:
    with pytest.raises(UsageError):
        HostSpec.parse(text)


def test_facts_script_runs_here_and_parses(tmp_path) -> None:
    """The real facts script, run by bash on this machine, parses into sensible facts."""
    venv = tmp_path / "no venv yet"
    script = facts_script("3.11", str(venv), str(tmp_path / "ck pt"), "no-such-session", ["bash", "nonexistent-pkg-x"])
    out = subprocess.run(["bash", "-s"], input=script, capture_output=True, text=True, check=True).stdout
    facts = parse_facts(out)
    assert facts.python.endswith(("python3.11", "python3"))
    assert facts.tools["tmux"] and facts.tools["rsync"]
    assert facts.free_ckpt > 0
    assert not facts.session_alive
    assert facts.venv_freeze is None
    assert facts.missing_apt == ["nonexistent-pkg-x"]
    assert facts.uid == os.getuid() and facts.is_root == (os.getuid() == 0)   # the quick layer runs rootless


def test_facts_find_this_recipes_run_outside_its_session_and_say_so(tmp_path) -> None:
    """A process running this recipe's run.sh, with no tmux session of it for this login: facts.sh
    finds it (this box's processes only), and "not running" is never the verdict."""
    from relaunch.host.facts import unseen_run
    from relaunch.host.spec import Target

    run_sh = f"{tmp_path}/.relaunch/unseen-run/run.sh"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", run_sh])
    try:
        def facts_of(name: str) -> HostFacts:
            script = facts_script("3.11", str(tmp_path / "v"), str(tmp_path / "ck"), name, [], name=name)
            return parse_facts(subprocess.run(["bash", "-s"], input=script, capture_output=True, text=True).stdout)

        facts = facts_of("unseen-run")
        assert {"uid": os.getuid(), "user": facts.user, "pid": proc.pid} in facts.runs
        found = unseen_run(facts, "unseen-run")
        assert found is not None and found.certain and found.owner == ""
        assert found.why.startswith("this recipe's training still runs on this box outside its tmux session "
                                    f"unseen-run (pid {proc.pid}")
        assert "relaunch up`, which would start a second training" in found.hint("status", Target("h", "root", 22))
        assert facts_of("unseen-other").runs == []                   # another recipe's run is not this one's
    finally:
        proc.kill()
        proc.wait()
    # another user's run: named, and the hint says how to look as that user, never to start one
    other = HostFacts(user="ubuntu", uid=1000, runs=[{"uid": 0, "user": "root", "pid": 42}])
    found = unseen_run(other, "s")
    assert found is not None and found.why == ("no run of this recipe is visible as ubuntu, but root runs it on this "
                                               "box (pid 42: its run.sh): the box's run is root's")
    assert found.hint("status", Target("203.0.113.7", "ubuntu", 40022)).startswith(
        "look as root: `relaunch status RECIPE root@203.0.113.7:40022`")
    tmux = unseen_run(HostFacts(user="ubuntu", uid=1000, other_tmux=[{"uid": 0, "user": "root", "pid": 7}]), "s")
    assert tmux is not None and not tmux.certain and "root has a tmux server on this box" in tmux.why
    hidden = unseen_run(HostFacts(user="ubuntu", uid=1000, ckpt_hidden="root /root"), "s")
    assert hidden is not None and hidden.why.startswith("ubuntu cannot look into /root (root's)")
    assert unseen_run(HostFacts(user="ubuntu", uid=1000), "s") is None


def test_facts_of_a_venv_list_its_packages(tmp_path) -> None:
    venv = tmp_path / "v"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True)
    script = facts_script("3.11", str(venv), str(tmp_path), "x", [])
    facts = parse_facts(subprocess.run(["bash", "-s"], input=script, capture_output=True, text=True).stdout)
    assert facts.venv_freeze == []


def test_facts_script_keeps_hostile_values_as_data(tmp_path) -> None:
    marker = tmp_path / "pwned"
    script = facts_script("3.11", f"/x/$(touch {marker})", f"'; touch {marker}; '", "s;touch " + str(marker), [])
    subprocess.run(["bash", "-s"], input=script, capture_output=True, text=True)
    assert not marker.exists()


def test_drift_and_pins() -> None:
    lock = ["# comment", "--index-url http://x", "torch==2.13.0+cpu", "typing_extensions==4.16.0", "Jinja2==3.1.6"]
    same = ["jinja2==3.1.6", "typing-extensions==4.16.0", "torch==2.13.0+cpu", "pip==24.0"]
    assert drift(lock, same) == []
    changed = ["jinja2==3.1.5", "torch==2.13.0+cpu", "rich==13"]
    assert drift(lock, changed) == ["jinja2: lock 3.1.6, installed 3.1.5", "extra rich==13",
                                    "missing typing-extensions==4.16.0"]
    assert pins(["pkg[extra]==1.0 ; python_version>'3'"]) == {"pkg": "1.0"}


def test_apt_command_uses_sudo_only_when_not_root() -> None:
    assert apt_command(["tmux"], root=True).startswith("env DEBIAN_FRONTEND")
    assert "sudo -n env" in apt_command(["tmux", "rsync"], root=False)


def test_url_userinfo_is_redacted_wherever_it_is_shown() -> None:
    from relaunch.ui import Redactor

    redact = Redactor()
    redact.add_urls(["https://__token__:pypi-SECRETa@pypi.example/simple",
                     "https://TOKENb42@other.example/simple/", "https://plain.example/simple"])
    text = ("Looking in indexes: https://__token__:pypi-SECRETa@pypi.example/simple, "
            "https://TOKENb42@other.example/x 401 for user __token__ with pypi-SECRETa; token TOKENb42; "
            "https://plain.example/simple; root@10.0.0.2:/ckpt")
    assert redact(text) == ("Looking in indexes: https://***@pypi.example/simple, "
                            "https://***@other.example/x 401 for user __token__ with ***; token ***; "
                            "https://plain.example/simple; root@10.0.0.2:/ckpt")


def test_env_files_uploads_get_a_deadline_that_grows_with_their_size(tmp_path) -> None:
    """A fixed deadline ends the upload of a big file (a tokenizer, a dataset shard) on a slow
    link; each upload gets as long as the slowest link relaunch plans for (rsync's rate) needs."""
    import json
    from pathlib import Path

    import yaml

    from relaunch.gather import env_files
    from relaunch.host.spec import Target
    from relaunch.job import Facts, Job, Node
    from relaunch.recipe import load_recipe
    from relaunch.steps.env import plan_env
    from relaunch.transports.rsync import DEADLINE_PER_GIB

    (tmp_path / "small.py").write_bytes(b"x" * 1024)
    with open(tmp_path / "big.bin", "wb") as big:
        big.truncate(500 * 1024**2)                     # sparse: 500 MB to stat, none written
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({
        "name": "files", "env": {"python": "3.11", "files": {"small.py": "~/small.py", "big.bin": "~/big.bin"}},
        "checkpoint": {"dir": "~/ckpt", "remote": str(tmp_path / "store")}, "run": {"command": "sleep 600"}}))
    recipe = load_recipe(tmp_path / "recipe.yaml", [])
    fixture = Path(__file__).parent / "fixtures" / "plans" / "facts-root.json"
    facts = Facts.from_dict(json.loads(fixture.read_text()))
    facts.modes, facts.sizes = env_files(recipe)
    job = Job(recipe, Node(Target(address="203.0.113.7", user="root", port=22, key=None)), facts)
    deadlines = {Path(a.title.split()[1]).name: a.deadline for a in plan_env(job) if a.title.startswith("upload ")}
    assert deadlines["small.py"] <= 60                          # a small file: a hang still ends soon
    assert deadlines["big.bin"] >= 500 / 1024 * DEADLINE_PER_GIB  # 500 MB at the slowest planned rate


def test_a_dcp_metadata_deleted_since_the_listing_is_a_checkpoint_gone_not_an_error(tmp_path) -> None:
    """A training that keeps its newest N checkpoints (relaunch.train.Checkpointer, keep) deletes
    one between relaunch's listing and its read of that checkpoint's `.metadata`: the read says
    so (its own exit status), and the checkpoint leaves the listing, instead of failing the sync."""
    import subprocess

    from relaunch.gather import VANISHED, metadata_command, without
    from relaunch.layouts import Entry

    folder = tmp_path / "ckpt dir"
    (folder / "step-00000010").mkdir(parents=True)
    (folder / "step-00000010" / ".metadata").write_bytes(b"meta")
    (folder / "step-00000020").mkdir()
    (folder / "step-00000020" / ".metadata").mkdir()        # there, but not readable as a file

    def run(name: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["bash", "-c", metadata_command(f"{folder}/{name}/.metadata")], capture_output=True)

    assert (run("step-00000010").returncode, run("step-00000010").stdout) == (0, b"meta")
    assert run("step-00000030").returncode == VANISHED            # deleted since the listing
    assert run("step-00000020").returncode == 1                   # another failure stays one
    listing = [Entry("step-00000010", "d", 0, 1.0), Entry("step-00000010/.metadata", "f", 4, 1.0),
               Entry("step-00000030", "d", 0, 2.0), Entry("step-00000030/.metadata", "f", 4, 2.0),
               Entry("step-000000300", "d", 0, 3.0)]
    assert [e.path for e in without(listing, {"step-00000030"})] == [
        "step-00000010", "step-00000010/.metadata", "step-000000300"]


def test_a_lock_of_comments_pins_nothing_and_installs_nothing(tmp_path):
    """adopt writes a lock with a comment only for a venv with no packages: `up` must not install
    "1 pinned packages" from an index the box may not reach."""
    from relaunch.job import read_lock

    lock = tmp_path / "requirements.lock"
    lock.write_text("# pip freeze of /workspace/venv (no packages)\n\n")
    assert read_lock(lock) == []
    lock.write_text("# a comment\nmpmath==1.3.0\n  \n-e git+https://example.com/x.git#egg=x\n")
    assert read_lock(lock) == ["mpmath==1.3.0", "-e git+https://example.com/x.git#egg=x"]
