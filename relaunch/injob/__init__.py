"""`relaunch run`: relaunch inside the job of a scheduler that rents, places and requeues (Slurm,
SkyPilot, dstack, Kubernetes), on the node itself, with no SSH. One job per module:

    engine      which engine, and this node's place in the group (its variables)
    node        this node as the "instance" the plans run on (bash here, rsync without SSH)
    restore     facts, the group's shape, the newest verified checkpoint and the env put in place
    training    run.command in the foreground: its environment, output, log, stop signal
    copying     each new checkpoint copied into the store as training saves it (sync rounds)
    group       several nodes: each copies its own part, node 0 verifies the whole (through the store)
    notices     a cloud's reclaim notice, from the guard's own sources
    records     the store's history of interruptions, and the run in progress (job.json)
    runner      the whole run, the engine's stop and the exit code the engine requeues on
"""

from .runner import EXIT_REQUEUE, Outcome, run

__all__ = ["EXIT_REQUEUE", "Outcome", "run"]
