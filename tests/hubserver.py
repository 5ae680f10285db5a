"""A small fake Hugging Face Hub for tests: the real `hf` CLI and huggingface_hub talk to it.

Point a client at it with `HF_ENDPOINT=<server.url>` and `HF_TOKEN=<server.token>` (`server.env()`
gives the full set). It keeps repos in a folder on disk, so a server restarted on the same root
sees the same repos:

    root/blobs/<sha256>                       every file's bytes, content-addressed
    root/repos/<type>s/<ns>/<name>.json       {"private", "refs": {"main": sha}, "commits": [...]}

There is no git: a commit is {sha (40 hex), parent, message, date, files: {path: [size, sha256,
lfs, oid]}} where `oid` is the git blob id (of the content, or of the LFS pointer for LFS files),
as the real Hub reports it.

Routes (shapes checked against huggingface_hub 2.4.0's own code):
- `GET /api/whoami-v2`, `POST /api/validate-yaml`, `POST /api/repos/create`
- `GET /api/{type}s/{repo}[/revision/{rev}]`, `GET /api/{type}s/{repo}/tree/{rev}[/{path}]`
  (recursive, cursor pagination through a `Link` header), `POST .../paths-info/{rev}`
- `HEAD|GET /[{type}s/]{repo}/resolve/{rev}/{path}` with X-Repo-Commit, ETag, X-Linked-Etag,
  X-Linked-Size, Content-Length and `Range`
- uploads: `POST .../preupload/{rev}`, the LFS batch API `POST /[{type}s/]{repo}.git/info/lfs/
  objects/batch` whose upload actions point back here (`PUT /lfs-upload/{oid}`, signed like a
  presigned S3 URL, so it carries no token) plus `.../objects/verify`, and the NDJSON
  `POST .../commit/{rev}`. A commit whose header names a `parentCommit` that is not the branch's
  head is refused with 412 ("A commit has happened since"), as the Hub does, whatever the commit
  holds (additions, deletions or both): that is what lets several writers share a repo safely.

For tests of concurrent writers, `HubServer.before_commit(match, action)` runs `action` once, in
the request's thread, when a commit whose summary contains `match` arrives and before it is
checked and applied: another writer's commits can land exactly between a client's read of the
head and its commit. (Test instrumentation, not part of the Hub's API.)

Not spoken: the Xet protocol. huggingface_hub >= 1.x uploads every "lfs" file through Xet when
the `hf_xet` package is installed (it is a hard dependency), so an uploading client must run with
`HF_HUB_DISABLE_XET=1` to take the classic LFS path; `env()` sets it. The Xet token routes answer
501 with a message saying so. Multipart LFS uploads and pull requests are not served either.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import json
import os
import re
import secrets
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

DEFAULT_TOKEN = "hf_relaunchTestToken0123456789abcdefXYZ"
USER = "relaunch-tester"
REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
# What the Hub writes in a new repo's first commit (shortened: the rules that matter here).
GITATTRIBUTES = (
    b"*.bin filter=lfs diff=lfs merge=lfs -text\n"
    b"*.pt filter=lfs diff=lfs merge=lfs -text\n"
    b"*.pth filter=lfs diff=lfs merge=lfs -text\n"
    b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
)
NO_BIND = {"", "0.0.0.0", "::", "[::]"}  # never expose a test server beyond this machine


class HubError(Exception):
    """An HTTP error answered in the Hub's shape: JSON `{"error": msg}` plus X-Error-* headers."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None,
                 body: dict[str, Any] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}
        self.body = body or {}  # more fields beside "error" (the 409 of repos/create carries "url")


@dataclass(frozen=True)
class FileEntry:
    """One file of a commit. `oid` is the git blob id the Hub shows (of the pointer for LFS files)."""

    size: int
    sha256: str
    lfs: bool
    oid: str

    @property
    def pointer(self) -> bytes:
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n".encode()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.oid


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")


class HubStore:
    """Repos, commits and blobs on disk; every method is safe to call from several threads."""

    def __init__(self, root: Path, lfs_threshold: int = 1) -> None:
        self.root = Path(root)
        self.blobs = self.root / "blobs"
        self.repos = self.root / "repos"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.repos.mkdir(parents=True, exist_ok=True)
        self.lfs_threshold = lfs_threshold
        self._lock = threading.RLock()
        self._counter = 0

    # -- blobs ------------------------------------------------------------------------------
    def blob_path(self, sha256: str) -> Path:
        return self.blobs / sha256

    def has_blob(self, sha256: str, size: int | None = None) -> bool:
        p = self.blob_path(sha256)
        return p.is_file() and (size is None or p.stat().st_size == size)

    def put_bytes(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        if not self.has_blob(sha, len(data)):
            fd, tmp = tempfile.mkstemp(dir=self.blobs, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.blob_path(sha))
        return sha

    def put_stream(self, chunks: Iterator[bytes], expect_sha256: str, expect_size: int) -> None:
        """Store an uploaded object, refusing bytes that do not match the announced oid and size."""
        digest = hashlib.sha256()
        size = 0
        fd, tmp = tempfile.mkstemp(dir=self.blobs, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    digest.update(chunk)
                    size += len(chunk)
                    f.write(chunk)
            if size != expect_size or digest.hexdigest() != expect_sha256:
                raise HubError(400, f"uploaded object does not match: got {size} bytes sha256 {digest.hexdigest()}")
            os.replace(tmp, self.blob_path(expect_sha256))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    # -- repos ------------------------------------------------------------------------------
    def _file(self, repo_type: str, repo_id: str) -> Path:
        return self.repos / f"{repo_type}s" / f"{repo_id}.json"

    def _save(self, repo_type: str, repo_id: str, state: dict[str, Any]) -> None:
        path = self._file(repo_type, repo_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, path)

    def state(self, repo_type: str, repo_id: str) -> dict[str, Any]:
        path = self._file(repo_type, repo_id)
        if not REPO_ID.match(repo_id) or ".." in repo_id or not path.is_file():
            raise HubError(404, "Repository not found", code="RepoNotFound")
        with self._lock:
            state: dict[str, Any] = json.loads(path.read_text())
        return state

    def exists(self, repo_type: str, repo_id: str) -> bool:
        return REPO_ID.match(repo_id) is not None and self._file(repo_type, repo_id).is_file()

    def create_repo(self, repo_type: str, repo_id: str, private: bool = False) -> bool:
        """Create a repo with the Hub's first commit (a .gitattributes); False if it already exists."""
        if not REPO_ID.match(repo_id) or ".." in repo_id:
            raise HubError(400, f"Invalid repo name {repo_id!r}: expected namespace/name")
        with self._lock:
            if self.exists(repo_type, repo_id):
                return False
            state = {"type": repo_type, "id": repo_id, "private": private, "createdAt": _now(),
                     "refs": {}, "commits": []}  # fmt: skip
            self._save(repo_type, repo_id, state)
            first = {".gitattributes": self.entry_for(GITATTRIBUTES, lfs=False)}  # a regular file on the Hub
            self.commit(repo_type, repo_id, "main", "initial commit", first, [])
        return True

    def resolve(self, state: dict[str, Any], revision: str) -> dict[str, Any]:
        """The commit a branch name or a full commit sha points at."""
        sha = state["refs"].get(revision)
        if sha is None and COMMIT_SHA.match(revision):
            sha = revision
        for commit in state["commits"]:
            if commit["sha"] == sha:
                return commit  # type: ignore[no-any-return]
        raise HubError(404, f"Invalid rev id: {revision}", code="RevisionNotFound")

    @staticmethod
    def entries(commit: dict[str, Any]) -> dict[str, FileEntry]:
        return {path: FileEntry(*rec) for path, rec in commit["files"].items()}

    def entry_for(self, data: bytes, lfs: bool | None = None) -> FileEntry:
        sha = self.put_bytes(data)
        lfs = len(data) >= self.lfs_threshold if lfs is None else lfs
        pointer = FileEntry(len(data), sha, True, "").pointer
        return FileEntry(len(data), sha, lfs, git_blob_id(pointer if lfs else data))

    def commit(
        self,
        repo_type: str,
        repo_id: str,
        branch: str,
        message: str,
        adds: Mapping[str, bytes | FileEntry],
        deletes: list[str],
        parent: str | None = None,
    ) -> str:
        """Apply additions (bytes or already-stored entries) and deletions on top of `branch`."""
        for path in [*adds, *deletes]:
            parts = path.rstrip("/").split("/")
            if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
                raise HubError(400, f"Invalid path in repo: {path!r}")
        with self._lock:
            state = self.state(repo_type, repo_id)
            head = state["refs"].get(branch)
            if head is None and state["commits"]:
                raise HubError(404, f"Invalid rev id: {branch}", code="RevisionNotFound")
            if parent is not None and parent != head:
                raise HubError(412, f"A commit has happened since. Please refresh and try again. ({parent} != {head})")
            files: dict[str, list[Any]] = dict(self.resolve(state, branch)["files"]) if head else {}
            for path in deletes:
                if path.endswith("/"):
                    gone = [p for p in files if p.startswith(path)]
                else:
                    gone = [path] if path in files else []
                if not gone:
                    raise HubError(404, f"A file with this name doesn't exist: {path}", code="EntryNotFound")
                for p in gone:
                    del files[p]
            for path, content in adds.items():
                entry = content if isinstance(content, FileEntry) else self.entry_for(content)
                files[path] = [entry.size, entry.sha256, entry.lfs, entry.oid]
            self._counter += 1
            seed = json.dumps([head, message, files, self._counter, secrets.token_hex(8)], sort_keys=True)
            sha = hashlib.sha1(seed.encode()).hexdigest()
            state["commits"].append({"sha": sha, "parent": head, "message": message, "date": _now(), "files": files})
            state["refs"][branch] = sha
            self._save(repo_type, repo_id, state)
        return sha


def _tree_entry(path: str, entry: FileEntry | None, commit_sha: str) -> dict[str, Any]:
    if entry is None:
        oid = hashlib.sha1(f"tree {commit_sha} {path}".encode()).hexdigest()
        return {"type": "directory", "oid": oid, "size": 0, "path": path}
    out: dict[str, Any] = {"type": "file", "oid": entry.oid, "size": entry.size, "path": path}
    if entry.lfs:
        out["lfs"] = {"oid": entry.sha256, "size": entry.size, "pointerSize": len(entry.pointer)}
    return out


def _folders(paths: list[str]) -> set[str]:
    out = set()
    for p in paths:
        parts = p.split("/")
        out.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return out


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive: every answer carries a Content-Length

    # -- plumbing ---------------------------------------------------------------------------
    def log_message(self, format: str, *args: Any) -> None:  # quiet: requests are kept in server.log
        pass

    def _body_chunks(self) -> Iterator[bytes]:
        self._body_taken = True
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return
                yield self.rfile.read(size)
                self.rfile.readline()
        remaining = int(self.headers.get("Content-Length") or 0)
        while remaining > 0:
            chunk = self.rfile.read(min(remaining, 1 << 20))
            if not chunk:
                return
            remaining -= len(chunk)
            yield chunk

    def _body(self) -> bytes:
        return b"".join(self._body_chunks())

    def _json_body(self) -> Any:
        try:
            return json.loads(self._body() or b"{}")
        except ValueError as e:
            raise HubError(400, f"Invalid JSON body: {e}") from None

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_type: str = "application/json", length: int | None = None) -> None:  # fmt: skip
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.server.log.append((self.command, self.path.split("?")[0], status))

    def _send_json(self, obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def _auth(self, required: bool) -> bool:
        """True when a valid token came; a wrong token is always refused, as the Hub does."""
        value = self.headers.get("Authorization")
        if value is None:
            if required:
                raise HubError(401, "You must be authenticated to access this resource")
            return False
        if not hmac.compare_digest(value.encode(), f"Bearer {self.server.token}".encode()):
            raise HubError(401, "Invalid credentials in Authorization header")
        return True

    def _repo(self, repo_type: str, repo_id: str, write: bool = False) -> dict[str, Any]:
        authed = self._auth(required=write)
        state = self.server.store.state(repo_type, repo_id)
        if state["private"] and not authed:
            raise HubError(404, "Repository not found", code="RepoNotFound")
        return state

    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        segs = [unquote(s) for s in url.path.strip("/").split("/")]
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        m = self.command
        if m == "GET" and url.path == "/api/whoami-v2":
            return self._whoami()
        if m == "GET" and url.path == "/api/agent-harnesses":  # the client's best-effort agent detection
            return self._send_json({"standardEnvVars": [], "harnesses": {}})
        if m == "POST" and url.path == "/api/validate-yaml":
            self._body()
            return self._send_json({"errors": [], "warnings": []})
        if m == "POST" and url.path == "/api/repos/create":
            return self._create()
        if m == "PUT" and len(segs) == 2 and segs[0] == "lfs-upload":
            return self._lfs_put(segs[1], query)
        if len(segs) >= 4 and segs[0] == "api" and segs[1] in REPO_TYPES:
            repo_type, repo_id, rest = REPO_TYPES[segs[1]], f"{segs[2]}/{segs[3]}", segs[4:]
            action = rest[0] if rest else None
            if m == "GET" and action is None:
                return self._info(repo_type, repo_id, "main", query)
            if len(rest) >= 2:
                rev, tail = rest[1], "/".join(rest[2:])
                if m == "GET" and action == "revision":
                    return self._info(repo_type, repo_id, rev, query)
                if m == "GET" and action == "tree":
                    return self._tree(repo_type, repo_id, rev, tail, query)
                if m == "POST" and action == "paths-info":
                    return self._paths_info(repo_type, repo_id, rev)
                if m == "POST" and action == "preupload":
                    return self._preupload(repo_type, repo_id, rev)
                if m == "POST" and action == "commit":
                    return self._commit(repo_type, repo_id, rev, query)
            if action in ("xet-write-token", "xet-read-token"):
                raise HubError(501, "This test hub does not speak the Xet protocol: run the client with "
                                    "HF_HUB_DISABLE_XET=1 so it uploads through the LFS batch API")  # fmt: skip
        # repo-scoped non-API routes: [datasets/|spaces/]ns/name/resolve/... and ns/name.git/info/lfs/...
        repo_type = "model"
        if segs[0] in REPO_TYPES and segs[0] != "models" and len(segs) >= 3:
            repo_type, segs = REPO_TYPES[segs[0]], segs[1:]
        if m in ("GET", "HEAD") and len(segs) >= 5 and segs[2] == "resolve":
            return self._resolve(repo_type, f"{segs[0]}/{segs[1]}", segs[3], "/".join(segs[4:]))
        if m == "POST" and len(segs) == 6 and segs[1].endswith(".git") and segs[2:5] == ["info", "lfs", "objects"]:
            repo_id = f"{segs[0]}/{segs[1].removesuffix('.git')}"
            if segs[5] == "batch":
                return self._lfs_batch(repo_type, repo_id)
            if segs[5] == "verify":
                return self._lfs_verify(repo_type, repo_id)
        raise HubError(404, f"Sorry, we can't find the page you are looking for: {m} {url.path}")

    def _handle(self) -> None:
        self._body_taken = False
        try:
            self._dispatch()
        except HubError as e:
            # Read what the client is still sending before answering: closing a socket with unread
            # data resets it, and the client then sees "disconnected" instead of this error.
            if not getattr(self, "_body_taken", False):
                for _ in self._body_chunks():
                    pass
            # the request body may be unread: do not reuse this connection, and say so, or the
            # client puts it back in its pool and its next request meets a closed socket
            headers = {"X-Error-Message": e.message, **e.headers, "Connection": "close"}
            if e.code:
                headers["X-Error-Code"] = e.code
            self._send_json({"error": e.message, **e.body}, e.status, headers)
        except Exception as e:  # a bug here must show as a 500 with its text, not a dropped connection
            self._send_json({"error": f"test hub crashed: {type(e).__name__}: {e}"}, 500, {"Connection": "close"})

    do_GET = do_HEAD = do_POST = do_PUT = _handle

    # -- routes -----------------------------------------------------------------------------
    def _whoami(self) -> None:
        self._auth(required=True)
        self._send_json({"type": "user", "id": "0" * 24, "name": USER, "fullname": "relaunch tests",
                         "email": None, "emailVerified": False, "isPro": False, "orgs": [],
                         "auth": {"type": "access_token",
                                  "accessToken": {"displayName": "tests", "role": "write"}}})  # fmt: skip

    def _create(self) -> None:
        self._auth(required=True)
        body = self._json_body()
        name, org = body.get("name"), body.get("organization")
        repo_type = body.get("type") or "model"
        if repo_type not in URL_PREFIX or not isinstance(name, str):
            raise HubError(400, f"Invalid repo type or name: {body!r}")
        repo_id = f"{org or USER}/{name}"
        private = body.get("private") is True or body.get("visibility") == "private"
        url = f"{self.server.url}/{URL_PREFIX[repo_type]}{repo_id}"
        if not self.server.store.create_repo(repo_type, repo_id, private=private):
            # huggingface_hub reads "url" from this answer when it was called with exist_ok=True
            raise HubError(409, f"You already created this {repo_type} repo", body={"url": url})
        self._send_json({"url": url, "name": repo_id, "id": hashlib.sha1(repo_id.encode()).hexdigest()[:24]})

    def _info(self, repo_type: str, repo_id: str, rev: str, query: dict[str, str]) -> None:
        state = self._repo(repo_type, repo_id)
        commit = self.server.store.resolve(state, rev)
        with_blobs = query.get("blobs", "").lower() in ("1", "true")
        siblings = []
        for path, e in sorted(HubStore.entries(commit).items()):
            sib: dict[str, Any] = {"rfilename": path}
            if with_blobs:
                sib.update(size=e.size, blobId=e.oid)
                if e.lfs:
                    sib["lfs"] = {"sha256": e.sha256, "size": e.size, "pointerSize": len(e.pointer)}
            siblings.append(sib)
        info = {"_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24], "id": repo_id, "author": repo_id.split("/")[0],
                "sha": commit["sha"], "lastModified": commit["date"], "createdAt": state["createdAt"],
                "private": state["private"], "disabled": False, "gated": False, "downloads": 0, "likes": 0,
                "tags": [], "siblings": siblings,
                "usedStorage": sum(e.size for e in HubStore.entries(commit).values())}  # fmt: skip
        if repo_type == "model":
            info["modelId"] = repo_id
        self._send_json(info)

    def _listing(self, commit: dict[str, Any], prefix: str, recursive: bool) -> list[dict[str, Any]]:
        entries = HubStore.entries(commit)
        folders = _folders(list(entries))
        if prefix and prefix not in folders:
            raise HubError(404, f"{prefix} does not exist on \"{commit['sha']}\"", code="EntryNotFound",
                           headers={"X-Repo-Commit": commit["sha"]})  # fmt: skip
        base = f"{prefix}/" if prefix else ""
        items: list[dict[str, Any]] = []
        for path in sorted(folders | set(entries)):
            if not path.startswith(base) or (not recursive and "/" in path[len(base) :]):
                continue
            items.append(_tree_entry(path, entries.get(path), commit["sha"]))
        return items

    def _tree(self, repo_type: str, repo_id: str, rev: str, path: str, query: dict[str, str]) -> None:
        state = self._repo(repo_type, repo_id)
        commit = self.server.store.resolve(state, rev)
        recursive = query.get("recursive", "").lower() in ("1", "true")
        items = self._listing(commit, path.strip("/"), recursive)
        start = int(query.get("cursor") or 0)
        size = self.server.tree_page_size
        headers = {"X-Repo-Commit": commit["sha"]}
        if start + size < len(items):
            next_query = urlencode({**query, "cursor": start + size})
            next_url = f"{self.server.url}{urlsplit(self.path).path}?{next_query}"
            headers["Link"] = f'<{next_url}>; rel="next"'
        self._send_json(items[start : start + size], headers=headers)

    def _paths_info(self, repo_type: str, repo_id: str, rev: str) -> None:
        state = self._repo(repo_type, repo_id)
        commit = self.server.store.resolve(state, rev)
        raw = self._body()
        if self.headers.get("Content-Type", "").startswith("application/json"):
            paths = json.loads(raw or b"{}").get("paths", [])
        else:
            paths = parse_qs(raw.decode()).get("paths", [])
        entries = HubStore.entries(commit)
        folders = _folders(list(entries))
        found = [p for p in paths if p in entries or p in folders]
        self._send_json([_tree_entry(p, entries.get(p), commit["sha"]) for p in found])

    def _preupload(self, repo_type: str, repo_id: str, rev: str) -> None:
        state = self._repo(repo_type, repo_id, write=True)
        entries = HubStore.entries(self.server.store.resolve(state, rev)) if rev in state["refs"] else {}
        files = []
        for f in self._json_body().get("files", []):
            old = entries.get(f["path"])
            files.append({
                "path": f["path"],
                "uploadMode": "lfs" if f["size"] >= self.server.store.lfs_threshold else "regular",
                "shouldIgnore": False,
                # what the client compares with its local oid to skip unchanged files
                "oid": None if old is None else (old.sha256 if old.lfs else old.oid),
            })  # fmt: skip
        self._send_json({"files": files, "commitOid": state["refs"].get(rev)})

    def _commit(self, repo_type: str, repo_id: str, rev: str, query: dict[str, str]) -> None:
        self._repo(repo_type, repo_id, write=True)
        if query.get("create_pr"):
            raise HubError(400, "This test hub does not serve pull requests")
        store = self.server.store
        header: dict[str, Any] = {}
        adds: dict[str, bytes | FileEntry] = {}
        deletes: list[str] = []
        for line in self._body().splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item.get("key"), item.get("value", {})
            if key == "header":
                header = value
            elif key == "file":
                if value.get("encoding", "base64") != "base64":
                    raise HubError(400, f"Unsupported encoding {value.get('encoding')!r}")
                adds[value["path"]] = store.entry_for(base64.b64decode(value["content"]), lfs=False)
            elif key == "lfsFile":
                oid = value.get("oid", "")
                if value.get("algo", "sha256") != "sha256" or not SHA256.match(oid):
                    raise HubError(400, f"Invalid LFS oid for {value.get('path')!r}")
                if not store.has_blob(oid, value.get("size")):
                    raise HubError(400, f"LFS object {oid} for {value['path']!r} was never uploaded")
                size = store.blob_path(oid).stat().st_size
                pointer = FileEntry(size, oid, True, "").pointer
                adds[value["path"]] = FileEntry(size, oid, True, git_blob_id(pointer))
            elif key == "deletedFile":
                deletes.append(value["path"].rstrip("/"))
            elif key == "deletedFolder":
                deletes.append(value["path"].rstrip("/") + "/")
            else:
                raise HubError(400, f"Unknown commit operation {key!r}")
        message = header.get("summary") or "commit"
        hook = self.server.take_hook(message)
        if hook is not None:
            hook()
        sha = store.commit(repo_type, repo_id, rev, message, adds, deletes, parent=header.get("parentCommit"))
        if self.server.take_drop(message):
            # the commit is made, its answer never sent: the connection is cut as a network does
            self.server.log.append((self.command, self.path.split("?")[0], 0))     # 0: no answer
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self._send_json({"success": True, "commitOid": sha, "hookOutput": "", "pullRequestUrl": None,
                         "commitUrl": f"{self.server.url}/{URL_PREFIX[repo_type]}{repo_id}/commit/{sha}"})  # fmt: skip

    def _resolve(self, repo_type: str, repo_id: str, rev: str, path: str) -> None:
        state = self._repo(repo_type, repo_id)
        commit = self.server.store.resolve(state, rev)
        entry = HubStore.entries(commit).get(path)
        if entry is None:
            raise HubError(404, "Entry not found", code="EntryNotFound", headers={"X-Repo-Commit": commit["sha"]})
        headers = {"X-Repo-Commit": commit["sha"], "ETag": f'"{entry.etag}"', "Accept-Ranges": "bytes"}
        if entry.lfs:
            headers.update({"X-Linked-Etag": f'"{entry.sha256}"', "X-Linked-Size": str(entry.size)})
        start, end, status = 0, entry.size - 1, 200
        rng = self.headers.get("Range")
        if rng:
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
            if not m or (m[1] == "" and m[2] == ""):
                raise HubError(416, f"Unsupported Range {rng!r}")
            if m[1] == "":  # suffix range: the last N bytes
                start = max(0, entry.size - int(m[2]))
            else:
                start, end = int(m[1]), min(int(m[2]) if m[2] else end, end)
            if start >= entry.size or start > end:
                raise HubError(416, f"Range {rng!r} outside {entry.size} bytes",
                               headers={"Content-Range": f"bytes */{entry.size}"})  # fmt: skip
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{entry.size}"
        length = max(0, end - start + 1)
        self._send(status, b"", headers, content_type="application/octet-stream", length=length)
        if self.command == "GET" and length:
            with open(self.server.store.blob_path(entry.sha256), "rb") as f:
                f.seek(start)
                left = length
                while left:
                    chunk = f.read(min(left, 1 << 20))
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    left -= len(chunk)

    def _lfs_batch(self, repo_type: str, repo_id: str) -> None:
        self._repo(repo_type, repo_id, write=True)
        body = self._json_body()
        if body.get("operation") != "upload":
            raise HubError(400, "This test hub only serves LFS uploads (downloads go through /resolve)")
        verify = f"{self.server.url}/{URL_PREFIX[repo_type]}{repo_id}.git/info/lfs/objects/verify"
        objects = []
        for obj in body.get("objects", []):
            oid, size = obj.get("oid"), obj.get("size")
            if not isinstance(oid, str) or not SHA256.match(oid) or not isinstance(size, int) or size < 0:
                objects.append({"oid": str(oid), "size": size if isinstance(size, int) else 0,
                                "error": {"code": 422, "message": "Invalid oid or size"}})  # fmt: skip
            elif self.server.store.has_blob(oid, size):
                objects.append({"oid": oid, "size": size})  # no actions: already stored
            else:
                signed = urlencode({"size": size, "sig": self.server.sign(oid, size)})
                href = f"{self.server.url}/lfs-upload/{oid}?{signed}"
                objects.append({"oid": oid, "size": size, "authenticated": True,
                                "actions": {"upload": {"href": href, "header": {}},
                                            "verify": {"href": verify, "header": {}}}})  # fmt: skip
        self._send_json({"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
                        headers={"Content-Type": "application/vnd.git-lfs+json"})  # fmt: skip

    def _lfs_put(self, oid: str, query: dict[str, str]) -> None:
        size = int(query.get("size", "-1"))
        if not SHA256.match(oid) or not hmac.compare_digest(query.get("sig", ""), self.server.sign(oid, size)):
            raise HubError(403, "Invalid or missing upload signature")
        self.server.store.put_stream(self._body_chunks(), oid, size)
        self._send(200, b"", {"ETag": f'"{hashlib.md5(oid.encode()).hexdigest()}"'})

    def _lfs_verify(self, repo_type: str, repo_id: str) -> None:
        self._repo(repo_type, repo_id, write=True)
        body = self._json_body()
        if not self.server.store.has_blob(str(body.get("oid")), body.get("size")):
            raise HubError(404, f"LFS object {body.get('oid')} not found")
        self._send_json({"success": True})


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], store: HubStore, token: str, tree_page_size: int) -> None:
        super().__init__(addr, _Handler)
        self.store = store
        self.token = token
        self.tree_page_size = tree_page_size
        self.secret = secrets.token_bytes(32)
        self.log: list[tuple[str, str, int]] = []
        self.hooks: list[tuple[str, Callable[[], None]]] = []
        self.drops: list[str] = []
        self.hooks_lock = threading.Lock()
        host, port = self.server_address[:2]
        self.url = f"http://{host}:{port}"

    def take_hook(self, message: str) -> Callable[[], None] | None:
        """The first waiting hook whose match is in this commit summary, removed (it runs once)."""
        with self.hooks_lock:
            for i, (match, action) in enumerate(self.hooks):
                if match in message:
                    del self.hooks[i]
                    return action
        return None

    def take_drop(self, message: str) -> bool:
        """Whether this commit's answer is to be dropped (the first waiting match, removed)."""
        with self.hooks_lock:
            for i, match in enumerate(self.drops):
                if match in message:
                    del self.drops[i]
                    return True
        return False

    def sign(self, oid: str, size: int) -> str:
        return hmac.new(self.secret, f"{oid}:{size}".encode(), hashlib.sha256).hexdigest()


class HubServer:
    """A running fake Hub: `.url`, `.token`, `.env()`, helpers to seed and read repos, `.stop()`."""

    def __init__(self, server: _Server) -> None:
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="fake-hub", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return self._server.url

    @property
    def token(self) -> str:
        return self._server.token

    @property
    def store(self) -> HubStore:
        return self._server.store

    @property
    def log(self) -> list[tuple[str, str, int]]:
        """(method, path, status) of every request answered, in order."""
        return self._server.log

    def before_commit(self, match: str, action: Callable[[], None]) -> None:
        """Run `action` once, before the next commit whose summary contains `match` is checked
        against its parentCommit and applied (in that request's thread: `action` may itself talk
        to this hub, and its own commits do not trigger the hook again)."""
        with self._server.hooks_lock:
            self._server.hooks.append((match, action))

    def drop_reply(self, match: str) -> None:
        """The next commit whose summary contains `match` is made, and its answer is never sent: the
        connection is cut right after it (a reply lost on the way back)."""
        with self._server.hooks_lock:
            self._server.drops.append(match)

    def env(self, hf_home: Path | None = None, token: str | None = None) -> dict[str, str]:
        """Environment for a real `hf` / huggingface_hub pointed here (merge it into os.environ)."""
        env = {
            "HF_ENDPOINT": self.url,
            "HF_TOKEN": self.token if token is None else token,
            "HF_HUB_DISABLE_XET": "1",  # uploads through LFS batch: this hub speaks no Xet
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_UPDATE_CHECK": "1",  # no call to pypi.org from the CLI
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        }
        if hf_home is not None:
            env["HF_HOME"] = str(hf_home)
        return env

    def create_repo(self, repo_id: str, *, repo_type: str = "model", private: bool = False) -> bool:
        return self.store.create_repo(repo_type, repo_id, private=private)

    def seed(
        self,
        repo_id: str,
        files: Mapping[str, bytes | Path] | Path,
        *,
        repo_type: str = "model",
        private: bool = False,
        message: str = "seed",
        branch: str = "main",
    ) -> str:
        """Commit files straight into the store (creating the repo if needed); returns the commit sha.

        `files` maps paths in the repo to bytes or local files, or is a local folder taken whole.
        """
        if isinstance(files, Path):
            folder = files
            files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
        adds = {path: (src.read_bytes() if isinstance(src, Path) else src) for path, src in files.items()}
        self.store.create_repo(repo_type, repo_id, private=private)
        return self.store.commit(repo_type, repo_id, branch, message, adds, [])

    def listing(self, repo_id: str, revision: str = "main", *, repo_type: str = "model") -> dict[str, FileEntry]:
        """Path -> FileEntry (size, sha256, lfs, oid) of a revision, as stored."""
        return HubStore.entries(self.store.resolve(self.store.state(repo_type, repo_id), revision))

    def blob_path(self, repo_id: str, path: str, revision: str = "main", *, repo_type: str = "model") -> Path:
        return self.store.blob_path(self.listing(repo_id, revision, repo_type=repo_type)[path].sha256)

    def read_files(self, repo_id: str, revision: str = "main", *, repo_type: str = "model") -> dict[str, bytes]:
        """Every file of a revision with its bytes, read back from storage."""
        return {p: self.store.blob_path(e.sha256).read_bytes()
                for p, e in self.listing(repo_id, revision, repo_type=repo_type).items()}  # fmt: skip

    def commits(self, repo_id: str, *, repo_type: str = "model") -> list[dict[str, Any]]:
        return list(self.store.state(repo_type, repo_id)["commits"])

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


def start_hub(
    root: Path,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str = DEFAULT_TOKEN,
    *,
    lfs_threshold: int = 1,
    tree_page_size: int = 1000,
) -> HubServer:
    """Serve a fake Hub from `root` on host:port (0 = any free port) in a background thread.

    Files of at least `lfs_threshold` bytes are announced as LFS at preupload (so `hf upload`
    goes through the LFS batch API); a huge threshold makes every file a regular, inline one,
    which also works for clients that keep Xet enabled. `tree_page_size` forces pagination.
    """
    if host in NO_BIND:
        raise ValueError(f"refusing to bind the test hub to {host!r}: use 127.0.0.1 or a sandbox's host address")
    store = HubStore(Path(root), lfs_threshold=lfs_threshold)
    return HubServer(_Server((host, port), store, token, tree_page_size))


def main() -> None:
    """`python tests/hubserver.py --root DIR [--host H] [--port P] [--token T]`: serve until Ctrl-C."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--token", default=DEFAULT_TOKEN)
    args = ap.parse_args()
    hub = start_hub(args.root, args.host, args.port, args.token)
    print(f"HF_ENDPOINT={hub.url} HF_TOKEN={quote(hub.token)}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        hub.stop()


if __name__ == "__main__":
    main()
