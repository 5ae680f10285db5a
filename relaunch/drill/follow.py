"""The drill's eyes on the training logs: one thread per instance follows `run.log` over SSH
(`tail -F`, from the end of what the log held when the follower started) and stamps every line
with the time it reached this machine. The drill measures from these lines, not from what it did
or when: a step is at the time its line was written (to within the link's latency), and a line
that never came (the instance went silent) was never seen here.

A follower is started before `up` runs where it looks (the drill's own `up`, or the watch's after
its `recover` event names the replacement), so the first step of a run is not missed: on the
drill's HOST it reads from the log's end (earlier runs are not the drill's), on a replacement from
its first byte. A dropped connection is opened again and the log read on from the byte where it
stopped. Lines that were written before they could be read (after a reconnection, or already in a
replacement's log when its follower got in) are marked `late`: their time is when they were read.
A host whose key the watch has not accepted yet is tried again until it has. `tail -F` reads a
line at once where the log exists when it starts (inotify), else polls every 0.1 s.
"""

from __future__ import annotations

import logging
import shlex
import threading
import time
from dataclasses import dataclass

from .. import processes
from ..cycle import make_target
from ..errors import Interrupted, RelaunchError
from ..host.connection import connect
from ..host.remote import Remote
from ..host.spec import HostSpec
from ..job import Node, paths_before_facts
from ..recipe import Recipe

log = logging.getLogger("relaunch.drill")

CONNECT_WAIT = 10.0        # ssh.wait for one attempt to open a follower's connection
AGAIN = 1.0                # seconds between attempts
FOLLOW_DEADLINE = 7 * 24 * 3600.0


@dataclass(frozen=True)
class Line:
    """One line of an instance's log, and when it reached this machine."""

    at: float              # epoch seconds
    host: str              # the HOST it was read on
    text: str
    late: bool = False     # read after a reconnection: written earlier than `at`


class Follower:
    def __init__(self, recipe: Recipe, spec: HostSpec, host_key: str | None = None, from_start: bool = False) -> None:
        ssh = recipe.ssh.model_copy(update={"wait": min(recipe.ssh.wait, CONNECT_WAIT), "host_key": host_key})
        self.recipe, self.spec = recipe.model_copy(update={"ssh": ssh}), spec
        self.host = str(spec)
        self.lines: list[Line] = []
        self.why = ""                                  # the last reason it could not read
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._offset: int | None = 0 if from_start else None   # bytes of the log read (None: from its end)
        self._partial = b""
        self._late_until = 0                           # lines ending at or before this byte: late
        self._thread = threading.Thread(target=self._run, name=f"follow {spec}", daemon=True)

    def start(self) -> Follower:
        self._thread.start()
        return self

    def stop(self, wait: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout=wait)

    def seen(self) -> list[Line]:
        with self._lock:
            return list(self.lines)

    def _stopped(self) -> bool:
        return self._stop.is_set() or processes.CANCEL.is_set()

    def _run(self) -> None:
        while not self._stopped():
            try:
                self._once()
            except Interrupted:
                return
            except Exception as exc:  # noqa: BLE001 - a follower that broke tries again; the drill goes on
                self.why = f"{type(exc).__name__}: {exc}"
                log.debug("follower of %s", self.host, exc_info=True)
            self._stop.wait(AGAIN)

    def _once(self) -> None:
        try:
            remote = connect(make_target(self.recipe, self.spec))
        except RelaunchError as exc:
            self.why = exc.message.splitlines()[0]       # not up yet, or its key not accepted yet (HostKeyError)
            return
        with remote:
            path = paths_before_facts(self.recipe, Node(remote.target), remote.home).log
            size = remote.exec(f"stat -c %s -- {shlex.quote(path)} 2>/dev/null || echo 0", deadline=30)
            if size.status != 0:
                return
            held = int(size.text.strip() or 0)
            if self._offset is None:
                self._offset = held
            # what was written before this connection could read it arrives now
            self._late_until = held
            self._follow(remote, path)

    def _follow(self, remote: Remote, path: str) -> None:
        assert self._offset is not None
        result = remote.exec(f"exec tail -s 0.1 -c +{self._offset + 1} -F -- {shlex.quote(path)} 2>/dev/null",
                             deadline=FOLLOW_DEADLINE, on_output=self._arrived, cancelled=self._stopped)
        self.why = result.output.strip().splitlines()[-1] if result.output.strip() else "the connection was lost"

    def _arrived(self, chunk: bytes) -> None:
        now = time.time()
        assert self._offset is not None
        data = self._partial + chunk
        end = self._offset - len(self._partial)        # the byte of the log where `data` begins
        self._offset += len(chunk)
        *complete, self._partial = data.split(b"\n")
        lines = []
        for raw in complete:
            end += len(raw) + 1
            lines.append(Line(now, self.host, raw.decode(errors="replace"), end <= self._late_until))
        with self._lock:
            self.lines.extend(lines)


class Followers:
    """Every instance the drill follows, by HOST; started once each."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.by_host: dict[str, Follower] = {}

    def follow(self, spec: HostSpec, host_key: str | None = None, from_start: bool = False) -> None:
        if str(spec) not in self.by_host:
            self.by_host[str(spec)] = Follower(self.recipe, spec, host_key, from_start).start()

    def lines(self) -> list[Line]:
        return [line for f in self.by_host.values() for line in f.seen()]

    def stop(self) -> None:
        for follower in self.by_host.values():
            follower._stop.set()
        for follower in self.by_host.values():
            follower.stop(wait=15.0)
