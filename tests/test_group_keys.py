"""A node group's fan-out key never touches the user's own lines in ~/.ssh/authorized_keys.

Real sandbox nodes: the user's key is only in the user's own authorized_keys (the sandbox's
cloud-init-like key file is emptied), written without a final newline as editors and `echo -n`
leave it. `up` on a group adds relaunch's copy key there and removes it; afterwards the user's
line is as it was and the user still gets in.
"""

from __future__ import annotations

from e2e import plain_recipe, run_cli
from relaunch import sandbox as sb
from test_faults import plant


def test_a_fanout_key_added_and_removed_leaves_a_user_line_without_final_newline_intact(
        tmp_path, sandbox, ssh, ssh_key):
    home = tmp_path / "state"
    n0, n1 = sandbox(), sandbox()
    recipe = plain_recipe(tmp_path / "work", name="fankeys", key=ssh_key)
    digest = plant(ssh, n0, 10)
    evac = run_cli("evacuate", str(recipe), n0.host, home=home)
    assert evac.returncode == 0, evac.stderr
    ssh(n0, "rm -rf ~/ckpt")                 # the group has no copy: the checkpoint fans out from the store

    user_line = ssh_key.with_suffix(".pub").read_text().strip()
    for inst in (n0, n1):
        ssh(inst, f"mkdir -p -m 700 ~/.ssh && printf %s '{user_line}' > ~/.ssh/authorized_keys "
                  "&& chmod 600 ~/.ssh/authorized_keys")
        (sb.RUN_DIR / inst.name / "authorized_keys").write_text("")   # only the user's own file lets us in
        assert ssh(inst, "echo in").stdout == "in\n"

    up = run_cli("up", str(recipe), n0.host, n1.host, home=home)
    for inst in (n0, n1):
        after = ssh(inst, "cat ~/.ssh/authorized_keys", check=False)
        assert after.returncode == 0, f"{inst.name}: the user is locked out: {after.stderr}"
        # the user's line, byte for byte; at most the newline that had to end it
        assert after.stdout in (user_line, user_line + "\n"), after.stdout
    assert up.returncode == 0, up.stderr
    for inst in (n0, n1):               # the copy key worked: node 1 got the checkpoint from node 0
        assert ssh(inst, "sha256sum ~/ckpt/ckpt-00000010.pt").stdout.split()[0] == digest
