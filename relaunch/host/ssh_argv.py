"""The argv of the `ssh` that a subprocess runs (rsync's `-e`): the same host-key file, strict
checking, identity and jump host as the connection, and no ssh config of its own, so that both
contact the same address and port with the same key.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from .spec import Target

# The key files paramiko (the connection) offers when no key is set, looked up under $HOME; OpenSSH
# looks under the password database's home instead. Named explicitly, the ssh of a copy offers the
# keys the connection offered, also where the two homes differ (sudo, a service, a HOME set by hand).
DEFAULT_KEYS = ("id_rsa", "id_ecdsa", "id_ed25519")


def default_key_files() -> list[Path]:
    """The default key files that exist under ~/.ssh ($HOME's), in the order paramiko tries them."""
    return [path for name in DEFAULT_KEYS if (path := Path("~/.ssh", name).expanduser()).is_file()]


def _ssh_options(target: Target, known_hosts: Path) -> list[str]:
    """`ssh` options for one hop: no ssh config read (`-F /dev/null`: the target is already
    resolved), relaunch's known_hosts with strict checking, and the resolved port, user and key."""
    argv = [
        "ssh", "-F", "/dev/null",
        "-o", f"UserKnownHostsFile={known_hosts}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", "StrictHostKeyChecking=yes",
        "-o", "BatchMode=yes",
        "-o", "ConnectTimeout=20",
        "-o", "ServerAliveInterval=5",
        "-o", "ServerAliveCountMax=3",
        "-p", str(target.port),
        "-l", target.user,
    ]  # fmt: skip
    if target.key:
        # a key with a passphrase comes from ssh-agent (matched by the .pub beside it);
        # IdentitiesOnly: no other key of the agent is offered
        argv += ["-i", str(Path(target.key).expanduser())]
        argv += ["-o", "IdentitiesOnly=yes"] if target.key_only else []
    else:
        argv += [arg for path in default_key_files() for arg in ("-o", f"IdentityFile={path}")]
    return argv


def ssh_argv(target: Target, known_hosts: Path) -> list[str]:
    """`ssh` with the same host-key file, strict checking, identity and jump host as the
    connection; the caller appends the resolved address (`target.address`)."""
    argv = _ssh_options(target, known_hosts)
    if target.jump is not None:
        # ProxyJump done by hand: OpenSSH's own -J would start the jump's ssh without these
        # options, checking its key against ~/.ssh/known_hosts instead of relaunch's file.
        # ssh expands %-tokens in a ProxyCommand: literal % in paths are doubled.
        hop = [a.replace("%", "%%") for a in _ssh_options(target.jump, known_hosts)]
        argv += ["-o", "ProxyCommand=" + shlex.join([*hop, "-W", "[%h]:%p", target.jump.address])]
    return argv


def rsync_rsh(target: Target, known_hosts: Path) -> str:
    """The `-e` value for rsync (rsync splits it like a shell would)."""
    return shlex.join(ssh_argv(target, known_hosts))
