"""What does the venv of a recipe with no lock cost `relaunch up`, made by uv against `python -m venv`?

With no lock, nothing is installed: the venv is the env step's whole work. uv makes it when the
recipe names a package index (env.index_url), as it does with a lock: uv comes from the index as
a wheel, makes the venv, and puts pip in it. With no index named, `python -m venv` makes it, and
its ensurepip installs and compiles pip (seconds of CPU). The baseline is that second `up`, on
another fresh instance, in the same run; the two alternate which goes first.

Against sandbox instances (Linux, root), each serving the package index inside itself (as a
rented instance reaches PyPI). The store is empty and the command a `sleep`: `up` is connect,
facts, env, start. Each `up` is timed end to end as a user runs it, and the machine's CPU time
during it (every process here and on the instance: they share this machine's CPUs) is read from
/proc/stat.

  python benchmarks/up_nolock.py [--runs 5]

Prints each pair and the medians, with the ratio uv / python -m venv pair by pair. No asserts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from relaunch import sandbox as sb

EXAMPLE_LOCK = Path(__file__).resolve().parents[1] / "examples" / "pytorch" / "requirements.lock"


def busy_seconds() -> float:
    """CPU seconds spent by every process of this machine so far (all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def write_recipe(folder: Path, key: Path, index: bool) -> Path:
    env = {"python": "3.11", "venv": "~/venvs/bench"}
    if index:
        env["index_url"] = f"http://127.0.0.1:{sb.INDEX_PORT}/simple/"
    (folder / "store").mkdir(parents=True, exist_ok=True)
    data = {"name": "bench", "ssh": {"key": str(key), "wait": 30}, "env": env,
            "checkpoint": {"dir": "~/ckpt", "layout": "files", "pattern": "ckpt-*.pt", "keep": 2,
                           "remote": str(folder / "store")},
            "run": {"command": "sleep 3600", "workdir": "~", "grace": 1}}
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def one_up(recipe: Path, index_dir: Path, key: Path, name: str) -> tuple[float, float]:
    """(seconds of the whole `up`, the machine's CPU seconds during it) on a fresh instance."""
    home = Path(tempfile.mkdtemp(prefix="relaunch-bench-"))
    try:
        host = sb.create(name, index_dir=index_dir, authorized_key=Path(f"{key}.pub")).host
        cpu, started = busy_seconds(), time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "relaunch.cli", "up", str(recipe), host],
                              capture_output=True, text=True, env={**os.environ, "RELAUNCH_HOME": str(home)})
        seconds, cpu = time.monotonic() - started, busy_seconds() - cpu
        if proc.returncode != 0:
            raise SystemExit(f"up on {name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return seconds, cpu
    finally:
        sb.destroy(name)
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="relaunch-bench-nolock-"))
    key = sb.default_key()
    index_dir = sb.build_index([EXAMPLE_LOCK])
    try:
        recipes = {"uv": write_recipe(work / "uv", key, index=True),
                   "venv": write_recipe(work / "venv", key, index=False)}
        pairs = []
        for run in range(args.runs):
            order = ["uv", "venv"] if run % 2 == 0 else ["venv", "uv"]
            got = {how: one_up(recipes[how], index_dir, key, f"bnl{run}{how[0]}") for how in order}
            pairs.append(got)
            print(f"pair {run + 1} ({order[0]} first): uv {got['uv'][0]:.2f} s, {got['uv'][1]:.2f} CPU s; "
                  f"python -m venv {got['venv'][0]:.2f} s, {got['venv'][1]:.2f} CPU s", flush=True)
        print(f"\n`up` of a recipe with no lock on a fresh instance, {args.runs} pair(s), medians; "
              "ratio = uv / python -m venv, pair by pair")
        print("| what | uv | python -m venv | ratio |\n|---|---|---|---|")
        for i, what in enumerate(("wall", "CPU (the whole machine)")):
            uv = statistics.median(p["uv"][i] for p in pairs)
            venv = statistics.median(p["venv"][i] for p in pairs)
            ratio = statistics.median(p["uv"][i] / p["venv"][i] for p in pairs)
            print(f"| {what} | {uv:.2f} s | {venv:.2f} s | {ratio:.2f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
