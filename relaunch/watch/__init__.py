"""`relaunch watch`: everything `sync` does, plus a look at every node's guard every few
seconds, and recovery when an instance is reclaimed or lost; for one instance or a node group.

- looks.py   one thread per node: read-only looks over a kept SSH connection
- rounds.py  the copy-off rounds, as `relaunch sync --once` children: never in the looks' way
- recover.py recover.command (rent, and what its answer allows) and recover.alive
- holder.py  one watch per recipe and store (a lock here, a lease in the store); what status shows
- loop.py    the decisions: notice, rebalance, lost, back, ended; recovery, shrink and grow back
"""

from .loop import Watch, WatchEnd, watch

__all__ = ["Watch", "WatchEnd", "watch"]
