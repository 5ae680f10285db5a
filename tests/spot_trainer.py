"""The watch tests' trainer (stdlib only, so an instance needs no install): a step every `--sleep`
seconds, a checkpoint `ckpt-NNNNNNNN.pt` every `--every` steps of `--size` bytes, written as careful
trainers do (temp name, then rename), the newest `--keep` kept; on SIGTERM it saves the step it is
at and exits 0 ("stopped at step N"), as a trainer asked by a reclaim notice does; `--stop-save S`
makes that save take S seconds (a big model's checkpoint); `--save-for S` makes every save write its
temp file over S seconds, in pieces (a `kill -9` lands in the middle of one).

A checkpoint's bytes depend only on its step and size, so a test knows what each must hold
(`content`); a resume reads them back and checks them. The log: `step N loss X` every step,
`resumed from PATH at step N` or `fresh start` first.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from pathlib import Path

_BODY: dict[int, bytes] = {}


def content(step: int, size: int) -> bytes:
    """Bytes no compressor shrinks (a link's rate is what the copy meets), fixed by step and size:
    the step on the first line, then the same random-looking body for every step of that size."""
    head = f"step={step}\n".encode()
    if size not in _BODY:
        _BODY[size] = random.Random(size).randbytes(size)
    return head + _BODY[size][:max(size - len(head), 0)]


def loss(step: int) -> float:
    return round(1.0 / (1 + step * 0.01), 6)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("resume", nargs="?", default="")
    parser.add_argument("--out", default="~/ckpt")
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=0.1)
    parser.add_argument("--stop-save", type=float, default=0.0)
    parser.add_argument("--save-for", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=0, help="finish (save, exit 0) after this step; 0: never")
    args = parser.parse_args()
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    step = 0
    if args.resume:
        data = Path(args.resume).read_bytes()
        step = int(data.split(b"\n", 1)[0].split(b"=")[1])
        if data != content(step, len(data)):
            print(f"error: {args.resume} does not hold the bytes of step {step}", file=sys.stderr)
            return 3
        print(f"resumed from {args.resume} at step {step}", flush=True)
    else:
        print("fresh start", flush=True)

    def save() -> None:
        name = out / f"ckpt-{step:08d}.pt"
        tmp = out / f".{name.name}.tmp"
        data = content(step, args.size)
        with open(tmp, "wb") as handle:
            pieces = 10 if args.save_for else 1
            for n in range(pieces):
                handle.write(data[n * len(data) // pieces:(n + 1) * len(data) // pieces])
                handle.flush()
                time.sleep(args.save_for / pieces)
        os.replace(tmp, name)
        for old in sorted(out.glob("ckpt-*.pt"))[:-args.keep]:
            old.unlink()

    stopping: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    saved = step
    while not stopping and not (args.steps and step >= args.steps):
        time.sleep(args.sleep)
        step += 1
        print(f"step {step} loss {loss(step)}", flush=True)
        if step % args.every == 0:
            save()
            saved = step
    if not stopping:
        if saved != step:
            save()
        print(f"done at step {step}", flush=True)
        return 0
    time.sleep(args.stop_save)
    if saved != step:
        save()
    print(f"stopped at step {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
