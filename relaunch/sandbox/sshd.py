"""sshd of a sandbox instance: its configuration, and the forced command that logs what it is asked."""

from __future__ import annotations

import shlex
from pathlib import Path

COMMAND_LOG, LOG_COMMAND = "commands.log", "log-command"  # in the instance's folder
SFTP_SERVER = "/usr/lib/openssh/sftp-server"


def config(folder: Path, address: str, port: int, command_log: bool, pid_file: bool = True) -> str:
    """pid_file: sshd writes its PID to <folder>/sshd.pid. Not in an instance with its own PID
    namespace, where sshd would write a PID of that namespace, which means another process here."""
    return "\n".join(
        [
            f"ListenAddress {address}",
            f"Port {port}",
            f"HostKey {folder}/ssh_host_ed25519_key",
            # the key this machine was given, and the user's own file, as on a cloud image
            f"AuthorizedKeysFile {folder}/authorized_keys .ssh/authorized_keys",
            f"PidFile {folder}/sshd.pid" if pid_file else "PidFile none",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "UsePAM no",
            "PrintMotd no",
            "PrintLastLog no",
            "X11Forwarding no",
            # Fabric's put/get speak SFTP; the in-process server needs no binary from the image,
            # but a forced command cannot run it: a logged instance runs the server program
            *(
                [f"ForceCommand {shlex.quote(str(folder / LOG_COMMAND))}", f"Subsystem sftp {SFTP_SERVER}"]
                if command_log
                else ["Subsystem sftp internal-sftp"]
            ),
            "",
        ]
    )


def log_command_script(log: Path) -> str:
    """sshd runs this instead of what the client asked for (ForceCommand), as the login user."""
    quoted = shlex.quote(str(log))
    return f"""#!/bin/sh
# Log the client's command, then run it exactly as sshd would have without a ForceCommand.
if [ -n "${{SSH_ORIGINAL_COMMAND+set}}" ]; then
    # channels run at once: the lock keeps one command's bytes together
    {{ flock 9 && printf '%s\\0' "$SSH_ORIGINAL_COMMAND" >&9; }} 9>>{quoted} ||
        {{ echo "relaunch sandbox: cannot log the command" >&2; exit 255; }}
    exec "$SHELL" -c "$SSH_ORIGINAL_COMMAND"
fi
exec "$SHELL" -l
"""

