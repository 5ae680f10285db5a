# relaunch: pin the files of one checkpoint for the length of its copy off the instance.
# argv: PINS CKPT_DIR BESIDE; stdin: NUL-separated paths relative to CKPT_DIR.
# A pin is a hard link: a trainer's rotation that deletes the checkpoint meanwhile only drops its
# own name, and the copy (which reads PINS) still finds every byte. PINS becomes a folder of hard
# links when it is on CKPT_DIR's filesystem; else BESIDE (a folder of relaunch's next to
# CKPT_DIR, on its filesystem) holds them and PINS is a symlink to it. Nothing is pinned (and
# nothing is left) when links are impossible, or when the disk has less room free than the
# checkpoint takes: a deleted but pinned checkpoint keeps its blocks until the copy ends, and the
# trainer's next save must still fit. What an earlier copy left (relaunch killed) goes first.
# One JSON line: {"pinned": FOLDER, "files": N, "stale": N} or {"unpinned": WHY, "stale": N};
# exit 3 when a file is gone already (rotated away before its copy began).
import errno
import json
import os
import shutil
import stat
import sys

pins, ckpt, beside = sys.argv[1:4]
paths = [os.fsdecode(raw) for raw in sys.stdin.buffer.read().split(b"\0") if raw]
uid = os.geteuid()


class Gone(Exception):
    pass


class Refused(Exception):
    pass


def ours(path):
    """A real folder of this user's (never a symlink someone else planted, as in /tmp)."""
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid


def files_in(path):
    return sum(len(names) for _, _, names in os.walk(path))


def clear():
    """Remove every pin of this recipe; how many pinned files there were."""
    found = 0
    if os.path.islink(pins):
        os.unlink(pins)
    elif os.path.isdir(pins):
        found += files_in(pins)
        shutil.rmtree(pins)
    elif os.path.lexists(pins):
        os.unlink(pins)
    try:
        if ours(beside):
            found += files_in(beside)
            shutil.rmtree(beside)
    except FileNotFoundError:
        pass
    return found


def mib(n):
    return f"{n / 2**20:.1f} MiB"


def why_not(err, path):
    """A failed link, in words a user can act on."""
    src = os.path.join(ckpt, path)
    if err.errno == errno.EXDEV:
        return f"{path} is on another filesystem than relaunch's folder"
    if err.errno == errno.EPERM:
        try:
            owner = os.lstat(src).st_uid
            with open("/proc/sys/fs/protected_hardlinks") as f:
                protected = f.read().strip() == "1"
        except OSError:
            owner, protected = uid, False
        if owner != uid and protected:
            try:
                import pwd
                name = pwd.getpwuid(owner).pw_name
            except (ImportError, KeyError):
                name = f"uid {owner}"
            return (f"{path} belongs to {name}, and fs.protected_hardlinks lets only its owner "
                    "(or root) link it")
        return f"linking {path} is not permitted here (a filesystem without hard links?)"
    if err.errno == errno.EMLINK:
        return f"{path} has as many hard links as its filesystem allows"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no room on the disk even for the pin's folder"
    return f"linking {path} failed: {err.strerror or err}"


def pin():
    try:
        dev = os.stat(ckpt).st_dev
    except FileNotFoundError:
        raise Gone(ckpt) from None
    sizes = {}
    for p in paths:
        try:
            sizes[p] = os.lstat(os.path.join(ckpt, p)).st_size
        except FileNotFoundError:
            raise Gone(p) from None
    state = os.path.dirname(pins)
    try:
        os.makedirs(state, exist_ok=True)
        here = os.stat(state).st_dev == dev
    except OSError as err:
        raise Refused(f"relaunch's folder {state} cannot be made: {err.strerror}") from None
    folder = pins
    if not here:
        holder = os.path.dirname(os.path.abspath(beside))
        try:
            same = os.stat(holder).st_dev == dev
        except OSError:
            same = False
        if not same:
            raise Refused(f"checkpoint.dir is a filesystem of its own, and relaunch's folder {state} "
                          "is on another")
        folder = beside
    vfs = os.statvfs(ckpt)
    free, total = vfs.f_bavail * vfs.f_frsize, sum(sizes.values())
    if free < total:
        raise Refused(f"only {mib(free)} free on checkpoint.dir's disk, less than the checkpoint's "
                      f"{mib(total)}: while pinned, what the trainer deletes frees no room for its next save")
    try:
        os.mkdir(folder, 0o700)
    except OSError as err:
        raise Refused(f"{folder} cannot be made: {err.strerror}") from None
    dirs = set()
    try:
        for p in paths:
            parent = os.path.dirname(p)
            while parent and parent not in dirs:
                dirs.add(parent)
                parent = os.path.dirname(parent)
            os.makedirs(os.path.join(folder, os.path.dirname(p)), exist_ok=True)
            try:
                os.link(os.path.join(ckpt, p), os.path.join(folder, p), follow_symlinks=False)
            except FileNotFoundError:
                if not os.path.lexists(os.path.join(ckpt, p)):
                    raise Gone(p) from None
                raise
        # the folders as the trainer made them (the copy keeps their mode and time); always
        # writable by this user, so that the pins can be removed
        for d in sorted(dirs, key=len, reverse=True):
            st = os.stat(os.path.join(ckpt, d))
            os.chmod(os.path.join(folder, d), stat.S_IMODE(st.st_mode) | 0o700)
            os.utime(os.path.join(folder, d), ns=(st.st_atime_ns, st.st_mtime_ns))
        if folder != pins:
            os.symlink(folder, pins)
    except Gone:
        clear()
        raise
    except OSError as err:
        clear()
        raise Refused(why_not(err, p) if err.filename == os.path.join(ckpt, p) or
                      err.filename2 == os.path.join(folder, p) else
                      f"the pins cannot be made: {err.strerror}") from None
    return folder


out = {}
code = 0
try:
    out["stale"] = clear()
    out["pinned"], out["files"] = pin(), len(paths)
except Gone as gone:
    out["gone"], code = str(gone), 3
except Refused as refused:
    out["unpinned"] = str(refused)
except Exception as exc:   # a pin is a help, never a reason for a copy not to happen
    try:
        clear()
    except Exception:
        pass
    out["unpinned"] = f"pinning failed: {type(exc).__name__}: {exc}"
sys.stdout.write(json.dumps(out) + "\n")
sys.exit(code)
