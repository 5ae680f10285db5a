"""What the user sees: one line per step on stderr, a bar per transfer, nothing secret.

Results for scripts go to stdout (`--json`); progress always goes to stderr.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
import urllib.parse
from collections.abc import Iterable

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

log = logging.getLogger("relaunch")


# Where a URL carries a credential (a package index, a Python mirror, a presigned object link):
# its userinfo (`https://user:token@host/`), a path segment shaped like a token (Cloudsmith's
# `https://dl.cloudsmith.io/<token>/org/repo/python/simple/`, Gemfury's `https://pypi.fury.io/<token>/me/`),
# or a query parameter (`?token=`, `X-Amz-Signature=`, an Azure SAS's `sig=`).
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
_URL_PARTS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#\s]*@)?(?P<host>[^/?#\s@]*)"
                        r"(?P<path>[^?#\s]*)(?P<rest>.*)", re.DOTALL)
_SECRET_PARAM = re.compile(r".*(token|secret|passw(or)?d|signature|credential|auth|authorization)|"
                           r"sig|key|apikey|api[-_]key|access[-_]?key|private[-_]?key|.*_key|pass|pwd|code",
                           re.IGNORECASE)
# a presigned link's other parameters (X-Amz-Date, X-Amz-Expires ...): hidden in the URL too, but not
# hunted for elsewhere in the text (an expiry of 3600 is no secret, and "3600" is everywhere)
_SIGNING_PARAM = re.compile(r"x-amz-.*|x-goog-.*", re.IGNORECASE)
_PARAM = re.compile(r"([?&;#])([^=&;#\s]+)=([^&;#\s]*)")
_AUTH_HEADER = re.compile(r"\b((?:proxy-)?authorization\s*[:=]\s*)(?:(?:basic|bearer|token|digest)\s+)?[^\s'\"]+",
                          re.IGNORECASE)


def _token_like(segment: str) -> bool:
    """A path segment that reads as a token: 16 or more letters, digits, `_` and `-`, whose letters
    and digits change case or kind often (a random string does, a word or a version does not:
    `3b7bf1e5a3c2a8f7` is one, `manylinux2014_x86_64` and `python-build-standalone` are not)."""
    if len(segment) < 16 or not re.fullmatch(r"[A-Za-z0-9_-]+", segment):
        return False

    def kind(c: str) -> str:
        return "d" if c.isdigit() else "u" if c.isupper() else "l"

    changes = sum(1 for a, b in zip(segment, segment[1:], strict=False)
                  if a.isalnum() and b.isalnum() and kind(a) != kind(b))
    return changes >= len(segment) / 4


def url_credentials(url: str) -> list[str]:
    """The credentials a URL carries, each as written in it (empty: none): the password of its
    userinfo (the user when it stands alone, `https://TOKEN@host`), every token-like path segment,
    the value of every query (or fragment) parameter named like a credential."""
    m = _URL_PARTS.fullmatch(url.strip())
    if m is None:
        return []
    found = []
    if m["userinfo"]:
        user, colon, password = m["userinfo"][:-1].partition(":")
        found.append(password if colon else user)
    found += [seg for seg in m["path"].split("/") if _token_like(seg)]
    found += [value for _, name, value in _PARAM.findall(m["rest"])
              if value and _SECRET_PARAM.fullmatch(urllib.parse.unquote(name))]
    return [f for f in found if f]


def has_credentials(url: str) -> bool:
    return bool(url_credentials(url))


def redact_url(url: str) -> str:
    """The URL with each credential (url_credentials) as `***`: `https://***@host/simple`,
    `https://host/***/simple`, `https://host/f?X-Amz-Signature=***`."""
    m = _URL_PARTS.fullmatch(url)
    if m is None:
        return url
    path = "/".join("***" if _token_like(seg) else seg for seg in m["path"].split("/"))

    def param(p: re.Match[str]) -> str:
        name = urllib.parse.unquote(p[2])
        secret = p[3] and (_SECRET_PARAM.fullmatch(name) or _SIGNING_PARAM.fullmatch(name))
        return f"{p[1]}{p[2]}=***" if secret else p[0]

    return (m["scheme"] + ("***@" if m["userinfo"] else "") + m["host"] + path + _PARAM.sub(param, m["rest"]))


class Redactor:
    """Replaces every known secret value, and every credential of every URL (userinfo, token-like
    path segment, credential query parameter: redact_url) and of an `Authorization:` header, with
    `***` in anything shown or logged."""

    def __init__(self) -> None:
        self.values: set[str] = set()

    def add(self, values: Iterable[str]) -> None:
        self.values.update(v for v in values if v and len(v) >= 4)

    def add_urls(self, urls: Iterable[str]) -> None:
        """The credentials in these URLs, wherever they appear without their URL (a tool's own
        message, a URL it shows otherwise encoded)."""
        for url in urls:
            for secret in url_credentials(url):
                self.add([secret, urllib.parse.unquote(secret)])

    def __call__(self, text: str) -> str:
        for value in sorted(self.values, key=len, reverse=True):
            text = text.replace(value, "***")
        text = _URL.sub(lambda m: redact_url(m[0]), text)
        return _AUTH_HEADER.sub(r"\1***", text)


redact = Redactor()


class _RedactingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class UI:
    def __init__(self, verbose: bool = False, quiet: bool = False) -> None:
        self.console = Console(stderr=True, highlight=False, soft_wrap=True)
        self.verbose = verbose
        self.quiet = quiet
        self._lock = threading.RLock()
        self._progress: Progress | None = None     # the bars shown now (one display for all)
        self._live = 0

    def _print(self, text: str, style: str | None = None, always: bool = False) -> None:
        text = redact(text)
        log.info(text)
        if always or not self.quiet:
            with self._lock:
                self.console.print(escape(text), style=style)

    def step(self, host: str, step: str, text: str) -> None:
        self._print(f"[{host}] {step}: {text}")

    def say(self, text: str) -> None:
        self._print(text)

    def ok(self, text: str) -> None:
        self._print(text, "bold green")

    def warn(self, text: str) -> None:
        # shown also where the steps' own lines are not (a sync round's one line): a warning is
        # something the user must see, such as a store that lost a checkpoint
        self._print(f"warning: {text}", "yellow", always=True)

    def detail(self, text: str) -> None:
        log.debug(redact(text))
        if self.verbose and not self.quiet:
            with self._lock:
                self.console.print(escape(redact(text)), style="dim")

    def transfer(self, description: str, total: int, kind: str = "rsync") -> Transfer | contextlib.nullcontext[None]:
        """A bar for a long phase fed by its program's own progress output (kind: rsync, rclone,
        hashes), or (kind `time`) for a program that says nothing on its way (an install, a
        Hub upload on the instance): it moves and shows the time so far; no bar (None) when
        kind is empty. Bars of phases that run at the same time share one display."""
        if not kind:
            return contextlib.nullcontext()
        return Transfer(self, description, None if kind == "time" else total)

    @property
    def plain_progress(self) -> bool:
        """No terminal (nohup, CI, a pipe): no bars; a long phase says where it is in a plain line
        every PLAIN_EVERY seconds instead, so that a log is never silent for minutes."""
        return not self.quiet and not self.console.is_terminal

    def _bars(self) -> Progress:
        with self._lock:
            if self._progress is None:
                self._progress = Progress(
                    TextColumn("{task.description}"), BarColumn(), _Amount(binary_units=True), _Speed(), _Time(),
                    console=self.console, transient=True,
                    disable=self.quiet or not self.console.is_terminal)
            if self._live == 0:
                self._progress.start()
            self._live += 1
            return self._progress

    def _bar_done(self) -> None:
        with self._lock:
            self._live -= 1
            if self._live == 0 and self._progress is not None:
                self._progress.stop()
                self._progress = None


def human(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{n} B"


_PROGRESS2 = re.compile(rb"^\s*([\d,]+)\s+(\d+)%")


_READ = re.compile(rb"^relaunch-read (\d+)$")


PLAIN_EVERY = 10.0


class Transfer:
    """A bar fed by a program's progress: rsync's `--info=progress2` lines, rclone's JSON stats
    (`--use-json-log --stats 1s`), or the hasher's `relaunch-read BYTES` lines. Without a
    terminal, a plain line every PLAIN_EVERY seconds instead."""

    def __init__(self, ui: UI, description: str, total: int | None) -> None:
        self.ui = ui
        self.plain = description
        self.description = escape(description)
        self.total = None if total is None else max(total, 1)
        self.completed = 0
        self._done = threading.Event()

    def __enter__(self) -> Transfer:
        self.progress = self.ui._bars()
        self.task = self.progress.add_task(self.description, total=self.total)
        self.started = time.monotonic()
        if self.ui.plain_progress:
            threading.Thread(target=self._tick, name="plain-progress", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self.progress.remove_task(self.task)
        self.ui._bar_done()

    def _tick(self) -> None:
        while not self._done.wait(PLAIN_EVERY):
            self.ui.say(self.line())

    def line(self) -> str:
        """Where this phase is, in words: for a log without a terminal."""
        seconds = time.monotonic() - self.started
        if self.total is None:
            return f"{self.plain}: still running ({seconds:.0f}s)"
        rate = self.completed / seconds if seconds > 0 else 0.0
        return (f"{self.plain}: {human(self.completed)} of {human(self.total)} "
                f"({100 * self.completed / self.total:.0f}%), {human(int(rate))}/s, {seconds:.0f}s")

    def update(self, completed: int) -> None:
        self.completed = completed
        self.progress.update(self.task, completed=completed)

    def feed(self, chunk: bytes) -> None:
        for part in re.split(rb"[\r\n]", chunk):
            match = _PROGRESS2.match(part) or _READ.match(part)
            if match:
                self.update(int(match.group(1).replace(b",", b"")))
            elif part.startswith(b"{"):
                self.feed_err(part)

    def feed_err(self, chunk: bytes) -> None:
        """rclone's `--use-json-log --stats 1s` lines carry the bytes so far."""
        for line in chunk.splitlines():
            if _READ.match(line):
                self.feed(line)
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and isinstance(entry.get("stats"), dict):
                self.update(int(entry["stats"].get("bytes", 0)))


class _Amount(DownloadColumn):
    def render(self, task: Task) -> Text:
        return Text("") if task.total is None else super().render(task)


class _Speed(TransferSpeedColumn):
    def render(self, task: Task) -> Text:
        return Text("") if task.total is None else super().render(task)


class _Time(TimeRemainingColumn):
    """The time left of a bar that knows its total, the time so far of one that does not."""

    def render(self, task: Task) -> Text:
        return TimeElapsedColumn().render(task) if task.total is None else super().render(task)


def setup_logging(path: str) -> None:
    """Full detail (tracebacks included) to the debug log only, secrets redacted, mode 0600."""
    import os

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.close(fd)
    os.chmod(path, 0o600)
    handler = logging.FileHandler(path)
    handler.setFormatter(_RedactingFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG)
