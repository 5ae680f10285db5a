"""Which engine runs this job and what it tells this node: its rank, how many nodes, the master's
address, a key all nodes of this run share (and the next run does not), the restarts so far, and
the seconds the engine leaves between its stop signal and its SIGKILL.

Read from each engine's own environment variables (a dict in, a Placement out), the Slurm ones
completed by `scontrol` through a function given in (the first host of the allocation and the
address Slurm itself reaches it at, KillWait). RELAUNCH_NODE_RANK, RELAUNCH_NNODES,
RELAUNCH_MASTER_ADDR and RELAUNCH_RUN_KEY win over all of them (a Kubernetes indexed Job, an engine
relaunch does not know).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..errors import UsageError

# What each engine documents between its stop signal and the SIGKILL (docs/schedulers.md):
# Slurm's KillWait (read from scontrol; 30 s by default), Kubernetes' terminationGracePeriodSeconds
# (30 s by default; the pod does not see its own), dstack's 10 s after SIGINT (its issue #2233).
# SkyPilot's managed jobs lose the VM: the cloud's notice window is the grace (guard.sources).
GRACES = {"slurm": 30.0, "kubernetes": 30.0, "dstack": 10.0}

Scontrol = Callable[[list[str]], str]     # scontrol's arguments -> its output ("" when it failed)


@dataclass(frozen=True)
class Placement:
    engine: str            # slurm | kubernetes | skypilot | dstack | "" (none)
    node: str              # this node's name
    rank: int = 0
    nnodes: int = 1
    master: str = ""       # the address of node 0 (torchrun's rendezvous); "" on one node
    run_key: str = ""      # the same on every node of this run; the next run (a requeue) has another
    restarts: int = 0
    grace: float | None = None     # seconds from the engine's stop signal to its SIGKILL; None: unknown
    job: str = ""          # the engine's job, in words ("Slurm job 12")

    @property
    def label(self) -> str:
        return self.node if self.nnodes == 1 else f"{self.node} (node {self.rank} of {self.nnodes})"


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit():
        raise UsageError(f"the environment variable {name}={value!r} is not a whole number")
    return int(value)


def placement(env: Mapping[str, str], scontrol: Scontrol) -> Placement:
    """Where this node stands, from the engine's variables (and RELAUNCH_* overrides)."""
    found = _engine(env, scontrol)
    rank = _int(env, "RELAUNCH_NODE_RANK", found.rank)
    nnodes = _int(env, "RELAUNCH_NNODES", found.nnodes)
    master = env.get("RELAUNCH_MASTER_ADDR") or found.master
    key = env.get("RELAUNCH_RUN_KEY") or found.run_key
    if nnodes < 1 or not 0 <= rank < nnodes:
        raise UsageError(f"node rank {rank} of {nnodes} node(s): not a place in the group",
                         "check the engine's variables or RELAUNCH_NODE_RANK / RELAUNCH_NNODES")
    if nnodes > 1 and not master:
        raise UsageError(f"{nnodes} nodes but no address for node 0", "set RELAUNCH_MASTER_ADDR")
    if nnodes > 1 and not key:
        raise UsageError(f"{nnodes} nodes but nothing names this run on every node",
                         "set RELAUNCH_RUN_KEY to the same value on every node (and a new one for each run)")
    return Placement(found.engine, found.node, rank, nnodes, master if nnodes > 1 else "", key, found.restarts,
                     found.grace, found.job)


def _engine(env: Mapping[str, str], scontrol: Scontrol) -> Placement:
    host = env.get("HOSTNAME") or socket.gethostname()
    if env.get("SLURM_JOB_ID"):
        return _slurm(env, scontrol, host)
    if env.get("SKYPILOT_TASK_ID") or env.get("SKYPILOT_NODE_RANK"):
        ips = [ip for ip in env.get("SKYPILOT_NODE_IPS", "").split() if ip]
        nnodes = _int(env, "SKYPILOT_NUM_NODES", len(ips) or 1)
        return Placement("skypilot", host, _int(env, "SKYPILOT_NODE_RANK", 0), nnodes, ips[0] if ips else "",
                         env.get("SKYPILOT_TASK_ID", ""), 0, None, f"SkyPilot task {env.get('SKYPILOT_TASK_ID', '?')}")
    if env.get("DSTACK_RUN_NAME") or env.get("DSTACK_NODE_RANK"):
        run = env.get("DSTACK_RUN_NAME", "")
        return Placement("dstack", host, _int(env, "DSTACK_NODE_RANK", 0), _int(env, "DSTACK_NODES_NUM", 1),
                         env.get("DSTACK_MASTER_NODE_IP", ""), run, 0, GRACES["dstack"], f"dstack run {run or '?'}")
    if env.get("KUBERNETES_SERVICE_HOST"):
        return Placement("kubernetes", host, _int(env, "JOB_COMPLETION_INDEX", 0), 1, "", "", 0,
                         GRACES["kubernetes"], f"Kubernetes pod {host}")
    return Placement("", host)


def _slurm(env: Mapping[str, str], scontrol: Scontrol, host: str) -> Placement:
    job = env["SLURM_JOB_ID"]
    restarts = _int(env, "SLURM_RESTART_COUNT", 0)
    nnodes = _int(env, "SLURM_NNODES", _int(env, "SLURM_JOB_NUM_NODES", 1))
    master = ""
    if nnodes > 1:
        hosts = scontrol(["show", "hostnames", env.get("SLURM_JOB_NODELIST", "")]).split()
        if not hosts:
            raise UsageError(f"Slurm job {job}: `scontrol show hostnames {env.get('SLURM_JOB_NODELIST', '')}` "
                             "named no node", "set RELAUNCH_MASTER_ADDR to node 0's address")
        master = node_address(scontrol(["show", "node", "-o", hosts[0]])) or hosts[0]
    grace = kill_wait(scontrol(["show", "config"]))
    return Placement("slurm", env.get("SLURMD_NODENAME") or host, _int(env, "SLURM_NODEID", 0), nnodes, master,
                     f"slurm-{job}-{restarts}", restarts, GRACES["slurm"] if grace is None else grace,
                     f"Slurm job {job}" + (f" (restart {restarts})" if restarts else ""))


def node_address(text: str) -> str:
    """NodeAddr= of `scontrol show node -o NAME`: the address Slurm itself reaches the node at (a
    node's name need not resolve anywhere else)."""
    found = re.search(r"\bNodeAddr=(\S+)", text)
    return found.group(1) if found else ""


def kill_wait(text: str) -> float | None:
    """KillWait of `scontrol show config` (`KillWait                = 30 sec`), in seconds."""
    found = re.search(r"^KillWait\s*=\s*(\d+)", text, re.M)
    return float(found.group(1)) if found else None
