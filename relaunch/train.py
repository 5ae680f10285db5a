"""relaunch.train: what a training script needs from relaunch, and nothing else.

Standard library only at import: `relaunch up` puts this one file on the training's PYTHONPATH
(`~/.relaunch/NAME/python/relaunch/train.py`, a namespace portion, so a relaunch installed in the
venv wins), and nothing of relaunch's own dependencies goes into the training's venv. torch,
transformers and Lightning are imported only inside the callbacks that need them.

    from relaunch import train as relaunch_train

    stop = relaunch_train.install()          # the guard's signal: run.stop.signal, default TERM
    for step in ...:
        ...
        if stop.requested():                 # a signal came, or the guard's notice record
            save(step)
            break

- `StopRequest` / `install()` / `stop_requested()`: has relaunch asked this training to save and
  exit? True once `run.stop.signal` arrived (the guard on a reclaim notice, `relaunch evacuate
  --stop`), or once the guard's notice record for this run exists (`RELAUNCH_NOTICE`, written
  before the guard signals: it still counts when a library swallowed the signal). Installing
  chains to a Python handler already there (transformers' JIT checkpoint, Lightning's).
- `TrainerCallback` (transformers) and `LightningCallback` (Lightning): save at the end of the
  step a notice came in, then stop training (see their docstrings).
- `save_accelerate_state` / `load_accelerate_state`: Accelerate's `save_state` plus a marker
  (`relaunch-complete.json`) that the `accelerate` layout reads as "every process finished", so
  a save made on a notice is copied off at once; resuming continues Accelerate's folder numbers.
- `GlobalBatchSampler`: a sampler whose order depends only on the seed, the step and the global
  batch, never on the world size, so a run resumed on another number of processes sees exactly
  the samples the uninterrupted run would have seen.

What `relaunch up` exports for this module (run.sh): RELAUNCH_STOP_SIGNAL (run.stop.signal),
RELAUNCH_NOTICE (the guard's notice record) and RELAUNCH_STARTED (when this run started, so that
a record left by an earlier run on the same instance is not taken for a new notice). Without
them (a run started by hand) the module still works: SIGTERM, no notice record.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

# TrainerCallback and LightningCallback are attributes too, made on first use (see __getattr__):
# not in __all__, so that `from relaunch.train import *` imports neither transformers nor Lightning
__all__ = [
    "COMPLETE_MARKER",
    "GlobalBatchSampler",
    "StopRequest",
    "install",
    "is_marked_complete",
    "lightning_callback",
    "load_accelerate_state",
    "mark_complete",
    "notice",
    "save_accelerate_state",
    "stop_requested",
    "trainer_callback",
]

STOP_SIGNAL_ENV = "RELAUNCH_STOP_SIGNAL"
NOTICE_ENV = "RELAUNCH_NOTICE"
STARTED_ENV = "RELAUNCH_STARTED"
COMPLETE_MARKER = "relaunch-complete.json"   # the accelerate layout reads it (relaunch/layouts/accelerate.py)
NOTICE_LOOK_EVERY = 1.0                      # seconds between looks at the notice record


def _say(message: str) -> None:
    print(f"relaunch.train: {message}", file=sys.stderr, flush=True)


def parse_signal(name: str | int) -> signal.Signals:
    """`TERM`, `SIGTERM`, `term` or `15` -> signal.SIGTERM. ValueError for anything else."""
    if isinstance(name, int) or str(name).strip().isdigit():
        return signal.Signals(int(name))
    text = str(name).strip().upper()
    try:
        return signal.Signals[text if text.startswith("SIG") else "SIG" + text]
    except KeyError:
        raise ValueError(f"not a signal name: {name!r}") from None


class StopRequest:
    """Whether relaunch asked this training to save and exit: the stop signal, or the guard's record.

    signals: default RELAUNCH_STOP_SIGNAL, else TERM. notice_file: default RELAUNCH_NOTICE (none
    when unset). started: records whose `seen_at` is before this time are an earlier run's
    (default RELAUNCH_STARTED, else now). `install()` sets the signal handlers (main thread only;
    elsewhere only the record is looked at); `requested()` is cheap enough for every step.
    """

    def __init__(self, signals: list[str | int] | None = None, notice_file: str | None = None,
                 started: float | None = None) -> None:
        if signals is None:
            signals = [os.environ.get(STOP_SIGNAL_ENV) or "TERM"]
        self.signals = [parse_signal(s) for s in signals]
        self.notice_file = notice_file if notice_file is not None else os.environ.get(NOTICE_ENV) or None
        if started is None:
            try:
                started = float(os.environ[STARTED_ENV])
            except (KeyError, ValueError):
                started = time.time()
        self.started = started
        self.signalled: signal.Signals | None = None   # the stop signal, once it came
        self.record: dict[str, Any] | None = None      # the guard's notice record, once seen
        self._previous: dict[signal.Signals, Any] = {}
        self._chained: dict[signal.Signals, bool] = {}
        self._looked = 0.0
        self._handling = False

    # -- the signal ---------------------------------------------------------------------------
    def install(self, chain: bool = True) -> StopRequest:
        """Handle the stop signals from now on; a Python handler already set is called too
        (chain=False: not; the Lightning callback takes the signal over from Lightning so).

        Calling it again (after a library replaced the handler) puts this one back on top. From
        a thread other than the main one nothing is changed (Python allows handlers only
        there): the notice record still works.
        """
        if threading.current_thread() is not threading.main_thread():
            return self
        for number in self.signals:
            current = signal.getsignal(number)
            if getattr(current, "__self__", None) is self:
                continue
            self._previous[number] = current
            self._chained[number] = chain
            signal.signal(number, self._handle)
        return self

    def uninstall(self) -> None:
        """Put back the handlers that were there before `install()`."""
        if threading.current_thread() is not threading.main_thread():
            return
        for number, previous in self._previous.items():
            if getattr(signal.getsignal(number), "__self__", None) is self:
                signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self._handling:          # a chain that leads back here (a library composing handlers)
            return
        first = self.signalled is None
        self.signalled = signal.Signals(signum)
        if first:
            _say(f"got {self.signalled.name}: training is asked to save and exit")
        number = signal.Signals(signum)
        previous = self._previous.get(number) if self._chained.get(number, True) else None
        # chained: transformers' JIT checkpoint, say; never Python's default SIGINT handler (a
        # KeyboardInterrupt in the middle of a step would lose the save)
        if callable(previous) and previous is not signal.default_int_handler:
            self._handling = True
            try:
                previous(signum, frame)
            finally:
                self._handling = False

    # -- the notice record --------------------------------------------------------------------
    def notice(self) -> dict[str, Any] | None:
        """The guard's notice record of this run (source, detail, deadline ...), or None."""
        if self.record is not None or not self.notice_file:
            return self.record
        now = time.monotonic()
        if now - self._looked < NOTICE_LOOK_EVERY and self._looked:
            return None
        self._looked = now
        try:
            with open(self.notice_file) as handle:
                data = json.load(handle)
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict):
            return None
        seen = data.get("seen_at")
        if not isinstance(seen, (int, float)) or seen < self.started:
            return None                      # an earlier run's record, left on this instance
        self.record = data
        _say("the guard's notice record: {} ({}): training is asked to save and exit".format(
            data.get("source", "?"), data.get("detail", "?")))
        return data

    def requested(self) -> bool:
        """Save now, then exit: the stop signal came, or the guard recorded a notice for this run."""
        return self.signalled is not None or self.notice() is not None

    @property
    def reason(self) -> str:
        if self.signalled is not None:
            return f"signal {self.signalled.name}"
        if self.record is not None:
            return "notice from {}: {}".format(self.record.get("source", "?"), self.record.get("detail", "?"))
        return ""

    def deadline(self) -> float | None:
        """When the instance goes (seconds since the epoch), from the notice record; None if unknown."""
        record = self.notice()
        value = record.get("deadline") if record else None
        return float(value) if isinstance(value, (int, float)) else None


_DEFAULT: StopRequest | None = None


def install() -> StopRequest:
    """The module's StopRequest (made from the environment on the first call), installed."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = StopRequest()
    return _DEFAULT.install()


def stop_requested() -> bool:
    """Has relaunch asked this training to save and exit? (Installs the handler on first use.)"""
    return install().requested()


def notice() -> dict[str, Any] | None:
    """The guard's notice record of this run, or None."""
    return install().notice()


# -- checkpoints without a marker of their own ---------------------------------------------------
def mark_complete(folder: str | os.PathLike[str], **info: Any) -> str:
    """Write `relaunch-complete.json` into a checkpoint folder once every process finished it.

    The `accelerate` layout counts a folder holding it as complete at once (without it only once
    a newer save exists). Written under a temporary name and renamed, so it is never half there.
    """
    path = os.path.join(os.fspath(folder), COMPLETE_MARKER)
    record = {"saved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "by": "relaunch.train", **info}
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        handle.write(json.dumps(record, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path


def is_marked_complete(folder: str | os.PathLike[str]) -> bool:
    path = os.path.join(os.fspath(folder), COMPLETE_MARKER)
    return os.path.isfile(path) and os.path.getsize(path) > 0


def save_accelerate_state(accelerator: Any, output_dir: str | None = None, **info: Any) -> str:
    """`accelerator.save_state()`, then, once every process is past it, the completion marker.

    Call it on every process (as `save_state` itself). Returns the folder saved to. `info` goes
    into the marker (the step, say); the number of processes is added.
    """
    folder = accelerator.save_state(output_dir)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        mark_complete(folder, processes=accelerator.num_processes, **info)
    accelerator.wait_for_everyone()
    return str(folder)


_ACCELERATE_DIR = re.compile(r"checkpoint_(\d+)")


def load_accelerate_state(accelerator: Any, input_dir: str) -> None:
    """`accelerator.load_state(input_dir)`, and with automatic checkpoint naming the next save
    continues after the restored folder's number (Accelerate itself starts at 0 again, and
    `checkpoint_0` would then look older than the checkpoint it resumed from)."""
    accelerator.load_state(input_dir)
    config = accelerator.project_configuration
    found = _ACCELERATE_DIR.fullmatch(os.path.basename(os.path.normpath(input_dir)))
    if getattr(config, "automatic_checkpoint_naming", False) and found:
        config.iteration = max(config.iteration, int(found[1]) + 1)


# -- the data order ------------------------------------------------------------------------------
_M64 = (1 << 64) - 1


def _mix(z: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit hash of a 64-bit integer."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class _Permutation:
    """A pseudo-random permutation of range(n) computed one index at a time (a 4-round Feistel
    network on the next even number of bits, cycle-walking back into range): no list of n
    numbers, the same answer on every machine and Python version."""

    ROUNDS = 4

    def __init__(self, n: int, key: int) -> None:
        self.n = n
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.half = bits // 2
        self.mask = (1 << self.half) - 1
        self.keys = [_mix(key ^ (i + 1) * 0x632BE59BD9B4E019) for i in range(self.ROUNDS)]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(k ^ right) & self.mask)
        return (left << self.half) | right

    def __getitem__(self, i: int) -> int:
        if self.n == 1:
            return 0
        x = self._encrypt(i)
        while x >= self.n:           # < 4n values in the domain: a few steps at most, on average
            x = self._encrypt(x)
        return x


class GlobalBatchSampler:
    """The samples of every global step, whatever the number of processes: a torch `Sampler`.

    The data is one stream: epoch e is a permutation of range(num_samples) seeded by (seed, e),
    the epochs follow each other, and global step s (counting from 1) trains on positions
    (s-1)*global_batch .. s*global_batch-1 of that stream. Which samples a step sees depends on
    the seed, the step and the global batch only, never on the world size; so a run resumed at
    step k on fewer or more processes (gradient accumulation recomputed to keep the global batch)
    trains on exactly the samples the uninterrupted run would have, none twice and none skipped.
    Every sample comes once per epoch (a global batch may span two epochs).

    This process's share of step s is a contiguous slice of its global batch: rank r of W gets
    global_batch/W samples, which a DataLoader with batch_size=micro_batch cuts into the
    grad_accum micro-batches of the step. Iterating yields this rank's indices for steps
    start_step+1 .. steps, in order. len() is this rank's share of the whole run (steps 1 ..
    steps) whatever start_step is, so what was computed from it on the first start (a schedule's
    length, Lightning's count of the batches in its epoch, which a resumed epoch continues)
    comes out the same on a resume. Pass it as a DataLoader's `sampler` (not through
    `accelerator.prepare`, and with Lightning's `use_distributed_sampler=False`: both would
    split the batches again).

    start_step: optimizer steps already done (the resumed checkpoint's step; 0 on a fresh start).
    steps: the last step of the run. micro_batch (optional): checked to divide this rank's share,
    gives `grad_accum`.
    """

    def __init__(self, num_samples: int, global_batch: int, *, steps: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1, start_step: int = 0, micro_batch: int | None = None,
                 shuffle: bool = True) -> None:
        if num_samples < 1 or global_batch < 1:
            raise ValueError("num_samples and global_batch must be at least 1")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not one of world size {world_size}")
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} does not split over world size {world_size}")
        if not 0 <= start_step <= steps:
            raise ValueError(f"start_step {start_step} is not within 0..steps ({steps})")
        self.num_samples, self.global_batch, self.seed = num_samples, global_batch, seed
        self.rank, self.world_size, self.start_step, self.steps = rank, world_size, start_step, steps
        self.shuffle = shuffle
        self.per_rank = global_batch // world_size
        self.micro_batch = micro_batch
        if micro_batch is not None and (micro_batch < 1 or self.per_rank % micro_batch):
            raise ValueError(f"micro batch {micro_batch} does not divide this rank's {self.per_rank} samples "
                             f"of the global batch {global_batch} (world size {world_size})")
        self._orders: dict[int, _Permutation] = {}

    @property
    def grad_accum(self) -> int:
        """Micro-batches per step on this rank (needs micro_batch)."""
        if self.micro_batch is None:
            raise ValueError("grad_accum needs micro_batch")
        return self.per_rank // self.micro_batch

    def sample(self, position: int) -> int:
        """The sample at `position` of the stream (position 0 is the first of step 1)."""
        epoch, index = divmod(position, self.num_samples)
        if not self.shuffle:
            return index
        order = self._orders.get(epoch)
        if order is None:
            if len(self._orders) > 2:
                self._orders.clear()
            order = self._orders[epoch] = _Permutation(self.num_samples, _mix(_mix(self.seed & _M64) ^ epoch))
        return order[index]

    def global_batch_of(self, step: int) -> list[int]:
        """The samples of global step `step` (from 1), all ranks together, in order."""
        first = (step - 1) * self.global_batch
        return [self.sample(p) for p in range(first, first + self.global_batch)]

    def indices(self, step: int, rank: int | None = None) -> list[int]:
        """Rank `rank`'s (default: this one's) samples of global step `step` (from 1)."""
        rank = self.rank if rank is None else rank
        first = (step - 1) * self.global_batch + rank * self.per_rank
        return [self.sample(p) for p in range(first, first + self.per_rank)]

    def __iter__(self) -> Iterator[int]:
        for step in range(self.start_step + 1, self.steps + 1):
            yield from self.indices(step)

    def __len__(self) -> int:
        return self.steps * self.per_rank


# -- the trainers' callbacks (their packages imported only when asked for) ----------------------
_CLASSES: dict[str, type] = {}


def _agree(flag: bool, device: Any = None) -> bool:
    """True on every process when it is True on any (torch.distributed, when it is running)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def trainer_callback() -> type:
    """The class of `TrainerCallback`, made on first use (imports transformers)."""
    if "trainer" in _CLASSES:
        return _CLASSES["trainer"]
    import transformers

    class RelaunchTrainerCallback(transformers.TrainerCallback):  # type: ignore[misc]
        """transformers' Trainer: on a notice, save a `checkpoint-N` at the end of the step, then stop.

        Add it to `Trainer(callbacks=[...])`. It installs relaunch's handler when training begins
        (chained to transformers' own). With `enable_jit_checkpoint=True` and the stop signal
        TERM, transformers saves on SIGTERM by itself (its JIT checkpoint, after a 3 s wait) and
        the callback leaves the save to it; it still acts on the guard's notice record and on
        another run.stop.signal. `stop.requested()` tells the script afterwards that training
        stopped on a notice rather than finished.
        """

        def __init__(self, stop: StopRequest | None = None) -> None:
            self.stop = stop
            self.jit = False
            self.stopping = False

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.stop = (self.stop or install()).install()   # on top of the JIT handler, chained to it
            self.jit = bool(getattr(args, "enable_jit_checkpoint", False))

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            stop = self.stop or install()
            if self.stopping or not _agree(stop.requested(), getattr(args, "device", None)):
                return
            if self.jit and stop.signals == [signal.SIGTERM] and stop.signalled is not None:
                return                  # transformers' JIT checkpoint saves on this SIGTERM
            self.stopping = True
            control.should_save = True
            control.should_training_stop = True
            _say(f"{stop.reason or 'stop requested'}: saving checkpoint-{state.global_step}, then stopping")

    _CLASSES["trainer"] = RelaunchTrainerCallback
    return RelaunchTrainerCallback


def _lightning() -> Any:
    """The Lightning package the script uses: `lightning.pytorch` or `pytorch_lightning`."""
    import importlib

    for name in ("lightning.pytorch", "pytorch_lightning"):
        if name in sys.modules:
            return sys.modules[name]
    try:
        return importlib.import_module("lightning.pytorch")
    except ImportError:
        return importlib.import_module("pytorch_lightning")


def lightning_callback(package: Any = None) -> type:
    """The class of `LightningCallback` for `package` (default: `lightning.pytorch`, or
    `pytorch_lightning` when that is the one imported), made on first use."""
    pl = package or _lightning()
    key = f"lightning:{pl.__name__}"
    if key in _CLASSES:
        return _CLASSES[key]
    import torch

    class RelaunchLightningCallback(pl.Callback):  # type: ignore[misc,name-defined]
        """Lightning: on a notice, save `epoch=E-step=S.ckpt` at the end of the step, then stop.

        Lightning (2.6.6) stops on SIGTERM outside SLURM without saving: it raises
        SIGTERMException at the end of the batch the signal came in, which with gradient
        accumulation can be in the middle of a step, where no checkpoint resumes exactly. So from
        `on_train_start` on (after Lightning set its handlers) this callback takes the stop signal
        over from Lightning, and at the end of the step (the last micro-batch) the signal or the
        guard's record came in, it saves, at the point of the loop where ModelCheckpoint saves
        its own step checkpoints, under the name and in the folder of the trainer's
        ModelCheckpoint (unless that one saves this very step anyway), and sets
        `trainer.should_stop`. Every process decides together (one reduce per step).
        """

        def __init__(self, stop: StopRequest | None = None) -> None:
            self.stop = stop
            self.saved: str | None = None

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.stop = (self.stop or install()).install()

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.stop = (self.stop or install()).install(chain=False)

        def _checkpoint(self, trainer: Any) -> tuple[str, bool]:
            """Where the save goes, and whether the trainer's ModelCheckpoint saves this step itself."""
            metrics = {**trainer.callback_metrics, "epoch": torch.tensor(trainer.current_epoch),
                       "step": torch.tensor(trainer.global_step)}
            for cb in trainer.checkpoint_callbacks:
                if isinstance(cb, pl.callbacks.ModelCheckpoint) and cb.dirpath:
                    every = getattr(cb, "_every_n_train_steps", 0) or 0
                    itself = bool(every) and trainer.global_step % every == 0 and cb.save_top_k != 0
                    return cb.format_checkpoint_name(metrics), itself
            name = f"epoch={trainer.current_epoch}-step={trainer.global_step}.ckpt"
            return os.path.join(trainer.default_root_dir, name), False

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if (batch_idx + 1) % max(1, trainer.accumulate_grad_batches):
                return                  # in the middle of a step: its gradients are not applied yet
            stop = self.stop or install()
            if self.saved is not None or not trainer.strategy.reduce_boolean_decision(stop.requested(), all=False):
                return
            path, itself = self._checkpoint(trainer)
            if not itself:
                trainer.save_checkpoint(path)
            self.saved = path
            trainer.should_stop = True
            if trainer.is_global_zero:
                _say(f"{stop.reason or 'stop requested'}: saved {path} at step {trainer.global_step}; stopping")

    _CLASSES[key] = RelaunchLightningCallback
    return RelaunchLightningCallback


def __getattr__(name: str) -> Any:
    # `relaunch.train.TrainerCallback` / `.LightningCallback`: made (and their packages imported)
    # only when a script asks for them
    if name == "TrainerCallback":
        return trainer_callback()
    if name == "LightningCallback":
        return lightning_callback()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
