"""`accelerate`: Accelerate's `save_state` folders, `checkpoints/checkpoint_<N>/`.

With automatic checkpoint naming Accelerate writes `checkpoints/checkpoint_<N>` under the
project dir (N counts saves, not steps; it only orders them). The files are written in place
with no marker, every process adding its own `random_states_<i>.pkl`. Conservatively, a
checkpoint counts once a newer one exists in the same folder: the main process starts the next
save only after training went on, which needs every process past the previous save. So the copy
off the machine runs one save behind, except for a folder holding `relaunch-complete.json`
(`relaunch.train.save_accelerate_state` writes it once every process finished that save): it
counts at once, so the save a reclaim notice asked for is copied off before the instance goes.
The checkpoint's name is its path under checkpoint.dir (`checkpoints/checkpoint_3`);
`checkpoint_<N>/` directly in checkpoint.dir works too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from relaunch.layouts.base import Checkpoint, Entry, files_under, ordered
from relaunch.train import COMPLETE_MARKER

_DIR = re.compile(r"(?:(checkpoints)/)?checkpoint_(\d+)")


class AccelerateLayout:
    name = "accelerate"

    def complete(self, entries: Sequence[Entry], pattern: str) -> list[Checkpoint]:
        entries = list(entries)
        kinds = {e.path: e.kind for e in entries}
        dirs: dict[str, int] = {}
        for e in entries:
            parts = e.path.split("/")
            for depth in (1, 2):
                candidate = "/".join(parts[:depth])
                m = _DIR.fullmatch(candidate)
                # a folder listed as one, or seen only through its children; never a symlink
                if m and kinds.get(candidate, "d") == "d" and (len(parts) > depth or e.kind == "d"):
                    dirs[candidate] = int(m[2])
        newest: dict[str, int] = {}
        for name, n in dirs.items():
            parent = name.rpartition("/")[0]
            newest[parent] = max(newest.get(parent, n), n)
        found = []
        for name, n in dirs.items():
            files = files_under(entries, name)
            marked = any(e.path == f"{name}/{COMPLETE_MARKER}" and e.size > 0 for e in files)
            if (marked or n < newest[name.rpartition("/")[0]]) and files:
                found.append(Checkpoint(name=name, step=n, files=files))
        return ordered(found)
