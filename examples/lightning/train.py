"""A tiny PyTorch Lightning job for relaunch: ModelCheckpoint every few steps, a save on a notice.

The model is a small MLP built in code (nothing is downloaded) that fits a fixed random linear
map; it runs on a CPU in seconds, and as it is on a GPU. What relaunch adds:

- `relaunch.train.LightningCallback()`: Lightning (2.6) stops on SIGTERM outside SLURM without
  saving, at the end of a batch, which with gradient accumulation may be the middle of a step.
  The callback takes the signal over while training runs and saves `epoch=E-step=S.ckpt` at
  the end of the step the notice (the guard's run.stop.signal, or its notice record) came in,
  where ModelCheckpoint saves its own step checkpoints; then training stops.
- `relaunch.train.GlobalBatchSampler`: the samples of every step depend only on the seed, the
  step and the global batch. Lightning resumes a checkpoint saved in the middle of its epoch,
  but a plain DataLoader would start that epoch's data again; this one continues at the
  restored step (and keeps the epoch's length, which Lightning's count of batches needs).

`--ckpt_path "{{ checkpoint }}"` is `trainer.fit(ckpt_path=...)`; an empty value is a fresh start.
Every step prints `step N loss X grad_norm Y` (relaunch drill reads it with run.metrics);
a notice ends with `stopped at step N`, the end of the run with `done step N`.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
import warnings
from pathlib import Path

POOL, FEATURES, HIDDEN = 1024, 16, 32


def say(line: str) -> None:
    """One write per line. Under torchrun every rank shares the log, and with PYTHONUNBUFFERED
    print() writes a line's text and its newline apart: two ranks' lines would splice into one."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt_dir", required=True, help="ModelCheckpoint's dirpath (checkpoint.dir)")
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--every_n_train_steps", type=int, default=10)
    parser.add_argument("--global_batch", type=int, default=16)
    parser.add_argument("--micro_batch", type=int, default=8)
    parser.add_argument("--ckpt_path", default="", help="a .ckpt file to resume from; empty: fresh start")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds between steps (a demo's pace)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--final", default="", help="write the sha256 of the final weights here")
    args = parser.parse_args()

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from relaunch import train as relaunch_train

    data = torch.Generator().manual_seed(1234)
    xs = torch.randn(POOL, FEATURES, generator=data)
    ys = xs @ torch.randn(FEATURES, 1, generator=data) + 0.1 * torch.randn(POOL, 1, generator=data)
    dataset = torch.utils.data.TensorDataset(xs, ys)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(),
                                           torch.nn.Linear(HIDDEN, 1))
            self.losses: list[float] = []
            self.norm = 0.0

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            loss = ((self.net(x) - y) ** 2).mean()
            self.losses.append(float(loss.detach()))
            return loss

        def on_before_optimizer_step(self, optimizer) -> None:  # type: ignore[no-untyped-def]
            self.norm = float(torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm=float("inf")))

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            if len(self.losses) == accum:   # the step's last micro-batch: the optimizer stepped
                say(f"step {self.global_step} loss {sum(self.losses) / accum:.6f} grad_norm {self.norm:.6f}")
                self.losses.clear()
                time.sleep(args.sleep)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)

        def train_dataloader(self):  # type: ignore[no-untyped-def]
            # called after a checkpoint was restored: global_step is the restored step
            sampler = relaunch_train.GlobalBatchSampler(
                POOL, args.global_batch, steps=args.max_steps, seed=args.seed, start_step=self.trainer.global_step,
                rank=self.global_rank, world_size=self.trainer.world_size, micro_batch=args.micro_batch)
            return torch.utils.data.DataLoader(dataset, batch_size=args.micro_batch, sampler=sampler)

    torch.manual_seed(args.seed)
    model = Tiny()
    accum = args.global_batch // args.micro_batch
    checkpoints = ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.every_n_train_steps,
                                  monitor="step", mode="max", save_top_k=2)     # the two newest
    trainer = pl.Trainer(max_steps=args.max_steps, accelerator="auto", devices=1, accumulate_grad_batches=accum,
                         callbacks=[checkpoints, relaunch_train.LightningCallback()],
                         use_distributed_sampler=False, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, deterministic=True, default_root_dir=args.ckpt_dir)
    if args.ckpt_path and not Path(args.ckpt_path).is_file():
        print(f"error: --ckpt_path {args.ckpt_path}: no such checkpoint file", file=sys.stderr)
        return 2
    say(f"resumed from {args.ckpt_path}" if args.ckpt_path else "fresh start")
    # Lightning warns that a plain DataLoader restarts its epoch on a resume; this one does not
    warnings.filterwarnings("ignore", message=".*resuming from a checkpoint that ended before the epoch ended")
    stop = relaunch_train.install()
    try:
        trainer.fit(model, ckpt_path=args.ckpt_path or None)
    except SIGTERMException:     # a SIGTERM before the first step (Lightning's own): nothing new to save
        pass
    if stop.requested():
        say(f"stopped at step {trainer.global_step}")
        return 0
    if args.final:
        weights = model.net.state_dict()
        digest = hashlib.sha256(b"".join(weights[k].detach().cpu().numpy().tobytes() for k in sorted(weights)))
        Path(args.final).expanduser().write_text(digest.hexdigest() + "\n")
    say(f"done step {trainer.global_step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
