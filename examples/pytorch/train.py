"""A tiny, deterministic PyTorch training job: the example that relaunch brings back to life.

It trains a small MLP on synthetic data and writes checkpoints the way real trainers do, in one of
three layouts (--layout):

  files       ckpt-00000010.pt            torch.save to ckpt-00000010.pt.tmp, then os.replace
  hf-trainer  checkpoint-10/              model.pt, optimizer.pt, rng_state.pth written in place,
                                          trainer_state.json LAST (its presence = complete)
  dcp         step-10/                    torch.distributed.checkpoint.save, single process;
                                          .metadata is renamed into place last (presence = complete)

Resuming (--resume PATH, the checkpoint file or folder as written above) at any saved step and
running to the end gives bit-identical final weights to an uninterrupted run, because
  - the model is initialised from torch.manual_seed(seed), deterministic algorithms, one thread;
  - the batch of step i comes from its own torch.Generator seeded from (seed, i), so it does not
    depend on how many batches this process drew before;
  - AdamW's state (moments and step counts) is in every checkpoint.
--final FILE writes the sha256 of the final weights; tests compare these between runs.

SIGTERM: the current step finishes, a checkpoint is saved, "stopped at step <i>" is printed and
the process exits 0 (how `relaunch evacuate --stop` asks training to save and stop).

Standard library + torch only: this file is uploaded to a bare instance with nothing else.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

LAYOUTS = ("files", "hf-trainer", "dcp")
# How each layout names one checkpoint in --out; the group is the step (used for --keep-last).
NAME_PATTERNS = {
    "files": re.compile(r"^ckpt-(\d+)\.pt$"),
    "hf-trainer": re.compile(r"^checkpoint-(\d+)$"),
    "dcp": re.compile(r"^step-(\d+)$"),
}
IN_FEATURES, HIDDEN, BATCH = 32, 64, 64
LR, WEIGHT_DECAY = 1e-2, 1e-2


class CheckpointProblem(Exception):
    """A --resume path we cannot use; reported as one line, exit code 2, never a traceback."""


class StopFlag:
    """Set by SIGTERM; the training loop checks it between steps (a handler must not save)."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True


# ---------------------------------------------------------------------------------------------
# Arguments


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _seed(text: str) -> int:
    value = int(text)
    if not 0 <= value < 2**31:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**31), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Tiny deterministic training job (relaunch example).")
    p.add_argument("--out", required=True, help="checkpoint folder (created)")
    p.add_argument("--layout", choices=LAYOUTS, default="files", help="checkpoint layout to write")
    p.add_argument("--steps", type=_positive_int, default=60, help="train until this step")
    p.add_argument("--save-every", type=_positive_int, default=10, help="save every K steps")
    p.add_argument("--sleep", type=_non_negative_float, default=0.0, help="seconds to idle per step")
    p.add_argument("--resume", default="", help="checkpoint to resume from; empty = fresh start")
    p.add_argument("--keep-last", type=_non_negative_int, default=0,
                   help="keep only the newest K checkpoints in --out (0 = keep all)")
    p.add_argument("--final", default="", help="write the sha256 of the final weights to this file")
    p.add_argument("--seed", type=_seed, default=0, help="seed for the weights and the data")
    return p


def _expand(path: str) -> Path:
    # Recipes pass paths like "~/ckpt/..." inside double quotes, where the shell does not expand ~.
    return Path(os.path.expanduser(path))


# ---------------------------------------------------------------------------------------------
# Model, data, one step


def make_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1)
    )
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    return model, optim


def batch_for_step(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    # One generator per step, seeded from (seed, step): resuming at step N draws exactly the
    # batches an uninterrupted run would have drawn, whatever happened before N.
    gen = torch.Generator().manual_seed(seed * 2**32 + step)
    x = torch.randn(BATCH, IN_FEATURES, generator=gen)
    y = torch.tanh(x[:, :8].sum(dim=1, keepdim=True) - x[:, 8:16].sum(dim=1, keepdim=True))
    return x, y


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, seed: int, step: int) -> float:
    x, y = batch_for_step(seed, step)
    optim.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    return float(loss.item())


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over name, dtype, shape and raw bytes of every tensor, in state_dict order."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        # Raw bytes without numpy (the instance's venv has only torch and its deps).
        h.update(bytes(t.reshape(-1).view(torch.uint8).tolist()))
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Saving, one function per layout; each returns the path it wrote


def save_files(out: Path, step: int, model: torch.nn.Module, optim: torch.optim.Optimizer,
               extra: dict[str, Any]) -> Path:
    path = out / f"ckpt-{step:08d}.pt"
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)  # atomic: a reader sees the old name or the whole new file
    return path


def save_hf_trainer(out: Path, step: int, model: torch.nn.Module, optim: torch.optim.Optimizer,
                    extra: dict[str, Any]) -> Path:
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True, exist_ok=True)
    # Rewriting a folder left by an earlier run: drop its marker first, so the folder never
    # looks complete while it holds a mix of old and new files.
    (path / "trainer_state.json").unlink(missing_ok=True)
    # Like transformers' Trainer: files written in place, trainer_state.json last.
    torch.save(model.state_dict(), path / "model.pt")
    torch.save(optim.state_dict(), path / "optimizer.pt")
    torch.save({"cpu_rng_state": torch.get_rng_state()}, path / "rng_state.pth")
    state = {"global_step": step, "max_steps": extra["max_steps"], "save_steps": extra["save_every"],
             "seed": extra["seed"], "log_history": [{"step": step, "loss": extra["loss"]}]}
    (path / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
    return path


def _quiet_dcp() -> Any:
    import torch.distributed.checkpoint as dcp  # slow import; only the dcp layout pays for it

    # Without a process group DCP warns on every save and load that it "assumes the intent is to
    # save/load in a single process". That is exactly our intent (checked on torch 2.13).
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    return dcp


def save_dcp(out: Path, step: int, model: torch.nn.Module, optim: torch.optim.Optimizer,
             extra: dict[str, Any]) -> Path:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dcp = _quiet_dcp()
    path = out / f"step-{step}"
    model_sd, optim_sd = get_state_dict(model, optim)  # optimizer state keyed by parameter name
    # Rewriting a folder left by an earlier run: DCP would rewrite the shards in place next to the
    # old .metadata (removing it only at the end), so the folder would look complete meanwhile.
    (path / ".metadata").unlink(missing_ok=True)
    # Writes __0_0.distcp, then .metadata.tmp renamed to .metadata: .metadata present = complete.
    dcp.save({"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id=str(path))
    return path


SAVERS: dict[str, Callable[..., Path]] = {
    "files": save_files, "hf-trainer": save_hf_trainer, "dcp": save_dcp,
}


def rotate(out: Path, layout: str, keep: int, just_saved: Path) -> None:
    """Delete the oldest checkpoints beyond `keep`, like trainers' save_total_limit."""
    found = []
    for entry in out.iterdir():
        m = NAME_PATTERNS[layout].match(entry.name)
        if m:
            found.append((int(m.group(1)), entry))
    found.sort()  # by step number, never by name or mtime
    for _, entry in found[:-keep]:
        if entry == just_saved:
            continue
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


# ---------------------------------------------------------------------------------------------
# Resuming: the layout is recognised from the path, so any checkpoint this script wrote works


def checkpoint_kind(path: Path) -> str:
    """Which layout wrote the checkpoint at `path`, judged by its completion marker."""
    if path.is_file():
        return "files"
    if path.is_dir() and (path / "trainer_state.json").is_file():
        return "hf-trainer"
    if path.is_dir() and (path / ".metadata").is_file():
        return "dcp"
    if path.is_dir():
        raise CheckpointProblem(f"{path}: not a complete checkpoint (no trainer_state.json, no .metadata)")
    raise CheckpointProblem(f"{path}: no such checkpoint")


def load_checkpoint(path: Path, kind: str, model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    """Load model and optimizer state from `path` in place; return the checkpoint's step."""
    try:
        if kind == "files":
            state = torch.load(path, map_location="cpu", weights_only=True)
            model.load_state_dict(state["model"])
            optim.load_state_dict(state["optim"])
            return int(state["step"])
        if kind == "hf-trainer":
            meta = json.loads((path / "trainer_state.json").read_text())
            model.load_state_dict(torch.load(path / "model.pt", map_location="cpu", weights_only=True))
            optim.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
            rng = torch.load(path / "rng_state.pth", map_location="cpu", weights_only=True)
            torch.set_rng_state(rng["cpu_rng_state"])
            return int(meta["global_step"])
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        dcp = _quiet_dcp()
        # DCP loads into a state dict of the right shapes; get_state_dict creates AdamW's state
        # with a zero-learning-rate step, which leaves the weights untouched.
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd, "step": -1}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return int(state["step"])
    except Exception as exc:  # corrupt zip, wrong shapes, missing keys: one line, not a traceback
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointProblem(f"{path}: cannot load {kind} checkpoint: {first}") from exc


# ---------------------------------------------------------------------------------------------


def pause(seconds: float, stop: StopFlag) -> None:
    """Idle for `seconds` (a stand-in for real compute), returning early when asked to stop."""
    deadline = time.monotonic() + seconds
    while not stop.requested:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.05))


def run(args: argparse.Namespace, stop: StopFlag) -> int:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    out = _expand(args.out)
    out.mkdir(parents=True, exist_ok=True)

    resume = _expand(args.resume) if args.resume else None
    if resume is not None:
        kind = checkpoint_kind(resume)  # before building the model: a bad path fails fast
    model, optim = make_model(args.seed)
    if resume is not None:
        start = load_checkpoint(resume, kind, model, optim)
        print(f"resumed from {resume} at step {start}")
    else:
        start = 0
        print("fresh start")

    save = SAVERS[args.layout]
    extra = {"max_steps": args.steps, "save_every": args.save_every, "seed": args.seed, "loss": None}

    def checkpoint(step: int) -> None:
        path = save(out, step, model, optim, extra)
        if args.keep_last:
            rotate(out, args.layout, args.keep_last, path)
        print(f"saved {path}")

    step, last_saved = start, start
    while step < args.steps and not stop.requested:
        step += 1
        extra["loss"] = loss = train_step(model, optim, args.seed, step)
        print(f"step {step} loss {loss:.6f}")
        if step % args.save_every == 0 or step == args.steps:
            checkpoint(step)
            last_saved = step
        if step < args.steps:
            pause(args.sleep, stop)

    if step < args.steps:  # SIGTERM: the step in flight is finished; save it and stop cleanly
        if last_saved != step:
            checkpoint(step)
        print(f"stopped at step {step}")
        return 0

    if args.final:
        final = _expand(args.final)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(final.name + ".tmp")
        tmp.write_text(weights_sha256(model) + "\n")
        os.replace(tmp, final)  # written before "done", so whoever waits for "done" can read it
    print(f"done step {step}")
    return 0


def main(argv: list[str] | None = None) -> int:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # tmux/log readers see each line
    stop = StopFlag()
    stop.install()
    args = build_parser().parse_args(argv)
    try:
        return run(args, stop)
    except CheckpointProblem as exc:
        print(f"error: --resume {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
