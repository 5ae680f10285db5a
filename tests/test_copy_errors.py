"""What a failed copy says: rsync's own reason, never a guess.

Real sandbox instances, the real CLI and real rsync. rsync's exit 23 is "partial transfer": files
that vanished (a trainer rotating checkpoints) and files it could not read both end that way;
only the first is the trainer's doing.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from e2e import plain_recipe, start_cli, wait_for
from relaunch.transports import rsync


def test_a_shard_rsync_cannot_read_is_a_copy_error_saying_permission_denied_never_rotated(
        tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    inst = sandbox(user="ubuntu", rate="16mbit")    # not root: chmod 000 keeps a file from the login user
    recipe = plain_recipe(tmp_path, name="unreadable", key=ssh_key, checkpoint={"layout": "dcp"})
    big = 16_000_000          # 8 s on this link; rsync reads at most a few MB ahead of it (socket buffers)
    ssh(inst, "mkdir -p ~/ckpt/step-00000020 && cd ~/ckpt/step-00000020 && "
              f"head -c {big} /dev/urandom > __0_0.distcp && head -c 1000 /dev/urandom > __1_0.distcp && "
              "head -c 500 /dev/urandom > .metadata.tmp && mv .metadata.tmp .metadata")
    staged = tmp_path / "store" / ".relaunch" / "partial"
    err = tmp_path / "evacuate.err"
    proc = start_cli("evacuate", str(recipe), inst.host, "--json", home=home, err=err)
    try:
        # the instance hashed its bytes beside the copy at once (milliseconds for 16 MB); rsync is
        # still sending the first shard when the second becomes unreadable
        wait_for("the first shard's first bytes", lambda: sum(p.stat().st_size for p in staged.rglob("*")
                                                              if p.is_file()) > 0, timeout=120, every=0.05)
        ssh(inst, "chmod 000 ~/ckpt/step-00000020/__1_0.distcp")
        proc.wait(timeout=180)
    finally:
        proc.kill()
    text = err.read_text()
    assert proc.returncode == 6, text
    assert "Permission denied" in text and "__1_0.distcp" in text, text
    assert "rotated" not in text, text
    assert "step-00000020" in text and inst.address in text, text
    assert not (tmp_path / "store" / "step-00000020").exists()
    assert json.loads(Path(tmp_path / "store" / ".relaunch" / "manifest.json").read_text()
                      if (tmp_path / "store" / ".relaunch" / "manifest.json").exists()
                      else '{"checkpoints": []}')["checkpoints"] == []


def test_a_partial_transfer_of_files_gone_before_they_were_sent_is_still_the_trainers_rotation(tmp_path):
    """Real rsync, on this machine: a listed file that is gone ends in exit 23 with a link_stat
    line, which stays `vanished` (skipped, not a failure); a summary line alone does not."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "ckpt-00000010.pt").write_bytes(b"x" * 100)
    done = subprocess.run(["rsync", "-a", "--from0", "--files-from=-", f"{src}/", f"{dst}/"],
                          input=b"ckpt-00000010.pt\0ckpt-00000020.pt\0", capture_output=True)
    assert done.returncode == 23, done.stderr
    output = (done.stdout + b"\n" + done.stderr).decode()
    assert rsync.only_vanished(output), output
    assert not rsync.only_vanished("rsync error: some files/attrs were not transferred (code 23)")
    denied = 'rsync: [sender] send_files failed to open "/x/ckpt-00000010.pt": Permission denied (13)'
    assert not rsync.only_vanished(output + "\n" + denied)
    # the other side giving up because of the missing file changes nothing
    assert rsync.only_vanished(output + "\nrsync: [Receiver] write error: Broken pipe (32)")
    assert not rsync.only_vanished(denied + "\nrsync: [Receiver] write error: Broken pipe (32)")
    assert rsync.error_lines(output + "\n" + denied)[-1] == denied
