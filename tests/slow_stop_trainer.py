"""A torchrun worker whose save on the stop signal takes longer than torchrun's own 30 s grace,
as a big model's checkpoint does. No torch import: torchrun starts it, nothing more.

argv: OUT SAVE_SECONDS. Rank 0 prints `step N` every 0.2 s and saves ckpt-N.pt every 10 steps;
on SIGTERM every rank takes SAVE_SECONDS, then rank 0 saves the current step and prints
`stopped at step N` (exit 0).
"""
import os
import signal
import sys
import time
from pathlib import Path

out, save_for = Path(sys.argv[1]).expanduser(), float(sys.argv[2])
rank = int(os.environ.get("RANK", "0"))
out.mkdir(parents=True, exist_ok=True)
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))


def save(step: int) -> None:
    path = out / f"ckpt-{step:08d}.pt"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(f"step {step}\n".encode() * 200)
    tmp.rename(path)


step = 0
while True:
    step += 1
    if rank == 0:
        print(f"step {step}", flush=True)
        if step % 10 == 0:
            save(step)
    if stopping:
        time.sleep(save_for)
        if rank == 0:
            save(step)
            print(f"stopped at step {step}", flush=True)
        sys.exit(0)
    time.sleep(0.2)
