"""What every kind of store does for the steps: receive a checkpoint off an instance, verify it,
commit it; send one back; keep the manifest. One implementation per `checkpoint.remote` kind.

Trust lives in the manifest alone: bytes may sit in the store before they are verified, but a
checkpoint counts only once its record is in the manifest, which is written after the bytes.
"""

from __future__ import annotations

import fcntl
import hashlib
import shlex
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..layouts import Checkpoint
from ..paths import state_dir
from ..store import CheckpointRecord, FileRecord, StoreManifest
from ..scripts import export_lines
from ..ui import UI, redact

if TYPE_CHECKING:
    from ..steps.common import Job


@contextmanager
def instance_env(job: Job, values: dict[str, str]) -> Iterator[str]:
    """Credentials for a command run on the instance: a 0600 file, never a command line.

    Yields the shell prefix that loads them; the file is removed when the step ends.
    """
    redact.add(values.values())
    path = f"{job.paths.state}/store.env"
    job.remote.exec(f"mkdir -p {shlex.quote(job.paths.state)} && chmod 700 {shlex.quote(job.paths.state)}")
    job.remote.put_bytes(path, export_lines(values).encode(), 0o600)
    try:
        yield f". {shlex.quote(path)} && "
    finally:
        job.remote.exec(f"rm -f {shlex.quote(path)}")


@dataclass
class Received:
    ok: bool
    vanished: bool = False     # the trainer rotated the checkpoint away during the copy
    lost: bool = False         # the connection to the instance dropped: worth another round
    message: str = ""


class Store(ABC):
    label: str                 # what the user wrote, for messages
    via: str = "local"         # local: bytes pass through this machine | instance: the instance talks to it

    # -- the record ---------------------------------------------------------------------------
    @abstractmethod
    def is_empty(self) -> bool: ...

    @abstractmethod
    def load_manifest(self) -> StoreManifest | None: ...

    @abstractmethod
    def save_manifest(self, manifest: StoreManifest) -> None: ...

    @abstractmethod
    def write_meta(self, filename: str, text: str) -> None: ...

    @abstractmethod
    def prune(self, manifest: StoreManifest, keep: int) -> list[str]: ...

    # -- evacuation: receive -> verify -> commit -> (caller) manifest --------------------------
    @abstractmethod
    def receive(self, job: Job, cp: Checkpoint, again: bool = False) -> Received:
        """Copy cp's files off the instance towards the store; `again`: compare full contents."""

    @abstractmethod
    def verify(self, job: Job, cp: Checkpoint, expected: dict[str, FileRecord]) -> list[str]:
        """Problems with what was received, against the instance's sha256 (empty = verified)."""

    @abstractmethod
    def commit(self, job: Job, record: CheckpointRecord) -> None:
        """Put verified bytes where the store keeps them (never over different bytes)."""

    # -- restore ----------------------------------------------------------------------------
    @abstractmethod
    def send(self, job: Job, record: CheckpointRecord, incoming: str) -> None:
        """Copy the record's files to `incoming/<path>` on the instance (the caller verifies)."""

    def describe_send(self, job: Job, record: CheckpointRecord, incoming: str) -> str:
        return f"copy {record.name} from {self.label} to {incoming}"

    @contextmanager
    def lock(self, ui: UI) -> Iterator[None]:
        """One writer per store on this machine: `sync` in the background and `evacuate` take turns."""
        folder = state_dir() / "locks"
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = folder / (hashlib.sha256(self.label.encode()).hexdigest()[:16] + ".lock")
        with open(path, "w") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                ui.say(f"waiting for another relaunch writing to {self.label} (a sync round?)")
                fcntl.flock(handle, fcntl.LOCK_EX)
            yield
