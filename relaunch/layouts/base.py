"""What every layout shares: the listing entries, the Checkpoint they produce, small helpers.

A layout never touches a host. It reads a listing of `checkpoint.dir` (see `listing.py`) and says
which checkpoints in it are complete, so it can be tested with fixtures alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from relaunch.errors import UsageError


@dataclass(frozen=True)
class Entry:
    """One line of the remote `find` listing."""

    path: str  # posix path relative to checkpoint.dir ("checkpoint-500/model.pt")
    kind: str  # "f" file, "d" directory, "l" symlink, other find %y letters
    size: int
    mtime: float

    @property
    def top(self) -> str:
        """The top-level name under checkpoint.dir this entry belongs to."""
        return self.path.split("/", 1)[0]


@dataclass(frozen=True)
class Checkpoint:
    name: str  # name under checkpoint.dir: "ckpt-00000500.pt", "checkpoint-500", "step-500"
    step: int
    files: tuple[Entry, ...]  # regular files only, paths relative to checkpoint.dir, sorted


class Layout(Protocol):
    name: str

    def complete(self, entries: Sequence[Entry], pattern: str) -> list[Checkpoint]:
        """The complete checkpoints in a listing, oldest first (by step)."""
        ...


_DIGITS = re.compile(r"\d+")

# Suffixes writers use for files still being written (`NAME.tmp` then os.replace, rsync/curl/wget
# partials, our own `.partial`). Matched case-insensitively on the whole name.
_TEMP_SUFFIXES = (".tmp", ".temp", ".partial", ".part", ".incomplete", "~")


def last_int(text: str) -> int | None:
    """The last run of digits in `text` as an int (leading zeros ignored), or None."""
    found = _DIGITS.findall(text)
    return int(found[-1]) if found else None


def looks_temporary(name: str) -> bool:
    """A name that marks something still being written: never a complete checkpoint.

    `NAME.tmp` (the careful torch.save pattern), `.partial`/`.part` downloads,
    `tmp-checkpoint-500` (some transformers versions stage there), `tmpab12cd.pt` (tempfile),
    `ckpt.tmp.pt`; hidden names (rsync's `.name.XXXXXX` temp files) are handled by callers.
    """
    low = name.lower()
    return low.startswith("tmp") or low.endswith(_TEMP_SUFFIXES) or ".tmp." in low or ".partial." in low


def ordered(checkpoints: Iterable[Checkpoint]) -> list[Checkpoint]:
    """Oldest first by step number (never lexically, never by mtime); the name breaks ties."""
    return sorted(checkpoints, key=lambda c: (c.step, c.name))


def group_by_top(entries: Iterable[Entry]) -> tuple[dict[str, Entry], dict[str, list[Entry]]]:
    """Split a listing into its top-level entries and, per top-level name, everything below it."""
    top: dict[str, Entry] = {}
    below: dict[str, list[Entry]] = {}
    for e in entries:
        if "/" in e.path:
            below.setdefault(e.top, []).append(e)
        else:
            top[e.path] = e
    return top, below


def regular_files(entries: Iterable[Entry]) -> tuple[Entry, ...]:
    return tuple(sorted((e for e in entries if e.kind == "f"), key=lambda e: e.path))


def files_under(entries: Iterable[Entry], prefix: str) -> tuple[Entry, ...]:
    """Regular files anywhere below the directory `prefix` (a path relative to checkpoint.dir)."""
    start = prefix + "/"
    return regular_files(e for e in entries if e.path.startswith(start))


def is_dir_candidate(name: str, top: dict[str, Entry], below: dict[str, list[Entry]]) -> bool:
    """`name` is a directory in the listing: listed as one, or only seen through its children.

    A top-level entry of another kind (a symlink `checkpoint-last -> checkpoint-500`, a file)
    is not: find does not descend symlinks, and following one would copy a checkpoint twice.
    """
    entry = top.get(name)
    if entry is not None:
        return entry.kind == "d"
    return name in below


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A shell glob as a regex with one group per wildcard, so a step can be read from what the
    wildcards matched (`*.h5` on `model-500.h5` is 500, not the 5 of `.h5`).

    Posix semantics on purpose (the instance is Linux): case-sensitive, `[!...]` negates.
    """
    if not pattern:
        raise UsageError("checkpoint.pattern is empty", hint='for example "ckpt-*.pt"')
    if "/" in pattern:
        raise UsageError(
            f"checkpoint.pattern {pattern!r} contains '/'",
            hint="the pattern matches names directly inside checkpoint.dir; point checkpoint.dir "
            "at the folder that holds the files instead",
        )
    out: list[str] = []
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "*":
            out.append("(.*)")
        elif ch == "?":
            out.append("(.)")
        elif ch == "[":
            j = i + 1
            if j < len(pattern) and pattern[j] in "!^":
                j += 1
            if j < len(pattern) and pattern[j] == "]":
                j += 1  # a leading ']' is a literal member of the class
            j = pattern.find("]", j)
            if j == -1:
                out.append(re.escape(ch))  # unclosed: a literal '[' as in the shell
            else:
                body = pattern[i + 1 : j]
                if body[:1] in ("!", "^"):
                    body = "^" + body[1:]
                body = body.replace("\\", "\\\\")
                out.append(f"([{body}])")
                i = j
        else:
            out.append(re.escape(ch))
        i += 1
    return re.compile("".join(out), re.DOTALL)


def step_from_glob(regex: re.Pattern[str], name: str) -> int | None:
    """The step in `name` per `glob_regex`: the last run of digits that a wildcard (partly)
    matched, taken whole (`ckpt-???.pt` on `ckpt-500.pt` is 500; `*.h5` on `model-500.h5` is 500).

    None if the name does not match or no number falls under a wildcard (`ckpt-last.pt`).
    """
    m = regex.fullmatch(name)
    if m is None:
        return None
    spans = [m.span(g) for g in range(1, regex.groups + 1)]
    step = None
    for run in _DIGITS.finditer(name):
        if any(start < run.end() and run.start() < end for start, end in spans):
            step = int(run.group())
    return step
