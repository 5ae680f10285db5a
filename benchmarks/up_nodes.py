"""How long does `relaunch up` take on a node group, against one node?

The checkpoint crosses the slow link (this machine -> the group) once, to node 0; then the nodes
double it between themselves (1 -> 2 -> 4 -> 8) over their own network, and verify their copies.
So `up` on N nodes should cost about one copy over the slow link plus log2(N) copies between
nodes, not N slow copies.

Against sandbox nodes (Linux, root): each node's link to this machine is shaped to RATE, the
links between nodes are not (as between the nodes of one datacenter). The store (a folder here)
holds one SIZE MB checkpoint of random bytes; the recipe has no lock and a `sleep` command, so
`up` is the restore. Each `up` is timed end to end as a user runs it, on fresh nodes each time.

  python benchmarks/up_nodes.py [--size-mb 256] [--rate 200mbit] [--nodes 1,2,4,8] [--runs 2]

Prints each run's seconds and the ratio to one node measured in the same run, for the whole `up`
and for its copy alone (from its start until every node verified its copy). All the nodes share
this machine's CPUs: what a real node does on its own CPUs (create its venv, decrypt, hash) is
done here by all of them on the same two cores. No asserts.
"""

from __future__ import annotations

import argparse
import hashlib
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
from relaunch.manifest import CheckpointRecord, FileRecord, StoreManifest, utc_now
from relaunch.transports.folder import StoreFolder


def make_store(folder: Path, size_mb: int) -> Path:
    """A local store holding ckpt-00000100.pt (SIZE MB of random bytes), verified in its manifest."""
    store = StoreFolder(folder / "store")
    name = "ckpt-00000100.pt"
    staged = store.staging(name) / name
    digest = hashlib.sha256()
    with open(staged, "wb") as out:
        for _ in range(size_mb):
            block = os.urandom(1 << 20)
            digest.update(block)
            out.write(block)
    record = CheckpointRecord(name, 100, {name: FileRecord(size_mb << 20, digest.hexdigest())}, utc_now(), "bench")
    store.commit(record)
    manifest = StoreManifest("bench")
    manifest.add(record)
    store.save_manifest(manifest)
    return store.root


def write_recipe(folder: Path, key: Path, store: Path) -> Path:
    data = {"name": "bench", "provider": "sandbox", "ssh": {"key": str(key), "wait": 30},
            "env": {"python": "3.11", "venv": "~/venvs/bench"},
            "checkpoint": {"dir": "~/ckpt", "layout": "files", "pattern": "ckpt-*.pt", "keep": 2,
                           "remote": str(store)},
            "run": {"command": "sleep 3600", "workdir": "~", "grace": 1}}
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def one_up(recipe: Path, nodes: int, rate: str, key: Path, tag: str) -> tuple[float, float]:
    """(seconds of the whole `up`, seconds from the copy's start until every node verified its copy)."""
    names = [f"bn{tag}{i}" for i in range(nodes)]
    home = Path(tempfile.mkdtemp(prefix="relaunch-bench-"))
    try:
        hosts = [sb.create(name, rate=rate, authorized_key=Path(f"{key}.pub")).host for name in names]
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "relaunch.cli", "up", str(recipe), *hosts],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "RELAUNCH_HOME": str(home)})
        assert proc.stderr is not None
        copy_start, restored, lines = 0.0, 0.0, []
        for line in proc.stderr:
            now = time.monotonic() - started
            lines.append(line)
            if "copying" in line and not copy_start:
                copy_start = now
            if "restored ckpt-" in line:
                restored = now
        seconds = time.monotonic() - started
        if proc.wait() != 0:
            raise SystemExit(f"up on {nodes} node(s) failed (exit {proc.returncode}):\n{''.join(lines)[-3000:]}")
        return seconds, restored - copy_start
    finally:
        for name in names:
            sb.destroy(name)
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--rate", default="200mbit")
    parser.add_argument("--nodes", default="1,2,4,8")
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    counts = [int(n) for n in args.nodes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="relaunch-bench-nodes-"))
    key = sb.default_key()
    try:
        recipe = write_recipe(work, key, make_store(work, args.size_mb))
        rows: dict[int, list[tuple[float, float, float, float]]] = {n: [] for n in counts}
        for run in range(args.runs):
            base, base_copy = one_up(recipe, 1, args.rate, key, f"{run}x")
            for n in counts:
                seconds, copying = (base, base_copy) if n == 1 else one_up(recipe, n, args.rate, key, f"{run}{n}")
                rows[n].append((seconds, seconds / base, copying, copying / base_copy))
                print(f"run {run + 1}: {n} node(s): up {seconds:5.1f} s (x{seconds / base:.2f}); the copy until "
                      f"every node verified it {copying:5.1f} s (x{copying / base_copy:.2f})", flush=True)
        print(f"\n{args.size_mb} MB checkpoint, {args.rate} between this machine and each node, {args.runs} run(s), "
              "median of each; ratios to one node in the same run")
        print("| nodes | up | ratio | the copy, until every node verified it | ratio |\n|---|---|---|---|---|")
        for n in counts:
            med = [statistics.median(r[i] for r in rows[n]) for i in range(4)]
            print(f"| {n} | {med[0]:.1f} s | {med[1]:.2f} | {med[2]:.1f} s | {med[3]:.2f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
