"""Evacuate: copy the newest complete checkpoints off the instance into the store, verified.

Order of trust: files are pulled into the store's staging folder (never trusted), hashed on
both ends, moved into place, and only then named in the manifest (written last). Training may
keep writing and rotating checkpoints meanwhile: one that vanishes mid-copy is skipped, never
recorded. Nothing on the instance is ever deleted or changed.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from ..errors import ConnectError, EvacuationError
from ..layouts import Checkpoint
from ..store import CheckpointRecord, FileRecord, StoreManifest, utc_now
from ..transports.base import Store
from .checkpoint import hash_on_instance, list_instance
from .common import Job, Lag
from .launch import tail_command
from .preflight import human

LOG_TAIL_LINES = 200


@dataclass(kw_only=True)
class Report(Lag):
    store: str
    copied: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)     # rotated away mid-copy
    pruned: list[str] = field(default_factory=list)
    bytes_copied: int = 0
    seconds: float = 0.0
    safe: bool = False


def _listing(job: Job) -> list[Checkpoint]:
    c = job.recipe.checkpoint
    return list_instance(job.remote, job.paths.ckpt_dir, c.layout, c.pattern, "evacuate (listing checkpoints)",
                         EvacuationError)


def _copy_one(job: Job, store: Store, manifest: StoreManifest, cp: Checkpoint, report: Report,
              reverify: bool) -> bool:
    """Copy and verify one checkpoint; False if it vanished (rotated away) meanwhile."""
    files = [e.path for e in cp.files]
    sizes = {e.path: e.size for e in cp.files}
    known = manifest.checkpoints.get(cp.name)
    if known is not None and not reverify and {p: f.size for p, f in known.files.items()} == sizes:
        report.already.append(cp.name)        # a sync round: same files, same sizes, verified before
        return True
    if known is not None:
        hashes = hash_on_instance(job.remote, job.paths.ckpt_dir, files, "evacuate (hashing)")
        if hashes is None:
            report.skipped.append(cp.name)
            return False
        if set(hashes) == set(known.files) and all(known.files[p].sha256 == h for p, h in hashes.items()):
            report.already.append(cp.name)
            return True
        raise EvacuationError(
            f"{job.host}: {cp.name} on the instance differs from the verified copy in the store {store.label}",
            "the store never overwrites a checkpoint; move the store's copy aside if the instance's is right",
        )

    total = sum(sizes.values())
    job.say("evacuate", f"copying {cp.name} (step {cp.step}, {len(files)} file(s), {human(total)}) to {store.label}")
    received = store.receive(job, cp)
    if not received.ok:
        if received.vanished and not _still_there(job, cp):
            job.say("evacuate", f"{cp.name} was rotated away by the trainer during the copy; skipped")
            report.skipped.append(cp.name)
            return False
        if received.lost or not job.remote.alive:
            raise ConnectError(f"{job.host}: evacuate: the instance dropped out while copying {cp.name}: "
                               f"{received.message}")
        raise EvacuationError(f"{job.host}: evacuate: copying {cp.name} failed: {received.message}")
    hashes = hash_on_instance(job.remote, job.paths.ckpt_dir, files, "evacuate (hashing)")
    if hashes is None or set(hashes) != set(files):
        job.say("evacuate", f"{cp.name} was rotated away by the trainer during the copy; skipped")
        report.skipped.append(cp.name)
        return False
    expected = {p: FileRecord(size=sizes[p], sha256=hashes[p]) for p in files}
    problems = store.verify(job, cp, expected)
    if problems:
        # one more pass comparing full contents: a quick check (size + mtime) can trust a
        # damaged partial file
        job.ui.warn(f"{cp.name}: {problems[0]}; copying again")
        again = store.receive(job, cp, again=True)
        problems = store.verify(job, cp, expected) if again.ok else [again.message]
    if problems:
        raise EvacuationError(f"{job.host}: evacuate: {cp.name} did not verify: {problems[0]}"
                              + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    record = CheckpointRecord(name=cp.name, step=cp.step, files=expected, verified_at=utc_now(), host=job.host,
                              written_at=max(e.mtime for e in cp.files))
    store.commit(job, record)
    manifest.add(record)
    store.save_manifest(manifest)        # after the files: the manifest only names verified bytes
    report.copied.append(cp.name)
    report.bytes_copied += total
    job.say("evacuate", f"{cp.name} verified: {len(files)} file(s), sha256 equal on both ends")
    return True


def _still_there(job: Job, cp: Checkpoint) -> bool:
    return any(c.name == cp.name for c in _listing(job))


def _save_meta(job: Job, store: Store) -> None:
    facts, paths = job.facts, job.paths
    if facts.venv_freeze is not None:
        store.write_meta("freeze.txt", "\n".join(facts.venv_freeze) + "\n")
    versions = {"python": facts.python3_version, "driver": facts.driver, "gpus": facts.gpus,
                "host": job.host, "at": utc_now()}
    store.write_meta("versions.json", json.dumps(versions, indent=2) + "\n")
    tail = job.remote.exec(tail_command(paths.log, LOG_TAIL_LINES))
    if tail.ok and tail.stdout:
        store.write_meta("log-tail.txt", tail.text)


def evacuate(job: Job, store: Store, rounds: int = 3, reverify: bool = True,
             require_newest: bool = True) -> Report:
    """Copy the newest `keep` complete checkpoints (newest first) until the newest is verified.

    `evacuate` re-hashes what the store already holds and insists that the newest checkpoint on
    the instance ends up verified; a `sync` round (reverify=False, require_newest=False) only
    moves what is new and reports the lag instead.
    """
    with store.lock(job.ui):
        return _evacuate(job, store, rounds, reverify, require_newest)


def _evacuate(job: Job, store: Store, rounds: int, reverify: bool, require_newest: bool) -> Report:
    started = time.monotonic()
    keep = job.recipe.checkpoint.keep
    report = Report(store=store.label)
    try:
        manifest = store.load_manifest() or StoreManifest(recipe=job.recipe.name)
        for _ in range(rounds):
            listing = _listing(job)
            for cp in reversed(listing[-keep:]):
                if cp.name not in report.copied and cp.name not in report.already:
                    _copy_one(job, store, manifest, cp, report, reverify)
            latest = _listing(job)
            if latest:
                newest = latest[-1]
                report.newest, report.newest_step = newest.name, newest.step
                report.newest_mtime = max((e.mtime for e in newest.files), default=None)
            if not latest or latest[-1].name in manifest.checkpoints or not require_newest:
                break
            job.say("evacuate", f"training wrote {latest[-1].name} meanwhile; another round")
        else:
            raise EvacuationError(
                f"{job.host}: training keeps writing new checkpoints faster than they can be copied; the "
                "newest is not in the store yet", "stop training first (`relaunch evacuate --stop`), then "
                "evacuate again")

        _save_meta(job, store)
        store.save_manifest(manifest)        # last, again: also records a store with meta only
        if require_newest and report.newest is not None and report.newest not in manifest.checkpoints:
            raise EvacuationError(f"{job.host}: the newest checkpoint {report.newest} is not verified in the store")
        if report.copied:
            report.pruned = store.prune(manifest, keep)
            for name in report.pruned:
                job.say("evacuate", f"pruned {name} from the store (keep={keep})")
    except OSError as exc:
        # a full or read-only disk on this machine: nothing is deleted to make room, and what
        # was being written stays in the store's staging folder, which is never trusted
        raise EvacuationError(f"writing the store {store.label} failed: {exc.strerror or exc}",
                              "free space on this machine (nothing was deleted to make room), then rerun") from exc
    stored = manifest.newest()
    if stored is not None:
        report.stored, report.stored_step, report.stored_written_at = stored.name, stored.step, stored.written_at
    report.seconds = time.monotonic() - started
    report.safe = report.newest is None or report.newest in manifest.checkpoints
    return report
