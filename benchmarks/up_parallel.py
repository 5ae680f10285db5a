"""Does `relaunch up` install the env and restore the checkpoint at the same time?

Issue 2 promises that `up` takes about as long as the slower of the two steps, not their sum.
Against sandbox instances (Linux, root), each `up` timed end to end as a user runs it:

  (a) env alone       a fresh instance, the store empty: venv + the example lock (torch CPU) with uv
  (o) neither         the same instance again, venv already matching, store empty: the fixed part
                      (connect, preflight, facts, launch and its 3 s look at the new tmux session)
  (b) restore alone   the same instance again, venv matching, store holding a SIZE MB checkpoint
  (c) both            a second fresh instance, store holding the checkpoint

The checkpoint is SIZE MB of random bytes planted as ckpt-00000100.pt on a third instance and
evacuated from it with the real `relaunch evacuate`, which writes the store's manifest. The links
of (a)-(c) are shaped to RATE both ways (tc tbf), so the copy takes seconds. The package index is
served inside each instance (on a real GPU box pip talks to PyPI, not through our link), so the
install does not share the shaped link with the copy.

  python benchmarks/up_parallel.py [--size-mb 200] [--rate 200mbit] [-v]

Prints the times and c/(a+b) (about 0.5 when both halves take as long, 1.0 if run one after the
other) and c/max(a,b) (about 1.0 when run in parallel). No asserts: this measures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from relaunch import sandbox as sb

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "examples" / "pytorch" / "requirements.lock"
NAMES = {"plant": "bup-plant", "a": "bup-a", "c": "bup-c"}
VERBOSE = False  # -v: each command's output, every line stamped with the seconds since it started


def write_recipe(folder: Path, file: str, key: Path, index_url: str, store: Path) -> Path:
    """The example's env (torch CPU via uv); the command is a sleep: the checkpoint is random bytes."""
    data = {
        "name": "bench",
        "provider": "sandbox",
        "ssh": {"key": str(key), "wait": 30},
        "env": {"python": "3.11", "venv": "~/venvs/bench", "installer": "uv", "lock": LOCK.name,
                "index_url": index_url},
        "checkpoint": {"dir": "~/ckpt", "layout": "files", "pattern": "ckpt-*.pt", "keep": 2,
                       "remote": str(store)},
        "run": {"command": "sleep 3600", "workdir": "~/work"},
    }
    path = folder / file
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def relaunch(home: Path, command: str, recipe: Path, inst: sb.Instance) -> float:
    """`relaunch COMMAND RECIPE root@INSTANCE` as a user runs it; seconds it took. A failure stops here."""
    env = {**os.environ, "RELAUNCH_HOME": str(home)}
    # pinned as a provider console shows it: sandbox addresses are reused with new host keys
    args = [command, str(recipe), f"{inst.user}@{inst.address}", "--set", f"ssh.host_key={inst.host_key_fingerprint}"]
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "relaunch.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**env, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    lines = [f"{time.monotonic() - started:6.1f}s  {line.rstrip()}" for line in proc.stdout if line.strip()]
    seconds = time.monotonic() - started
    if VERBOSE or proc.wait() != 0:
        print(f"$ relaunch {' '.join(args)}", *lines, sep="\n", file=sys.stderr)
    if proc.wait() != 0:
        sys.exit(f"`relaunch {' '.join(args)}` failed (exit {proc.returncode})")
    return seconds


def stop_training(name: str) -> None:
    """Make the instance look like one whose training ended: no session, no checkpoints."""
    sb.run_in(name, ["sh", "-c", "tmux kill-server 2>/dev/null; rm -rf ~/ckpt ~/work ~/bench.log"], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=200, help="checkpoint size (MB of random bytes)")
    parser.add_argument("--rate", default="200mbit", help="tc rate of the measured instances' links")
    parser.add_argument("-v", "--verbose", action="store_true", help="show each command's output, timestamped")
    args = parser.parse_args()
    global VERBOSE
    VERBOSE = args.verbose
    if os.geteuid() != 0:
        sys.exit("needs root: sandbox instances are network namespaces")

    index = sb.build_index([LOCK])
    tmp = Path(tempfile.mkdtemp(prefix="relaunch-bench-"))
    home = tmp / "state"  # our own known_hosts and debug log, not the user's
    home.mkdir(mode=0o700)
    key = tmp / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    shutil.copy(LOCK, tmp / LOCK.name)
    empty, full = tmp / "store-empty", tmp / "store-full"
    made: list[str] = []

    def create(role: str, rate: str | None) -> sb.Instance:
        made.append(NAMES[role])
        return sb.create(NAMES[role], user="root", authorized_key=key.with_suffix(".pub"), rate=rate,
                         index_dir=index)

    try:
        for name in NAMES.values():  # left over from an interrupted run
            sb.destroy(name)
        # the store: a planted checkpoint, evacuated for real (copy, sha256 both ends, manifest)
        plant = create("plant", None)
        assert plant.index_url is not None
        recipe_empty = write_recipe(tmp, "recipe-empty.yaml", key, plant.index_url, empty)
        recipe_full = write_recipe(tmp, "recipe-full.yaml", key, plant.index_url, full)
        sb.run_in(plant.name, ["sh", "-c", f"mkdir -p ~/ckpt && head -c {args.size_mb}M /dev/urandom "
                               "> ~/ckpt/ckpt-00000100.pt"], check=True)
        relaunch(home, "evacuate", recipe_full, plant)
        sb.destroy(plant.name)
        made.remove(plant.name)

        a = create("a", args.rate)
        t_env = relaunch(home, "up", recipe_empty, a)
        stop_training(a.name)
        t_fixed = relaunch(home, "up", recipe_empty, a)
        stop_training(a.name)
        t_restore = relaunch(home, "up", recipe_full, a)
        c = create("c", args.rate)
        t_both = relaunch(home, "up", recipe_full, c)
    finally:
        for name in made:
            sb.destroy(name)
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"checkpoint {args.size_mb} MB over a {args.rate} link; env: {LOCK.name} (torch CPU) with uv")
    print(f"  (a) env alone      {t_env:6.1f} s")
    print(f"  (b) restore alone  {t_restore:6.1f} s")
    print(f"  (c) both           {t_both:6.1f} s")
    print(f"  (o) neither        {t_fixed:6.1f} s   (the fixed part, inside each of a, b, c)")
    print(f"  c/(a+b)    = {t_both / (t_env + t_restore):.2f}   (1.0: one after the other; 0.5: perfectly "
          "parallel halves of equal length)")
    print(f"  c/max(a,b) = {t_both / max(t_env, t_restore):.2f}   (1.0: as long as the slower one)")
    a_, b_, c_ = t_env - t_fixed, t_restore - t_fixed, t_both - t_fixed
    if min(a_, b_) > 0:
        print(f"  without the fixed part: (c-o)/((a-o)+(b-o)) = {c_ / (a_ + b_):.2f}, "
              f"(c-o)/max(a-o,b-o) = {c_ / max(a_, b_):.2f}")


if __name__ == "__main__":
    main()
