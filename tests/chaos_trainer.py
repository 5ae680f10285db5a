"""The chaos and drill tests' trainer (stdlib only): a step every 0.1 s, a checkpoint every 30 steps, written
as careful trainers do (temp name, then rename), the newest 3 kept; a save on SIGTERM.

A checkpoint's bytes depend only on its step, so the test knows what every checkpoint must hold
wherever it was copied. Every start appends one line to ~/starts.log: `resumed NAME SHA256 STEP`
(the hash of the bytes it read) or `fresh`. Every stop on SIGTERM saves (unless that step is saved
already), then appends `stopped at step N` to ~/stops.log: the save a stop asked for. While
~/hold-saves exists it saves nothing on its own (a training that has not saved yet); the save on
SIGTERM still happens.
"""

import hashlib
import os
import signal
import sys
import time
from pathlib import Path

SIZE, KEEP = 200_000, 3
# the drill's test saves more often, in shorter steps: a save lands between any look and a kill
EVERY = int(os.environ.get("CHAOS_EVERY", "30"))
TICK = float(os.environ.get("CHAOS_TICK", "0.1"))


def content(step: int) -> bytes:
    return f"step={step}\n".encode() + hashlib.sha256(str(step).encode()).digest() * (SIZE // 32)


def main() -> None:
    if os.environ.get("CHAOS_OWN_SESSION"):
        os.setsid()              # as torchrun's workers do: out of the group relaunch recorded
    out = Path.home() / "ckpt"
    out.mkdir(exist_ok=True)
    resume = sys.argv[1] if len(sys.argv) > 1 else ""
    step = 0
    if resume:
        data = Path(resume).read_bytes()
        step = int(data.split(b"\n", 1)[0].split(b"=")[1])
        line = f"resumed {os.path.basename(resume)} {hashlib.sha256(data).hexdigest()} {step}"
    else:
        line = "fresh"
    with open(Path.home() / "starts.log", "a") as log:
        log.write(line + "\n")
    print(line, flush=True)

    def save() -> None:
        name = out / f"ckpt-{step:08d}.pt"
        tmp = out / f"{name.name}.tmp"
        tmp.write_bytes(content(step))
        os.replace(tmp, name)
        for old in sorted(out.glob("ckpt-*.pt"))[:-KEEP]:
            old.unlink()

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    saved = step
    hold = Path.home() / "hold-saves"
    while not stopping:
        time.sleep(TICK)
        step += 1
        print(f"step {step} loss {1.0 / step:.6f}", flush=True)      # a number of the step alone
        if step % EVERY == 0 and not hold.exists():
            save()
            saved = step
    if saved != step or not (out / f"ckpt-{step:08d}.pt").exists():
        save()
    with open(Path.home() / "stops.log", "a") as log:
        log.write(f"stopped at step {step}\n")
    print(f"stopped at step {step}", flush=True)


if __name__ == "__main__":
    main()
