"""`hf-trainer`: Hugging Face Trainer's `checkpoint-<step>/` folders.

The Trainer writes the files in place and `trainer_state.json` last, so its presence (non-empty)
marks a complete checkpoint. `tmp-checkpoint-<step>/` (where some transformers versions stage)
never counts, nor does a folder holding `checkpoint-is-incomplete.txt`: transformers' JIT
checkpoint (`enable_jit_checkpoint`, the save on SIGTERM) writes it before saving and removes it
once the save is done, and it saves into a folder of that name that may already hold an older
`trainer_state.json`. As an extra guard against a folder being deleted by checkpoint rotation while we
list it, sharded weights (`model-00001-of-00003.safetensors`) must all be present.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from relaunch.layouts.base import Checkpoint, Entry, files_under, group_by_top, is_dir_candidate, ordered

_NAME = re.compile(r"checkpoint-(\d+)")
_SHARD = re.compile(r"(.*)-(\d+)-of-(\d+)(\.[A-Za-z0-9]+)")
MARKER = "trainer_state.json"
INCOMPLETE = "checkpoint-is-incomplete.txt"     # transformers' JIT checkpoint, while it saves


def shards_complete(files: Sequence[Entry]) -> bool:
    """Every `X-0000k-of-0000n.ext` family holds all of 1..n."""
    families: dict[tuple[str, int, str], set[int]] = {}
    for e in files:
        m = _SHARD.fullmatch(e.path)
        if m:
            families.setdefault((m[1], int(m[3]), m[4]), set()).add(int(m[2]))
    return all(seen == set(range(1, total + 1)) for (_, total, _), seen in families.items())


class HfTrainerLayout:
    name = "hf-trainer"

    def complete(self, entries: Sequence[Entry], pattern: str) -> list[Checkpoint]:
        top, below = group_by_top(entries)
        found = []
        for name in set(top) | set(below):
            m = _NAME.fullmatch(name)
            if m is None or not is_dir_candidate(name, top, below):
                continue
            files = files_under(below.get(name, ()), name)
            marker = next((e for e in files if e.path == f"{name}/{MARKER}"), None)
            if marker is None or marker.size == 0 or not shards_complete(files):
                continue
            if any(e.path == f"{name}/{INCOMPLETE}" for e in files):
                continue
            found.append(Checkpoint(name=name, step=int(m[1]), files=files))
        return ordered(found)
