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
- `set_aside`: a resume from an older checkpoint starts a new branch; the later checkpoints go
  under `.relaunch-aside/` in their folder and the branch into its lineage file, which relaunch
  reads. The Checkpointer's `restore` and both callbacks call it; a loop of your own may too.

What `relaunch up` exports for this module (run.sh): RELAUNCH_STOP_SIGNAL (run.stop.signal),
RELAUNCH_NOTICE (the guard's notice record) and RELAUNCH_STARTED (when this run started, so that
a record left by an earlier run on the same instance is not taken for a new notice). Without
them (a run started by hand) the module still works: SIGTERM, no notice record.

One file, long on purpose: `up` ships it alone, so it cannot be split into modules that import
each other; each part is one trainer's side of the same job (save when asked, resume exactly).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

# TrainerCallback and LightningCallback are attributes too, made on first use (see __getattr__):
# not in __all__, so that `from relaunch.train import *` imports neither transformers nor Lightning
__all__ = [
    "COMPLETE_MARKER",
    "Checkpointer",
    "GlobalBatchSampler",
    "StopRequest",
    "install",
    "is_marked_complete",
    "lightning_callback",
    "load_accelerate_state",
    "mark_complete",
    "notice",
    "save_accelerate_state",
    "set_aside",
    "stop_requested",
    "trainer_callback",
]

STOP_SIGNAL_ENV = "RELAUNCH_STOP_SIGNAL"
NOTICE_ENV = "RELAUNCH_NOTICE"
STARTED_ENV = "RELAUNCH_STARTED"
COMPLETE_MARKER = "relaunch-complete.json"   # the accelerate layout reads it (relaunch/layouts/accelerate.py)
ASIDE_DIR = ".relaunch-aside"                # in a checkpoint folder: abandoned branches (no layout lists it)
LINEAGE_FILE = "lineage.jsonl"               # in ASIDE_DIR: one JSON line per branch (relaunch reads it)
NOTICE_LOOK_EVERY = 1.0                      # seconds between looks at the notice record


def _line(stream: Any, text: str) -> None:
    """One write of the whole line: print() writes the text and its newline apart, and on a
    write-through stream (stderr; stdout under PYTHONUNBUFFERED) the ranks' lines then splice
    mid-line in a shared log."""
    stream.write(text + "\n")
    stream.flush()


def _say(message: str) -> None:
    _line(sys.stderr, f"relaunch.train: {message}")


def _say_in_a_handler(message: str) -> None:
    """_say for a signal handler: one write(2) to fd 2, past sys.stderr's buffer. The signal can
    come while the main thread is inside a write to sys.stderr (a notice's line, a trainer's
    progress bar); a second write there raises RuntimeError ("reentrant call"), which ended the
    training instead of saving it."""
    try:
        os.write(2, f"relaunch.train: {message}\n".encode())
    except OSError:
        pass


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
            if self._on_top(number):
                self._chained[number] = chain      # already on top: only whether to chain changes
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
            if self._on_top(number):
                signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def let_go(self, done: Any) -> None:
        """Stop chaining to the handlers `done(handler)` picks, and to any handler of a signal
        this one no longer handles (a library replaced it: it can never be called from here).

        A chained bound method keeps its object alive, and through it whatever that holds: a
        trainer's, the whole training (its model, its process group's threads).
        """
        for number, previous in list(self._previous.items()):
            if not self._on_top(number):
                del self._previous[number]
            elif done(previous):
                self._previous[number] = None      # uninstall() puts back the default

    def _on_top(self, number: signal.Signals) -> bool:
        """Is this request's handler the one the signal calls now?"""
        return getattr(signal.getsignal(number), "__self__", None) is self

    def _handle(self, signum: int, frame: Any) -> None:
        if self._handling:          # a chain that leads back here (a library composing handlers)
            return
        first = self.signalled is None
        self.signalled = signal.Signals(signum)
        if first:
            _say_in_a_handler(f"got {self.signalled.name}: training is asked to save and exit")
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


# -- lineage: a resume from an older checkpoint starts a new branch ------------------------------
def _utc(at: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(at))


BRANCH_ID = re.compile(r"[A-Za-z0-9_=+-][A-Za-z0-9_.=+-]*")   # what a branch id may be (a folder name)


def branch_id(resumed: str, at: float) -> str:
    """`<UTC time>-from-<name>`: the branch's name, and its folder under `.relaunch-aside/`."""
    name = os.path.basename(os.path.normpath(resumed)) if os.path.isabs(resumed) else resumed
    name = re.sub(r"[^A-Za-z0-9_.=+-]", "-", name.replace("/", "--"))
    return f"{_utc(at)}-from-{name or 'scratch'}"


def set_aside(folder: str | os.PathLike[str], names: list[str], resumed: str, step: int,
              by: str = "a training script", ident: str | None = None,
              at: float | None = None) -> dict[str, Any] | None:
    """Training in `folder` resumed from `resumed` (at `step`) while `names` (checkpoints of later
    steps, relative to `folder`) are there: they belong to an abandoned branch. Each goes under
    `folder/.relaunch-aside/<id>/` with one rename, never deleted, so that neither a layout
    (relaunch's listing leaves the folder out) nor the trainer's own rotation sees them, and the
    branch is appended to `.relaunch-aside/lineage.jsonl` first (written whole: a temporary file
    renamed), which `relaunch evacuate`, `sync` and `watch` read to set the same ones aside in the
    store. Returns the branch's record, None when there is nothing to set aside."""
    folder = os.path.abspath(os.path.expanduser(os.fspath(folder)))
    present = sorted(n for n in names if os.path.lexists(os.path.join(folder, n)))
    if not present:
        return None
    at = time.time() if at is None else at
    ident = ident or branch_id(resumed, at)
    aside = os.path.join(folder, ASIDE_DIR)
    where = os.path.join(aside, ident)
    record = {"id": ident, "resumed": resumed, "step": int(step), "at": at, "aside": present, "by": by,
              "where": where}
    os.makedirs(where, exist_ok=True)
    lineage = os.path.join(aside, LINEAGE_FILE)
    try:
        with open(lineage) as handle:
            before = handle.read()
    except FileNotFoundError:
        before = ""
    if ident not in _branch_ids(before):        # the nodes of a group sharing one folder: once
        if before and not before.endswith("\n"):
            before += "\n"
        tmp = f"{lineage}.tmp-{os.getpid()}"
        with open(tmp, "w") as handle:
            handle.write(before + json.dumps(record, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, lineage)                  # the branch is known before anything moves
    for name in present:
        target = os.path.join(where, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.rename(os.path.join(folder, name), target)
    _fsync_dir(folder)
    _fsync_dir(where)
    return record


def _branch_ids(text: str) -> set[str]:
    ids = set()
    for line in text.splitlines():
        try:
            ids.add(json.loads(line)["id"])
        except (ValueError, TypeError, KeyError):
            continue                              # a line cut short by a crash of an older writer
    return ids


def _said_aside(record: dict[str, Any]) -> None:
    _say(f"training resumed from {record['resumed']} (step {record['step']}) while newer checkpoints were there: "
         f"a new branch; {', '.join(record['aside'])} set aside in {record['where']} (kept, never counted as "
         "the newest again)")


_STEP_NAME = re.compile(r"step=(\d+)")                 # Lightning's `epoch=3-step=1200.ckpt`
_HF_CHECKPOINT = re.compile(r"checkpoint-(\d+)")       # the Trainer's folders


def _newer_here(folder: str, step: int, pattern: re.Pattern[str]) -> list[str]:
    """The names directly in `folder` whose step (the pattern's group) is later than `step`."""
    try:
        entries = os.listdir(folder)
    except OSError:
        return []
    return sorted(n for n in entries if (m := pattern.fullmatch(n)) and int(m[1]) > step)


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


# -- the Checkpointer: a plain PyTorch loop, one process or torchrun ----------------------------
CHECKPOINT_METRIC = "relaunch.checkpoint:"   # each committed save's metric line (relaunch/savecosts.py reads it)
TEMP_PREFIX = "tmp-"                         # a save being written: no layout counts it (layouts/base.py)
DCP_MARKER = ".metadata"                     # what the dcp layout counts as complete (layouts/dcp.py)


def _fsync_dir(path: str) -> None:
    """Make a rename in `path` durable (the folder's own entry list reaches the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(path: str) -> None:
    """Delete folder `path`, renamed first to a `tmp-` name that no layout counts (one atomic step,
    made durable): a kill or an I/O error part way through the removal leaves that `tmp-` folder
    (the next start removes it), never a checkpoint with some of its files gone."""
    import shutil

    parent, base = os.path.split(path)
    gone = os.path.join(parent, f"{TEMP_PREFIX}gone-{os.getpid()}-{base}")
    shutil.rmtree(gone, ignore_errors=True)      # what an earlier removal of this name left
    os.rename(path, gone)
    _fsync_dir(parent)
    shutil.rmtree(gone, ignore_errors=True)


class _Failed(Exception):
    """A step of a commit that failed on some rank, and every rank knows it: `error` is this
    rank's own, or what it was told. (A collective that raises instead means a rank is gone, and
    nobody here knows how far it got.)"""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _pack(value: Any) -> bytes:
    """Anything torch can save, as one opaque value of the DCP state dict (never flattened)."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unpack(data: bytes) -> Any:
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in a (nested) state dict that this process holds (a DTensor's shard)."""
    import torch

    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return local.numel() * local.element_size()
    return 0


def _rng_state() -> dict[str, Any]:
    import random

    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in state and numpy is not None:
        numpy.random.set_state(state["numpy"])


class Checkpointer:
    """Saves and restores a plain PyTorch training with PyTorch DCP, off the training's path.

        ckpt = Checkpointer("~/ckpt", model, optimizer, scheduler=scheduler, sampler=sampler, keep=2)
        start = ckpt.restore(args.resume)        # relaunch's {{ checkpoint }}; "" = the newest in ~/ckpt
        for step in range(start + 1, steps + 1):
            ...                                  # one optimizer step
            if ckpt.stop_requested():            # a stop signal or the guard's notice, on any rank
                ckpt.finish(step)                # save this step, flush the write in flight, commit
                break
            if step % save_every == 0:
                ckpt.save(step)                  # blocks for the copy of the state; writes behind
        else:
            ckpt.finish(steps)

    What a save holds: the model and the optimizer (DCP, each rank its own shards: FSDP2,
    DDP or one process), the scheduler, every rank's RNG state, the data position (a
    `GlobalBatchSampler`'s: the step; another sampler's `state_dict()` per rank) and `extra`.

    How it saves: `save()` copies the state to host memory (DCP's stager: pinned memory with
    CUDA, shared memory for a background process) and returns; DCP writes it from a
    background thread (`background="process"`: a process) with a cached save plan. One write
    is in flight at most: a save waits for the one before. `async_save=False`: `dcp.save`, the
    training waits for the whole write.

    How it commits: every rank writes into `tmp-step-N/` (a name no relaunch layout counts);
    once every rank's write has finished (rank 0's DCP `.metadata` is then in it), each other
    node renames its own part to `step-N/`, and rank 0 renames its folder, holding `.metadata`,
    last. So `layout: dcp` (and `auto`) counts `step-N` exactly when it is whole, on one node or
    across a node group, and a process killed mid-write leaves only a `tmp-` folder, removed
    when the next run starts. A `step-N/` already there (saved again by a run that did not
    restore) moves to a `tmp-old-` name first, rank 0's before any other node's part changes; it
    comes back if the save does not commit (at the next start, when the process was killed). Nothing is deleted
    until every rank knows the new checkpoint is complete: then the earlier `step-N/` and all but
    the last `keep` checkpoints go, each renamed to a `tmp-gone-` name before its files are
    removed, so that no folder a layout counts ever misses a file.

    Resuming: `restore(path)` loads any world size's save (DCP reshards; the script recomputes
    its gradient accumulation as before). A save older than the folder's later ones starts a new
    branch: those go aside (`set_aside`) before it returns. RNG states and per-rank sampler states come back when
    the world size is the same; the scheduler, the step, `extra` and a GlobalBatchSampler's
    position always.

    Each committed save prints a metric line on rank 0 (`relaunch.checkpoint: step=N ...
    blocking_s=B write_s=W step_s=T ...`): what it blocked the training for, how long the
    background write and commit took, the mean training step since the save before. `relaunch
    interval`, `status` and `drill` read them.

    Every rank must make the Checkpointer (after `init_process_group`) and call `save`,
    `stop_requested`, `finish` and `restore` at the same steps: they are collective.
    """

    def __init__(self, dir: str | os.PathLike[str], model: Any, optimizer: Any = None, *, scheduler: Any = None,
                 sampler: Any = None, keep: int = 2, prefix: str = "step-", async_save: bool = True,
                 background: str = "thread", stop: StopRequest | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint import DefaultSavePlanner
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if keep < 1:
            raise ValueError(f"keep must be at least 1 (got {keep})")
        if background not in ("thread", "process"):
            raise ValueError(f"background is 'thread' or 'process' (got {background!r})")
        if not re.fullmatch(r"[A-Za-z0-9_.=-]*", prefix) or prefix.lower().startswith("tmp") or prefix[:1] == ".":
            raise ValueError(f"prefix {prefix!r}: letters, digits and _.=- only, not hidden, not tmp...")
        self.dir = os.path.abspath(os.path.expanduser(os.fspath(dir)))
        self.model, self.optimizer, self.scheduler, self.sampler = model, optimizer, scheduler, sampler
        self.keep, self.prefix, self.async_save = keep, prefix, async_save
        self.stop = stop or install()
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        # The background write and commit use a group of their own, and the training's thread
        # another (the stop agreement, restore): neither meets the training's own collectives.
        self._control = dist.new_group(backend="gloo") if self.distributed else None
        self._writing = dist.new_group(backend="gloo") if self.distributed else None
        self.background = background if self.distributed else "thread"   # a process needs the group
        if not self.distributed:
            import warnings

            # DCP warns at every save and load of one process that it is one process; so it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        os.makedirs(self.dir, exist_ok=True)
        self.leader = self._lowest_rank_here()
        self._planner = DefaultSavePlanner(enable_plan_caching=True)
        self._planner._cached_plans_key = f"relaunch.Checkpointer.{id(self)}"   # its own cache entry
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(),
                                                    use_shared_memory=self.background == "process",
                                                    use_async_staging=False, use_non_blocking_copy=False))
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relaunch-checkpoint")
        self._pending: Any = None                # the Future of the save in flight: written and committed
        self._error: BaseException | None = None
        self._closed = False
        self.saved_step = -1                     # the newest step saved (or restored): not saved again
        self._committed_step = -1                # the newest step committed (or restored)
        self._mark, self._mark_step = time.monotonic(), 0   # the step time counts from here
        self.costs: list[dict[str, Any]] = []    # every committed save: step, blocking_s, write_s, step_s, bytes
        self.restored: str | None = None
        self.extra: Any = None
        self._remove_temporary()

    # -- collectives --------------------------------------------------------------------------
    def _lowest_rank_here(self) -> bool:
        """Is this the lowest rank of those that share this checkpoint folder (one disk)? That
        rank looks after the folder: renames, keep N, what a killed run left. Every rank leaves
        a probe file in it and looks which probes it sees: a hostname cannot tell (containers,
        namespaces, several nodes named alike), a shared filesystem shows all of them."""
        import uuid

        if not self.distributed:
            return True
        import torch.distributed as dist

        token = [uuid.uuid4().hex]
        dist.broadcast_object_list(token, src=0, group=self._control)
        prefix = f".relaunch-probe-{token[0]}-"
        probe = os.path.join(self.dir, f"{prefix}{self.rank}")
        with open(probe, "w"):
            pass
        self._barrier(self._control)
        seen = [int(name[len(prefix):]) for name in os.listdir(self.dir) if name.startswith(prefix)]
        self._barrier(self._control)
        os.remove(probe)
        return min(seen) == self.rank

    def _barrier(self, group: Any) -> None:
        self._reduce(0.0, group)

    def _reduce(self, value: float, group: Any, op: str = "SUM") -> float:
        if not self.distributed:
            return value
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op), group=group)
        return float(tensor.item())

    def _together(self, what: str, action: Callable[[], object]) -> None:
        """`action` on every rank (each does its own part, or nothing), then `_Failed` on every
        rank when it failed on any (so that none waits for it in a collective)."""
        error: OSError | None = None
        try:
            action()
        except OSError as exc:
            error = exc
        if self._reduce(1.0 if error else 0.0, self._writing, "MAX") > 0:
            raise _Failed(error or RuntimeError(f"{what} failed on another rank"))

    def _agree(self, flag: bool) -> bool:
        """True on every rank when it is True on any."""
        return self._reduce(1.0 if flag else 0.0, self._control, "MAX") > 0

    # -- the folders --------------------------------------------------------------------------
    def name(self, step: int) -> str:
        return f"{self.prefix}{step:08d}"

    def _steps_here(self) -> list[tuple[int, str]]:
        """(step, path) of this machine's checkpoint folders of this prefix, oldest first."""
        pattern = re.compile(re.escape(self.prefix) + r"(\d+)")
        found = []
        for entry in os.scandir(self.dir):
            match = pattern.fullmatch(entry.name)
            if match and entry.is_dir(follow_symlinks=False):
                found.append((int(match[1]), entry.path))
        return sorted(found)

    def newest(self) -> str | None:
        """The newest complete checkpoint in the folder (its DCP `.metadata` is there), or None."""
        complete = [path for _, path in self._steps_here()
                    if os.path.isfile(os.path.join(path, DCP_MARKER))
                    and os.path.getsize(os.path.join(path, DCP_MARKER)) > 0]
        return complete[-1] if complete else None

    def _newest_whole(self) -> str | None:
        """The newest checkpoint whose every file (those its `.metadata` names) is in some node's
        folder: what a start without `path` resumes. Collective. One with a file on no node (the
        node that held its part was replaced, its disk with it) is said and passed over: loading it
        fails, at every start. (Without a shared disk each rank reads its own folder, which `up`
        fills with the whole checkpoint it restores.)"""
        import torch.distributed as dist
        from torch.distributed.checkpoint import FileSystemReader

        candidates: list[tuple[str, list[str]]] = []
        if self.rank == 0:
            for _, path in reversed(self._steps_here()):
                try:       # (this file alone is on the instance: DCP reads what its `.metadata` names)
                    storage = FileSystemReader(path).read_metadata().storage_data or {}
                    candidates.append((path, sorted({info.relative_path for info in storage.values()})))
                except Exception:        # no `.metadata`, or not DCP's: not complete, no layout counts it
                    continue
        shared: list[Any] = [candidates]
        if self.distributed:
            dist.broadcast_object_list(shared, src=0, group=self._control)
        here: dict[str, list[str]] = {}
        if self.leader:
            for path, _ in shared[0]:
                name = os.path.basename(path)
                try:
                    here[name] = os.listdir(os.path.join(self.dir, name))
                except OSError:
                    here[name] = []
        every: list[Any] = [here]
        if self.distributed:
            every = [None] * self.world_size
            dist.all_gather_object(every, here, group=self._control)
        for path, needed in shared[0]:
            name = os.path.basename(path)
            held = {file for node in every if node for file in node.get(name, [])}
            missing = [file for file in needed if file not in held]
            if not missing:
                return path
            if self.rank == 0:
                _say(f"{path} is not resumed: {len(missing)} of its files are on no node ({', '.join(missing[:3])}"
                     f"{', ...' if len(missing) > 3 else ''}): a node's part is missing")
        return None

    def _asides(self) -> dict[str, list[str]]:
        """name -> the `tmp-old-` folders holding an earlier `name` of this prefix, moved aside."""
        pattern = re.compile(rf"{TEMP_PREFIX}old-\d+-({re.escape(self.prefix)}\d+)")
        found: dict[str, list[str]] = {}
        for entry in os.scandir(self.dir):
            match = pattern.fullmatch(entry.name)
            if match and entry.is_dir(follow_symlinks=False):
                found.setdefault(match[1], []).append(entry.path)
        return found

    def _aside(self, name: str) -> None:
        """Move `name` here to a `tmp-old-` name: no layout counts it any more, and `_settle`
        decides whether it goes or comes back. On another node than rank 0's, without a `name`
        here, an empty folder of that name says so: what `name` holds after this is the new
        save's part, to go if the save does not commit. (Rank 0's rename is the commit itself.)"""
        final, aside = os.path.join(self.dir, name), os.path.join(self.dir, f"{TEMP_PREFIX}old-{os.getpid()}-{name}")
        if os.path.lexists(final):
            os.rename(final, aside)
        elif self.rank != 0:
            os.mkdir(aside)
        else:
            return
        _fsync_dir(self.dir)

    def _settle(self, name: str, committed: bool) -> None:
        """The end of a save of `name` in this folder: committed, the earlier `name` moved aside
        goes; not committed, it comes back (and this node's part of the save that failed goes).
        The save's `tmp-` folder goes either way."""
        import shutil

        final = os.path.join(self.dir, name)
        asides = self._asides().get(name, [])
        if asides and not committed:
            if os.path.lexists(final):
                _discard(final)
            if os.listdir(asides[-1]):           # (empty: there was no `name` before)
                os.rename(asides.pop(), final)
                _fsync_dir(self.dir)
        for path in [*asides, os.path.join(self.dir, TEMP_PREFIX + name)]:
            shutil.rmtree(path, ignore_errors=True)

    def _settle_or_say(self, name: str, committed: bool) -> None:
        try:
            self._settle(name, committed)
        except OSError as exc:                   # nothing is lost: what stays aside keeps its `tmp-old-` name
            _say(f"{name}: left as it is in {self.dir}: {exc}")

    def _settle_in_order(self, name: str, committed: bool) -> None:
        """`_settle` on every node, rank 0's folder last: whether `name` is there is what a
        restart reads as "committed", so it changes only once the other nodes' parts agree."""
        if self.leader and self.rank != 0:
            self._settle_or_say(name, committed)
        self._barrier(self._writing)
        if self.rank == 0:
            self._settle_or_say(name, committed)

    def _remove_temporary(self) -> None:
        """What a killed run left (called on every rank). An earlier checkpoint that a save moved
        aside comes back unless that save committed (its name in rank 0's folder again); every
        other `tmp-` folder of this prefix goes: a write never committed, a removal cut short."""
        import shutil

        import torch.distributed as dist

        there = [[os.path.basename(path) for _, path in self._steps_here()] if self.rank == 0 else None]
        if self.distributed:
            dist.broadcast_object_list(there, src=0, group=self._control)
        committed = set(there[0] or ())
        if self.leader:                          # rank 0's folder, the evidence, changes last
            for name in self._asides():
                if self.rank != 0 or name in committed:
                    self._settle_or_say(name, name in committed)
        self._barrier(self._control)
        if self.rank == 0:
            for name in self._asides():
                self._settle_or_say(name, False)  # (the committed ones went above)
        if self.leader:
            pattern = re.compile(rf"{TEMP_PREFIX}(gone-\d+-)?{re.escape(self.prefix)}\d+")
            for entry in os.scandir(self.dir):
                if pattern.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
        self._barrier(self._control)

    def _prune(self) -> None:
        """Keep the newest `keep` checkpoints of this machine's folder (once every rank knows the
        newest is complete)."""
        for _, path in self._steps_here()[:-self.keep]:
            try:
                _discard(path)
            except OSError as exc:
                _say(f"keep={self.keep}: {path} stays: {exc}")

    def _set_aside_newer(self, found: str, step: int) -> None:
        """Restoring a save older than the folder's later ones starts a new branch: on every node,
        those later saves (complete or not) go aside (`set_aside`), so that `keep` prunes only
        this branch's older saves and `newest()` (and relaunch's layouts) see this branch's.
        Collective, like restore: one branch id for every node."""
        inside = os.path.dirname(os.path.abspath(found)) == self.dir
        resumed = os.path.basename(os.path.abspath(found)) if inside else found
        ident = [branch_id(resumed, time.time())]
        if self.distributed:
            import torch.distributed as dist

            dist.broadcast_object_list(ident, src=0, group=self._control)
        error: OSError | None = None
        if self.leader:
            pattern = re.compile(re.escape(self.prefix) + r"(\d+)")
            newer = [n for n in _newer_here(self.dir, step, pattern) if os.path.isdir(os.path.join(self.dir, n))]
            try:
                record = set_aside(self.dir, newer, resumed, step, "relaunch.train.Checkpointer", ident=ident[0])
            except OSError as exc:
                error, record = exc, None
            if record is not None:
                _said_aside(record)
        if self._reduce(1.0 if error else 0.0, self._control, "MAX") > 0:
            raise error or RuntimeError("relaunch.train: setting the later saves aside failed on another node")

    # -- saving -------------------------------------------------------------------------------
    def _state(self, step: int, extra: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        state: dict[str, Any] = {"step": step}
        if self.optimizer is not None:
            state["model"], state["optim"] = get_state_dict(self.model, self.optimizer)
        else:
            state["model"] = get_model_state_dict(self.model)
        sampler = self.sampler
        common = {"world_size": self.world_size, "extra": extra,
                  "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                  "data": ({"step": step, "num_samples": sampler.num_samples, "global_batch": sampler.global_batch,
                            "seed": sampler.seed} if isinstance(sampler, GlobalBatchSampler) else None)}
        own = {"rng": _rng_state(),
               "data": sampler.state_dict() if hasattr(sampler, "state_dict") and
               not isinstance(sampler, GlobalBatchSampler) else None}
        # opaque values: the same on every rank (DCP writes one), and one per rank
        state["common"], state[f"rank{self.rank}"] = _pack(common), _pack(own)
        return state

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"relaunch.train: a checkpoint save failed: {type(error).__name__}: {error}") from error

    def wait(self) -> None:
        """Until the save in flight is written and committed (on every rank)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except BaseException as exc:    # the background's failure, told on the training's thread
                self._error = exc
                self.saved_step = self._committed_step     # not saved: that step may be saved again
        self._raise_error()

    def save(self, step: int, extra: Any = None) -> bool:
        """Save `step`: copy the state, start its write in the background, return. False when
        this step is saved already (or was restored). Call it on every rank."""
        return self._save(step, extra, time.monotonic())

    def _save(self, step: int, extra: Any, reached: float) -> bool:
        """`reached`: when training reached this save (the step time counts until then)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self._raise_error()
        if step <= self.saved_step:
            return False
        began = time.monotonic()
        self.wait()                              # one write in flight at most; the training waits for it
        state = self._state(step, extra)
        name = self.name(step)
        writer = FileSystemWriter(os.path.join(self.dir, TEMP_PREFIX + name))
        if self.async_save:
            kind = AsyncCheckpointerType.PROCESS if self.background == "process" else AsyncCheckpointerType.THREAD
            response = dcp.async_save(state, storage_writer=writer, planner=self._planner, process_group=self._writing,
                                      async_checkpointer_type=kind, async_stager=self._stager,
                                      no_dist=not self.distributed)
            upload = getattr(response, "upload_completion", response)
        else:
            dcp.save(state, storage_writer=writer, planner=self._planner, process_group=self._writing,
                     no_dist=not self.distributed)
            upload = None
        staged = time.monotonic()
        steps = step - self._mark_step
        step_time = (reached - self._mark) / steps if steps > 0 else None
        self.saved_step = step
        cost = {"step": step, "name": name, "blocking_s": staged - began, "step_s": step_time,
                "bytes": _tensor_bytes({k: state[k] for k in ("model", "optim") if k in state})}
        if upload is None:                       # blocking: the commit too, before the training goes on
            try:
                self._commit(None, cost, staged)
            except BaseException:
                self.saved_step = self._committed_step
                raise
            cost["blocking_s"], cost["write_s"] = time.monotonic() - began, 0.0
            self._report(cost)
        else:
            self._pending = self._committer.submit(self._commit, upload, cost, staged)
            if self.rank == 0:
                _say(f"{name}: state copied in {cost['blocking_s']:.3f}s, writing in the background")
        self._mark, self._mark_step = time.monotonic(), step
        return True

    def _commit(self, upload: Any, cost: dict[str, Any], staged: float) -> None:
        """In the background, once every rank's write has finished: into place in agreed moves,
        rank 0's rename last; the earlier folders go only once every rank knows it is complete."""
        import shutil

        name = cost["name"]
        temporary, final = os.path.join(self.dir, TEMP_PREFIX + name), os.path.join(self.dir, name)

        def aside() -> None:                     # rank 0's earlier `name`, holding `.metadata`
            if self.rank == 0:
                self._aside(name)

        def part() -> None:
            # A rank returns from DCP's save only after rank 0 wrote `.metadata`: every shard is
            # written. Other machines rename their own part (without `.metadata`, not complete
            # yet); a machine that sees `.metadata` shares rank 0's disk and leaves it to rank 0.
            if self.leader and self.rank != 0 and os.path.isdir(temporary) and \
                    not os.path.exists(os.path.join(temporary, DCP_MARKER)):
                self._aside(name)
                os.rename(temporary, final)
                _fsync_dir(self.dir)

        def complete() -> None:
            if self.rank == 0:
                os.rename(temporary, final)      # with `.metadata`: complete from this moment
                try:
                    _fsync_dir(self.dir)
                except OSError as exc:           # renamed all the same: an error here would undo a commit
                    _say(f"{name}: committed, but making its rename durable failed: {exc}")

        try:
            if upload is not None:
                upload.result()                  # DCP raises on every rank when any rank's write failed
            # the earlier `name` stops counting before any node's part of it changes
            self._together(f"moving the earlier {name} aside", aside)
            self._together(f"renaming a node's part of {name}", part)
            total = self._reduce(float(cost["bytes"]), self._writing)
            self._together(f"committing {name}", complete)      # and every rank knows it is committed
        except _Failed as failed:                # every rank knows it did not commit: undo, together
            self._settle_in_order(name, committed=False)
            raise failed.error from None
        except BaseException:                    # a rank is gone: what it did is settled at the next start
            if self.leader:
                shutil.rmtree(temporary, ignore_errors=True)     # never committed (a full disk gets its room back)
            raise
        self._committed_step = cost["step"]
        if self.leader:
            self._settle(name, committed=True)
            self._prune()
        cost["bytes"] = int(total)
        if upload is not None:
            cost["write_s"] = time.monotonic() - staged
            self._report(cost)

    def _report(self, cost: dict[str, Any]) -> None:
        self.costs.append(cost)
        if self.rank == 0:
            step_s = "-" if cost["step_s"] is None else f"{cost['step_s']:.6f}"
            _line(sys.stdout, f"{CHECKPOINT_METRIC} step={cost['step']} name={cost['name']} "
                              f"blocking_s={cost['blocking_s']:.6f} write_s={cost['write_s']:.6f} step_s={step_s} "
                              f"bytes={cost['bytes']} world_size={self.world_size}")   # interval reads it

    def stop_requested(self) -> bool:
        """Has relaunch asked this training to save and exit (a signal or the guard's notice, seen
        by any rank)? One small reduce: call it on every rank at the same step."""
        return self._agree(self.stop.requested())

    def finish(self, step: int | None = None, extra: Any = None) -> str | None:
        """The end of training, or a stop: save `step` (unless it is saved already), wait for
        every write, commit. On a notice with a deadline, a save that would not be written
        before it (by the saves measured so far) is not started: the write in flight is still
        flushed and committed. A write in flight that failed (the disk was full then) is said,
        and `step` is saved all the same; the failure is raised only when that save does not
        happen. Returns the newest committed checkpoint here (rank 0's folder)."""
        reached = time.monotonic()
        failed: RuntimeError | None = None
        try:
            self.wait()
        except RuntimeError as exc:              # that save failed (a full disk): this one may not
            failed = exc
            if self.rank == 0:
                _line(sys.stderr, str(exc))
        if step is not None and step > self.saved_step:
            deadline = self.stop.deadline() if self.stop.requested() else None
            needed = sorted(c["blocking_s"] + c["write_s"] for c in self.costs)
            late = bool(deadline is not None and needed and time.time() + needed[len(needed) // 2] > deadline)
            if self._agree(late):
                if self.rank == 0:
                    _say(f"no save of step {step}: it would not be written before the notice's deadline; "
                         f"the newest committed checkpoint stays {self.name(self.saved_step)}")
            else:
                self._save(step, extra, reached)
                self.wait()
                failed = None
                if self.rank == 0 and self.stop.requested():
                    _say(f"{self.stop.reason}: {self.name(step)} saved and committed")
        if failed is not None:
            raise failed
        return self.newest()

    def close(self) -> None:
        """Wait for the save in flight, then let go of the staging memory and the background thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self._committer.shutdown(wait=True)
            self._stager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- resuming -----------------------------------------------------------------------------
    def restore(self, path: str | os.PathLike[str] | None = None) -> int:
        """Load `path` (relaunch's `{{ checkpoint }}`; empty or None: the newest checkpoint in the
        folder whose every file is on some node) at any world size, and return its step; 0 when
        there is none."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        found = os.path.expanduser(os.fspath(path)) if path else self._newest_whole()
        if not found:
            if self.rank == 0:
                _say(f"no checkpoint in {self.dir}: a fresh start")
            self.saved_step = self._committed_step = 0
            self._mark, self._mark_step = time.monotonic(), 0
            return 0
        reader = FileSystemReader(found)
        keys = set(reader.read_metadata().state_dict_metadata)
        state = self._state(0, None)
        own = f"rank{self.rank}"
        state = {k: v for k, v in state.items() if k != own}
        if own in keys:
            state[own] = b""
        dcp.load(state, storage_reader=reader, process_group=self._control, no_dist=not self.distributed)
        if self.optimizer is not None:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        else:
            set_model_state_dict(self.model, state["model"])
        step, common = int(state["step"]), _unpack(state["common"])
        saved_world = int(common.get("world_size", 0))
        if self.scheduler is not None and common.get("scheduler") is not None:
            self.scheduler.load_state_dict(common["scheduler"])
        same = saved_world == self.world_size
        if same and own in state:
            mine = _unpack(state[own])
            _set_rng_state(mine["rng"])
            if mine.get("data") is not None and hasattr(self.sampler, "load_state_dict"):
                self.sampler.load_state_dict(mine["data"])
        if isinstance(self.sampler, GlobalBatchSampler):
            data = common.get("data") or {}
            changed = [k for k in ("num_samples", "global_batch", "seed") if k in data and
                       data[k] != getattr(self.sampler, k)]
            if changed and self.rank == 0:
                _say(f"the data order changed since {found}: {', '.join(changed)} (the samples of each step differ "
                     "from the uninterrupted run's)")
            self.sampler.start_step = step
        self._set_aside_newer(found, step)
        self.extra, self.restored = common.get("extra"), found
        self.saved_step = self._committed_step = step
        self._mark, self._mark_step = time.monotonic(), step
        if self.rank == 0:
            world = f"world size {saved_world}" + ("" if same else f" -> {self.world_size}")
            kept = "" if same else "; each rank keeps the RNG seeded by the script (per-rank streams do not carry over)"
            _say(f"resumed from {found} at step {step} ({world}){kept}")
        return step


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


def _world_size(args: Any = None) -> int:
    """The number of processes training together: the Trainer's, or torch.distributed's."""
    import torch.distributed as dist

    size = int(getattr(args, "world_size", 1) or 1)
    if dist.is_available() and dist.is_initialized():
        size = max(size, dist.get_world_size())
    return size


def trainer_callback() -> type:
    """The class of `TrainerCallback`, made on first use (imports transformers)."""
    if "trainer" in _CLASSES:
        return _CLASSES["trainer"]
    import transformers

    class RelaunchTrainerCallback(transformers.TrainerCallback):  # type: ignore[misc]
        """transformers' Trainer: on a notice, save a `checkpoint-N` at the end of the step, then stop.

        Add it to `Trainer(callbacks=[...])`. It installs relaunch's handler when training begins
        (chained to transformers' own). With `enable_jit_checkpoint=True`, the stop signal TERM
        and a single process, transformers saves on SIGTERM by itself (its JIT checkpoint, after
        a 3 s wait) and the callback leaves the save to it; it still acts on the guard's notice
        record and on another run.stop.signal. With more than one process the JIT checkpoint
        would be decided on each rank alone (a rank the signal missed keeps training while the
        others save, a collective): there relaunch's handler does not pass SIGTERM on to
        transformers', and every rank saves and stops at the step they agree on.
        `stop.requested()` tells the script afterwards that training stopped on a notice rather
        than finished (on the ranks the signal reached; `stopping` on every rank).
        """

        def __init__(self, stop: StopRequest | None = None) -> None:
            self.stop = stop
            self.jit = False
            self.stopping = False

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # the state is the resumed checkpoint's by now: later `checkpoint-N` folders in
            # output_dir are an abandoned branch's; left there, save_total_limit would delete this
            # branch's saves around them, and relaunch's layout would call the highest the newest
            writes = state.is_local_process_zero if getattr(args, "save_on_each_node", False) else \
                state.is_world_process_zero
            if writes and args.output_dir:
                newer = [n for n in _newer_here(args.output_dir, state.global_step, _HF_CHECKPOINT)
                         if os.path.isdir(os.path.join(args.output_dir, n))]
                resumed = f"checkpoint-{state.global_step}" if state.global_step else ""
                record = set_aside(args.output_dir, newer, resumed, state.global_step, "relaunch.train.TrainerCallback")
                if record is not None:
                    _said_aside(record)
            jit = bool(getattr(args, "enable_jit_checkpoint", False))
            self.jit = jit and _world_size(args) < 2
            # on top of the JIT handler: chained to it with one process, never with several
            self.stop = (self.stop or install()).install(chain=self.jit or not jit)

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

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # transformers' JIT handler, chained under this one, holds the Trainer: kept, it would
            # keep the DDP model and its process group alive into Python's shutdown, where a gloo
            # thread letting go of a tensor aborts the process after a good save
            if self.stop is not None:
                self.stop.let_go(lambda handler: type(getattr(handler, "__self__", None)).__module__
                                 .startswith("transformers."))

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
        ModelCheckpoint (unless that one saves this very step anyway: with a `monitor`, only when
        the step enters its top k), and sets
        `trainer.should_stop`. Every process decides together (one reduce per step).
        """

        def __init__(self, stop: StopRequest | None = None) -> None:
            self.stop = stop
            self.saved: str | None = None

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.stop = (self.stop or install()).install()

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.stop = (self.stop or install()).install(chain=False)
            if trainer.is_global_zero:
                self._set_aside_newer(trainer)

        @staticmethod
        def _set_aside_newer(trainer: Any) -> None:
            """The loops are the resumed checkpoint's by now: `*.ckpt` of later steps in a
            ModelCheckpoint's folder are an abandoned branch's (never the newest again)."""
            for cb in trainer.checkpoint_callbacks:
                folder = getattr(cb, "dirpath", None)
                if not isinstance(cb, pl.callbacks.ModelCheckpoint) or not folder or not os.path.isdir(folder):
                    continue
                step = trainer.global_step
                newer = [n for n in os.listdir(folder) if n.endswith(".ckpt") and
                         (found := _STEP_NAME.findall(n)) and int(found[-1]) > step]
                resumed = f"step={step}" if step else ""
                record = set_aside(folder, newer, resumed, step, "relaunch.train.LightningCallback")
                if record is not None:
                    _said_aside(record)

        def _checkpoint(self, trainer: Any) -> tuple[str, bool]:
            """Where the save goes, and whether the trainer's ModelCheckpoint saves this step itself."""
            metrics = {**trainer.callback_metrics, "epoch": torch.tensor(trainer.current_epoch),
                       "step": torch.tensor(trainer.global_step)}
            for cb in trainer.checkpoint_callbacks:
                if isinstance(cb, pl.callbacks.ModelCheckpoint) and cb.dirpath:
                    every = getattr(cb, "_every_n_train_steps", 0) or 0
                    itself = bool(every) and trainer.global_step % every == 0 and cb.save_top_k != 0 and \
                        self._saves_anyway(cb, trainer, metrics)
                    # a key of the name missing from the metrics formats as 0 (Lightning's rule)
                    return cb.format_checkpoint_name(metrics), itself
            name = f"epoch={trainer.current_epoch}-step={trainer.global_step}.ckpt"
            return os.path.join(trainer.default_root_dir, name), False

        @staticmethod
        def _saves_anyway(cb: Any, trainer: Any, metrics: dict[str, Any]) -> bool:
            """Whether `cb`, due at this step, saves it itself. With a `monitor` it keeps only a
            step in its top k, and it waits for validation when the key is missing or on an
            epoch's last batch (validation may not run once training stops)."""
            if cb.monitor is None:
                return True
            last = getattr(trainer.fit_loop.epoch_loop.batch_progress, "is_last_batch", False)
            if cb.monitor not in metrics or last:
                return False
            # a reduce once k models are kept: every rank gets here at the same step
            return cb.save_top_k == -1 or bool(cb.check_monitor_top_k(trainer, metrics[cb.monitor]))

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
