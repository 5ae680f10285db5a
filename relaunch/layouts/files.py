"""`files`: one file per checkpoint directly in checkpoint.dir (`ckpt-00000500.pt`, `model-500.h5`).

Plain torch.save has no completion marker; the careful pattern writes `NAME.tmp` and then
os.replace()s it, so a name that matches the pattern and is not a temporary name is whole.
A zero-byte file is a save that has only just begun (or failed): never complete.
"""

from __future__ import annotations

from collections.abc import Sequence

from relaunch.layouts.base import (
    Checkpoint,
    Entry,
    glob_regex,
    looks_temporary,
    ordered,
    step_from_glob,
)


class FilesLayout:
    name = "files"

    def complete(self, entries: Sequence[Entry], pattern: str) -> list[Checkpoint]:
        regex = glob_regex(pattern)
        found = []
        for e in entries:
            if "/" in e.path or e.kind != "f" or e.size == 0 or looks_temporary(e.path):
                continue  # symlinks (`last.pt -> ckpt-500.pt`) would only duplicate a checkpoint
            if e.path.startswith(".") and not pattern.startswith("."):
                continue  # shell glob rule; also skips rsync's `.ckpt-500.pt.XXXXXX` temp files
            step = step_from_glob(regex, e.path)
            if step is None:
                continue  # `last.pt`, `ckpt-final.pt`: no step to order by
            found.append(Checkpoint(name=e.path, step=step, files=(e,)))
        return ordered(found)
