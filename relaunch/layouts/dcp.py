"""`dcp`: PyTorch Distributed Checkpoint folders (`step-500/` holding `__0_0.distcp` ... `.metadata`).

DCP renames `.metadata` into place only after every rank has written its shards, so a folder
holding `.metadata` directly is complete. Step = the last integer in the folder's name.
"""

from __future__ import annotations

from collections.abc import Sequence

from relaunch.layouts.base import (
    Checkpoint,
    Entry,
    files_under,
    group_by_top,
    is_dir_candidate,
    last_int,
    looks_temporary,
    ordered,
)

MARKER = ".metadata"


def has_metadata(name: str, files: Sequence[Entry]) -> bool:
    return any(e.path == f"{name}/{MARKER}" and e.size > 0 for e in files)


class DcpLayout:
    name = "dcp"

    def complete(self, entries: Sequence[Entry], pattern: str) -> list[Checkpoint]:
        top, below = group_by_top(entries)
        found = []
        for name in set(top) | set(below):
            if name.startswith(".") or looks_temporary(name) or not is_dir_candidate(name, top, below):
                continue
            step = last_int(name)
            files = files_under(below.get(name, ()), name)
            if step is None or not has_metadata(name, files):
                continue
            found.append(Checkpoint(name=name, step=step, files=files))
        return ordered(found)
