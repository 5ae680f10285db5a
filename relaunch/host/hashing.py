"""Hashes computed on the instance, where the bytes are: the command and the parser of its output.

One small Python script (templates/hashes.py) reads each file once and computes every hash a
store needs (sha256 always; md5 for S3-like remotes; the git blob id for small files on the
Hub), and says when a file cannot be trusted: a torch zip without its central directory or a
safetensors file whose header does not match its size (a save that crashed half-way). The files
are named on stdin, NUL-separated, relative to a folder, so any name stays data.

Where bytes land (the instance on `up`, this machine on `evacuate`), the same script follows
rsync as it writes (`--follow`): the receiver's hash is ready when the copy ends, not one full
read later.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError
from ..resources import templates_dir
from ..scripts import plain

ALGOS = ("sha256", "md5", "gitblob")
NICE = "nice -n 10 "      # a hash beside a copy has time: the copy's processes come first
HASH_DEADLINE_PER_GIB = 30.0     # seconds per GiB read on the instance (a slow disk reads 40 MB/s)


@dataclass(frozen=True)
class FileHash:
    path: str
    size: int = -1
    hashes: dict[str, str] = field(default_factory=dict, hash=False)
    problem: str = ""            # why the bytes cannot be trusted ("truncated zip ...")
    missing: bool = False        # gone (rotated away) when it was read


def hash_command(root: str, python: str, algos: tuple[str, ...] = ("sha256",), follow: str = "",
                 beside: bool = False) -> str:
    """Hash the NUL-separated paths on stdin, relative to `root`, with `python` on the instance;
    no algos: only check that each save finished (reads a file's first and last bytes).
    `follow`: hash them while a copy writes them, until the file `follow` exists (hashes.py).
    `beside`: it runs beside a copy, which it must not slow down: at a lower CPU priority."""
    return (f"cd {shlex.quote(root)} && {NICE if beside or follow else ''}{shlex.quote(python or 'python3')} -c "
            f"{shlex.quote(plain('hashes.py'))} {shlex.join(hash_args(algos, follow))}").rstrip()


def hash_args(algos: tuple[str, ...], follow: str = "") -> list[str]:
    for algo in algos:
        if algo not in ALGOS:
            raise ValueError(f"unknown hash {algo}")
    return [*(["--follow", follow] if follow else []), *algos]


def local_hash_argv(root: Path, algos: tuple[str, ...] = ("sha256",), follow: Path | None = None) -> tuple[str, ...]:
    """The same hasher run on this machine, in folder `root`, for files landing here: what it
    follows it also flushes to disk as it lands, so that a store's commit (fsync) finds it done."""
    args = hash_args(algos, str(follow) if follow else "")
    if follow:
        args.insert(2, "--sync")
    return (*(NICE.split() if follow else ()), sys.executable, str(templates_dir() / "hashes.py"), "--in", str(root),
            *args)


def paths_stdin(paths: list[str]) -> bytes:
    return b"".join(p.encode("utf-8", "surrogateescape") + b"\0" for p in paths)


def hash_deadline(total_bytes: int) -> float:
    return float(round(60.0 + HASH_DEADLINE_PER_GIB * total_bytes / 1024**3))


def parse_hashes(raw: bytes) -> dict[str, FileHash]:
    """The hasher's JSON lines, by path."""
    result: dict[str, FileHash] = {}
    for n, line in enumerate(raw.decode("utf-8", "surrogateescape").splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            path = doc["path"]
            if doc.get("missing"):
                result[path] = FileHash(path, missing=True)
                continue
            result[path] = FileHash(path, int(doc["size"]), {a: str(doc[a]) for a in ALGOS if a in doc},
                                    str(doc.get("problem", "")))
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"could not read the instance's hashes: line {n} {line[:80]!r}: {exc}",
                                  "the instance runs its python3 to hash files; is it a working Python?") from None
    return result


def sha256_of(hashes: dict[str, FileHash]) -> dict[str, str]:
    return {p: h.hashes.get("sha256", "") for p, h in hashes.items() if not h.missing}
