# relaunch: hash files in one read each. Changes nothing.
# argv: the hashes wanted (sha256, md5, gitblob); stdin: NUL-separated paths relative to the
# current folder. One JSON line per path: its size and hashes, or why it cannot be trusted.
# `--follow MARKER` first: hash each file while rsync writes it, from its temp
# file as it grows, until the file MARKER exists (the copy is over). A followed file counts only
# if its final name now holds the very file that was read (same inode) at the size read; any
# other file (not seen being written, copied again, replaced) is read again in full.
import hashlib
import json
import os
import struct
import sys
import time

algos = sys.argv[1:]
if algos[:1] == ["--in"]:       # run here, on this machine: the folder the paths are relative to
    os.chdir(algos[1])
    algos = algos[2:]
marker = None
if algos[:1] == ["--follow"]:
    marker, algos = algos[1], algos[2:]
sync = algos[:1] == ["--sync"]   # also flush what landed to disk as it goes (a store's commit fsyncs)
algos = algos[1:] if sync else algos
SYNC_EVERY = 1 << 27
READ = [0, 0.0]   # bytes read so far, when that was last told (stderr: `relaunch-read BYTES`)


def told(n):
    READ[0] += n
    if time.monotonic() - READ[1] > 0.5:
        READ[1] = time.monotonic()
        sys.stderr.write(f"relaunch-read {READ[0]}\n")
        sys.stderr.flush()
BLOCK = 1 << 22


def problem(path, size, head, tail):
    # a torch.save zip ends with its central directory; a crash mid-save leaves none
    if head[:4] == b"PK\x03\x04" and b"PK\x05\x06" not in tail[-65558:]:
        return "truncated zip (no central directory): the save did not finish"
    if path.endswith(".safetensors"):
        if size < 8:
            return "safetensors file shorter than its header"
        (n,) = struct.unpack("<Q", head[:8])
        if 8 + n > size:
            return "safetensors header longer than the file"
        try:
            with open(path, "rb") as f:
                f.seek(8)
                meta = json.loads(f.read(n))
            end = max([v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"] or [0])
        except (ValueError, KeyError, TypeError, IndexError, OSError):
            return "safetensors header unreadable"
        if 8 + n + end != size:
            return f"safetensors size {size}, header says {8 + n + end}"
    return ""


def hashers(size):
    return {a: hashlib.sha1(b"blob %d\0" % size) if a == "gitblob" else hashlib.new(a) for a in algos}


def check(path, size, out):
    """Whether the save finished, from the file's first and last bytes."""
    with open(path, "rb") as f:
        head = f.read(16)
        f.seek(max(size - 65558, 0))
        tail = f.read()
    bad = problem(path, size, head, tail)
    if bad:
        out["problem"] = bad
    return out


def whole(path):
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            hs = hashers(size)
            if hs:
                for block in iter(lambda: f.read(BLOCK), b""):
                    for h in hs.values():
                        h.update(block)
                    told(len(block))
        return check(path, size, {"path": path, "size": size, **{a: h.hexdigest() for a, h in hs.items()}})
    except FileNotFoundError:
        return {"path": path, "missing": True}


def copy_temps(folder, names, since):
    """{name: the newest temp file rsync writes it to (`.NAME.XXXXXX`)}, only temps written since
    we started (not ones a killed copy left). rsync writes a temp from its start to its end;
    copies that write several parts at once (rclone's multi-thread downloads) are not followed."""
    found = {}
    try:
        entries = list(os.scandir(folder or "."))
    except FileNotFoundError:
        return found
    for e in entries:
        n = e.name
        name = n[1:-7] if n.startswith(".") and len(n) > 8 and n[-7] == "." else ""
        if name in names:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_mtime >= since - 1 and (name not in found or st.st_mtime > found[name][0]):
                found[name] = (st.st_mtime, os.path.join(folder, n))
    return {name: path for name, (_, path) in found.items()}


class Followed:
    def __init__(self, temp):
        self.f = open(temp, "rb")
        self.ino = os.fstat(self.f.fileno()).st_ino
        self.read = 0
        self.hs = hashers(0)

    def more(self, limit):
        block = self.f.read(limit)
        for h in self.hs.values():
            h.update(block)
        if sync and self.read // SYNC_EVERY != (self.read + len(block)) // SYNC_EVERY:
            os.fsync(self.f.fileno())
        self.read += len(block)
        told(len(block))
        return len(block)


def landed(p, state, st):
    """The line for a followed file, or None when what is at p is not all of what was read."""
    if state is None or state.ino != st.st_ino:
        return None
    while state.read < st.st_size and state.more(BLOCK):
        pass
    if state.read != st.st_size:
        return None
    return check(p, st.st_size, {"path": p, "size": st.st_size, "followed": True,
                                 **{a: h.hexdigest() for a, h in state.hs.items()}})


def emit(out):
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


def follow(paths):
    """Each file's line as soon as it is in place, read as it landed (the rest at the end)."""
    since = time.time()
    by_folder = {}
    for p in paths:
        folder, name = os.path.split(p)
        by_folder.setdefault(folder, {})[name] = p
    active, done, last_scan = {}, set(), 0.0
    while True:
        over = os.path.exists(marker)   # checked first: what was written before it counts below
        if time.monotonic() - last_scan > 0.2:
            last_scan = time.monotonic()
            for folder, names in by_folder.items():
                for name, temp in copy_temps(folder, names, since).items():
                    p = names[name]
                    try:
                        if p not in done and (p not in active or os.stat(temp).st_ino != active[p].ino):
                            if p in active:
                                active[p].f.close()
                            active[p] = Followed(temp)   # a copy started again: start again too
                    except OSError:
                        pass
        moved = sum(state.more(BLOCK) for state in active.values())
        for p, state in list(active.items()):
            try:
                st = os.stat(p)
            except OSError:
                continue
            if st.st_ino == state.ino and state.read == st.st_size:   # renamed into place, all read
                emit(landed(p, state, st))
                state.f.close()
                del active[p]
                done.add(p)
        if over:
            break
        if not moved:
            time.sleep(0.05)
    for p in paths:
        if p in done:
            continue
        state = active.pop(p, None)
        try:
            st = os.stat(p)
        except FileNotFoundError:
            out = {"path": p, "missing": True}
        else:
            out = landed(p, state, st) or whole(p)
        if state is not None:
            state.f.close()
        emit(out)


paths = [os.fsdecode(raw) for raw in sys.stdin.buffer.read().split(b"\0") if raw]
if marker is not None and "gitblob" not in algos:
    follow(paths)
else:
    for path in paths:
        sys.stdout.write(json.dumps(whole(path)) + "\n")
