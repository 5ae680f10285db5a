"""The Hugging Face Hub as the hf store talks to it: every call bounded by the running action's
deadline, the store's files at one commit, the token, the ids the Hub gives a file.
"""

from __future__ import annotations

import hashlib
import os
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import processes
from ...errors import shorten
from ...ui import redact
from ..base import store_wait
from ..folder import StoreFolder

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def hub_token() -> str | None:
    """This machine's Hub token: HF_TOKEN, else the one `hf auth login` stored (as the `hf` CLI does)."""
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"]
    try:
        from huggingface_hub import get_token
    except ImportError:
        return None
    return get_token() or None


def git_blob_id(path: Path) -> str:
    """The id git (and the Hub, for a regular file) gives a file's content."""
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_of(path: Path) -> str:
    return StoreFolder.hash_file(path)


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in ANSI.sub("", redact(text)).splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith("Hint: set HF_DEBUG")]
    return shorten(lines[-1]) if lines else "no output"


@dataclass
class RemoteFile:
    size: int
    blob_id: str
    sha256: str | None          # LFS files only


# huggingface_hub's client waits forever by default (timeout=None): a request that gets no byte
# for this long fails, so that a call relaunch stopped waiting for (Bounded) ends too
STALL_SECONDS = 300.0


class Bounded:
    """HfApi whose every call ends at the running action's deadline (else store_wait()) and
    with its lane, with a TimeoutError naming the endpoint: a Hub that accepted the connection
    and never answers must not hang relaunch. A listing comes back whole (the paging happens
    within the deadline)."""

    def __init__(self, api: Any, endpoint: str) -> None:
        self._api, self._endpoint = api, endpoint
        from huggingface_hub import get_session

        session = get_session()
        if session.timeout.read is None:
            session.timeout = type(session.timeout)(STALL_SECONDS)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._api, name)
        if not callable(method):
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            def whole() -> Any:
                result = method(*args, **kwargs)
                return list(result) if isinstance(result, types.GeneratorType) else result
            return processes.bounded(whole, store_wait(), f"the Hub at {self._endpoint} ({name})")
        return call


@dataclass
class Snapshot:
    """The store's files at one commit, paths relative to the store (the subfolder)."""

    sha: str
    files: dict[str, RemoteFile]
