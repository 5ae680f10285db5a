"""`evacuate` (and a `sync` round): copy the instance's newest checkpoints into the store, verify
every byte, then the verdict from what the store holds at that moment (verdicts.py).
"""

from __future__ import annotations

import dataclasses
import shlex
import time
from typing import Any

from .. import verdicts
from ..errors import EvacuationError, Interrupted, RelaunchError, UsageError
from ..executor import Executor
from ..gather import LISTING_DEADLINE, gather_group, read_listing, share_listings
from ..host.facts import unseen_run
from ..host.remote import Remote
from ..host.spec import HostSpec
from ..job import Job
from ..layouts import Checkpoint, Entry
from ..manifest import ASIDE, CheckpointRecord
from ..plan import LOCAL, Action
from ..recipe import Recipe
from ..scripts import this_run, whole_lines
from ..steps import lineage
from ..steps.checkpoint import instance_checkpoints
from ..steps.evacuate import LOG_TAIL_LINES, Report, Unpinned, hash_action, plan_copy, plan_meta, plan_unpin
from ..steps.group import tag
from ..steps.guard import newest_logged_step
from ..steps.launch import tail_command
from ..steps.stop import ended_command
from ..transports import Damaged, Mismatch, Store, Vanished, open_store
from ..transports.base import store_deadline
from ..ui import UI
from .handlers import executor_for
from .hosts import connected, open_group
from .stopping import stop_jobs


def evacuate(recipe: Recipe, specs: HostSpec | list[HostSpec], ui: UI, stop: bool = False,
             allow_empty: bool = False, newest_only: bool = False, reverify: bool = True) -> Report:
    """Any failure becomes exit 6: the instance (or any node of the group) must not be destroyed;
    Ctrl-C stays an interruption (exit 130), which says the same. `newest_only`: after a reclaim
    notice, only the newest checkpoint is copied (the others are either in the store already or
    older than what the instance has left to give in its window)."""
    specs = specs if isinstance(specs, list) else [specs]
    try:
        store = open_store(recipe)
        pairs = open_group(recipe, specs, ui)
        with connected(pairs) as remotes:
            jobs = gather_group(pairs, recipe)
            executor = executor_for(jobs[0], remotes[jobs[0].host], store, ui, remotes)
            if stop:
                stop_jobs(jobs, executor, ui)
                relist(jobs, remotes)            # the save the stop asked for
            with store.lock(ui):
                return evacuate_jobs(jobs, remotes, store, executor, ui, allow_empty=allow_empty,
                                     newest_only=newest_only, reverify=reverify)
    except (UsageError, Interrupted):
        raise
    except RelaunchError as exc:
        what = "the instance" if len(specs) == 1 else "any node of the group"
        refusal = EvacuationError(f"{exc.message}\nevacuation NOT verified: DO NOT destroy {what}", exc.hint,
                                  exc.refused)
        refusal.result = exc.result
        raise refusal from exc


# what to do when the instance's progress is not in any checkpoint there (`relaunch run` says its own)
EMPTY_HINT = "`relaunch evacuate --allow-empty` accepts it: what training did there is then lost with the instance"


def evacuate_jobs(jobs: list[Job], remotes: dict[str, Remote], store: Store, executor: Executor, ui: UI,
                  rounds: int = 3, reverify: bool = True, require_newest: bool = True,
                  allow_empty: bool = False, newest_only: bool = False,
                  empty_hint: str = EMPTY_HINT) -> Report:
    """Copy the newest `keep` complete checkpoints (newest first) until the newest is verified;
    in a node group, each file from the node that holds it. Then the verdict, from what the store
    holds at that moment (verdicts.py): `report.safe`.

    Call with the store lock held. `evacuate` re-hashes on the instance what the store already
    records and insists that the newest checkpoint on the instance ends up verified; a `sync` round
    (reverify=False, require_newest=False) only moves what is new and reports the lag instead.
    """
    started = time.monotonic()
    job = jobs[0]
    keep = job.recipe.checkpoint.keep
    state = store.read(writing=True)
    for each in jobs:
        each.facts.store = state
    report = Report(store=store.label, verified_by=store.hash_name)
    # a rollback on the instance (its lineage file): the abandoned branch's records set aside
    # before anything is ranked or copied (written with the manifest, below)
    branches = {b.id: b for b in lineage.box_branches(jobs)}
    for ident, marked in lineage.apply(state.manifest, jobs).items():
        report.branches[ident] = marked
        ui.step(job.host, "evacuate", lineage.said(branches[ident], marked, store.label))
    listing = instance_checkpoints(job)
    at_start = listing[-1] if listing else None     # what a sync round must have verified when it ends
    copied_any = False          # a copy ran (and pinned first)
    unchecked: dict[str, Checkpoint] = {}     # counted already there, their store check left for the verdict's
    ended = False               # the training was seen ended: the listing after that is final
    try:
        for round_no in range(rounds + 1):
            for cp in reversed(listing[-(1 if newest_only else keep):]):
                if cp.name not in report.copied + report.already + report.skipped + _names(report.damaged):
                    # the newest is checked in the store once, for the verdict, after everything else
                    copied_any = _evacuate_one(jobs, store, executor, cp, report, reverify,
                                               check_store=cp is not listing[-1]) or copied_any
                    if cp is listing[-1] and cp.name in report.already and cp.name not in report.unchanged:
                        unchecked[cp.name] = cp
            listing = _relisted(jobs, remotes, report)
            newest = listing[-1] if listing else None
            report.newest = report.newest_step = report.newest_mtime = None
            if newest is not None:
                report.newest, report.newest_step = newest.name, newest.step
                report.newest_mtime = max((e.mtime for e in newest.files), default=None)
            if newest is None or not require_newest or newest.name in report.copied + report.already:
                break
            if round_no + 1 >= rounds:
                # out of rounds: a training that has ended writes nothing more, so one more round
                # copies its last checkpoint; one still running outpaces every round
                if ended or not _training_ended(jobs, remotes):
                    raise EvacuationError(
                        f"{job.host}: training keeps writing new checkpoints faster than they can be copied; "
                        "the newest is not in the store yet", "stop training first (`relaunch evacuate --stop`), "
                        "then evacuate again")
                ended = True
                listing = _relisted(jobs, remotes, report)
                ui.step(job.host, "evacuate", f"training has ended; one more round for "
                                              f"{(listing[-1] if listing else newest).name}")
                continue
            ui.step(job.host, "evacuate", f"training wrote {newest.name} meanwhile; another round")
        if not copied_any:
            # no copy ran, so none removed what a killed relaunch may have left pinned: a pin
            # holds the disk space the trainer's rotation meant to free
            executor.run(plan_unpin(jobs))
        executor.run(plan_meta(job))
        newest = listing[-1] if listing else None
        # the verdict's checkpoint: evacuate's is the newest now; a sync round's the newest when it
        # began, unless the instance holds nothing that new any more (its trainer deleted it): then
        # the newest it holds now
        target = newest if require_newest else at_start
        if not require_newest and at_start is not None and (newest is None or newest.step < at_start.step):
            target = newest
        if target is not None and target.name in report.copied + report.already:
            _check_in_store(jobs, store, executor, target, report, reverify)
        # a newest that training overtook meanwhile is not the verdict's: checked as any other, before
        # it counts as already there (and towards `keep`)
        for name, cp in unchecked.items():
            if (target is None or name != target.name) and name in report.already:
                _check_in_store(jobs, store, executor, cp, report, reverify)
        # deletion is the last step of a proof: nothing is pruned before the newest is checked in the store
        if report.copied and target is not None and target.name in report.verified_now:
            report.pruned = _prune(jobs, store, executor, report, keep, reverify)
            for name in report.pruned:
                ui.step(job.host, "evacuate", f"pruned {name} from the store (keep={keep})")
        empty, unseen = None, None
        if newest is None and require_newest:
            held = _newest_held(store, executor)
            # no checkpoint here may mean a run this login does not see (another user's): never "safe" then
            unseen = None if job.facts.host.session_alive else unseen_run(job.facts.host, job.recipe.run.session)
            progress = _progress(job, executor, unseen.why if unseen is not None else "")
            empty = verdicts.nothing_to_copy(progress, held.step if held else None, allow_empty)
        verdict = (verdicts.evacuation(report.newest, report.verified_now, empty) if require_newest else
                   verdicts.sync_round(target.name if target else None, report.verified_now, report.newest,
                                       began=at_start.name if at_start else None))
        report.safe, report.why = verdict.ok, verdict.why
        if require_newest and not report.safe:
            hint = (unseen.hint("evacuate", job.target) if unseen is not None else
                    None if empty is None else empty_hint)
            refusal = EvacuationError(f"{job.host}: {verdict.why}", hint)
            refusal.result = report.as_dict()
            raise refusal
    except OSError as exc:
        # a full or read-only disk on this machine: nothing is deleted to make room, and what
        # was being written stays in the store's staging folder, which is never trusted
        raise EvacuationError(f"writing the store {store.label} failed: {exc.strerror or exc}",
                              "free space on this machine (nothing was deleted to make room), then rerun",
                              refused=True) from exc
    stored = store.manifest.newest() if store.manifest else None
    if stored is not None:
        report.stored, report.stored_step, report.stored_written_at = stored.name, stored.step, stored.written_at
    report.seconds = time.monotonic() - started
    return report


def _check_in_store(jobs: list[Job], store: Store, executor: Executor, cp: Checkpoint, report: Report,
                    reverify: bool) -> None:
    """The verdict's evidence: the store holds cp now, byte for byte as the instance's record says.
    A file missing or different is copied again (once), never taken on the manifest's word."""
    for attempt in range(2):
        record = store.manifest.checkpoints.get(cp.name) if store.manifest else None
        problems = (["not in the store's manifest"] if record is None else
                    verdicts.store_holds(record, executor.run_one(_observe_action(store, record))))
        if not problems:
            report.verified_now.append(cp.name)
            return
        said = (lost_from_store(cp.name, store, problems) if record else
                f"{cp.name} is not in the store {store.label}'s manifest after its copy")
        executor.ui.warn(f"{jobs[0].host}: {said}" + ("; copying it again" if attempt == 0 else ""))
        if attempt:
            break
        for name in (report.copied, report.already, report.unchanged, report.pinned):
            if cp.name in name:
                name.remove(cp.name)
        _evacuate_one(jobs, store, executor, cp, report, reverify, recopy=True)
        if cp.name not in report.copied:
            break


def _prune(jobs: list[Job], store: Store, executor: Executor, report: Report, keep: int,
           reverify: bool) -> list[str]:
    """store.prune, where `keep` counts only the checkpoints the store holds now: those this run
    copied or checked, and older ones whose bytes it still holds (evacuate: size and hash; a sync
    round: as its cheap look at what it already holds). A record whose bytes are gone counts for
    nothing: it is said, and neither counted nor deleted (what is older than the `keep` held ones is)."""
    if store.manifest is None:
        return []
    proven = set(report.verified_now + report.copied + report.already)
    held, spared = 0, set()
    for record in reversed(store.manifest.ordered()):
        if held == keep:
            break
        problems: list[str] = []
        if record.name not in proven:
            seen = executor.run_one(_observe_action(store, record, size_only=not reverify))
            problems = verdicts.store_holds(record, seen, size_only=not reverify and
                                            not any(s.hashes for s in seen.values()))
        if problems:
            executor.ui.warn(f"{jobs[0].host}: {lost_from_store(record.name, store, problems)}; it does not count "
                             f"towards checkpoint.keep")
            spared.add(record.name)
        else:
            held += 1
    if held < keep:
        return []
    # drop_beyond counts records from the newest: the spared ones newer than the keep-th held one are
    # counted there and protected, so that exactly what is older than it goes
    return store.prune(store.manifest, held + len(spared), frozenset(proven | spared))


def _observe_action(store: Store, record: CheckpointRecord, size_only: bool = False) -> Action:
    total = sum(f.size for f in record.files.values())
    return Action("evacuate", f"what the store {store.label} holds of {record.name} now", where=LOCAL,
                  call="store.observe", args={"record": record, "size_only": size_only},
                  deadline=store_deadline(0 if size_only else total), fails_as="evacuate")


def _newest_held(store: Store, executor: Executor) -> CheckpointRecord | None:
    """The newest checkpoint the store holds now, byte for byte as recorded: what the verdict on an
    instance with nothing to copy compares with (a record whose files are gone holds no step)."""
    records = store.manifest.ordered() if store.manifest else []
    for record in reversed(records):
        if not verdicts.store_holds(record, executor.run_one(_observe_action(store, record))):
            return record
    return None


def _progress(job: Job, executor: Executor, unseen: str = "") -> verdicts.Progress:
    """What training did on an instance with nothing to copy: checkpoint.dir there or not, the
    step its log shows, how long its session has been alive."""
    q = shlex.quote
    read = Action("evacuate", "what training has done (checkpoint.dir, the clock, the log's tail)",
                  command=f"if [ -d {q(job.paths.ckpt_dir)} ]; then echo dir=1; else echo dir=0; fi; "
                          f"echo now=$(date +%s); {tail_command(job.paths.log, LOG_TAIL_LINES)} || true",
                  produces="progress", parse="text", fails_as="evacuate")
    # whole lines: a last one still being written says another step (`step 1` of `step 150`)
    read_lines = whole_lines(str(executor.run([read]).get("progress") or ""))
    head, lines = read_lines[:2], read_lines[2:]
    # this run's lines: an earlier run's higher steps above its start line are not this one's progress
    lines = this_run(lines)
    words = dict(line.partition("=")[::2] for line in head)
    host = job.facts.host
    since, now = host.session_since, words.get("now", "")
    age = float(now) - float(since) if since.isdigit() and now.isdigit() else None
    return verdicts.Progress(ckpt_dir=job.paths.ckpt_dir, dir_exists=words.get("dir") == "1",
                             log_step=newest_logged_step(lines, job.recipe.run.metrics.step),
                             session_alive=host.session_alive, session_age=age, grace=job.recipe.run.grace,
                             unseen=unseen)


def _relisted(jobs: list[Job], remotes: dict[str, Remote], report: Report) -> list[Checkpoint]:
    """The instance's complete checkpoints now, without those found damaged."""
    relist(jobs, remotes)
    return [cp for cp in instance_checkpoints(jobs[0]) if cp.name not in _names(report.damaged)]


def _training_ended(jobs: list[Job], remotes: dict[str, Remote]) -> bool:
    """The training runs on no node now (an answer that is not `ended` counts as running)."""
    for job in jobs:
        result = remotes[job.host].exec(ended_command(job), deadline=LISTING_DEADLINE)
        if result.status != 0 or result.stdout.strip() != b"ended":
            return False
    return True


def relist(jobs: list[Job], remotes: dict[str, Remote]) -> None:
    """Read checkpoint.dir again on every node (training may have saved meanwhile)."""
    if len(jobs) == 1:
        jobs[0].facts.listing = read_listing(remotes[jobs[0].host], jobs[0].paths.ckpt_dir, EvacuationError)
        return
    share_listings(jobs, remotes, {job.host: read_listing(remotes[job.host], job.paths.ckpt_dir, EvacuationError)
                                   for job in jobs})


def _names(damaged: list[str]) -> list[str]:
    return [d.split(":", 1)[0] for d in damaged]


def parts_of(jobs: list[Job], cp: Checkpoint) -> list[tuple[Job, Checkpoint]]:
    """Which node sends which files of cp (the first node that holds each)."""
    if len(jobs) == 1:
        return [(jobs[0], cp)]
    holders = jobs[0].facts.holders or {}
    by_host = {job.host: job for job in jobs}
    parts: dict[str, list[Entry]] = {}
    for entry in cp.files:
        parts.setdefault(holders[entry.path][0], []).append(entry)
    return [(by_host[host], dataclasses.replace(cp, files=tuple(files))) for host, files in parts.items()]


def _evacuate_one(jobs: list[Job], store: Store, executor: Executor, cp: Checkpoint, report: Report,
                  reverify: bool, recopy: bool = False, check_store: bool = True) -> bool:
    """Copy cp into the store, verified, unless the store holds it already: the manifest's record
    of it matched by the instance's bytes (re-hashed there) and (`check_store`) by what the store
    holds now. `recopy`: the store was found not to hold it; set aside what differs and copy it.
    Whether a copy ran (it pinned first, so it removed what a killed relaunch left pinned)."""
    job = jobs[0]
    known = store.manifest.checkpoints.get(cp.name) if store.manifest else None
    if known is not None and known.aside is not None:
        _displace(job, store, executor, known, report)         # a new branch's save of an abandoned name
        known = None
    sizes = {e.path: e.size for e in cp.files}
    parts = parts_of(jobs, cp)
    if known is not None and not recopy:
        if not reverify and {p: f.size for p, f in known.files.items()} == sizes:
            # a sync round: same files, same sizes, verified before; and the store still holds them
            # as recorded, as far as a cheap look shows (sizes; a remote's listing gives its hashes too)
            seen = executor.run_one(_observe_action(store, known, size_only=True))
            size_problems = verdicts.store_holds(known, seen, size_only=not any(s.hashes for s in seen.values()))
            if not size_problems:
                report.already.append(cp.name)
                report.unchanged.append(cp.name)
                return False
            executor.ui.warn(f"{job.host}: {lost_from_store(cp.name, store, size_problems)}; copying it again")
            recopy = True
    if known is not None and not recopy:
        hashes: dict[str, Any] = {}
        for part_job, part in parts:
            found = executor.run_one(tag([hash_action(part_job, store, part)], part_job)[0]
                                     if len(jobs) > 1 else hash_action(part_job, store, part))
            hashes.update(found)
        if any(h.missing for h in hashes.values()):
            report.skipped.append(cp.name)
            return False
        if set(hashes) != set(known.files) or any(known.files[p].sha256 != h.hashes.get("sha256")
                                                  for p, h in hashes.items()):
            raise EvacuationError(
                f"{job.host}: {cp.name} on the instance differs from the verified copy in the store {store.label}",
                "the store never overwrites a checkpoint; move the store's copy aside if the instance's is right",
                refused=True)
        problems = verdicts.store_holds(known, executor.run_one(_observe_action(store, known))) if check_store else []
        if not problems:
            report.already.append(cp.name)
            return False
        executor.ui.warn(f"{job.host}: {lost_from_store(cp.name, store, problems)}; copying it again")
        recopy = True
    if recopy and known is not None:
        seen = executor.run_one(_observe_action(store, known))
        moved = store.set_aside(known, verdicts.differing(known, seen))
        if moved:
            executor.ui.step(job.host, "evacuate", f"{cp.name}: what the store held differently was set aside: {moved}")
            report.set_aside.append(cp.name)
    about: dict[str, Any] = {"saved_with": job.facts.host.run or None}
    if len(jobs) > 1:
        about["held"] = {e.path: part_job.host for part_job, part in parts for e in part.files}
    try:
        results = _copy(jobs, store, executor, cp, parts, about, report)
    except Vanished:
        executor.ui.step(job.host, "evacuate", f"{cp.name} was rotated away by the trainer during the copy; skipped")
        report.skipped.append(cp.name)
        return True
    except Damaged as exc:
        executor.ui.warn(f"{job.host}: {cp.name} is damaged on the instance ({exc}); not copied")
        report.damaged.append(f"{cp.name}: {exc}")
        return True
    report.copied.append(cp.name)
    if cp.name not in _names(report.unpinned):
        report.pinned.append(cp.name)
    report.bytes_copied += sum(sizes.values())
    where = "" if len(parts) == 1 else f" from {len(parts)} nodes"
    executor.ui.step(job.host, "evacuate", f"{cp.name} verified: {len(sizes)} file(s){where}, "
                                           f"{results.get(f'verified:{cp.name}') or store.hash_name}")
    return True


def _displace(job: Job, store: Store, executor: Executor, known: CheckpointRecord, report: Report) -> None:
    """The instance's checkpoint has the name of a record an abandoned branch left (training went
    past the step it resumed from): that record's files move out of its way (never deleted, never
    overwritten: `.relaunch/aside/<branch>/`; a Hub repo keeps them in its history), its branch says
    where, and the manifest without it is written before the new copy begins."""
    assert store.manifest is not None and known.aside is not None
    seen = executor.run_one(_observe_action(store, known, size_only=True))
    where = store.set_aside(known, sorted(seen), into=f"{ASIDE}/{known.aside}") or "nowhere: the store held none of it"
    store.manifest.displace(known.name, where)
    store.flush()
    report.displaced.append(f"{known.name}: {where}")
    executor.ui.step(job.host, "evacuate", f"{known.name} of the abandoned branch {known.aside} makes way for the "
                                           f"new branch's save of that name: {where}")


def _copy(jobs: list[Job], store: Store, executor: Executor, cp: Checkpoint, parts: list[tuple[Job, Checkpoint]],
          about: dict[str, Any], report: Report) -> dict[str, Any]:
    """Run cp's copy plan: pinned, unless a node cannot pin (then planned again, unpinned there,
    said); after a mismatch once more, comparing every byte."""
    job = jobs[0]
    unpinned: frozenset[str] = frozenset()
    every_byte = False
    while True:
        try:
            return executor.run(plan_copy(job, store, cp, every_byte=every_byte, parts=parts, about=about,
                                          unpinned=unpinned))
        except Unpinned as exc:
            for host, why in exc.why.items():
                executor.ui.warn(f"{host}: {cp.name} is copied unpinned: {why}; if the trainer's rotation deletes "
                                 "it during the copy, the copy is skipped")
            report.unpinned.append(f"{cp.name}: {exc}")
            unpinned |= frozenset(exc.why)
        except Mismatch as exc:
            if every_byte:
                raise
            # a quick check (size + mtime) can trust a damaged partial file: compare every byte
            executor.ui.warn(f"{cp.name}: {exc.problems[0]}; copying again, comparing every byte")
            every_byte = True


def lost_from_store(name: str, store: Store, problems: list[str]) -> str:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"{name} is in the store's manifest, but the store {store.label} does not hold it: {problems[0]}{more}"
