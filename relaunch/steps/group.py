"""A node group: its shape (processes per node, world size, gradient accumulation that keeps
the global batch), what changed since the checkpoint was saved, and the actions that fan a
restored checkpoint out from the first node to the others over the nodes' own network.

Each node's actions carry its label (`host`) and lanes of their own, so one executor runs the
whole group: every node installs at the same time as the checkpoint crosses the slow link to the
group once and then doubles between the nodes (1 -> 2 -> 4 -> 8), each copy starting as soon as
its sender holds a verified one.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Sequence
from typing import Any

from ..errors import CheckpointError, EnvError
from ..host.hashing import hash_command, hash_deadline, paths_stdin
from ..host.remote import upload_command
from ..job import Job
from ..manifest import CheckpointRecord
from ..plan import LOCAL, Action, Ref
from ..transports.rsync import deadline_for
from ..ui import human

MARK = "relaunch-fanout"       # comment on the key relaunch adds to authorized_keys, and removes
# sed: delete a line only when all of it is a key relaunch added (`restrict TYPE KEY MARK`), never
# a user's line that merely ends with the mark
MARKED_LINE = rf"\|^restrict ssh-ed25519 [A-Za-z0-9+/]*=* {MARK}$|d"


@dataclasses.dataclass(frozen=True)
class Shape:
    nnodes: int
    nproc: int
    world_size: int
    grad_accum: int

    def as_dict(self, recipe_batch: Any) -> dict[str, Any]:
        batch = {"global": recipe_batch.global_, "micro": recipe_batch.micro} if recipe_batch else {}
        return {"nnodes": self.nnodes, "nproc_per_node": self.nproc, "world_size": self.world_size,
                "grad_accum": self.grad_accum, **batch}


def shape(jobs: Sequence[Job]) -> Shape:
    """Processes per node (run.nproc_per_node, else the GPUs every node has, at least 1), the
    world size, and gradient accumulation = global / (micro x world size); EnvError when the
    nodes differ or the global batch does not divide (naming the counts that would)."""
    recipe = jobs[0].recipe
    if recipe.run.nproc_per_node:
        nproc = recipe.run.nproc_per_node
    else:
        counts = {job.host: max(len(job.facts.host.gpus), 1) for job in jobs}
        if len(set(counts.values())) > 1:
            raise EnvError("the nodes have different GPU counts: " + ", ".join(f"{h} {n}" for h, n in counts.items()),
                           "set run.nproc_per_node to the processes each node should run")
        nproc = next(iter(counts.values()))
    world = nproc * len(jobs)
    batch = recipe.run.batch
    if batch is None:
        return Shape(len(jobs), nproc, world, 1)
    micro_batches, rest = divmod(batch.global_, batch.micro)
    if rest or micro_batches % world:
        fits = [w for w in range(1, micro_batches + 1) if micro_batches % w == 0] if not rest else []
        nodes = ", ".join(f"{w // nproc} node(s) x {nproc}" for w in fits if w % nproc == 0) or "none"
        raise EnvError(
            f"run.batch: global {batch.global_} is not micro {batch.micro} x world size {world} x a whole "
            f"gradient accumulation ({len(jobs)} node(s) x {nproc} process(es))",
            f"world sizes that keep the global batch: {', '.join(map(str, fits)) or 'none (global % micro != 0)'}; "
            f"with {nproc} per node: {nodes}")
    return Shape(len(jobs), nproc, world, micro_batches // world)


def shaped(jobs: Sequence[Job], s: Shape) -> list[Job]:
    return [dataclasses.replace(job, node=dataclasses.replace(job.node, nproc=s.nproc, world_size=s.world_size,
                                                             grad_accum=s.grad_accum)) for job in jobs]


def what_changed(record: CheckpointRecord | None, s: Shape, job: Job) -> str:
    """`world size 8 -> 4: grad_accum 2 -> 4, global batch 512 kept`, or "" when nothing did."""
    before = (record.saved_with or {}) if record is not None else {}
    if not before or before.get("world_size") in (None, s.world_size):
        return ""
    text = f"world size {before['world_size']} -> {s.world_size}"
    batch = job.recipe.run.batch
    if batch is not None:
        text += f": grad_accum {before.get('grad_accum', '?')} -> {s.grad_accum}, global batch {batch.global_} kept"
    return text


def check_reshard(record: CheckpointRecord | None, s: Shape, job: Job) -> None:
    """A DeepSpeed ZeRO checkpoint cannot be loaded at another world size as it is: say what
    converts it before anything starts."""
    before = (record.saved_with or {}) if record is not None else {}
    is_zero = record is not None and any("zero_pp_rank_" in p for p in record.files)
    if is_zero and before.get("world_size") not in (None, s.world_size):
        assert record is not None
        raise CheckpointError(
            f"{record.name} is a DeepSpeed ZeRO checkpoint saved at world size {before['world_size']}; it cannot be "
            f"loaded at world size {s.world_size} as it is",
            f"convert it to a universal checkpoint (`python -m deepspeed.checkpoint.ds_to_universal --input_folder "
            f"{record.name} --output_folder {record.name}_universal`) and resume with `load_universal`, or keep "
            f"{before['world_size'] // max(s.nproc, 1) or 1} node(s) x {s.nproc}")


def tag(actions: Sequence[Action], job: Job, lane: str | None = None) -> list[Action]:
    """The actions of one node of a group: its label, and lanes of its own (`env@host`)."""
    return [dataclasses.replace(a, host=a.host or job.host, lane=lane if lane is not None else
                                (f"{a.lane}@{job.host}" if a.lane else a.lane)) for a in actions]


def barrier(step: str, text: str) -> Action:
    """Nothing runs; lanes before it end before actions after it start."""
    return Action(step, text, say=text)


def _node_ssh(job: Job, paths_key: str, known: str) -> str:
    """The `ssh` a node uses to reach another node: relaunch's key for this copy, strict keys."""
    return shlex.join(["ssh", "-i", paths_key, "-o", f"UserKnownHostsFile={known}", "-o",
                       "GlobalKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
                       "-o", "IdentitiesOnly=yes", "-o", "ConnectTimeout=20"])


def sender(k: int) -> int:
    """Who gives node k the checkpoint: the nodes that have it double each round (0 -> 1;
    0 -> 2, 1 -> 3; 0 -> 4, 1 -> 5, 2 -> 6, 3 -> 7 ...)."""
    return k - (1 << (k.bit_length() - 1))


def plan_fanout(jobs: Sequence[Job], record: CheckpointRecord, known_hosts: str, first_copy: Sequence[Action],
                moves: Sequence[Action]) -> tuple[Action, list[Action], list[Action]]:
    """How the checkpoint reaches every node: (the key for this copy, the restore lanes, the cleanups).

    Node 0's lane copies it from the store (`first_copy`) and verifies it; every other node's
    lane waits until its sender holds a verified copy, then the sender copies it over the nodes'
    own network, and the node verifies it by sha256. The lanes run beside the nodes' env
    installs; a node moves its copy into place once every node verified its own (senders read
    from their hidden incoming folders until then).

    The copies between nodes use a key made for this copy: its private half on the nodes only
    while the copy runs, its public half in their authorized_keys with a marker, both removed
    afterwards, also on failure; host keys are checked against relaunch's known_hosts
    (`known_hosts`: their lines).
    """
    name, total = record.name, sum(f.size for f in record.files.values())
    expected = {f: r.sha256 for f, r in record.files.items()}
    files = sorted(record.files)
    everyone = tuple(f"ckpt@{job.host}" for job in jobs)
    q = shlex.quote
    keypair = Action("checkpoint", "a key for copying between the nodes", where=LOCAL, call="fanout.keypair",
                     produces="fanout-key", fails_as="checkpoint")
    lanes: list[Action] = []
    cleanup: list[Action] = []
    for k, job in enumerate(jobs):
        lane = "checkpoint" if k == 0 else f"checkpoint@{job.host}"
        state = job.paths.state
        key, known = f"{state}/fanout_key", f"{state}/fanout_known_hosts"
        auth = f"{job.paths.home}/.ssh/authorized_keys"
        keys = [
            Action("checkpoint", f"the copy key -> {key} (mode 0600, for this copy only)",
                   command=upload_command(key, 0o600), stdin=Ref("fanout-key", "private"), secret=("fanout key",),
                   fails_as="checkpoint"),
            Action("checkpoint", f"the group's host keys -> {known}", command=upload_command(known, 0o600),
                   stdin=known_hosts.encode(), fails_as="checkpoint"),
            Action("checkpoint", f"let the copy key in: {auth}",
                   # a file whose last line has no newline would take the key into that line
                   command=f"umask 077 && mkdir -p -- {q(job.paths.home + '/.ssh')} && "
                           f"if [ -s {q(auth)} ] && [ -n \"$(tail -c 1 -- {q(auth)})\" ]; then echo >> {q(auth)}; fi"
                           f" && cat >> {q(auth)}",
                   stdin=Ref("fanout-key", "authorized"), fails_as="checkpoint", produces=f"keys@{job.host}"),
        ]
        if k == 0:
            copy = [*first_copy[:-1], dataclasses.replace(first_copy[-1], produces=f"ckpt@{job.host}")]
        else:
            giver = jobs[sender(k)]
            incoming = giver.paths.incoming
            to = f"{job.target.address}:{job.paths.incoming}/{name}" + ("/" if record.is_dir else "")
            argv = ["rsync", "-a", "-s", "--partial-dir=.rsync-partial", "--mkpath", "-e",
                    _node_ssh(giver, f"{giver.paths.state}/fanout_key", f"{giver.paths.state}/fanout_known_hosts")
                    + f" -p {job.target.port} -l {q(job.target.user)}",
                    f"{incoming}/{name}" + ("/" if record.is_dir else ""), to]
            copy = [
                Action("checkpoint", f"{name} ({human(total)}) {giver.host} -> {job.host}", command=shlex.join(argv),
                       host=giver.host, needs=(f"ckpt@{giver.host}", f"keys@{giver.host}"),
                       deadline=deadline_for(total), fails_as="checkpoint",
                       say=f"copying {name} to {job.host} over the nodes' network"),
                Action("checkpoint", f"verify {name} on {job.host} against the store manifest (sha256)",
                       command=hash_command(job.paths.incoming, job.facts.host.python), stdin=paths_stdin(files),
                       deadline=hash_deadline(total), parse="hashes:sha256", expect=expected, fails_as="checkpoint",
                       produces=f"ckpt@{job.host}", hint="nothing was put in place; rerun `relaunch up`"),
            ]
        lanes += tag([*keys, *copy, dataclasses.replace(moves[k], needs=everyone)], job, lane=lane)
        cleanup += tag([Action("checkpoint", f"remove the copy key from {job.host}", always=True,
                               command=f"rm -f -- {q(key)} {q(known)}; "
                                       f"if [ -f {q(auth)} ]; then sed -i {q(MARKED_LINE)} {q(auth)}; fi",
                               fails_as="checkpoint")], job, lane="")
    return keypair, lanes, cleanup


def known_hosts_lines(jobs: Sequence[Job], known: dict[str, list[str]]) -> str:
    """The lines of relaunch's known_hosts for every node, as the nodes will see each other."""
    return "".join(line + "\n" for job in jobs for line in known.get(job.target.known_hosts_name, []))

