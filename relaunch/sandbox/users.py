"""The login users of sandbox instances: root, and `ubuntu` as on cloud images.

The `ubuntu` user is this machine's (an instance shares its /etc): made on the first instance that
needs it, unless one exists (a locked one is unlocked), with passwordless sudo from
/etc/sudoers.d/relaunch-sandbox. What had to change is recorded first, in the journal (a reboot
keeps it), and undone with the last instance on this machine (`restore_ubuntu`), or by
`relaunch sandbox clean` after a reboot.
"""

from __future__ import annotations

import contextlib
import os
import pwd
from pathlib import Path
from typing import Any

from . import journal, network
from .network import require_tools, run

HOMES = {"root": "/root", "ubuntu": "/home/ubuntu"}
SUDOERS = Path("/etc/sudoers.d/relaunch-sandbox")  # the sandbox's own name: removed with the last instance
SUDOERS_TMP = SUDOERS.with_name(".relaunch-sandbox.tmp")  # sudo ignores names containing "."


def ensure_ubuntu() -> tuple[int, int]:
    """The `ubuntu` user as on cloud images: exists, not locked, passwordless sudo."""
    with network.machine_lock():
        ensure_user("ubuntu", HOMES["ubuntu"])
        rule = "ubuntu ALL=(ALL) NOPASSWD:ALL\n"
        journal.add("files", str(SUDOERS))      # the sandbox's own name: its own, whoever wrote it
        if not SUDOERS.exists() or SUDOERS.read_text() != rule:
            SUDOERS_TMP.write_text(rule)
            SUDOERS_TMP.chmod(0o440)
            os.replace(SUDOERS_TMP, SUDOERS)
        entry = pwd.getpwnam("ubuntu")
        return entry.pw_uid, entry.pw_gid


def ensure_user(user: str, home: str) -> None:
    """`user` exists, is not locked, and its home (the mount point of its disk) exists. What has to
    change for that is recorded in the journal before it is done, for restore_user. Call under
    machine_lock()."""
    with journal.changing() as data:
        changes: dict[str, Any] = {"created": False, "password": None, "home": False, **data["users"].get(user, {})}
        exists = has_user(user)
        # With `UsePAM no`, sshd refuses even key logins for a "locked" account (shadow password
        # starting with "!", which is what useradd leaves). "*" means: no password, not locked.
        password = shadow_password(user) if exists else "!"
        changes["created"] = changes["created"] or not exists
        if password.startswith("!") and not changes["created"] and changes["password"] is None:
            changes["password"] = password
        changes["home"] = changes["home"] or not Path(home).exists()
        data["users"][user] = {**changes, "home_path": home}
    if not exists:
        require_tools(["useradd"])
        run(["useradd", "-M", "-d", home, "-s", "/bin/bash", user])
    if password.startswith("!"):
        run(["usermod", "-p", "*", user])
    Path(home).mkdir(parents=True, exist_ok=True)


def restore_user(user: str, home: str | None = None) -> str:
    """Undo what ensure_user changed: delete the user if it made it, else lock it again as it was;
    remove the home folder if it made it (`home`, else the recorded one). Returns what it did, in
    words ("" when nothing was recorded). Call under machine_lock(), with no instance left."""
    changes = journal.read()["users"].get(user)
    if changes is None:
        return ""
    done = f"the user {user}: nothing to undo"
    if changes.get("created"):
        if has_user(user):
            run(["userdel", user])
            done = f"deleted the user {user} (the sandbox made it)"
    elif changes.get("password") is not None and shadow_password(user) == "*":
        # through stdin: a hash on a command line would be visible in `ps`
        run(["chpasswd", "-e"], input=f"{user}:{changes['password']}\n")
        done = f"locked the user {user} again, as it was"
    home = home or changes.get("home_path") or HOMES.get(user)
    if changes.get("home") and home:
        with contextlib.suppress(OSError):
            Path(home).rmdir()  # only if empty: nothing of anyone else's goes
    journal.forget("users", user)
    return done


def restore_ubuntu() -> list[str]:
    """With the last instance on this machine gone: the sudoers file goes, the `ubuntu` user as it
    was before the first instance. Returns what it did, in words. Call under machine_lock()."""
    done = []
    for path in (SUDOERS, SUDOERS_TMP):
        if path.exists():
            path.unlink()
            done.append(f"removed {path}")
    journal.forget("files", str(SUDOERS))
    user = restore_user("ubuntu", HOMES["ubuntu"])
    return done + ([user] if user else [])


def has_user(user: str) -> bool:
    try:
        pwd.getpwnam(user)
    except KeyError:
        return False
    return True


def shadow_password(user: str) -> str:
    for line in Path("/etc/shadow").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == user and len(fields) > 1:
            return fields[1]
    return ""
