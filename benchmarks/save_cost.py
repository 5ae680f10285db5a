"""What a checkpoint save costs the training: the time the training path is blocked, for three ways
of saving the same FSDP2 state, side by side in one run, on 1, 2 and 4 ranks (gloo on CPU here).

- `Checkpointer`: relaunch.train.Checkpointer.save: the state is copied to host memory (DCP's
  stager) and written by a background thread (DCP async_save, cached plan), committed by rename.
  The training waits for the copy only; the write's own time is measured too (`its write`).
- `dcp.save`: a blocking torch.distributed.checkpoint.save of the same state dict, each rank its
  own shards (what examples/pytorch/train_dist.py did before).
- `torch.save rank 0`: the full state gathered to rank 0 (each sharded tensor's full_tensor(),
  one at a time) and written there with torch.save, the others waiting at a barrier: the
  "single-rank aggregated saving" many scripts start with.

Each time is from a barrier before the save to a barrier after it (every rank is back to
training); the methods take turns (which goes first rotates from run to run); run 0 of each
size warms up (the stager's buffers, the cached plan, the page cache) and is not counted, but the
Checkpointer's first save is shown apart: it allocates the buffers the later saves reuse. Every
save writes to disk with fsync (DCP's sync_files, and an fsync after torch.save), under --dir.
The state is the model's parameters and SGD's momentum, fp32, in 2048x2048 layers.

    sudo -E python benchmarks/save_cost.py                    # --sizes 128M,512M,1G,2G --ranks 1,2,4 --runs 2
    python benchmarks/save_cost.py --quick                     # 32M,128M on 1 and 2 ranks, one run: it works
    python benchmarks/save_cost.py plot                        # the plot again from benchmarks/save_cost.json

Writes benchmarks/save_cost.json and .png (--quick: /tmp/save_cost-quick.*) and prints the table
as markdown (docs/speed.md holds the full run's). No asserts: it measures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WIDTH = 2048                                   # one layer: 2048 x 2048 fp32 = 16 MiB, 32 MiB with momentum
METHODS = ("Checkpointer", "dcp.save", "torch.save rank 0")
UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1:] in UNITS else int(text)


def size_text(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= UNITS[unit] and n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]}{unit}"
    return f"{n / UNITS['M']:.0f}M"


# -- the worker: one torchrun job, every size ----------------------------------------------------
def measure_size(size: int, runs: int, out: Path, first_step: int) -> tuple[int, dict[str, list[float]]]:
    """(the state's bytes, every method's blocking times) for one state size, on this job's ranks."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from relaunch import train

    rank = dist.get_rank()
    layers = max(1, round(size / (2 * WIDTH * WIDTH * 4)))
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    for _ in range(layers):                                 # sharded one by one: never the whole model here
        layer = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        fully_shard(layer)
        model.append(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model(torch.randn(1, WIDTH)).sum().backward()          # momentum buffers exist from here on
    optimizer.step()
    optimizer.zero_grad()
    ckpt = train.Checkpointer(out / "ckpt", model, optimizer, keep=1,
                              stop=train.StopRequest(signals=["USR2"], notice_file=""))

    def checkpointer(step: int) -> None:
        ckpt.save(step)

    def blocking_dcp(step: int) -> None:
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd, "step": step}, checkpoint_id=str(out / f"dcp-{step}"))

    def gather(value: object) -> object:
        """The full tensors on rank 0, one at a time (the other ranks keep none of them)."""
        if isinstance(value, dict):
            return {k: gather(v) for k, v in value.items()}
        if isinstance(value, list):
            return [gather(v) for v in value]
        if hasattr(value, "full_tensor"):
            full = value.full_tensor()
            return full if rank == 0 else None
        return value

    def gathered(step: int) -> None:
        msd, osd = (gather(part) for part in get_state_dict(model, optimizer))
        if rank == 0:
            with open(out / f"torch-{step}.pt", "wb") as handle:
                torch.save({"model": msd, "optim": osd, "step": step}, handle)
                handle.flush()
                os.fsync(handle.fileno())

    saves = {"Checkpointer": checkpointer, "dcp.save": blocking_dcp, "torch.save rank 0": gathered}
    times: dict[str, list[float]] = {name: [] for name in (*METHODS, "its write", "first Checkpointer")}
    step = first_step
    try:
        for run in range(runs + 1):
            order = METHODS[run % 3:] + METHODS[:run % 3]
            for name in order:
                step += 1
                dist.barrier()
                began = time.perf_counter()
                saves[name](step)
                dist.barrier()
                blocked = time.perf_counter()
                if name == "Checkpointer":
                    ckpt.wait()                            # the write finishes before the next save is timed
                    dist.barrier()
                if run:
                    times[name].append(blocked - began)
                    if name == "Checkpointer":
                        times["its write"].append(time.perf_counter() - blocked)
                elif name == "Checkpointer":                # its buffers are allocated at the first save
                    times["first Checkpointer"].append(blocked - began)
                if rank == 0:
                    shutil.rmtree(out / f"dcp-{step}", ignore_errors=True)
                    (out / f"torch-{step}.pt").unlink(missing_ok=True)
                dist.barrier()
    finally:
        ckpt.close()
    return 2 * layers * WIDTH * WIDTH * 4, times


def worker(sizes: list[int], runs: int, folder: Path, result: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    found: dict[str, dict[str, list[float]]] = {}
    for n, size in enumerate(sizes):
        out = folder / size_text(size)
        state_bytes, times = measure_size(size, runs, out, n * 100)
        gc.collect()                                       # this size's model and staging buffers go
        found[str(state_bytes)] = times
        if rank == 0:
            medians = ", ".join(f"{k} {statistics.median(v):.3f}s" for k, v in times.items())
            print(f"save_cost: {world} rank(s), {size_text(state_bytes)}: {medians}", file=sys.stderr, flush=True)
            shutil.rmtree(out, ignore_errors=True)
            result.write_text(json.dumps(found))          # after each size: a later failure keeps these
        dist.barrier()
    dist.destroy_process_group()


# -- the driver: one torchrun per rank count, the table, the plot ------------------------------
def run_all(sizes: list[int], ranks: list[int], runs: int, folder: Path, path: Path,
            merge: bool) -> dict[str, Any]:
    """One torchrun job per rank count; the results file is written after each (with --merge,
    the rank counts not run now keep their earlier results)."""
    import torch

    results: dict[str, Any] = json.loads(path.read_text()) if merge and path.exists() else {"by_ranks": {}}
    results.update(sizes=sizes, runs=runs, cpus=os.cpu_count(), python=sys.version.split()[0],
                   torch=torch.__version__)
    results.setdefault("jobs", {})
    for n in ranks:
        with tempfile.TemporaryDirectory(dir=folder, prefix=f"save-cost-{n}-") as work:
            out = Path(work) / "result.json"
            # glibc's malloc raises its mmap threshold to the largest block freed (up to 32 MiB), so
            # the 16 MiB tensors each save allocates and frees came from heaps it never gave back:
            # 4 GiB per rank at a 2 GiB state, and a 4-rank job killed for memory. A fixed
            # threshold returns every large block at once, for every method alike.
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                       str(Path(__file__).resolve()), "worker", "--sizes", ",".join(map(str, sizes)),
                       "--runs", str(runs), "--dir", work, "--result", str(out)]
            began, load = time.monotonic(), os.getloadavg()[0]
            done = subprocess.run(command, env=env)
            results["by_ranks"][str(n)] = json.loads(out.read_text()) if out.exists() else {}
            results["jobs"][str(n)] = {"seconds": round(time.monotonic() - began), "load_before": round(load, 1),
                                       "load_after": round(os.getloadavg()[0], 1), "exit": done.returncode,
                                       "at": time.strftime("%Y-%m-%d %H:%M")}
        path.write_text(json.dumps(results, indent=1) + "\n")
        if done.returncode:
            print(f"save_cost: the {n}-rank job failed (exit {done.returncode}; out of memory is -9 in its "
                  "report); its finished sizes are kept", file=sys.stderr)
    return results


def table(results: dict) -> str:
    rows = ["| state | ranks | Checkpointer | its write (background) | dcp.save | torch.save rank 0 | "
            "Checkpointer / dcp.save | Checkpointer's first save |", "|---|---|---|---|---|---|---|---|"]
    by_ranks = results["by_ranks"]
    sizes = sorted({int(s) for r in by_ranks.values() for s in r})
    for size in sizes:
        for n in sorted(by_ranks, key=int):
            times = by_ranks[n].get(str(size))
            if not times:
                continue
            m = {k: statistics.median(v) for k, v in times.items()}
            rows.append(f"| {size_text(size)} | {n} | {m['Checkpointer']:.2f} s | {m['its write']:.2f} s | "
                        f"{m['dcp.save']:.2f} s | {m['torch.save rank 0']:.2f} s | "
                        f"{m['Checkpointer'] / m['dcp.save']:.2f} | {m['first Checkpointer']:.2f} s |")
    return "\n".join(rows)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_ranks = {n: r for n, r in results["by_ranks"].items() if r}
    fig, axes = plt.subplots(1, len(by_ranks), figsize=(4.2 * len(by_ranks), 3.6), sharey=True, squeeze=False)
    for ax, n in zip(axes[0], sorted(by_ranks, key=int), strict=True):
        sizes = sorted(int(s) for s in by_ranks[n])
        gb = [s / 2**30 for s in sizes]
        for name, style in (("Checkpointer", "o-"), ("dcp.save", "s-"), ("torch.save rank 0", "^-"),
                            ("its write", "o:")):
            label = ("Checkpointer's background write\n(training goes on)" if name == "its write"
                     else f"{name}: training blocked")
            ax.plot(gb, [statistics.median(by_ranks[n][str(s)][name]) for s in sizes], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(gb, [f"{g:g}" for g in gb])
        ax.set_yscale("log")
        ax.set_title(f"{n} rank(s), gloo on {results.get('cpus', '?')} CPUs")
        ax.set_xlabel("state (model + optimizer), GiB")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("seconds per save")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="*", default=["table"], help="table (run, print, plot) | plot | worker")
    parser.add_argument("--sizes", default="128M,512M,1G,2G", help="states to save, all ranks together")
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--runs", type=int, default=2, help="timed runs per size (after one warm-up)")
    parser.add_argument("--quick", action="store_true", help="32M,128M on 1 and 2 ranks, one run: a smoke test")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the saves are written (a disk)")
    parser.add_argument("--out", help="results prefix (default benchmarks/save_cost; --quick: /tmp/save_cost-quick)")
    parser.add_argument("--merge", action="store_true", help="keep the results of rank counts not run now")
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.ranks, args.runs = "32M,128M", "1,2", 1
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.what == ["worker"]:
        worker(sizes, args.runs, Path(args.dir), Path(args.result))
        return 0
    prefix = Path(args.out or ("/tmp/save_cost-quick" if args.quick else HERE / "save_cost"))
    if "plot" in args.what and "table" not in args.what:
        plot(json.loads(prefix.with_suffix(".json").read_text()), prefix.with_suffix(".png"))
        return 0
    results = run_all(sizes, [int(n) for n in args.ranks.split(",")], args.runs, Path(args.dir),
                      prefix.with_suffix(".json"), args.merge)
    jobs = "; ".join(f"{n} rank(s): {j['seconds']} s, load {j['load_before']} -> {j['load_after']}"
                     for n, j in sorted(results["jobs"].items()))
    print(f"{results['runs']} timed run(s) per size after a warm-up, medians; {results['cpus']} CPUs, "
          f"torch {results['torch']}; {jobs}\n")
    print(table(results))
    try:
        plot(results, prefix.with_suffix(".png"))
    except ImportError:
        print("no matplotlib: no plot (pip install -e '.[bench]')", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
