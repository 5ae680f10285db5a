"""Where the run keeps its checkpoints: the folders its command and source name, what each holds
(which layout, how new), and the one chosen.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..layouts import Entry, complete_checkpoints, detect_layout
from .candidates import Candidate
from .commandline import invocation, options
from .facts import MARK, Scan
from .program import ckpt_names_in_source, file_pattern
from .words import CKPT_OPTIONS, NOT_FOLDERS, absolute


@dataclass
class Place:
    """A folder that may be checkpoint.dir, why, and what its listing holds."""

    path: str
    why: str
    rank: int                        # lower is better evidence: 0 named by the command, 1 by its source, 2 the disk
    listing: list[Entry] | None = None
    layout: str = ""
    pattern: str = ""
    found: list[Any] = field(default_factory=list)   # complete checkpoints, oldest first


def examine(place: Place) -> Place:
    if not place.listing:
        return place
    layout = detect_layout(place.listing)
    names = [e.path for e in place.listing if "/" not in e.path and e.kind == "f"]
    pattern = file_pattern([n for n in names if re.search(r"\d", n) and not n.startswith(".")]) \
        if layout == "files" else "ckpt-*.pt"
    place.layout, place.pattern = layout, pattern
    place.found = complete_checkpoints(place.listing, layout, pattern)
    return place


def choose_place(places: list[Place], since: float) -> Place | None:
    """The best checkpoint.dir: one with complete checkpoints (named by the command, then its
    source, then written since the training started, then any), else one named without any."""
    holding = [p for p in places if p.found]
    if holding:
        def score(p: Place) -> tuple[int, int, float]:
            newest = max((e.mtime for e in p.found[-1].files), default=0.0)
            return (p.rank, 0 if newest >= since else 1, -newest)
        return min(holding, key=score)
    named = [p for p in places if p.rank < 2]
    return min(named, key=lambda p: p.rank) if named else None


def plan_places(scan: Scan, c: Candidate, detail_paths: dict[str, Any] | None, source_text: str,
                ctx_home: str) -> list[Place]:
    """The folders named as checkpoint folders: by the command's options, by its source and configs."""
    p = c.root
    home = p.home if p.uid != scan.uid and p.home else ctx_home
    cwd = p.cwd or home
    call = invocation(p.argv)
    places: list[Place] = []
    seen: set[str] = set()
    for option in options(call.args):
        if option.name in CKPT_OPTIONS and option.value and MARK not in option.value \
                and not option.value.lower().endswith(NOT_FOLDERS):
            path = absolute(option.value, cwd, home)
            info = (detail_paths or {}).get(path)
            if info is not None and info.kind == "f":
                continue
            if path not in seen:
                seen.add(path)
                places.append(Place(path, f"the command's {option.written} {option.value}", 0))
    for key, value, line in ckpt_names_in_source(source_text):
        path = absolute(value, cwd, home)
        if path not in seen and not value.startswith(("http", "s3:", "gs:")):
            seen.add(path)
            places.append(Place(path, f"{key} = {value!r} in the program's source or config (line {line})", 1))
    return places


def scanned_places(folders: list[Any], named: list[Place]) -> list[Place]:
    taken = {pl.path for pl in named}
    out = []
    for folder in folders:
        # Lightning without ModelCheckpoint(dirpath=...): a new version_N each run, so the folder to
        # watch is lightning_logs, whose version_N/checkpoints the lightning layout reads
        logs = re.fullmatch(r"(.*/lightning_logs)/version_\d+/checkpoints", folder.dir)
        path = logs.group(1) if logs else folder.dir
        if path in taken:
            continue
        taken.add(path)
        inside = next((pl for pl in named if path.startswith(pl.path.rstrip("/") + "/")), None)
        why = (f"inside {inside.path} ({inside.why})" if inside else "found on the disk")
        what = f"{folder.hits} checkpoint-like entries ({', '.join(folder.sample[:3])})"
        if logs:
            what += f" in {folder.dir[len(path) + 1:]}: Lightning's logger folder, a new version_N each run"
        out.append(Place(path, f"{why}: {what}", 1 if inside else 2))
    return out
