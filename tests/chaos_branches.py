"""What tests/test_chaos.py knows of checkpoints and of the run's branches, read from the world.

A checkpoint is named by its identity (step, line): the bytes chaos_trainer.py (a file) and
chaos_ckpt_trainer.py (a DCP folder, read back by DCP itself) wrote for that step on that line.
Anything else (damaged, cut short, a node's part without the others) has no identity.

The branches are the trainer's own records (`~/branches.log`: a line, the line and step it left;
`~/line`: the line of the latest start), and a rollback the test asked for once relaunch acted on
it (the instance's lineage file or the store's manifest say so, or the trainer resumed it): the
current branch is the current line's saves and, up the lines it came from, those up to each fork.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from chaos_ckpt_trainer import FIXED
from chaos_trainer import content, identity

Ident = tuple[int, int]          # (step, line)
FILE = re.compile(r"ckpt-\d+\.pt")
FOLDER = re.compile(r"step-\d+")


def dcp_identity(folder: Path) -> Ident | None:
    """A DCP checkpoint folder holding every file its `.metadata` names, whose state DCP reads back
    as exactly what the trainer saved for one step of one line."""
    from relaunch.layouts.dcp import required_files

    try:
        needed = required_files((folder / ".metadata").read_bytes())
        if not needed or not needed <= {p.name for p in folder.iterdir()}:
            return None
    except Exception:            # not there, or not DCP's metadata (a byte flipped in it)
        return None
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    state = {"model": {"payload": torch.zeros(FIXED, dtype=torch.uint8), "tag": torch.zeros(2, dtype=torch.int64)}}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    except (Exception, CheckpointException):     # missing, cut short: no identity (what a resume would meet)
        return None
    step, line = (int(v) for v in state["model"]["tag"].tolist())
    data = state["model"]["payload"].numpy().tobytes()
    want = content(step, line)
    return (step, line) if data[:len(want)] == want and not any(data[len(want):]) else None


def identities(folder: Path) -> dict[str, Ident]:
    """name -> identity of every checkpoint directly in `folder` that is whole and as written."""
    found: dict[str, Ident] = {}
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return found
    for entry in entries:
        try:
            if FILE.fullmatch(entry.name) and entry.is_file():
                ident = identity(Path(entry.path).read_bytes())
            elif FOLDER.fullmatch(entry.name) and entry.is_dir():
                ident = dcp_identity(Path(entry.path))
            else:
                continue
        except OSError:                  # renamed or removed while read: not there
            continue
        if ident is not None:
            found[entry.name] = ident
    return found


def merged(folders: list[Path], into: Path) -> Path:
    """The checkpoint folders of a node group's disks as one (each node holds its ranks' part), as
    `up` counts a group's checkpoints; `into` is emptied first."""
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    for folder in folders:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if FILE.fullmatch(entry.name) and entry.is_file():
                    shutil.copy(entry.path, into / entry.name)
                elif FOLDER.fullmatch(entry.name) and entry.is_dir():
                    shutil.copytree(entry.path, into / entry.name, dirs_exist_ok=True)
            except OSError:
                continue
    return into


@dataclass
class Fork:
    line: int            # the new branch's line
    name: str            # the checkpoint it resumed
    at: Ident            # that checkpoint's identity
    ids: set[str]        # the branch ids relaunch gave it (lineage file, manifest), when it wrote one
    before: int | None = None   # the line of the latest start when it was asked (no start since: still that)


@dataclass
class Branches:
    parents: dict[int, tuple[int | None, int]] = field(default_factory=dict)   # line -> (parent, fork step)
    current: int | None = None
    forks: list[Fork] = field(default_factory=list)      # the rollbacks the test asked for that took effect

    def on(self, ident: Ident) -> bool:
        """Is this checkpoint the current branch's? (Everything is, before the first start.)"""
        if self.current is None:
            return True
        step, line = ident
        at, limit = self.current, None
        seen = set()
        while at is not None and at not in seen:
            seen.add(at)
            if line == at and (limit is None or step <= limit):
                return True
            parent, fork = self.parents.get(at, (None, 0))
            limit = fork if limit is None else min(limit, fork)
            at = parent
        return False

    def lines(self) -> set[int]:
        return {*self.parents, *(p for p, _ in self.parents.values() if p is not None)}

    def learn(self, log: str, line: str) -> None:
        """The trainer's records: every line it took, and the line of its latest start."""
        for row in log.splitlines():
            words = row.split()
            if len(words) == 3 and words[0].isdigit():
                self.parents[int(words[0])] = (None if words[1] == "-" else int(words[1]), int(words[2]))
        if line.strip().isdigit():
            started = int(line)
            if self.forks and started == self.forks[-1].before:
                return          # no start since the rollback (its `up` failed before training began)
            pending = self.forks[-1].line if self.forks else None
            # a rollback relaunch acted on is current from then on: a start that went elsewhere is
            # a resume of the abandoned branch, which the check of that start reports
            if pending is None or started == pending or started not in (self.parents.get(pending, (None, 0))[0],):
                self.current = started

    def fork(self, line: int, name: str, at: Ident, ids: set[str], before: int | None = None) -> None:
        self.parents[line] = (at[1], at[0])
        self.current = line
        self.forks.append(Fork(line, name, at, ids, before))

    def forget(self, fork: Fork) -> None:
        """A rollback only the lost instance knew of: the line it left is current again."""
        self.forks.remove(fork)
        self.current = fork.at[1]
