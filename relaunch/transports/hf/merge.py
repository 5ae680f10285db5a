"""How two writers' manifests of one hf store merge: what this writer changed since it read,
applied to the head; a name another writer recorded with other files is refused, never overwritten.
"""

from __future__ import annotations

import dataclasses

from ...errors import EvacuationError
from ...manifest import Branch, CheckpointRecord, StoreManifest


class HeadMoved(Exception):
    """Another writer committed after the head a commit was computed from (the Hub answered 412)."""


def merge_manifests(base: StoreManifest, ours: StoreManifest, theirs: StoreManifest, label: str) -> StoreManifest:
    """This writer's changes since `base` (what it read), as `ours` holds them, applied to `theirs`
    (the manifest at the head now). Records are keyed by checkpoint name: a record we added is
    added, or kept as theirs when they recorded the same files; a name they recorded with other
    files is an EvacuationError, never overwritten. A record we dropped is dropped only while
    theirs still holds it as we knew it. What we did not change is theirs to keep or drop.
    """
    merged = StoreManifest(recipe=theirs.recipe, checkpoints=dict(theirs.checkpoints),
                           branches=merge_branches(theirs.branches, ours.branches))
    for name in sorted(set(base.checkpoints) | set(ours.checkpoints)):
        was, mine, now = base.checkpoints.get(name), ours.checkpoints.get(name), theirs.checkpoints.get(name)
        if mine == was:
            continue
        if mine is None:
            if was is not None and now is not None and now.files == was.files:
                del merged.checkpoints[name]
        elif now is None:
            merged.checkpoints[name] = mine
        elif now.files != mine.files:
            raise conflict_error(label, now)
        elif mine.aside != now.aside:
            # set aside by either writer: aside (a branch is never undone by a merge)
            merged.checkpoints[name] = dataclasses.replace(now, aside=now.aside or mine.aside)
    return merged


def merge_branches(theirs: list[Branch], ours: list[Branch]) -> list[Branch]:
    """Both writers' branches, once each by id (theirs first); where the displaced bytes of each went,
    from both."""
    mine = {b.id: b for b in ours}
    merged = [dataclasses.replace(b, moved={**b.moved, **mine[b.id].moved}) if b.id in mine else b for b in theirs]
    known = {b.id for b in theirs}
    return merged + [b for b in ours if b.id not in known]


def conflict_error(label: str, theirs: CheckpointRecord) -> EvacuationError:
    return EvacuationError(
        f"{label}: {theirs.name} is already recorded in the store with different files (by another writer: "
        f"{theirs.host}, verified {theirs.verified_at}); refusing to overwrite that record",
        "the store never overwrites a checkpoint: are two runs writing the same checkpoint names to one store? "
        "give each its own checkpoint.remote (or SUBFOLDER), or move one copy aside after checking which is right",
        refused=True)
