"""`deepspeed`: DeepSpeed's `global_step<N>/` folders beside a `latest` file naming the tag.

There is no marker that proves the NEWEST save whole: rank 0 writes `latest` after its own
shards but before the closing barrier, while other ranks may still be writing theirs (and a
listing cannot read what `latest` says anyway). What is certain: `save_checkpoint` ends with a
barrier, so once a newer `global_step<M>/` exists, every rank finished `global_step<N>` for all
N < M. We therefore count a tag complete only when a newer tag exists: conservative, and it
means the copy off the machine runs one save behind. Not covered: DeepSpeed's asynchronous
checkpoint engines (writes continue after the barrier), and a stale half-written tag left by a
crashed run that a later run (with a different save interval) overtook.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from relaunch.layouts.base import Checkpoint, Entry, files_under, group_by_top, is_dir_candidate, ordered

_NAME = re.compile(r"global_step(\d+)")


class DeepSpeedLayout:
    name = "deepspeed"

    def complete(self, entries: Sequence[Entry], pattern: str) -> list[Checkpoint]:
        top, below = group_by_top(entries)
        tags: dict[str, int] = {}
        for name in set(top) | set(below):
            m = _NAME.fullmatch(name)
            if m and is_dir_candidate(name, top, below):
                tags[name] = int(m[1])
        if not tags:
            return []
        newest = max(tags.values())
        found = []
        for name, step in tags.items():
            files = files_under(below.get(name, ()), name)
            if step < newest and files:
                found.append(Checkpoint(name=name, step=step, files=files))
        return ordered(found)
