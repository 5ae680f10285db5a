"""The parser of the listing command the layouts read: `find -printf` on checkpoint.dir.

It uses NUL separators because checkpoint names may hold spaces and even newlines, and it
decodes names as UTF-8 with surrogateescape, so a name that is not valid UTF-8 still round-trips
through `os.fsencode` to the exact bytes on the instance.
"""

from __future__ import annotations

from relaunch.errors import CheckpointError
from relaunch.layouts.base import Entry
from relaunch.train import ASIDE_DIR

# relaunch runs this on the instance with {dir} shell-quoted. -mindepth 1 leaves out the folder
# itself; %P is the path relative to it; %T@ is the mtime in seconds (kept, but never used to
# order checkpoints); find does not follow symlinks by default, so a symlink is one entry "l".
# An abandoned branch's checkpoints (relaunch.train.set_aside) are not listed: no layout counts them.
LISTING_COMMAND = f"find {{dir}} -mindepth 1 -name {ASIDE_DIR} -prune -o -printf '%y %s %T@ %P\\0'"


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _show(record: bytes) -> str:
    text = _decode(record)
    return repr(text if len(text) <= 80 else text[:77] + "...")


def parse_listing(raw: bytes) -> list[Entry]:
    """Parse `LISTING_COMMAND` output: NUL-terminated `KIND SIZE MTIME PATH` records.

    The path is everything after the third space, so spaces and newlines in it survive.
    """
    entries: list[Entry] = []
    records = raw.split(b"\0")
    if records and records[-1] == b"":
        records.pop()  # the terminator of the last record
    for n, record in enumerate(records, 1):
        parts = record.split(b" ", 3)
        problem = None
        if len(parts) != 4 or not parts[3]:
            problem = "expected 'KIND SIZE MTIME PATH'"
        else:
            kind_b, size_b, mtime_b, path_b = parts
            try:
                kind = kind_b.decode("ascii")
                size = int(size_b)
                mtime = float(mtime_b)
            except ValueError:
                problem = "bad kind, size or mtime"
            else:
                if len(kind) != 1 or size < 0 or path_b.startswith(b"/"):
                    problem = "bad kind, size or path"
        if problem:
            raise CheckpointError(
                f"could not read the checkpoint listing: record {n} {_show(record)}: {problem}",
                hint="the listing comes from GNU find's -printf; is findutils installed on the instance?",
            )
        entries.append(Entry(path=_decode(path_b), kind=kind, size=size, mtime=mtime))
    return entries
