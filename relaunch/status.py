"""`relaunch status`: one look at a run. Is training alive, what would a loss right now cost."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .cycle import connected, open_group, open_host
from .errors import RelaunchError, shorten
from .gather import gather, gather_group
from .history import Interruption, read_history
from .host.facts import unseen_run
from .host.remote import Remote
from .host.spec import HostSpec
from .interval import badput_now
from .job import Job, Lag, StoreState, drift
from .recipe import Recipe
from .savecosts import read_command, saves_of, summarize
from .steps import lineage
from .steps.checkpoint import instance_checkpoints
from .steps.guard import LOOK_DEADLINE as GUARD_LOOK_DEADLINE
from .steps.guard import guard_session, look_command, parse_look, source_lines
from .steps.launch import tail_command
from .steps.notices import protection
from .transports import open_store
from .transports.base import Store
from .ui import UI, human
from .watch.exposure import Exposure
from .watch.holder import read_state

GPU_QUERY = ("timeout -k 2 10 nvidia-smi --query-gpu=name,utilization.gpu,memory.used,memory.total "
             "--format=csv,noheader,nounits")
LOOK_DEADLINE = 30.0
HISTORY_SHOWN = 5


@dataclass(kw_only=True)
class Status(Lag):
    host: str
    alive: bool
    since: str = ""
    log_tail: list[str] = field(default_factory=list)
    gpus: list[str] = field(default_factory=list)
    free_bytes: int = 0
    drift: list[str] = field(default_factory=list)
    env: str = ""                                # the venv against the lock, in words (drift: the differences)
    log: str = ""                                # run.log on the instance, rendered
    user: str = ""                               # who looked (the login)
    unseen: str = ""                             # not alive for this login, but a run of this recipe is there
    unseen_hint: str = ""                        # what to do then (never `relaunch up`)
    guard: dict[str, Any] | None = None          # the guard's own state: running, its sources
    notice: dict[str, Any] | None = None         # the guard's notice record, when one came
    interruptions: list[dict[str, Any]] = field(default_factory=list)   # the last ones, from the store
    watch: dict[str, Any] | None = None          # the last `relaunch watch` of this recipe and store here
    store_error: str = ""                        # the store did not answer: what it said
    notices: dict[str, Any] | None = None        # which guard sources can fire here, the loss bound when none
    badput: dict[str, Any] | None = None         # what checkpoints cost the run now (the Checkpointer's metric lines)
    aside: list[str] = field(default_factory=list)   # abandoned branches' checkpoints: where they are (lineage)


def read_store(store: Store, ui: UI) -> tuple[StoreState | None, str]:
    """The store's state, or why it cannot be read: a look at the instance is still worth having
    when the store is down (an S3 outage, a Hub 5xx, credentials gone), so it is said, not fatal."""
    try:
        return store.read(False), ""
    except RelaunchError as exc:
        why = shorten(exc.message, 200)
        ui.warn(f"the store {store.label} did not answer; the instance is shown without it: {why}")
        return None, why


def status(recipe: Recipe, spec: HostSpec, ui: UI, lines: int = 10) -> Status:
    store = open_store(recipe)
    node, remote = open_host(recipe, spec, ui)
    with remote:
        job = gather(remote, recipe, node, notices=True)
        job.facts.store, store_error = read_store(store, ui)
        manifest = job.facts.store.manifest if job.facts.store else None
        lineage.apply(manifest, [job])             # a rollback on the instance the store has not heard of yet
        notices = protection(job, job.facts.notices)
        facts, paths = job.facts.host, job.paths
        result = Status(host=job.host, alive=facts.session_alive, free_bytes=facts.free_ckpt,
                        store_error=store_error, notices=notices.as_dict())
        see_unseen(result, job)
        if facts.session_since.isdigit():
            result.since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(int(facts.session_since)))
        tail = remote.exec(tail_command(paths.log, lines), deadline=LOOK_DEADLINE)
        result.log, result.log_tail = paths.log, tail.text.splitlines() if tail.ok else []
        if facts.tools.get("nvidia-smi"):
            gpus = remote.exec(GPU_QUERY, deadline=LOOK_DEADLINE)
            result.gpus = (gpus.text.splitlines() if gpus.ok
                           else [f"nvidia-smi failed or hung: {shorten(gpus.output, 100)}"])
        listing = instance_checkpoints(job)
        if listing:
            newest = listing[-1]
            result.newest, result.newest_step = newest.name, newest.step
            result.newest_mtime = max((e.mtime for e in newest.files), default=None)
        stored = manifest.newest() if manifest else None
        if stored is not None:
            result.stored, result.stored_step, result.stored_written_at = stored.name, stored.step, stored.written_at
        result.env, result.drift = env_state(job)
        result.aside = lineage.aside_lines(manifest, [job])
        look = remote.exec(look_command(job), deadline=GUARD_LOOK_DEADLINE)
        if look.ok:
            seen = parse_look(look.stdout)
            result.guard = {"running": seen.guard, "session": guard_session(recipe), "state": seen.state,
                            "rebalance": seen.rebalance}
            result.notice = seen.notice
        entries: list[Interruption] = []
        try:
            if not store_error:
                entries = read_history(store)
                result.interruptions = [e.as_dict() for e in entries[-HISTORY_SHOWN:]]
        except RelaunchError as exc:
            ui.warn(f"could not read the history of interruptions from {store.label}: {shorten(exc.message, 200)}")
        result.badput = saving_costs(remote, paths.log, entries)
        result.watch = read_state(recipe.name, store.label)
        return result


def see_unseen(status: Status, job: Job) -> None:
    """A session not alive for this login is "not running" only when no run of this recipe is there
    for another login (or outside the session): else that is said, and `relaunch up` never hinted."""
    status.user = job.facts.host.user
    found = None if status.alive else unseen_run(job.facts.host, job.recipe.run.session)
    if found is not None:
        status.unseen, status.unseen_hint = found.why, found.hint("status", job.target)


def session_state(s: Status) -> str:
    if s.alive:
        return f"ALIVE since {s.since}" if s.since else "ALIVE"
    return f"NOT SEEN as {s.user or 'this user'}" if s.unseen else "NOT RUNNING"


def env_state(job: Job) -> tuple[str, list[str]]:
    """(the venv against the lock, in words; the differences): never "matches" without a lock or a venv."""
    lock, installed = job.recipe.env.lock, job.facts.host.venv_freeze
    if installed is None:
        return f"no venv at {job.paths.venv}", []
    if lock is None:
        return "no lock (env.lock is not set; `relaunch freeze RECIPE` writes one from this venv)", []
    if not job.facts.lock:
        return f"no lock yet ({lock} does not exist; `relaunch freeze RECIPE` writes it from this venv)", []
    differences = drift(job.facts.lock, installed)
    if not differences:
        return "matches the lock", []
    return f"{len(differences)} difference(s) from the lock: " + "; ".join(differences[:5]), differences


def saving_costs(remote: Remote, log: str, entries: list[Interruption]) -> dict[str, Any] | None:
    """The run's Badput now, from the Checkpointer's metric lines in its log (None without them)."""
    found = remote.exec(read_command(log), deadline=LOOK_DEADLINE)
    costs = summarize(saves_of(found.text)) if found.ok else None
    return None if costs is None else badput_now(costs, entries).as_dict()


def badput_lines(data: dict[str, Any] | None) -> list[str]:
    from .interval import BadputNow
    from .savecosts import SaveCosts

    if not data:
        return []
    costs = SaveCosts(**{k: data[k] for k in SaveCosts.__dataclass_fields__})
    return BadputNow(costs, data["interruptions"], data["mtbi"], data["mtbi_gaps"]).lines()


def in_store_unknown(s: Status) -> str:
    return f"unknown: the store did not answer ({s.store_error})" if s.store_error else "none"


def render(s: Status, recipe: Recipe) -> str:
    out = [f"{s.host}  tmux session {recipe.run.session}: {session_state(s)}"]
    if s.unseen:
        out.append(f"  {s.unseen}")
    if s.gpus:
        out += [f"  gpu  {g}" for g in s.gpus]
    else:
        out.append("  gpu  none (nvidia-smi not found)")
    on_instance = f"{s.newest} (step {s.newest_step})" if s.newest else "none yet"
    in_store = f"{s.stored} (step {s.stored_step})" if s.stored else in_store_unknown(s)
    out.append(f"  newest checkpoint on the instance: {on_instance}")
    out.append(f"  newest verified in the store:      {in_store}")
    if s.lag_steps is not None:
        minutes = f", {s.lag_seconds / 60:.1f} min" if s.lag_seconds is not None else ""
        out.append(f"  a loss right now would cost: {s.lag_steps} steps{minutes}")
    out += aside_block(s.aside, "  ")
    out.append(f"  free disk under checkpoint.dir: {human(s.free_bytes)}")
    out.append(f"  env: {s.env}")
    out += _guard_lines(s, recipe)
    if s.notices:
        out.append("  notices that can reach this run:")
        out += ["    " + line for line in s.notices["said"]]
    out += ["  " + line for line in badput_lines(s.badput)]
    out += watch_lines(s.watch)
    if s.interruptions:
        out.append(f"  interruptions (the last {len(s.interruptions)}, .relaunch/history.jsonl in the store):")
        out += ["    " + Interruption.from_dict(e).line() for e in s.interruptions]
    if s.log_tail:
        out.append(f"  last lines of {s.log}:")
        out += ["    " + line for line in s.log_tail]
    return "\n".join(out)


def group_status(recipe: Recipe, specs: list[HostSpec], ui: UI, lines: int = 10) -> list[Status]:
    """Every node of a group at once; the checkpoint lag is the group's (complete across nodes)."""
    store = open_store(recipe)
    pairs = open_group(recipe, specs, ui)
    with connected(pairs) as remotes:
        jobs = gather_group(pairs, recipe, notices=True)
        state, store_error = read_store(store, ui)
        for job in jobs:
            job.facts.store = state
        group = instance_checkpoints(jobs[0])
        manifest = jobs[0].facts.store.manifest if jobs[0].facts.store else None
        lineage.apply(manifest, jobs)
        stored = manifest.newest() if manifest else None
        found = []
        for job in jobs:
            facts = job.facts.host
            one = Status(host=job.host, alive=facts.session_alive, free_bytes=facts.free_ckpt, gpus=facts.gpus,
                         store_error=store_error, notices=protection(job, job.facts.notices).as_dict())
            see_unseen(one, job)
            if facts.session_since.isdigit():
                one.since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(int(facts.session_since)))
            tail = remotes[job.host].exec(tail_command(job.paths.log, lines), deadline=LOOK_DEADLINE)
            one.log, one.log_tail = job.paths.log, tail.text.splitlines() if tail.ok else []
            if group:
                one.newest, one.newest_step = group[-1].name, group[-1].step
                one.newest_mtime = max((e.mtime for e in group[-1].files), default=None)
            if stored is not None:
                one.stored, one.stored_step, one.stored_written_at = stored.name, stored.step, stored.written_at
            one.env, one.drift = env_state(job)
            found.append(one)
        entries: list[Interruption] = []
        try:
            entries = read_history(store) if not store_error else []
        except RelaunchError as exc:
            ui.warn(f"could not read the history of interruptions from {store.label}: {shorten(exc.message, 200)}")
        found[0].badput = saving_costs(remotes[jobs[0].host], jobs[0].paths.log, entries)
        found[0].watch = read_state(recipe.name, store.label)
        found[0].aside = lineage.aside_lines(manifest, jobs)
        return found


def render_group(statuses: list[Status], recipe: Recipe) -> str:
    """One table of the nodes, then the group's checkpoints and node 0's last log lines."""
    rows = [("node", "tmux " + recipe.run.session, "GPUs", "free disk", "env")]
    for s in statuses:
        state = session_state(s)
        env = f"{len(s.drift)} difference(s)" if s.drift else s.env.partition(" (")[0]
        rows.append((s.host, state, str(len(s.gpus)), human(s.free_bytes), env))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    first = statuses[0]
    out.append(f"newest checkpoint complete across the group: "
               f"{f'{first.newest} (step {first.newest_step})' if first.newest else 'none yet'}")
    out.append(f"newest verified in the store:                "
               f"{f'{first.stored} (step {first.stored_step})' if first.stored else in_store_unknown(first)}")
    if first.lag_steps is not None:
        minutes = f", {first.lag_seconds / 60:.1f} min" if first.lag_seconds is not None else ""
        out.append(f"a loss right now would cost: {first.lag_steps} steps{minutes}")
    out += aside_block(first.aside, "")
    for s in statuses:
        if s.unseen:
            out.append(f"{s.host}: {s.unseen}")
    for s in statuses:
        if s.notices:
            out.append(f"notices that can reach {s.host}: {s.notices['said'][-1]}")
    out += badput_lines(first.badput)
    out += [line[2:] for line in watch_lines(first.watch)]
    if first.log_tail:
        out.append(f"last lines of {first.log} on {first.host}:")
        out += ["  " + line for line in first.log_tail]
    return "\n".join(out)


def aside_block(lines: list[str], indent: str) -> list[str]:
    """The abandoned branches (a resume from an older checkpoint): never the newest, kept, and where."""
    if not lines:
        return []
    return [f"{indent}set aside (abandoned branches: never resumed, never pruned):"] + \
        [f"{indent}  {line}" for line in lines]


def watch_lines(w: dict[str, Any] | None) -> list[str]:
    """The last `relaunch watch` of this recipe and store on this machine: running or not, its
    last round, its last error."""
    if not w:
        return []
    hosts = " ".join(w.get("hosts") or [])
    out = [f"  watch: running here (pid {w.get('pid')}, since {w.get('since')}), watching {hosts}" if w.get("running")
           else f"  watch: not running (the last one, pid {w.get('pid')}, ended {w.get('ended') or 'without a word'})"]
    if w.get("last_round"):
        out.append(f"    last round at {w['last_round'].get('at')}: {w['last_round'].get('line')}")
    out += exposure_lines(w.get("exposure"), w.get("exposure_most"))
    if w.get("last_error"):
        out.append(f"    last error at {w['last_error'].get('at')}: {w['last_error'].get('message')}")
    return out


def exposure_lines(now: dict[str, Any] | None, most: dict[str, Any] | None) -> list[str]:
    """What the watch measured at its looks: the exposure then, and the most it has been."""
    if not now:
        return []
    out = [f"    exposure at {now.get('at')}: {Exposure.from_dict(now).words()}"]
    if most:
        out.append(f"    the most since the watch started: {Exposure.from_dict(most).words()}, at {most.get('at')}")
    return out


def _guard_lines(s: Status, recipe: Recipe) -> list[str]:
    out = []
    guard = s.guard or {}
    state = guard.get("state") or {}
    probed = (s.notices or {}).get("sources") or {}
    sources = "; ".join(source_lines(state, [n for n, found in probed.items() if found.get("fires") is False]))
    if guard.get("running"):
        out.append(f"  guard: running (tmux session {guard['session']}): {sources or 'starting'}")
    elif not recipe.guard.enabled:
        out.append("  guard: off (guard.enabled is false)")
    elif state:
        saw = f"; it saw: {sources}" if sources else ""
        out.append(f"  guard: not running ({state.get('stopped') or 'ended'}){saw}")
    elif s.unseen:
        out.append(f"  guard: not seen as {s.user or 'this user'} (see above)")
    else:
        out.append("  guard: not started on this instance (`relaunch up` starts it)")
    advice = guard.get("rebalance")
    if advice:
        out.append(f"  rebalance recommendation from {advice.get('source')} at {advice.get('seen')}: "
                   f"{advice.get('detail')} (not a notice: training goes on; `relaunch watch` copies off at once)")
    n = s.notice
    if n:
        save = n.get("save") or {}
        copy = n.get("copy") or {}
        out.append(f"  reclaim notice from {n.get('source')} at {n.get('seen')}: {n.get('detail')}")
        out.append(f"    save: {save.get('state', '?')}" + (f" (exit {save['exit']}, {save.get('seconds')}s)"
                                                             if save.get("exit") else ""))
        out.append("    copy: " + (f"{copy.get('checkpoint')} verified by {copy.get('by')}" if copy.get("verified")
                                   else "not verified yet (`relaunch watch` or `relaunch evacuate` copies it)"))
        if n.get("verdict"):
            out.append(f"    verdict: {n['verdict']}")
    return out


__all__ = ["group_status", "render", "render_group", "status", "Status"]
