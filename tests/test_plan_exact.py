"""`relaunch plan` shows exactly what `up` runs: every command sshd was asked to run during `up`
is in the plan, and every command in the plan ran. The instance logs each command it is given
(sandbox `command_log`: sshd's ForceCommand writes it down, then runs it unchanged).
"""

from __future__ import annotations

import json
import shlex
from collections import Counter

from e2e import plain_recipe, run_cli
from relaunch import sandbox as sb


def unwrap(logged: str) -> str:
    """relaunch sends `exec bash -c '<pgid line>\\n<command>'`; the command is the rest."""
    argv = shlex.split(logged)
    assert argv[:3] == ["exec", "bash", "-c"] and len(argv) == 4, logged
    first, _, command = argv[3].partition("\n")
    assert first.startswith("printf 'relaunch-pgid"), logged
    return command


def test_plan_then_up_runs_exactly_the_planned_commands(tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    old = sandbox()
    (tmp_path / "train.py").write_text("print('step 1 loss 0.5')\n")
    recipe = plain_recipe(tmp_path, name="exact", key=ssh_key,
                          command='python train.py --resume "{{ checkpoint }}"; sleep 600',
                          env={"files": {"train.py": "~/train.py"}, "secrets": ["EXACT_TOKEN"],
                               "setup": ["echo set up > ~/setup.txt"]},
                          run={"ready": "^step 1 "})
    ssh(old, "mkdir -p ~/ckpt && head -c 5000 /dev/urandom > ~/ckpt/ckpt-00000005.pt")
    secret = {"EXACT_TOKEN": "exact-secret-value-42"}
    assert run_cli("evacuate", str(recipe), old.host, home=home, env=secret).returncode == 0

    new = sandbox(user="ubuntu", command_log=True)
    planned = run_cli("plan", str(recipe), new.host, "--json", home=home, env=secret)
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert sb.commands(new.name), "plan itself read the facts"
    reads = Counter(unwrap(c) for c in sb.commands(new.name))
    assert reads == Counter(plan["reads"])                      # plan only read, and said what it read

    up = run_cli("up", str(recipe), new.host, home=home, env=secret)
    assert up.returncode == 0, up.stderr
    logged = sb.commands(new.name)[sum(reads.values()):]
    ran = Counter(unwrap(c) for c in logged if c.startswith("exec bash -c "))
    instance = Counter(a["command"] for a in plan["actions"] if a["where"] == "instance" and a["command"])
    assert ran == instance + Counter(plan["reads"])
    # this machine's rsync reaches the instance as rsync's own server command, once per planned copy
    servers = [c for c in logged if not c.startswith("exec bash -c ")]
    rsyncs = [a for a in plan["actions"] if a["argv"] and a["argv"][0] == "rsync"]
    assert len(rsyncs) == 1 and len(servers) == len(rsyncs)
    assert all(c.startswith("rsync --server") for c in servers)
    # and what ran did what the plan said
    assert ssh(new, "cat ~/setup.txt").stdout == "set up\n"
    assert ssh(new, "ls ~/ckpt").stdout.split() == ["ckpt-00000005.pt"]
    assert "exact-secret-value-42" not in planned.stdout + planned.stderr + up.stdout + up.stderr


def test_each_env_files_upload_gets_a_deadline_from_the_files_size_as_plan_reads_it(tmp_path, sandbox, ssh_key):
    """The facts `plan` (and `up`) read hold each env.files file's size here: a 500 MB file (sparse,
    nothing written) gets a minute plus as long as rsync's rate for the slowest planned link needs,
    a small one the minute (tests/test_units.py computes the same from facts it makes itself)."""
    from relaunch.transports.rsync import DEADLINE_PER_GIB

    inst = sandbox()
    (tmp_path / "train.py").write_text("print('step 1 loss 0.5')\n")
    with open(tmp_path / "shard.bin", "wb") as shard:
        shard.truncate(500 * 1024**2)
    recipe = plain_recipe(tmp_path, name="sizes", key=ssh_key,
                          env={"files": {"train.py": "~/train.py", "shard.bin": "~/data/shard.bin"}})
    planned = run_cli("plan", str(recipe), inst.host, "--json", home=tmp_path / "state")
    assert planned.returncode == 0, planned.stderr
    deadlines = {a["title"].split()[1].rsplit("/", 1)[1]: a["deadline"] for a in json.loads(planned.stdout)["actions"]
                 if a["title"].startswith("upload ") and a["title"].split()[1].startswith(str(tmp_path))}
    assert deadlines == {"train.py": 60, "shard.bin": round(60 + DEADLINE_PER_GIB * 500 / 1024)}
