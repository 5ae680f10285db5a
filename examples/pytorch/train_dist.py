"""A tiny multi-node training job for relaunch's node groups: torchrun, FSDP2, PyTorch DCP.

Run by torchrun on every node (gloo on CPU; NCCL when there are GPUs). Checkpoints are written by
`relaunch.train.Checkpointer`: each rank copies its shards to memory and goes on training while
a background thread writes them to its own node's disk (`--out`, no shared filesystem) under
`tmp-step-N/`; once every rank has finished, the folders are renamed to `step-N/`, node 0's
(holding DCP's `.metadata`) last, so the `dcp` layout counts a checkpoint exactly when it is
whole. It resumes from any checkpoint at any world size: DCP reshards, and the global batch
stays the same because gradient accumulation makes up for the world size (`--grad-accum` =
global / (micro x world size), which relaunch computes as {{ grad_accum }}).

Every step prints `step N loss X grad_norm Y` (rank 0), so a resumed run can be compared with an
uninterrupted one: the same samples make the same global batch at every world size. Every save
prints its cost (`relaunch.checkpoint: ... blocking_s=... write_s=... step_s=...`), which
`relaunch interval`, `status` and `drill` read. SIGTERM (`relaunch evacuate --stop`, a reclaim
notice) finishes the step, saves it, flushes the write in flight, commits and exits 0.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import socket
import struct
import sys
import time
from pathlib import Path

POOL, FEATURES, HIDDEN = 4096, 16, 32


def say(line: str) -> None:
    """One write per line. Under torchrun every rank shares the log, and with PYTHONUNBUFFERED
    print() writes a line's text and its newline apart: two ranks' lines would splice into one."""
    sys.stdout.write(line + "\n")
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--resume", default="")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--final", default="")
    parser.add_argument("--keep", type=int, default=2, help="committed checkpoints kept on this node")
    args = parser.parse_args()

    if "GLOO_SOCKET_IFNAME" not in os.environ and os.environ.get("MASTER_ADDR"):
        name = interface_towards(os.environ["MASTER_ADDR"])
        if name:
            os.environ["GLOO_SOCKET_IFNAME"] = name

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from relaunch import train as relaunch_train

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.micro * world * args.grad_accum != args.global_batch:
        print(f"error: micro {args.micro} x world {world} x grad_accum {args.grad_accum} != global "
              f"{args.global_batch}", file=sys.stderr)
        return 2
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        say(f"node ready: ranks {rank}..{rank + int(os.environ.get('LOCAL_WORLD_SIZE', 1)) - 1} of {world}")

    torch.manual_seed(0)
    data = torch.Generator().manual_seed(1234)
    xs = torch.randn(POOL, FEATURES, generator=data)
    ys = xs @ torch.randn(FEATURES, 1, generator=data) + 0.1 * torch.randn(POOL, 1, generator=data)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    # the samples of each global step, whatever the world size: rank r takes its share of the step
    sampler = relaunch_train.GlobalBatchSampler(POOL, args.global_batch, steps=args.steps, rank=rank,
                                                world_size=world, micro_batch=args.micro, shuffle=False)
    ckpt = relaunch_train.Checkpointer(args.out, model, optimizer, sampler=sampler, keep=args.keep)

    start = ckpt.restore(args.resume) if args.resume else 0
    if rank == 0:
        say(f"resumed from {args.resume} at step {start} (world size {world}, grad_accum {args.grad_accum})"
            if args.resume else "fresh start")

    step = start
    while step < args.steps:
        step += 1
        share = sampler.indices(step)
        total = torch.zeros(1)
        for k in range(args.grad_accum):                # this rank's micro-batches of the global batch
            batch = share[k * args.micro:(k + 1) * args.micro]
            loss = ((model(xs[batch]) - ys[batch]) ** 2).mean()
            (loss / args.grad_accum).backward()
            total += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total)
        if rank == 0:
            say(f"step {step} loss {total.item() / (world * args.grad_accum):.6f} grad_norm {float(norm):.6f}")
        if ckpt.stop_requested():                       # every rank stops at the same step
            ckpt.finish(step)                           # saves it, flushes the write in flight, commits
            if rank == 0:
                say(f"stopped at step {step}")
            break
        if step % args.save_every == 0 or step == args.steps:
            ckpt.save(step)
        time.sleep(args.sleep)
    else:
        ckpt.finish(step)
        if args.final:
            full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
            if rank == 0:
                digest = hashlib.sha256(b"".join(full[k].detach().numpy().tobytes() for k in sorted(full)))
                Path(args.final).expanduser().write_text(digest.hexdigest() + "\n")
                say(f"done step {step}")
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
