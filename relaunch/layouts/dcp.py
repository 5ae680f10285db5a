"""`dcp`: PyTorch Distributed Checkpoint folders (`step-500/` holding `__0_0.distcp` ... `.metadata`).

DCP renames `.metadata` into place only after every rank has written its shards, so a folder
holding `.metadata` directly is complete on one machine. Step = the last integer in the folder's
name. Across a node group (each node writes its own ranks' shards to its own disk) the metadata
also says which files the checkpoint needs: `required_files`.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from typing import Any

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

MARKER = ".metadata"


def has_metadata(name: str, files: Sequence[Entry]) -> bool:
    return any(e.path == f"{name}/{MARKER}" and e.size > 0 for e in files)


class DcpLayout:
    name = "dcp"

    def complete(self, entries: Sequence[Entry], pattern: str) -> list[Checkpoint]:
        top, below = group_by_top(entries)
        found = []
        for name in set(top) | set(below):
            if name.startswith(".") or looks_temporary(name) or not is_dir_candidate(name, top, below):
                continue
            step = last_int(name)
            files = files_under(below.get(name, ()), name)
            if step is None or not has_metadata(name, files):
                continue
            found.append(Checkpoint(name=name, step=step, files=files))
        return ordered(found)


class _Stub:
    """Any class the metadata names: keeps whatever state it is given, nothing else."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state: object) -> None:
        if isinstance(state, tuple) and len(state) == 2:      # (dict, slots) of a slotted class
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)

    def __call__(self, *args: object, **kwargs: object) -> _Stub:
        return _Stub(*args, **kwargs)


class _MetadataReader(pickle.Unpickler):
    """Reads DCP's pickled Metadata without torch: every class outside the standard library is a
    stub, so nothing in the file can run code here."""

    _SAFE = {("collections", "OrderedDict"), ("copyreg", "_reconstructor"), ("builtins", "object"),
             ("builtins", "tuple"), ("builtins", "list"), ("builtins", "dict"), ("builtins", "set")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._SAFE:
            return super().find_class(module, name)
        return type(name, (_Stub,), {})


def required_files(metadata: bytes) -> set[str]:
    """The data files a DCP checkpoint's `.metadata` says it needs (relative to its folder).

    ValueError when the bytes are not such a metadata file.
    """
    try:
        found = _MetadataReader(io.BytesIO(metadata)).load()
        storage = found.storage_data
        paths = {info.relative_path for info in storage.values()}
    except Exception as exc:  # any malformed pickle: the caller decides what that means
        raise ValueError(f"not a DCP .metadata file: {type(exc).__name__}: {exc}") from None
    if not all(isinstance(p, str) and p and "/" not in p and p not in (".", "..") for p in paths):
        raise ValueError("the .metadata names files outside its folder")
    return paths
