"""Facts, gathered once per host before anything is planned: the instance (one script), its
checkpoint folder (one listing), the store, and this machine's inputs (lock, secrets, file
modes). Every read has a deadline; none changes anything.
"""

from __future__ import annotations

import json
import os
import shlex
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .errors import CheckpointError, ConnectError, EnvError, RelaunchError, remote_failure
from .host.connection import HOME_COMMAND
from .host.facts import FACTS_DEADLINE, HostFacts, facts_script, parse_facts
from .host.hashing import hash_command, parse_hashes, paths_stdin
from .host.indexes import READ_DEADLINE as INDEXES_DEADLINE
from .host.indexes import indexes_command
from .host.remote import Remote
from .job import Facts, Job, Node, read_lock
from .layouts import LISTING_COMMAND, Entry, complete_checkpoints, parse_listing
from .layouts.dcp import MARKER as DCP_MARKER
from .layouts.dcp import required_files
from .recipe import Recipe
from .steps import lineage
from .steps.checkpoint import instance_checkpoints
from .transports import Store

LISTING_DEADLINE = 300.0        # a folder of thousands of checkpoint shards on a slow disk
VANISHED = 44                  # read_required's exit status for a .metadata deleted since the listing
CHECKED = 10                    # how many of the instance's newest checkpoints are checked for a finished save


def listing_command(ckpt_dir: str) -> str:
    q = shlex.quote(ckpt_dir)
    return f"if [ -d {q} ]; then {LISTING_COMMAND.format(dir=q)}; fi"


def read_host(remote: Remote, job: Job) -> HostFacts:
    recipe, paths = job.recipe, job.paths
    script = facts_script(recipe.env.python, paths.venv, paths.ckpt_dir, recipe.run.session, list(recipe.env.apt),
                          templates=recipe.templates, run_info=paths.run_info, name=recipe.name)
    result = remote.exec("bash -s", stdin=script.encode(), deadline=FACTS_DEADLINE)
    _check(remote, result, "reading facts (facts.sh)", EnvError, FACTS_DEADLINE)
    facts = parse_facts(result.text)
    if not facts.home:
        facts.home = remote.home
    return facts


def read_indexes(remote: Remote, job: Job) -> dict[str, Any]:
    """What templates/indexes.py reads of the instance's pip and uv configuration (host/indexes.py
    parses it), with the venv's python."""
    command = indexes_command(job.paths.venv)
    result = remote.exec(command, deadline=INDEXES_DEADLINE)
    _check(remote, result, "reading pip's and uv's configuration (indexes.py)", EnvError, INDEXES_DEADLINE, command)
    try:
        doc = json.loads(result.text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        doc = None
    if not isinstance(doc, dict):
        raise EnvError(f"{remote.label}: reading pip's and uv's configuration: indexes.py printed no JSON",
                       "the full output is in the debug log")
    return doc


def read_listing(remote: Remote, ckpt_dir: str, error: type[RelaunchError] = CheckpointError) -> list[Entry]:
    """checkpoint.dir on the instance ([] when it does not exist yet)."""
    command = listing_command(ckpt_dir)
    result = remote.exec(command, deadline=LISTING_DEADLINE)
    # find exits 1 when a file vanishes while it walks (trainers rotate checkpoints); the
    # listing is still good. Anything else it says is a real problem.
    vanished = all("No such file or directory" in line for line in result.stderr.decode(errors="replace")
                   .splitlines() if line.strip())
    if not (result.status == 1 and vanished):
        _check(remote, result, "listing checkpoint.dir", error, LISTING_DEADLINE, command)
    return parse_listing(result.stdout)


def read_damaged(remote: Remote, job: Job) -> dict[str, str]:
    """Which of the instance's newest complete checkpoints (newer than the store's) are saves that
    did not finish: a torch zip without its end, a safetensors file shorter than its header says.
    Reads only each file's first and last bytes."""
    stored = job.facts.store.manifest.newest() if job.facts.store and job.facts.store.manifest else None
    newer = [cp for cp in instance_checkpoints(job) if stored is None or cp.step > stored.step][-CHECKED:]
    if not newer:
        return {}
    files = {e.path: cp.name for cp in newer for e in cp.files}
    command = hash_command(job.paths.ckpt_dir, job.facts.host.python, ())
    result = remote.exec(command, stdin=paths_stdin(sorted(files)), deadline=LISTING_DEADLINE)
    _check(remote, result, "checking the newest checkpoints", CheckpointError, LISTING_DEADLINE, command)
    damaged: dict[str, str] = {}
    for path, found in parse_hashes(result.stdout).items():
        if found.problem and files.get(path) and files[path] not in damaged:
            damaged[files[path]] = f"{path}: {found.problem}"
    return damaged


def _check(remote: Remote, result: object, what: str, error: type[RelaunchError], deadline: float,
           command: str | None = None) -> None:
    from .host.remote import ExecResult

    assert isinstance(result, ExecResult)
    if result.ok:
        return
    if result.timed_out:
        raise error(f"{remote.label}: {what} did not answer within {deadline:g}s; it was ended",
                    "the instance may be overloaded or hung (a broken GPU driver?); rerun, or reboot it")
    if result.status is None:
        raise ConnectError(f"{remote.label}: {what}: the SSH connection was lost")
    raise remote_failure(error, remote.label, what, command or result.command, result.status, result.output)


def read_notices(remote: Remote, job: Job) -> dict[str, dict[str, Any]]:
    """Which guard sources can fire here: the guard script's own one look at each (steps/notices.py)."""
    from .steps.notices import PROBE_DEADLINE, parse_probe, probe_script

    if not job.recipe.guard.enabled or not job.recipe.guard.sources:
        return {}
    result = remote.exec("bash -s", stdin=probe_script(job).encode(), deadline=PROBE_DEADLINE)
    _check(remote, result, "asking which notice sources can fire (guard.py's probe)", EnvError, PROBE_DEADLINE)
    return parse_probe(result.text)


def gather(remote: Remote, recipe: Recipe, node: Node, store: Store | None = None, *, listing: bool = True,
           writing: bool = False, notices: bool = False) -> Job:
    """The job on this node with every fact planning needs (the store only when given; which notice
    sources can fire only when `notices`)."""
    job = Job(recipe, node, Facts(host=HostFacts(home=remote.home)))
    host = read_host(remote, job)
    job = Job(recipe, node, Facts(host=host))
    paths = job.paths
    facts = job.facts
    facts.reads = [HOME_COMMAND, "bash -s"]        # stdin of bash -s: facts.sh
    if listing:
        facts.listing = read_listing(remote, paths.ckpt_dir)
        facts.reads.append(listing_command(paths.ckpt_dir))
        if node.nnodes == 1:
            # a DCP checkpoint a node group wrote: its .metadata is here, other nodes' shards may
            # not be (a node that survived its group); complete only with every file it names
            facts.required, vanished = read_required({job.host: remote}, job,
                                                     {e.path: [job.host] for e in facts.listing}, facts.reads)
            facts.listing = without(facts.listing, vanished)
    if store is not None:
        facts.store = store.read(writing)
        lineage.apply(facts.store.manifest, [job])     # a rollback the store has not heard of yet
        if facts.listing:
            facts.damaged = read_damaged(remote, job)
            facts.reads.append(hash_command(paths.ckpt_dir, facts.host.python, ()))
    if notices:
        facts.notices = read_notices(remote, job)
        if facts.notices:
            facts.reads.append("bash -s")            # stdin of bash -s: guard.py, probing
    facts.lock = read_lock(recipe.env.lock)
    # the store's own credentials go to the instance only for a copy, never into training's file
    facts.withheld = [n for n in recipe.env.secrets if store is not None and store.is_credential(n)]
    facts.secrets = environ_secrets([n for n in recipe.env.secrets if n not in facts.withheld])
    facts.modes, facts.sizes = env_files(recipe)
    return job


def environ_secrets(names: list[str]) -> dict[str, str]:
    """The values of the recipe's `env.secrets`, from this machine's environment."""
    return {name: os.environ[name] for name in names if name in os.environ}


def env_files(recipe: Recipe) -> tuple[dict[str, int], dict[str, int]]:
    """The mode (kept on the instance) and size (the upload's deadline) of each env.files file here."""
    found = {str(p): os.stat(p) for p in recipe.env.files if p.exists()}
    return {p: s.st_mode & 0o777 for p, s in found.items()}, {p: s.st_size for p, s in found.items()}


def metadata_command(path: str) -> str:
    """`cat` a DCP `.metadata`; exit VANISHED when it is no longer there (deleted since the listing)."""
    quoted = shlex.quote(path)
    return f"cat -- {quoted} || {{ test -e {quoted} || exit {VANISHED}; exit 1; }}"


def without(listing: list[Entry], names: set[str]) -> list[Entry]:
    """The listing without the checkpoints `names` (and everything below them)."""
    return [e for e in listing if not any(e.path == n or e.path.startswith(n + "/") for n in names)]


def read_required(remotes: dict[str, Remote], job: Job, holders: dict[str, list[str]],
                  reads: list[str] | None = None) -> tuple[dict[str, list[str]], set[str]]:
    """For the group's newest DCP checkpoints: the files each one's `.metadata` says it needs,
    read from the node that holds the metadata (a few KB each; torch is not needed here);
    each command read is added to `reads`. Also the checkpoints whose `.metadata` was deleted
    since the listing (a training keeping its newest N): gone, not complete, not an error."""
    c = job.recipe.checkpoint
    found = complete_checkpoints(job.facts.listing or [], c.layout, c.pattern)
    required: dict[str, list[str]] = {}
    vanished: set[str] = set()
    for cp in found[-max(CHECKED, c.keep):]:
        meta = f"{cp.name}/{DCP_MARKER}"
        if meta not in holders:
            continue                              # not a DCP checkpoint
        remote = remotes[holders[meta][0]]
        command = metadata_command(f"{job.paths.ckpt_dir}/{meta}")
        result = remote.exec(command, deadline=LISTING_DEADLINE)
        if reads is not None:
            reads.append(command)
        if result.status == VANISHED:
            vanished.add(cp.name)
            continue
        _check(remote, result, f"reading {meta}", CheckpointError, LISTING_DEADLINE, command)
        try:
            required[cp.name] = sorted(required_files(result.stdout))
        except ValueError:
            continue                              # a newer format: its presence is the rule, as on one node
    return required, vanished


def gather_group(pairs: list[tuple[Node, Remote]], recipe: Recipe, store: Store | None = None, *,
                 writing: bool = False, notices: bool = False) -> list[Job]:
    """Every node's facts (read at the same time), then one view of the group: the checkpoint
    folders of all nodes merged (which node holds what), shared by every node's job."""
    if len(pairs) == 1:
        node, remote = pairs[0]
        return [gather(remote, recipe, node, store, writing=writing, notices=notices)]
    with ThreadPoolExecutor(max_workers=len(pairs), thread_name_prefix="gather") as pool:
        jobs = list(pool.map(lambda pair: gather(pair[1], recipe, pair[0], notices=notices), pairs))
    remotes = {job.host: remote for job, (_, remote) in zip(jobs, pairs, strict=True)}
    state = store.read(writing) if store is not None else None
    damaged: dict[str, str] = {}
    if state is not None:
        lineage.apply(state.manifest, jobs)
        for job in jobs:
            job.facts.store = state
            damaged.update(read_damaged(remotes[job.host], job))
    for job in jobs:
        job.facts.store, job.facts.damaged = state, damaged
    share_listings(jobs, remotes, {job.host: job.facts.listing or [] for job in jobs})
    return jobs


def share_listings(jobs: list[Job], remotes: dict[str, Remote], listings: dict[str, list[Entry]]) -> None:
    """One view of a group's checkpoint folders, shared by every node's job: the merged listing,
    which nodes hold each path, and what the DCP checkpoints among them need."""
    merged: dict[str, Entry] = {}
    holders: dict[str, list[str]] = {}
    for job in jobs:
        for entry in listings[job.host]:
            merged.setdefault(entry.path, entry)
            holders.setdefault(entry.path, []).append(job.host)
    listing = list(merged.values())
    jobs[0].facts.listing = listing
    required, vanished = read_required(remotes, jobs[0], holders)
    listing = without(listing, vanished)
    for job in jobs:
        job.facts.listing, job.facts.holders, job.facts.required = listing, holders, required
