"""A node group inside a job (`srun` over N nodes, each running `relaunch run`): every node copies
its own part of a checkpoint into the store, node 0 verifies the whole and records it. The nodes
do not reach each other; they meet in the store's `.relaunch/` folder, through two kinds of small
files named by the run (Placement.run_key, the same on every node of this run only):

    group-KEY-RANK.json   a node's word (rank >= 1): what its checkpoint.dir holds (its listing),
                          the parts it copied with their hashes (of its own bytes), whether its
                          training still runs
    group-KEY.json        node 0's: which files of which checkpoint it wants from which rank, and
                          the verdict of the stop's copy (`final`), which every node exits with

Node 0 merges the listings as `evacuate` merges a group's (which node holds what; a DCP
checkpoint is whole only with every file its .metadata names), asks each node for its files,
copies its own, then joins the parts (Store.join_parts), verifies all of them against the nodes'
hashes and records the checkpoint (Store.plan_accept), written last as always. Each part is
copied exactly as a checkpoint of one node is (steps/evacuate.plan_copy: pinned, hashed on its
node), under the name Store.part_name gives it, without the acceptance.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import verdicts
from ..errors import EvacuationError, RelaunchError
from ..executor import Executor
from ..gather import read_listing, read_required, without
from ..host.hashing import FileHash, parse_hashes
from ..job import Job
from ..layouts import Checkpoint, Entry, complete_checkpoints
from ..plan import Ref
from ..steps.checkpoint import instance_checkpoints
from ..steps.evacuate import Report, plan_copy, plan_meta
from ..transports import Store, Vanished
from ..ui import UI
from .copying import LOOK_EVERY
from .engine import Placement
from .node import NodeShell

POLL = 0.5                  # seconds between looks at the other nodes' files
PART_WAIT = 900.0           # seconds node 0 waits for a node's part while training runs


def leader_file(key: str) -> str:
    return f"group-{key}.json"


def node_file(key: str, rank: int) -> str:
    return f"group-{key}-{rank}.json"


def hash_lines(hashes: dict[str, FileHash]) -> str:
    """The hasher's own JSON lines again (parse_hashes reads them back)."""
    out = []
    for h in hashes.values():
        doc: dict[str, Any] = {"path": h.path}
        if h.missing:
            doc["missing"] = True
        else:
            doc.update({"size": h.size, **h.hashes, **({"problem": h.problem} if h.problem else {})})
        out.append(json.dumps(doc, sort_keys=True))
    return "\n".join(out) + "\n"


def _read(store: Store, name: str) -> dict[str, Any]:
    try:
        data = json.loads(store.read_meta(name) or "{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def copy_part(job: Job, store: Store, executor: Executor, cp: Checkpoint, rank: int) -> dict[str, FileHash]:
    """This node's files of cp into the store under its part's name, pinned and hashed here (the
    hashes of its own bytes, which node 0 checks the store's copy against)."""
    staged = dataclasses.replace(cp, name=store.part_name(cp.name, rank))
    actions = [a for a in plan_copy(job, store, staged) if a.call != "store.accept"]
    results = executor.run(actions)
    return dict(results[f"hashes:{staged.name}"])


class Leader:
    """Node 0: the group's rounds (Copier calls `round`) and the verdict every node exits with."""

    def __init__(self, job: Job, shell: NodeShell, store: Store, executor: Executor, place: Placement,
                 ui: UI) -> None:
        self.job, self.shell, self.store, self.executor, self.place, self.ui = job, shell, store, executor, place, ui
        self.key = place.run_key
        self.want: dict[str, dict[str, Any]] = {}
        self.final: dict[str, Any] | None = None
        self.stopping = threading.Event()     # the stop came: a round waiting for parts gives up (the stop's own waits)

    def newest(self) -> str | None:
        """The newest checkpoint complete on node 0's own disk (its marker: DCP's .metadata, a
        trainer_state.json): what makes a round worth starting."""
        listing = read_listing(self.shell, self.job.paths.ckpt_dir)
        c = self.job.recipe.checkpoint
        found = complete_checkpoints(listing, c.layout, c.pattern)
        return found[-1].name if found else None

    def _post(self) -> None:
        self.store.post(leader_file(self.key), json.dumps({"want": self.want, "final": self.final}, sort_keys=True))

    def _reports(self) -> dict[int, dict[str, Any]]:
        return {rank: doc for rank in range(1, self.place.nnodes)
                if (doc := _read(self.store, node_file(self.key, rank)))}

    def _view(self, reports: dict[int, dict[str, Any]]) -> tuple[Job, dict[str, int]]:
        """The group's checkpoint folders as one (this job's facts: merged listing, holders, what
        each DCP checkpoint needs), and which rank each holder label is."""
        job = self.job
        own = read_listing(self.shell, job.paths.ckpt_dir)
        ranks = {job.host: 0}
        listings = {job.host: own}
        for rank, doc in sorted(reports.items()):
            label = str(doc.get("label") or f"node {rank}")
            ranks[label] = rank
            listings[label] = [Entry(path=p, kind=k, size=s, mtime=m) for k, s, m, p in doc.get("listing") or []]
        merged: dict[str, Entry] = {}
        holders: dict[str, list[str]] = {}
        for label, entries in listings.items():
            for entry in entries:
                merged.setdefault(entry.path, entry)
                holders.setdefault(entry.path, []).append(label)
        job.facts.listing, job.facts.holders = list(merged.values()), holders
        # what a DCP checkpoint needs, from the .metadata node 0 holds (rank 0 writes it)
        required, vanished = read_required({job.host: self.shell}, job, {p: [job.host] for p in (e.path for e in own)})
        job.facts.listing, job.facts.required = without(job.facts.listing, vanished), required
        return job, ranks

    def _wait(self, until: float, ready: Callable[[dict[int, dict[str, Any]]], bool],
              final: bool = False) -> dict[int, dict[str, Any]]:
        while True:
            reports = self._reports()
            if ready(reports) or time.time() >= until or (self.stopping.is_set() and not final):
                return reports
            time.sleep(POLL)

    def round(self, final: bool, deadline: float | None = None) -> Report:
        try:
            report = self._round(final, deadline)
        except RelaunchError as exc:
            if final:
                self.final = {"verified": False, "why": exc.message.splitlines()[0]}
                self._post()
            raise
        if final:
            self.final = {"verified": report.safe, "why": report.why, "name": report.newest}
            self._post()
        return report

    def _round(self, final: bool, deadline: float | None) -> Report:
        store, job = self.store, self.job
        until = deadline if deadline is not None else time.time() + PART_WAIT
        others = range(1, self.place.nnodes)
        # every node's word first (after the stop: its training over, its save on its disk)
        reports = self._wait(until, lambda got: all(r in got and (not final or got[r].get("state") == "stopped")
                                                    for r in others), final)
        report = Report(store=store.label, verified_by=store.hash_name)
        missing = [r for r in others if r not in reports]
        if missing:
            report.why = f"node(s) {', '.join(map(str, missing))} said nothing yet of what they hold"
            if final:
                raise EvacuationError(f"{self.place.label}: {report.why}")
            return report
        with store.lock(self.ui):
            job.facts.store = state = store.read(writing=True)
            view, ranks = self._view(reports)
            found = [cp for cp in instance_checkpoints(view)]
            newest = found[-1] if found else None
            if newest is not None:
                report.newest, report.newest_step = newest.name, newest.step
            for cp in reversed(found[-(1 if final else job.recipe.checkpoint.keep):]):
                known = state.manifest.checkpoints.get(cp.name) if state.manifest else None
                sizes = {e.path: e.size for e in cp.files}
                if known is not None and {p: f.size for p, f in known.files.items()} == sizes:
                    report.already.append(cp.name)
                    continue
                self._copy(view, cp, ranks, until, report, final)
            self.executor.run(plan_meta(job))
            if report.copied and store.manifest is not None:
                report.pruned = store.prune(store.manifest, job.recipe.checkpoint.keep,
                                            frozenset(report.copied + report.already))
            if newest is not None and newest.name in report.copied + report.already and store.manifest is not None:
                record = store.manifest.checkpoints[newest.name]
                if not verdicts.store_holds(record, store.observe(record)):
                    report.verified_now.append(newest.name)
            verdict = (verdicts.evacuation(report.newest, report.verified_now, None) if final else
                       verdicts.sync_round(report.newest, report.verified_now, report.newest))
            report.safe, report.why = verdict.ok, verdict.why
            stored = store.manifest.newest() if store.manifest else None
            if stored is not None:
                report.stored, report.stored_step = stored.name, stored.step
        if final and not report.safe:
            raise EvacuationError(f"{self.place.label}: {report.why}")
        return report

    def _copy(self, view: Job, cp: Checkpoint, ranks: dict[str, int], until: float, report: Report,
              final: bool) -> None:
        holders = view.facts.holders or {}
        parts: dict[int, list[Entry]] = {}
        for entry in cp.files:
            parts.setdefault(ranks[holders[entry.path][0]], []).append(entry)
        self.want[cp.name] = {"step": cp.step, "parts": {str(r): [e.path for e in es] for r, es in parts.items()}}
        self._post()
        hashes: dict[int, dict[str, FileHash]] = {}
        try:
            if 0 in parts:
                hashes[0] = copy_part(self.job, self.store, self.executor,
                                      dataclasses.replace(cp, files=tuple(parts[0])), 0)
        except Vanished:
            report.skipped.append(cp.name)
            return
        reports = self._wait(until, lambda got: all(cp.name in (got.get(r, {}).get("parts") or {})
                                                    for r in parts if r), final)
        for rank in (r for r in parts if r):
            part = (reports.get(rank, {}).get("parts") or {}).get(cp.name)
            if part is None:
                raise EvacuationError(f"{self.place.label}: node {rank} did not copy its part of {cp.name} in time")
            if part.get("error"):
                raise EvacuationError(f"{self.place.label}: node {rank} could not copy its part of {cp.name}: "
                                      f"{part['error']}")
            hashes[rank] = parse_hashes(str(part.get("hashes", "")).encode())
        files = sorted(e.path for e in cp.files)
        self.store.join_parts(cp.name, [self.store.part_name(cp.name, r) for r in sorted(parts)], files)
        for rank, found in hashes.items():
            self.executor.results[f"part:{cp.name}@{rank}"] = found
        label = {rank: host for host, rank in ranks.items()}
        about = {"saved_with": self.job.facts.host.run or None,
                 "held": {e.path: label[rank] for rank, es in parts.items() for e in es}}
        refs = [Ref(f"part:{cp.name}@{r}") for r in sorted(parts)]
        results = self.executor.run(self.store.plan_accept(self.job, cp, refs, about))
        report.copied.append(cp.name)
        report.bytes_copied += sum(e.size for e in cp.files)
        self.ui.step(self.job.host, "evacuate", f"{cp.name} verified: {len(files)} file(s) from {len(parts)} node(s), "
                                                f"{results.get(f'verified:{cp.name}') or self.store.hash_name}")


class Follower:
    """A node of rank >= 1: says what it holds, copies the parts node 0 asks for, and takes node 0's
    verdict of the stop's copy as its own."""

    def __init__(self, job: Job, shell: NodeShell, store: Store, executor: Executor, place: Placement,
                 ui: UI) -> None:
        self.job, self.shell, self.store, self.executor, self.place, self.ui = job, shell, store, executor, place, ui
        self.key = place.run_key
        self.parts: dict[str, dict[str, Any]] = {}
        self.verified = False
        self.why = "node 0 gave no verdict of the stop's copy"
        self.halt = threading.Event()
        self.thread: threading.Thread | None = None
        self.state = "training"

    def start(self) -> None:
        def loop() -> None:
            while not self.halt.wait(LOOK_EVERY):
                try:
                    self.serve()
                except RelaunchError as exc:
                    self.ui.warn(f"{self.place.label}: {exc.message.splitlines()[0]}; trying again")
        self.thread = threading.Thread(target=loop, name="group", daemon=True)
        self.thread.start()

    def serve(self) -> dict[str, Any]:
        """Say what this node holds; copy what node 0 asks for; node 0's file as read."""
        listing = read_listing(self.shell, self.job.paths.ckpt_dir)
        self._post(listing)
        lead = _read(self.store, leader_file(self.key))
        for name, wanted in (lead.get("want") or {}).items():
            paths = (wanted.get("parts") or {}).get(str(self.place.rank))
            if not paths or name in self.parts:
                continue
            entries = {e.path: e for e in listing}
            lacking = [p for p in paths if p not in entries]
            if lacking:
                self.parts[name] = {"error": f"{lacking[0]} is not on {self.place.label} any more"}
            else:
                cp = Checkpoint(name=name, step=int(wanted.get("step") or 0), files=tuple(entries[p] for p in paths))
                try:
                    self.parts[name] = {"hashes": hash_lines(copy_part(self.job, self.store, self.executor, cp,
                                                                       self.place.rank))}
                except Vanished:
                    self.parts[name] = {"error": f"{name} was rotated away during its copy"}
                except RelaunchError as exc:
                    self.parts[name] = {"error": exc.message.splitlines()[0]}
            self._post(listing)
        return lead

    def _post(self, listing: list[Entry]) -> None:
        doc = {"label": self.job.host, "rank": self.place.rank, "state": self.state, "at": time.time(),
               "listing": [[e.kind, e.size, e.mtime, e.path] for e in listing], "parts": self.parts}
        self.store.post(node_file(self.key, self.place.rank), json.dumps(doc, sort_keys=True))

    def finish(self, deadline: float | None) -> None:
        """The training here is over: serve node 0 until it gives the verdict of the stop's copy."""
        self.halt.set()
        if self.thread is not None:
            self.thread.join()
        self.state = "stopped"
        until = deadline if deadline is not None else time.time() + PART_WAIT
        while time.time() < until:
            try:
                final = self.serve().get("final")
            except RelaunchError as exc:
                self.ui.warn(f"{self.place.label}: {exc.message.splitlines()[0]}; trying again")
                final = None
            if isinstance(final, dict):
                self.verified, self.why = bool(final.get("verified")), str(final.get("why") or "")
                return
            time.sleep(POLL)
