"""The chaos and drill tests' trainer (stdlib only): a step every 0.1 s, a checkpoint every 30 steps, written
as careful trainers do (temp name, then rename), the newest 3 kept; a save on SIGTERM.

A checkpoint's bytes depend only on its step and its branch (`line`), and its first line names both,
so the test knows what every checkpoint must hold wherever it was copied. A line is the run's own
history: a resume keeps the line of the checkpoint it read, a fresh start takes a new one, and a
rollback the test asked for (`~/branch` holding `LINE NAME`, read and removed at every start) takes
LINE when the start resumed NAME. Every start appends one line to ~/starts.log: `resumed NAME SHA256
STEP` (the hash of the bytes it read) or `fresh`, after writing its line to ~/line and, when it took
a new one, `LINE PARENT STEP` to ~/branches.log (PARENT `-` for a fresh start). Every save appends
`saved NAME STEP LINE` to ~/saves.log. Every stop on SIGTERM saves (unless that step is saved
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
# the drill's test: a resumed run's steps come slower than the drill's looks at the log
TICK_RESUMED = float(os.environ.get("CHAOS_TICK_RESUMED", TICK))


def content(step: int, line: int = 0) -> bytes:
    """A checkpoint's bytes (line 0: as before lines existed; a trainer's lines are never 0)."""
    head, seed = (f"step={step}", str(step)) if not line else (f"step={step} line={line}", f"{step}/{line}")
    return f"{head}\n".encode() + hashlib.sha256(seed.encode()).digest() * (SIZE // 32)


def identity(data: bytes) -> tuple[int, int] | None:
    """(step, line) of a checkpoint whose bytes are exactly what the trainer wrote for them, else None."""
    try:
        fields = dict(word.split("=", 1) for word in data[:80].split(b"\n", 1)[0].decode().split())
        step, line = int(fields["step"]), int(fields.get("line", 0))
    except (ValueError, KeyError, UnicodeDecodeError):
        return None
    return (step, line) if data == content(step, line) else None


def take_line(resumed: str, line: int | None, step: int) -> int:
    """This start's line (see the docstring); its records written before the start's own."""
    home = Path.home()
    asked = home / "branch"
    try:
        wanted, name = asked.read_text().split()
        asked.unlink()
    except (OSError, ValueError):
        wanted, name = "", ""
    parent = line
    if line is None:                                # a fresh start: a line of its own
        line = int.from_bytes(os.urandom(6), "big") + 1_000_000
    if wanted and resumed and os.path.basename(resumed.rstrip("/")) == name:
        line = int(wanted)
    if line != parent:
        with open(home / "branches.log", "a") as log:
            log.write(f"{line} {'-' if parent is None else parent} {step}\n")
    (home / "line.tmp").write_text(f"{line}\n")
    os.replace(home / "line.tmp", home / "line")
    return line


def main() -> None:
    if os.environ.get("CHAOS_OWN_SESSION"):
        os.setsid()              # as torchrun's workers do: out of the group relaunch recorded
    out = Path.home() / "ckpt"
    out.mkdir(exist_ok=True)
    resume = sys.argv[1] if len(sys.argv) > 1 else ""
    step, line = 0, None
    if resume:
        data = Path(resume).read_bytes()
        step = int(data.split(b"\n", 1)[0].split()[0].split(b"=")[1])
        line = (identity(data) or (step, 0))[1]
        started = f"resumed {os.path.basename(resume)} {hashlib.sha256(data).hexdigest()} {step}"
    else:
        started = "fresh"
    line = take_line(resume, line, step)
    with open(Path.home() / "starts.log", "a") as log:
        log.write(started + "\n")
    print(started, flush=True)

    def save() -> None:
        name = out / f"ckpt-{step:08d}.pt"
        tmp = out / f"{name.name}.tmp"
        tmp.write_bytes(content(step, line))
        os.replace(tmp, name)
        with open(Path.home() / "saves.log", "a") as log:
            log.write(f"saved {name.name} {step} {line}\n")
        for old in sorted(out.glob("ckpt-*.pt"))[:-KEEP]:
            old.unlink()

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    saved = step
    hold = Path.home() / "hold-saves"
    tick = TICK_RESUMED if resume else TICK
    while not stopping:
        time.sleep(tick)
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
