"""A store that is a folder on this machine, reached with rsync over the instance's SSH settings.

Its staging (`.relaunch/partial/`) is also how the relay (`via: local` for rclone and hf) holds
a checkpoint on its way from the instance to the remote: `pull_actions` and `push_actions` are
shared with it.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .. import processes
from ..errors import EvacuationError, Interrupted
from ..host.hashing import FileHash, hash_deadline, local_hash_argv, parse_hashes, paths_stdin
from ..job import Job, StoreState
from ..layouts import Checkpoint
from ..manifest import CheckpointRecord, Seen, StoreManifest
from ..paths import known_hosts_file
from ..plan import LOCAL, Action, Ref
from ..ui import human
from . import rsync
from .base import Hashes, Mismatch, Store, expected_record, incoming_ready
from .folder import StoreFolder

COPY_LANE, FOLLOW_LANE = "copy", "hash-here"


def pull_actions(parts: list[tuple[Job, Checkpoint]], fs: StoreFolder, cp: Checkpoint, every_byte: bool,
                 room: str, follow: bool = True, streams: int | None = None) -> list[Action]:
    """rsync exactly cp's listed files into the staging folder of `fs` (never trusted there),
    each part from the node that holds it, a checkpoint of several large files in up to
    `streams` (default checkpoint.streams) rsyncs at once; then mark the copy over
    (`fs.copied_marker`). With `follow`, beside the copy: sha256 of each file as it lands
    (result `received:<name>`, for `staging.verify`); without, the caller follows the copy itself."""
    files = [e.path for e in cp.files]
    staging = fs.staging_path(cp.name)
    ready = f"staging:{cp.name}"
    actions = [Action("evacuate", f"prepare the staging folder of {cp.name}", where=LOCAL, call="staging.prepare",
                      args={"name": cp.name, "files": files}, fails_as="evacuate", produces=ready, lane=COPY_LANE)]
    others: list[Action] = []       # the streams after the first, each in a lane of its own
    for job, part in parts:
        source = "the instance" if len(parts) == 1 else job.host
        argv = rsync.pull_argv(job.target, known_hosts_file(), job.copy_from, staging,
                               ("--checksum",) if every_byte else ())
        sizes = {e.path: e.size for e in part.files}
        wanted = streams or job.recipe.checkpoint.streams
        groups = rsync.split(list(sizes.items()), wanted if len(parts) == 1 else 1)
        for i, names in enumerate(groups):
            size = sum(sizes[n] for n in names)
            said = (f"copying {cp.name} (step {cp.step}, {len(sizes)} file(s), {human(sum(sizes.values()))}) to "
                    f"{room}" + (f" from {job.host}" if len(parts) > 1 else "")
                    + (f" in {len(groups)} streams" if len(groups) > 1 else "")
                    + (", comparing every byte" if every_byte else ""))
            stream = f" (stream {i + 1} of {len(groups)})" if len(groups) > 1 else ""
            action = Action(
                "evacuate", f"{cp.name} (step {cp.step}, {len(names)} file(s), {human(size)}) from {source}{stream}",
                where=LOCAL, argv=argv, stdin=paths_stdin(names), deadline=rsync.deadline_for(size), retry=True,
                outcomes=rsync.OUTCOMES, fails_as="evacuate", progress="rsync", size=size, room=f"in {room}",
                say=said if i == 0 else "", lane=COPY_LANE)
            if i:
                action = dataclasses.replace(action, lane=f"{COPY_LANE}-{i + 1}", needs=(ready,),
                                             produces=f"pulled:{cp.name}:{i + 1}")
                others.append(action)
            else:
                actions.append(action)
    actions.append(Action("evacuate", f"the copy of {cp.name} is over", where=LOCAL, call="staging.copied",
                          args={"name": cp.name}, fails_as="evacuate", lane=COPY_LANE,
                          needs=tuple(a.produces for a in others)))
    total = sum(e.size for e in cp.files)
    follow_action = Action("evacuate", f"sha256 of {cp.name} here as it lands", where=LOCAL,
                           argv=local_hash_argv(staging, follow=fs.copied_marker(cp.name)), stdin=paths_stdin(files),
                           deadline=rsync.deadline_for(total) * 3 + hash_deadline(total), lane=FOLLOW_LANE,
                           needs=(ready,), produces=f"received:{cp.name}", parse="hashes", fails_as="evacuate")
    return [*actions, *others, *([follow_action] if follow else [])]


def push_actions(job: Job, source: Path, name: str, incoming: str, files: dict[str, int], is_dir: bool,
                 after: tuple[str, ...] = ()) -> list[Action]:
    """rsync a checkpoint (file or folder; `files`: its paths in the store and sizes) from this
    machine to `incoming/<name>` on the instance; a folder of several large files in up to
    checkpoint.streams rsyncs at once: the first in the caller's lane, each other in its own,
    waiting for the incoming folder and the results `after`, producing `pushed:<name>:<n>`."""
    total = sum(files.values())
    groups = rsync.split(list(files.items()), job.recipe.checkpoint.streams) if is_dir else [list(files)]
    argv = rsync.push_argv(job.target, known_hosts_file(), source, f"{incoming}/{name}", is_dir,
                           some=len(groups) > 1)
    actions = []
    for i, paths in enumerate(groups):
        size = sum(files[p] for p in paths)
        stream = f": {len(paths)} file(s), {human(size)} (stream {i + 1} of {len(groups)})" if len(groups) > 1 else ""
        action = Action("checkpoint", f"{name} ({human(total)}) to the instance{stream}", where=LOCAL, argv=argv,
                        deadline=rsync.deadline_for(size), retry=True, outcomes=rsync.PUSH_OUTCOMES,
                        fails_as="checkpoint", progress="rsync", size=size, room="on the instance",
                        hint="nothing is lost; rerun `relaunch up`")
        if len(groups) > 1:        # store paths are NAME/...: the list is relative to the folder
            action = dataclasses.replace(action, stdin=paths_stdin([p.split("/", 1)[1] for p in paths]))
        if i:
            action = dataclasses.replace(action, lane=f"push-{i + 1}", produces=f"pushed:{name}:{i + 1}",
                                         needs=(incoming_ready(name), *after))
        actions.append(action)
    return actions


class StagingCalls:
    """The in-process operations on a StoreFolder's staging that plans call (`staging.*`)."""

    def __init__(self, fs: StoreFolder) -> None:
        self.fs = fs

    def prepare(self, name: str, files: list[str]) -> None:
        self.fs.prepare_staging(name, files)

    def copied(self, name: str) -> None:
        self.fs.copied_marker(name).touch()

    def follow(self, cp: Checkpoint, algos: tuple[str, ...],
               cancelled: Callable[[], bool]) -> Iterator[list[FileHash]]:
        """The staged files' hashes as soon as the copy put them in place (hashes.py --follow),
        until the copy is marked over, then the rest: each time, all that arrived meanwhile."""
        files = [e.path for e in cp.files]
        total = sum(e.size for e in cp.files)
        lines: queue.Queue[bytes | BaseException | None] = queue.Queue()
        buffer = bytearray()
        stop = threading.Event()

        def feed(chunk: bytes) -> None:
            buffer.extend(chunk)
            while b"\n" in buffer:
                line, _, rest = bytes(buffer).partition(b"\n")
                buffer[:] = rest
                lines.put(line)

        def run() -> None:
            try:
                done = processes.run(local_hash_argv(self.fs.staging_path(cp.name), algos,
                                                     follow=self.fs.copied_marker(cp.name)),
                                     stdin=paths_stdin(files), deadline=rsync.deadline_for(total) * 3,
                                     on_stdout=feed, cancelled=lambda: stop.is_set() or cancelled())
                if done.status != 0:
                    lines.put(EvacuationError(f"hashing {cp.name} here failed: {done.err.strip()[-300:]}"))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
                lines.put(exc)
            finally:
                lines.put(None)

        thread = threading.Thread(target=run, name=f"follow-{cp.name}", daemon=True)
        thread.start()
        try:
            while True:
                try:
                    item = lines.get(timeout=0.2)
                except queue.Empty:
                    processes.check_cancel()
                    if cancelled():
                        raise Interrupted("interrupted") from None
                    continue
                batch: list[FileHash] = []
                while item is not None:
                    if isinstance(item, BaseException):
                        raise item
                    batch += parse_hashes(item).values()
                    try:
                        item = lines.get_nowait()
                    except queue.Empty:
                        break
                if batch:
                    yield batch
                if item is None:
                    return
        finally:
            stop.set()
            thread.join()

    def verify(self, cp: Checkpoint, hashes: Hashes, host: str, about: dict[str, Any] | None = None,
               received: dict[str, FileHash] | None = None) -> CheckpointRecord:
        """The staged copy against the instance's hashes: the record it earns, or Mismatch.
        `received`: the staged files' hashes computed as they landed."""
        record = expected_record(cp, hashes, host, about)
        landed = {p: (h.size, h.hashes["sha256"]) for p, h in (received or {}).items()
                  if not h.missing and not h.problem and "sha256" in h.hashes}
        problems = self.fs.verify_staged(cp.name, record.files, landed)
        if problems:
            raise Mismatch(f"{cp.name} did not verify: {problems[0]}"
                           + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""), problems)
        return record

    def drop(self, name: str) -> None:
        self.fs.drop_staging(name)


class LocalPathStore(Store):
    def __init__(self, root: Path, recipe_name: str) -> None:
        self.fs = StoreFolder(root)
        self.label = str(root)
        self.recipe_name = recipe_name
        self.staging = StagingCalls(self.fs)

    @property
    def root(self) -> Path:
        return self.fs.root

    def handlers(self) -> dict[str, Any]:
        return {"store": self, "staging": self.staging}

    def read(self, writing: bool = False) -> StoreState:
        self.manifest = self.fs.load_manifest()
        return StoreState(self.label, self.fs.is_empty(), self.manifest)

    def save_manifest(self, manifest: StoreManifest) -> None:
        self.fs.save_manifest(manifest)

    def write_meta(self, filename: str, text: str) -> None:
        self.fs.write_meta(filename, text)

    def read_meta(self, filename: str) -> str | None:
        return self.fs.read_meta(filename)

    swap_guarantee = "a compare-and-set under an fcntl lock on the store folder's .relaunch/"

    def swap_meta(self, filename: str, expected: str | None, text: str) -> bool:
        return self.fs.swap_meta(filename, expected, text)

    def prune(self, manifest: StoreManifest, keep: int, protect: frozenset[str] = frozenset()) -> list[str]:
        return self.fs.prune(manifest, keep, protect)

    def observe(self, record: CheckpointRecord, size_only: bool = False) -> dict[str, Seen]:
        return self.fs.observe(record, size_only)

    def set_aside(self, record: CheckpointRecord, paths: list[str], into: str | None = None) -> str:
        return self.fs.set_aside(record.name, paths, into)

    takes_parts = True

    def part_name(self, name: str, rank: int) -> str:
        return f"{name}@{rank}"           # each node's own staging: none prepares away another's files

    def join_parts(self, name: str, parts: list[str], files: list[str]) -> None:
        self.fs.join_staged(name, parts, files)

    def plan_send(self, job: Job, record: CheckpointRecord, incoming: str) -> list[Action]:
        source = self.root / record.name
        return push_actions(job, source, record.name, incoming, {p: f.size for p, f in record.files.items()},
                            is_dir=record.is_dir)

    def plan_receive(self, job: Job, cp: Checkpoint, every_byte: bool = False) -> list[Action]:
        return pull_actions([(job, cp)], self.fs, cp, every_byte, f"the store {self.label}")

    def plan_receive_parts(self, parts: list[tuple[Job, Checkpoint]], cp: Checkpoint,
                           every_byte: bool = False) -> list[Action]:
        return pull_actions(parts, self.fs, cp, every_byte, f"the store {self.label}")

    def plan_accept(self, job: Job, cp: Checkpoint, hashes: Ref | list[Ref],
                    about: dict[str, Any] | None = None) -> list[Action]:
        return [dataclasses.replace(a, args={**a.args, "received": Ref(f"received:{cp.name}")})
                for a in super().plan_accept(job, cp, hashes, about)]

    def accept(self, cp: Checkpoint, hashes: Hashes, host: str, about: dict[str, Any] | None = None,
               received: dict[str, FileHash] | None = None) -> str:
        record = self.staging.verify(cp, hashes, host, about, received)
        self.fs.commit(record)
        self.record(record)
        return self.hash_name
