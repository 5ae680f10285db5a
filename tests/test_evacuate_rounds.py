"""evacuate while training still saves: another round for each checkpoint written meanwhile, and
when the rounds run out, the answer depends on the world, not on a count.

The trainer here saves its next checkpoint the moment the copy of its newest begins (it watches
the pin, a second hard link), so every round ends with a newer checkpoint than it copied, on any
machine however slow or fast. A training that has ended by then writes nothing more: one more
round copies its last save, verified, and the instance is safe to destroy. One that goes on
saving outpaces every round: exit 6, never "safe". Sandbox instances, the real CLI, rsync, tmux.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path

from e2e import plain_recipe, run_cli, wait_for

# saves ckpt 1..LAST (each written under a temp name, then renamed); after each save but the last,
# waits for that save's pin before the next: a new save per round of evacuate
TRAINER = """import os, sys, time
d, last = os.path.expanduser("~/ckpt"), int(sys.argv[1])
os.makedirs(d, exist_ok=True)
for k in range(1, last + 1):
    f = os.path.join(d, f"ckpt-{k:08d}.pt")
    with open(f + ".tmp", "wb") as out:
        out.write(os.urandom(300_000))
    os.rename(f + ".tmp", f)
    while k < last and os.stat(f).st_nlink < 2:
        time.sleep(0.05)
"""


def start_trainer(inst, ssh, last: int) -> None:
    ssh(inst, f"cat > ~/saver.py <<'EOF'\n{TRAINER}EOF\n"
              f"tmux new-session -d -s rounds {shlex.quote(f'exec python3 $HOME/saver.py {last}')}")
    wait_for("the first save", lambda: "ckpt-00000001.pt" in ssh(inst, "ls ~/ckpt 2>/dev/null", check=False).stdout)


def manifest(store: Path) -> dict[str, dict]:
    path = store / ".relaunch" / "manifest.json"
    return {c["name"]: c for c in json.loads(path.read_text())["checkpoints"]} if path.exists() else {}


def test_a_training_that_ends_while_evacuate_runs_out_of_rounds_gets_its_last_save_copied(tmp_path, sandbox, ssh,
                                                                                             ssh_key):
    inst = sandbox()
    recipe = plain_recipe(tmp_path, name="rounds", key=ssh_key)
    start_trainer(inst, ssh, last=4)          # the 4th save comes during the 3rd round; then it exits
    evac = run_cli("evacuate", str(recipe), inst.host, home=tmp_path / "state")
    assert evac.returncode == 0, evac.stderr
    assert "training wrote ckpt-00000003.pt meanwhile; another round" in evac.stderr
    assert "training has ended; one more round for ckpt-00000004.pt" in evac.stderr
    assert "safe to destroy" in evac.stderr
    last = ssh(inst, "sha256sum ~/ckpt/ckpt-00000004.pt").stdout.split()[0]
    store = tmp_path / "store"
    assert hashlib.sha256((store / "ckpt-00000004.pt").read_bytes()).hexdigest() == last
    assert manifest(store)["ckpt-00000004.pt"]["files"]["ckpt-00000004.pt"]["sha256"] == last


def test_a_training_that_saves_faster_than_every_round_is_never_called_safe(tmp_path, sandbox, ssh, ssh_key):
    inst = sandbox()
    recipe = plain_recipe(tmp_path, name="rounds", key=ssh_key)
    start_trainer(inst, ssh, last=10_000)     # a new save per round, for as long as evacuate goes on
    evac = run_cli("evacuate", str(recipe), inst.host, home=tmp_path / "state")
    assert evac.returncode == 6, evac.stderr
    assert "training keeps writing new checkpoints faster than they can be copied" in evac.stderr
    assert "evacuation NOT verified: DO NOT destroy the instance" in evac.stderr
    assert "safe to destroy" not in evac.stderr.replace("DO NOT destroy", "")
    assert "training has ended" not in evac.stderr
    # what it did copy is whole in the store; the newest on the instance is not there
    newest = ssh(inst, "ls ~/ckpt | grep -v tmp | sort | tail -1").stdout.strip()
    assert newest not in manifest(tmp_path / "store")
    assert ssh(inst, "tmux has-session -t =rounds && echo alive", check=False).stdout.strip() == "alive"
