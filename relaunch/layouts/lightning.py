"""`lightning`: PyTorch Lightning's `epoch=3-step=1200.ckpt` files, or `*.ckpt/` folders.

A `*.ckpt` file has no marker: it counts when non-empty and not a temporary name (as for
`files`). A `*.ckpt/` folder (sharded strategies) counts when it holds a DCP `.metadata`;
DeepSpeed-style `*.ckpt/` folders are not recognised. The step is `step=N` in the name, else the
last integer before a `-vN` collision suffix; names without one (`last.ckpt`, often a symlink)
are skipped, since they cannot be ordered. `checkpoint.pattern` is not used.

Where `ModelCheckpoint` has no `dirpath`, Lightning saves under its `default_root_dir` in
`lightning_logs/version_N/checkpoints/` (`checkpoints/` without a logger), and a resumed run
starts a new `version_N+1`: with checkpoint.dir at `default_root_dir` (or at `lightning_logs`),
the `*.ckpt` files of every `version_N/checkpoints/` count too, named with their folders and
ordered by step across versions, so that the resumed run's checkpoints are found where it
writes them.
"""

from __future__ import annotations

import re
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
from relaunch.layouts.dcp import has_metadata

_STEP = re.compile(r"step=(\d+)")
# Lightning's own folders below default_root_dir (or below lightning_logs/) when ModelCheckpoint has no dirpath
LOGGER_DIRS = re.compile(r"(?:(?:lightning_logs/)?version_\d+/)?checkpoints/(?P<name>[^/]+\.ckpt)")
_VERSION = re.compile(r"-v\d+$")


def lightning_step(name: str) -> int | None:
    stem = name[: -len(".ckpt")]
    steps = _STEP.findall(stem)
    if steps:
        return int(steps[-1])
    return last_int(_VERSION.sub("", stem))


class LightningLayout:
    name = "lightning"

    def complete(self, entries: Sequence[Entry], pattern: str) -> list[Checkpoint]:
        top, below = group_by_top(entries)
        found = []
        for name in set(top) | set(below):
            if not name.endswith(".ckpt") or name.startswith(".") or looks_temporary(name):
                continue
            step = lightning_step(name)
            if step is None:
                continue
            entry = top.get(name)
            if entry is not None and entry.kind == "f":
                if entry.size > 0:
                    found.append(Checkpoint(name=name, step=step, files=(entry,)))
            elif is_dir_candidate(name, top, below):
                files = files_under(below.get(name, ()), name)
                if has_metadata(name, files):
                    found.append(Checkpoint(name=name, step=step, files=files))
        for entry in entries:
            m = LOGGER_DIRS.fullmatch(entry.path)
            name = m.group("name") if m else ""
            if not m or entry.kind != "f" or entry.size <= 0 or name.startswith(".") or looks_temporary(name):
                continue
            step = lightning_step(name)
            if step is not None:
                found.append(Checkpoint(name=entry.path, step=step, files=(entry,)))
        return ordered(found)
