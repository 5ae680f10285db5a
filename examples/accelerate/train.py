"""A tiny Accelerate job for relaunch: `accelerate launch` on several processes, `save_state`.

The model is a small MLP built in code (nothing is downloaded) that fits a fixed random linear
map; DDP over gloo on a CPU (NCCL on GPUs). What relaunch adds:

- `relaunch.train.stop_requested()`: the guard's run.stop.signal (or its notice record) on any
  process; `accelerator.set_trigger()` / `check_trigger()` make every process stop at the
  same step.
- `relaunch.train.save_accelerate_state()`: `save_state` plus `relaunch-complete.json` once every
  process finished, so the `accelerate` layout takes the save a notice asked for at once
  (Accelerate writes no marker of its own). `load_accelerate_state()` resumes and lets the next
  save continue the folder numbers (`checkpoints/checkpoint_N`, N counting saves).
- `relaunch.train.GlobalBatchSampler`: the samples of every step depend only on the seed, the
  step and the global batch, so a run resumed on another number of processes
  (`--gradient_accumulation_steps {{ grad_accum }}`, which relaunch recomputes from run.batch)
  trains on exactly the samples the uninterrupted run would have.

`--resume_from_checkpoint "{{ checkpoint }}"` is a `checkpoints/checkpoint_N` folder; an empty value is a fresh
start. Every step prints `step N loss X grad_norm Y` (main process); a notice ends with
`stopped at step N`, the end of the run with `done step N`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accelerate import Accelerator

POOL, FEATURES, HIDDEN = 1024, 16, 32


class Progress:
    """The step counter, saved and restored by Accelerate with the rest of the state."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def say(accelerator: Accelerator, line: str) -> None:
    """accelerator.print's rule (the main process alone) in one write: with PYTHONUNBUFFERED,
    print() writes a line's text and its newline apart, and another rank's line could land between."""
    if accelerator.is_main_process:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True, help="Accelerate's project_dir (checkpoint.dir)")
    parser.add_argument("--max_train_steps", type=int, default=60)
    parser.add_argument("--checkpointing_steps", type=int, default=10)
    parser.add_argument("--global_batch", type=int, default=16)
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1,
                        help="{{ grad_accum }}: global / (micro x processes)")
    parser.add_argument("--resume_from_checkpoint", default="",
                        help="a checkpoints/checkpoint_N folder; empty: fresh start")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds between steps (a demo's pace)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--final", default="", help="write the sha256 of the final weights here")
    args = parser.parse_args()
    if args.resume_from_checkpoint and not Path(args.resume_from_checkpoint).is_dir():
        print(f"error: --resume_from_checkpoint {args.resume_from_checkpoint}: no such checkpoint folder",
              file=sys.stderr)
        return 2

    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from relaunch import train as relaunch_train

    stop = relaunch_train.install()
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), project_config=ProjectConfiguration(
        project_dir=args.output_dir, automatic_checkpoint_naming=True, total_limit=3))
    world, rank = accelerator.num_processes, accelerator.process_index
    if args.micro_batch * world * args.gradient_accumulation_steps != args.global_batch:
        print(f"error: micro batch {args.micro_batch} x processes {world} x grad_accum "
              f"{args.gradient_accumulation_steps} != global {args.global_batch}", file=sys.stderr)
        return 2

    torch.manual_seed(args.seed)
    data = torch.Generator().manual_seed(1234)
    xs = torch.randn(POOL, FEATURES, generator=data)
    ys = xs @ torch.randn(FEATURES, 1, generator=data) + 0.1 * torch.randn(POOL, 1, generator=data)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume_from_checkpoint:
        relaunch_train.load_accelerate_state(accelerator, args.resume_from_checkpoint)
        say(accelerator, f"resumed from {args.resume_from_checkpoint} at step {progress.step} "
                         f"(processes {world}, grad_accum {args.gradient_accumulation_steps})")
    else:
        say(accelerator, "fresh start")

    sampler = relaunch_train.GlobalBatchSampler(POOL, args.global_batch, steps=args.max_train_steps, seed=args.seed,
                                                rank=rank, world_size=world, start_step=progress.step,
                                                micro_batch=args.micro_batch)
    # not through accelerator.prepare: the sampler already gives each process its share
    batches = iter(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=args.micro_batch,
                                               sampler=sampler))
    while progress.step < args.max_train_steps:
        progress.step += 1
        total = torch.zeros(1, device=accelerator.device)
        for k in range(args.gradient_accumulation_steps):
            x, y = (t.to(accelerator.device) for t in next(batches))
            last = k == args.gradient_accumulation_steps - 1
            with contextlib.nullcontext() if last else accelerator.no_sync(model):
                loss = ((model(x) - y) ** 2).mean()
                accelerator.backward(loss / args.gradient_accumulation_steps)
            total += loss.detach()
        norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=float("inf"))
        optimizer.step()
        optimizer.zero_grad()
        total = accelerator.reduce(total, reduction="sum")
        say(accelerator, f"step {progress.step} loss {total.item() / (world * args.gradient_accumulation_steps):.6f} "
                         f"grad_norm {float(norm):.6f}")
        if stop.requested():
            accelerator.set_trigger()
        stopping = accelerator.check_trigger()        # on every process, when any one was asked
        if progress.step % args.checkpointing_steps == 0 or stopping:
            folder = relaunch_train.save_accelerate_state(accelerator, step=progress.step)
            say(accelerator, f"saved {folder}")
        if stopping:
            say(accelerator, f"stopped at step {progress.step}")
            break
        time.sleep(args.sleep)
    else:
        if args.final and accelerator.is_main_process:
            weights = accelerator.unwrap_model(model).state_dict()
            digest = hashlib.sha256(b"".join(weights[k].detach().cpu().numpy().tobytes() for k in sorted(weights)))
            Path(args.final).expanduser().write_text(digest.hexdigest() + "\n")
        say(accelerator, f"done step {progress.step}")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
