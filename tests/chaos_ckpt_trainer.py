"""The chaos test's trainer through relaunch.train.Checkpointer (torch, PyTorch DCP): one process, or a
node group under torchrun with a checkpoint folder per node. As chaos_trainer.py (whose lines,
records and `content` it shares): a step every 0.1 s, a save every 30 steps (in the background,
committed by the Checkpointer's renames), `CHAOS_KEEP` (default 2) kept by the Checkpointer, a save
on the stop signal (`finish`), ~/hold-saves, the logs in the home folder of node 0. Its state is a
buffer holding `content(step, line)` (zeros after it) and a tag (step, line): the test knows what
every checkpoint must hold wherever it was copied.

Faults it lands in itself, where no signal from outside can be aimed: the test arms one by a file in
the node's home folder, removed as it fires, and the trainer appends what it did to ~/faults.log
before it dies.
- ~/kill-in-prune: the next removal of a checkpoint folder (keep N, renamed `tmp-gone-` first)
  deletes one of its data files, then `kill -9` of this process.
- ~/kill-in-resave: the next rename of a node's new folder into place while the earlier one of that
  step is moved aside (`tmp-old-`; on node 1 the marker that there was none), between the two
  renames: `kill -9`.
"""

import fcntl
import hashlib
import os
import re
import shutil
import signal
import socket
import struct
import sys
import time
from pathlib import Path

from chaos_trainer import EVERY, SIZE, TICK, content, take_line

FIXED = SIZE + 64                        # the buffer's length: every content() fits, zeros after it
KEEP = int(os.environ.get("CHAOS_KEEP", "2"))
HOME = Path.home()


def say(line: str) -> None:
    sys.stdout.write(line + "\n")        # one write per line: torchrun's ranks share the log
    sys.stdout.flush()


def interface_towards(address: str) -> str | None:
    """The network interface this machine reaches `address` through (gloo binds to it)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((address, 9))
        local = probe.getsockname()[0]
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == local:
                return name
    finally:
        probe.close()
    return None


def armed(fault: str, what: str) -> bool:
    """Whether the test armed `fault` here; disarmed and written down as it fires."""
    try:
        (HOME / fault).unlink()
    except OSError:
        return False
    with open(HOME / "faults.log", "a") as log:
        log.write(f"{fault} {what}\n")
        log.flush()
        os.fsync(log.fileno())
    return True


def land_faults() -> None:
    rmtree, rename = shutil.rmtree, os.rename

    def cut_short(path, *args, **kwargs):
        # a removal renamed out of sight first, or (a prune that is not) a checkpoint's own folder
        base = os.path.basename(os.fspath(path))
        removal = base.startswith("tmp-gone-") or re.fullmatch(r"step-\d+", base)
        if removal and os.path.isdir(path) and armed("kill-in-prune", base):
            # a data file first, as a removal part way through leaves it: `.metadata` without a shard
            files = sorted((f for f in os.listdir(path) if os.path.isfile(os.path.join(path, f))),
                           key=lambda f: (f == ".metadata", f))
            if files:
                os.remove(os.path.join(path, files[0]))
            os.kill(os.getpid(), signal.SIGKILL)
        return rmtree(path, *args, **kwargs)

    def into_place(src, dst, *args, **kwargs):
        s, d = os.path.basename(os.fspath(src)), os.path.basename(os.fspath(dst))
        folder = os.path.dirname(os.fspath(dst))
        if s == f"tmp-{d}" and any(n.startswith("tmp-old-") and n.endswith(f"-{d}") for n in os.listdir(folder)) \
                and armed("kill-in-resave", d):
            os.kill(os.getpid(), signal.SIGKILL)
        return rename(src, dst, *args, **kwargs)

    shutil.rmtree, os.rename = cut_short, into_place


def main() -> int:
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.environ.get("MASTER_ADDR"):
        name = interface_towards(os.environ["MASTER_ADDR"])
        if name:
            os.environ["GLOO_SOCKET_IFNAME"] = name
    import torch
    import torch.distributed as dist

    from relaunch import train

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    land_faults()

    class State(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("payload", torch.zeros(FIXED, dtype=torch.uint8))
            self.register_buffer("tag", torch.zeros(2, dtype=torch.int64))

        def become(self, step: int, line: int) -> None:
            data = content(step, line)
            self.payload.zero_()
            self.payload[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self.tag[0], self.tag[1] = step, line

    state = State()
    resume = sys.argv[1] if len(sys.argv) > 1 else ""
    ckpt = train.Checkpointer(HOME / "ckpt", state, keep=KEEP)
    step = ckpt.restore(resume)
    line = None
    if ckpt.restored:
        read_step, line = (int(v) for v in state.tag.tolist())
        data = state.payload.numpy().tobytes()
        n = len(content(read_step, line))
        good = read_step == step and not any(data[n:])
        digest = hashlib.sha256(data[:n]).hexdigest() if good else "not-what-was-saved"
        started = f"resumed {os.path.basename(ckpt.restored.rstrip('/'))} {digest} {step}"
    else:
        started = "fresh"
    if rank == 0:
        line = take_line(ckpt.restored or "", line, step)
        with open(HOME / "starts.log", "a") as log:
            log.write(started + "\n")
        say(started)
    else:
        say(f"started rank {rank} at step {step}")       # every node's `run.ready` line
    shared = [line]
    dist.broadcast_object_list(shared, src=0)
    line = shared[0]

    reported = 0
    hold = torch.zeros(1)
    while True:
        time.sleep(TICK)
        step += 1
        state.become(step, line)
        if rank == 0:
            say(f"step {step} loss {1.0 / step:.6f}")
        if ckpt.stop_requested():
            ckpt.finish(step)
            if rank == 0:
                with open(HOME / "stops.log", "a") as log:
                    log.write(f"stopped at step {step}\n")
                say(f"stopped at step {step}")
            break
        if step % EVERY == 0:
            hold[0] = float((HOME / "hold-saves").exists())
            dist.all_reduce(hold, op=dist.ReduceOp.MAX)     # node 0's file: every rank saves, or none
            if not hold[0]:
                ckpt.save(step)
        if rank == 0:
            for cost in ckpt.costs[reported:]:              # committed since: the trainer's own record
                with open(HOME / "saves.log", "a") as log:
                    log.write(f"saved {cost['name']} {cost['step']} {line}\n")
            reported = len(ckpt.costs)
    ckpt.close()
    if rank == 0:
        for cost in ckpt.costs[reported:]:
            with open(HOME / "saves.log", "a") as log:
                log.write(f"saved {cost['name']} {cost['step']} {line}\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
