"""`relaunch freeze` records the package indexes the instance's pip and uv use: reading their
configuration (pure, from what templates/indexes.py prints) and editing the recipe file in place."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from relaunch.errors import UsageError
from relaunch.freeze import index_change, plan_freeze
from relaunch.host.indexes import combined, pip_indexes, uv_indexes
from relaunch.recipe import load_recipe
from relaunch.recipe.edit import Edit, apply, scalar

REPO = Path(__file__).resolve().parents[1]
CU = "https://download.pytorch.org/whl/cu124"
PYPI = "https://pypi.org/simple"
MIRROR = "https://mirror.example.com/simple"


# -- reading pip's and uv's configuration ----------------------------------------------------------

def test_pip_config_list_install_over_global_and_the_login_environment_over_both() -> None:
    listed = f"global.index-url='{PYPI}'\ninstall.index-url='{CU}'\nglobal.extra-index-url='{MIRROR}\\nhttps://b/simple'\n"
    found = pip_indexes({"pip_config": listed, "pip_files": [["/etc/pip.conf", "[global]\nindex-url = x\n"]]})
    assert (found.index_url, found.extra) == (CU, [MIRROR, "https://b/simple"])
    assert found.where == {CU: "pip config list: install.index-url", MIRROR: "pip config list: global.extra-index-url",
                           "https://b/simple": "pip config list: global.extra-index-url"}
    found = pip_indexes({"pip_config": listed, "env": {"PIP_INDEX_URL": "https://env/simple"}})
    assert found.index_url == "https://env/simple"
    assert found.where["https://env/simple"] == "PIP_INDEX_URL in the login environment"


def test_pip_files_when_there_is_no_pip_to_ask_later_files_win() -> None:
    files = [["/etc/pip.conf", f"[global]\nindex-url = {PYPI}\nextra-index-url = {MIRROR}\n"],
             ["/root/.config/pip/pip.conf", f"[global]\nindex-url = {CU}\n"],
             ["/root/venv/pip.conf", "not an ini file ["]]
    found = pip_indexes({"pip_config": None, "pip_files": files})
    assert (found.index_url, found.extra) == (CU, [MIRROR])
    assert found.shown() == (f"{CU} (/root/.config/pip/pip.conf [global] index-url), "
                             f"{MIRROR} (/etc/pip.conf [global] extra-index-url)")


def test_uv_toml_index_tables_the_pip_table_and_uv_variables() -> None:
    system = f'index-url = "{PYPI}"\n'
    user = (f'extra-index-url = ["{MIRROR}"]\n[[index]]\nname = "pytorch"\nurl = "{CU}"\ndefault = true\n'
            '[[index]]\nurl = "https://other/simple"\n')
    found = uv_indexes({"uv_files": [["/etc/uv/uv.toml", system], ["/root/.config/uv/uv.toml", user]]})
    assert (found.index_url, found.extra) == (CU, [MIRROR, "https://other/simple"])
    found = uv_indexes({"uv_files": [["/etc/uv/uv.toml", f'[pip]\nindex-url = "{CU}"\n']],
                        "env": {"UV_INDEX": f"torch={CU} https://x/simple", "UV_DEFAULT_INDEX": PYPI}})
    assert (found.index_url, found.extra) == (PYPI, [CU, "https://x/simple"])
    assert uv_indexes({"uv_files": [["/etc/uv/uv.toml", "= broken"]]}).urls == []


def test_both_tools_the_installers_default_first_the_others_an_extra() -> None:
    doc = {"pip_config": f"global.index-url='{CU}'\n", "uv_files": [["/etc/uv/uv.toml", f'index-url = "{PYPI}"\n']]}
    assert (combined(doc, "uv").index_url, combined(doc, "uv").extra) == (PYPI, [CU])
    assert (combined(doc, "pip").index_url, combined(doc, "pip").extra) == (CU, [PYPI])


def test_every_instance_script_is_python_3_8() -> None:
    """The scripts that run with the instance's python3 (Ubuntu 20.04 ships 3.8) use no newer syntax."""
    import ast

    for script in sorted((REPO / "templates").glob("*.py")):
        ast.parse(script.read_text(), str(script), feature_version=(3, 8))


@pytest.mark.sandbox  # a Python 3.8 fetched by uv
def test_the_reader_runs_on_python_3_8(tmp_path: Path) -> None:
    """templates/indexes.py runs on the instance with the venv's Python, which may be 3.8."""
    pythons = sorted(Path("/root/.pyenv/versions").glob("3.8.*/bin/python3.8"))
    python = str(pythons[-1]) if pythons else sys.executable
    out = subprocess.run([python, str(REPO / "templates" / "indexes.py"), str(tmp_path)], capture_output=True,
                         text=True, check=True, env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert '"uv_files": []' in out.stdout


# -- editing the recipe file -----------------------------------------------------------------------

RECIPE = """\
# my run
name: r
env:
  python: "3.11"   # the image's
  # where packages come from
  index_url: https://old/simple   # the team mirror
  extra_index_urls:
    - https://a/simple   # first
    # a comment between items
    - https://b/simple
  lock: requirements.lock
checkpoint: {remote: ./store}
run:
  command: python train.py
"""


def test_a_scalar_is_replaced_on_its_line_and_its_comment_kept() -> None:
    out = apply(RECIPE, "r.yaml", [Edit("index_url", CU, 6)])
    assert out.splitlines()[5] == f"  index_url: {CU}   # the team mirror"
    assert out.replace(CU, "https://old/simple") == RECIPE


def test_a_block_list_gains_items_after_its_last_one() -> None:
    out = apply(RECIPE, "r.yaml", [Edit("extra_index_urls", ["https://a/simple", "https://b/simple", CU], 7)])
    assert out.splitlines()[7:12] == ["    - https://a/simple   # first", "    # a comment between items",
                                      "    - https://b/simple", f"    - {CU}", "  lock: requirements.lock"]


def test_a_flow_list_is_rewritten_on_its_line_and_a_missing_key_goes_under_env(tmp_path: Path) -> None:
    text = "name: r\nenv:\n  python: '3.11'\n  extra_index_urls: []  # none yet\ncheckpoint: {remote: ./s}\n" \
           "run: {command: x}\n"
    out = apply(text, "r.yaml", [Edit("extra_index_urls", [PYPI], 4), Edit("index_url", CU)])
    assert out == (f"name: r\nenv:\n  python: '3.11'\n  extra_index_urls: [{PYPI}]  # none yet\n  index_url: {CU}\n"
                   "checkpoint: {remote: ./s}\nrun: {command: x}\n")
    path = tmp_path / "r.yaml"
    path.write_text(out)
    r = load_recipe(path)
    assert (r.env.index_url, r.env.extra_index_urls) == (CU, [PYPI])


def test_no_env_block_gets_one_and_a_flow_env_is_refused_with_what_to_write() -> None:
    out = apply("name: r\nextends: base.yaml\n", "r.yaml", [Edit("index_url", CU)])
    assert out == f"name: r\nextends: base.yaml\n\nenv:\n  index_url: {CU}\n"
    with pytest.raises(UsageError) as info:
        apply("name: r\nenv: {python: '3.11'}\n", "r.yaml", [Edit("index_url", CU)])
    assert str(info.value) == "r.yaml: cannot edit env.index_url in place: its env: is written in flow style"
    assert info.value.hint == f"write `index_url: {CU}` under env: yourself, then rerun `relaunch freeze`"


def test_scalars_that_yaml_would_read_otherwise_are_quoted() -> None:
    assert scalar(CU) == CU
    assert scalar("https://h/simple #x") == '"https://h/simple #x"'
    assert scalar("yes") == '"yes"'


# -- what freeze writes ----------------------------------------------------------------------------

def recipe_at(folder: Path, text: str, base: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if base is not None:
        (folder / "base.yaml").write_text(base)
    path = folder / "recipe.yaml"
    path.write_text(text)
    return path


def test_additive_what_the_recipe_names_stays_and_the_instances_indexes_are_added(tmp_path: Path) -> None:
    path = recipe_at(tmp_path, RECIPE)
    doc = {"pip_config": f"global.index-url='{CU}'\nglobal.extra-index-url='https://a/simple'\n"}
    change, warnings = index_change(load_recipe(path), doc)
    assert change is not None and not warnings
    assert (change.index_url, change.extra) == ("https://old/simple", ["https://a/simple", "https://b/simple", CU])
    assert change.new == RECIPE.replace("    - https://b/simple\n", f"    - https://b/simple\n    - {CU}\n")
    path.write_text(change.new)
    assert index_change(load_recipe(path), doc) == (None, [])          # now it says the same


def test_a_key_from_a_base_file_is_overridden_in_the_top_file_never_edited_there(tmp_path: Path) -> None:
    base = f"env:\n  python: '3.11'\n  extra_index_urls: [{MIRROR}]\n"
    path = recipe_at(tmp_path, "name: r\nextends: base.yaml\ncheckpoint: {remote: ./s}\nrun: {command: x}\n", base)
    change, _ = index_change(load_recipe(path), {"uv_files": [["/etc/uv/uv.toml", f'index-url = "{CU}"\n']],
                                                 "pip_config": f"global.extra-index-url='{PYPI}'\n"})
    assert change is not None
    assert change.new.endswith(f"\nenv:\n  index_url: {CU}\n  extra_index_urls: [{MIRROR}, {PYPI}]\n")
    assert (tmp_path / "base.yaml").read_text() == base


def test_a_url_with_a_credential_of_any_shape_is_written_as_a_variable_and_the_warning_names_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A token in the userinfo, in a path segment (`/<token>/simple`, as Cloudsmith and Gemfury give
    them) or in the query never reaches the recipe file: it names each such index as ${NAME}, and
    the warning says which variable to set; set here, the recipe says the same as the instance."""
    path = recipe_at(tmp_path, "name: r\nenv:\n  python: '3.11'\ncheckpoint: {remote: ./s}\nrun: {command: x}\n")
    userinfo = "https://me:s3cr3t-t0ken@private.example.com/simple"
    in_path = "https://dl.cloudsmith.io/3b7bf1e5a3c2a8f7/team/repo/python/simple/"
    in_query = "https://pypi.team.example/simple?token=q7Secret"
    doc = {"pip_config": f"global.extra-index-url='{in_query}'\n",
           "env": {"PIP_INDEX_URL": userinfo, "UV_EXTRA_INDEX_URL": in_path}}
    change, warnings = index_change(load_recipe(path), doc)
    assert change is not None
    assert change.index_url == "${INDEX_URL_PRIVATE_EXAMPLE_COM}"
    assert change.extra == ["${INDEX_URL_DL_CLOUDSMITH_IO}", "${INDEX_URL_PYPI_TEAM_EXAMPLE}"]
    for secret in ("s3cr3t-t0ken", "3b7bf1e5a3c2a8f7", "q7Secret"):
        assert secret not in change.new and not any(secret in w for w in warnings)
    assert len(warnings) == 3
    assert warnings[0] == (
        "the instance's index https://***@private.example.com/simple (PIP_INDEX_URL in the login environment) "
        f"carries a credential: {path} names it as ${{INDEX_URL_PRIVATE_EXAMPLE_COM}}, never the URL; set "
        "INDEX_URL_PRIVATE_EXAMPLE_COM to that URL on this machine (export INDEX_URL_PRIVATE_EXAMPLE_COM='...') "
        "before `relaunch up`")
    assert "https://dl.cloudsmith.io/***/team/repo/python/simple/" in warnings[1]
    assert "https://pypi.team.example/simple?token=***" in warnings[2]

    path.write_text(change.new)
    # what the user does when told: then the recipe names the instance's indexes, nothing to write
    for name, url in (("INDEX_URL_PRIVATE_EXAMPLE_COM", userinfo), ("INDEX_URL_DL_CLOUDSMITH_IO", in_path),
                      ("INDEX_URL_PYPI_TEAM_EXAMPLE", in_query)):
        monkeypatch.setenv(name, url)
    assert index_change(load_recipe(path), doc) == (None, [])


# -- the lock: made where the recipe names none, replaced only with a prompt ------------------------

def starter(folder: Path) -> Path:
    """What `relaunch init recipe.yaml --provider runpod` writes (its env.lock commented out)."""
    from relaunch.recipe.providers import starter_recipe

    return recipe_at(folder, starter_recipe("runpod"))


def test_a_recipe_without_a_lock_gets_one_beside_it_and_env_lock_in_place_of_its_example(tmp_path: Path) -> None:
    path = starter(tmp_path)
    text = path.read_text()
    plan = plan_freeze(load_recipe(path), ["mpmath==1.3.0"], {})
    assert plan.lock == tmp_path / "requirements.lock" and plan.old is None and plan.writes_lock
    assert plan.change is not None and plan.change.lock == "requirements.lock" and not plan.change.indexes
    assert not plan.asks                        # a new file and a new key replace nothing: no prompt
    example = next(line for line in text.splitlines() if line.lstrip().startswith("# lock:"))
    written = next(line for line in plan.change.new.splitlines() if line.lstrip().startswith("lock:"))
    # the example line became the key, its comment kept in its column; nothing else changed
    assert plan.change.new.replace(written, example) == text
    assert written.index("#") == example.index("# a pinned")
    path.write_text(plan.change.new)
    assert load_recipe(path).env.lock == tmp_path / "requirements.lock"


def test_a_named_lock_not_written_yet_is_created_without_a_prompt(tmp_path: Path) -> None:
    path = recipe_at(tmp_path, RECIPE)
    plan = plan_freeze(load_recipe(path), ["mpmath==1.3.0"], {})
    assert (plan.old, plan.change, plan.asks) == (None, None, False)
    assert plan.what() == f"1 packages to {tmp_path / 'requirements.lock'} (a new file)"


def test_changing_an_existing_lock_or_a_value_the_recipe_had_shows_the_diff_and_asks(tmp_path: Path) -> None:
    path = recipe_at(tmp_path, RECIPE)
    (tmp_path / "requirements.lock").write_text("mpmath==1.2.0\n")
    plan = plan_freeze(load_recipe(path), ["mpmath==1.3.0"], {})
    assert plan.asks and "-mpmath==1.2.0" in plan.diff() and "+mpmath==1.3.0" in plan.diff()
    (tmp_path / "requirements.lock").write_text("mpmath==1.3.0\n\n")
    assert not plan_freeze(load_recipe(path), ["mpmath==1.3.0"], {}).writes_lock
    # an index added to a list the recipe had changes that value: asked too
    extended = plan_freeze(load_recipe(path), ["mpmath==1.3.0"], {"pip_config": f"global.extra-index-url='{CU}'\n"})
    assert not extended.writes_lock and extended.change is not None and extended.change.replaces and extended.asks


def test_up_plan_and_check_refuse_a_named_lock_that_does_not_exist_before_any_host(tmp_path: Path) -> None:
    from e2e import run_cli

    path = recipe_at(tmp_path, RECIPE)
    for args in (["up", str(path), "root@203.0.113.7"], ["plan", str(path), "root@203.0.113.7"],
                 ["check", str(path)]):
        out = run_cli(*args, "--set", "ssh.wait=1", home=tmp_path / "state")
        assert out.returncode == 2, out.stderr
        assert f"{path}:11: env.lock: the lock file {tmp_path / 'requirements.lock'} does not exist" in out.stderr
        assert "relaunch freeze" in out.stderr and "internal error" not in out.stderr
        assert "connecting" not in out.stderr


# -- on a sandbox instance -------------------------------------------------------------------------

def test_freeze_writes_the_indexes_of_the_instances_pip_conf_and_uv_toml_into_the_recipe(
        tmp_path, sandbox, ssh, ssh_key, package_index):
    from e2e import run_cli

    inst = sandbox(index_dir=package_index)
    ssh(inst, f"python3 -m venv ~/venvs/frozen && ~/venvs/frozen/bin/pip install -q --index-url {inst.index_url} "
              "mpmath==1.3.0")
    team = "https://pypi.team.example/simple"
    token = "tok3n-never-written"
    ssh(inst, "mkdir -p ~/.config/pip ~/.config/uv && "
              f"printf '[global]\\nindex-url = {CU}\\n' > ~/.config/pip/pip.conf && "
              f"printf '[[index]]\\nname = \"team\"\\nurl = \"{team}\"\\n' > ~/.config/uv/uv.toml && "
              f"echo 'export UV_EXTRA_INDEX_URL=https://me:{token}@private.example.com/simple' > ~/.profile")
    (tmp_path / "requirements.lock").write_text("mpmath==1.3.0\n")
    recipe = tmp_path / "recipe.yaml"
    text = ("# the team's fine-tune\n"
            "name: frozen\n"
            f"ssh: {{key: {ssh_key}, wait: 20}}\n"
            "env:\n"
            "  python: \"3.11\"      # what the image has\n"
            "  venv: ~/venvs/frozen\n"
            "  lock: requirements.lock   # relaunch freeze writes it\n"
            "checkpoint:\n"
            "  remote: ./store   # beside this file\n"
            "run:\n"
            "  command: sleep 600\n")
    recipe.write_text(text)
    home = tmp_path / "state"

    out = run_cli("freeze", str(recipe), inst.host, "--yes", home=home)
    assert out.returncode == 0, out.stderr
    # the index with a token is named by a variable, never written
    named = '"${INDEX_URL_PRIVATE_EXAMPLE_COM}"'
    assert recipe.read_text() == text.replace("  lock: requirements.lock   # relaunch freeze writes it\n",
                                              "  lock: requirements.lock   # relaunch freeze writes it\n"
                                              f"  index_url: {CU}\n  extra_index_urls: [{named}, {team}]\n")
    assert f"+  index_url: {CU}" in out.stdout                                     # shown as a diff
    # uv's first (the recipe's installer), its variables' indexes before its files'
    assert (f"the instance's indexes: {CU} (pip config list: global.index-url), https://***@private.example.com/simple "
            f"(UV_EXTRA_INDEX_URL in the login environment), {team} (/root/.config/uv/uv.toml [[index]] team)"
            ) in out.stderr
    assert token not in out.stdout + out.stderr + recipe.read_text()
    assert ("https://***@private.example.com/simple (UV_EXTRA_INDEX_URL in the login environment) carries a "
            "credential") in out.stderr and "set INDEX_URL_PRIVATE_EXAMPLE_COM to that URL" in out.stderr
    assert (tmp_path / "requirements.lock").read_text() == "mpmath==1.3.0\n"    # the lock already matched
    r = load_recipe(recipe)
    assert (r.env.index_url, r.env.extra_index_urls) == (CU, ["${INDEX_URL_PRIVATE_EXAMPLE_COM}", team])
    check = run_cli("check", str(recipe), home=home)
    assert check.returncode == 0, check.stderr

    # with the variable set as told, the recipe names the instance's indexes
    again = run_cli("freeze", str(recipe), inst.host, "--yes", "--json", home=home,
                    env={"INDEX_URL_PRIVATE_EXAMPLE_COM": f"https://me:{token}@private.example.com/simple"})
    assert again.returncode == 0, again.stderr
    assert '"changed": false' in again.stdout and "the recipe names its indexes" in again.stderr
    assert token not in again.stdout + again.stderr


def test_freeze_after_init_and_up_works_as_the_readme_writes_it(tmp_path, sandbox, ssh, ssh_key):
    """README: `relaunch init recipe.yaml --provider runpod`, edit, `relaunch up recipe.yaml $HOST`,
    `relaunch freeze recipe.yaml`, from a script (no terminal): the lock is made and named, no prompt."""
    from e2e import INDEX_URL, run_cli

    inst = sandbox(image="runpod")
    home = tmp_path / "state"
    path = tmp_path / "recipe.yaml"
    assert run_cli("init", str(path), "--provider", "runpod", home=home).returncode == 0
    text = path.read_text()
    for line, edited in (('command: python train.py --resume "{{ checkpoint }}"', "command: sleep 600"),
                         ("# key: ~/.ssh/id_ed25519", f"key: {ssh_key}"),
                         ("# index_url: https://download.pytorch.org/whl/cu124", f"index_url: {INDEX_URL}")):
        assert line in text
        text = text.replace(line, edited)
    path.write_text(text)
    up = run_cli("up", str(path), inst.host, "--set", "run.grace=3", home=home)
    assert up.returncode == 0, up.stderr
    ssh(inst, f"/workspace/venvs/my-run/bin/python -m pip install -q --index-url {INDEX_URL} mpmath==1.3.0")
    status = run_cli("status", str(path), home=home)
    assert status.returncode == 0, status.stderr
    assert "  env: no lock (env.lock is not set; `relaunch freeze RECIPE` writes one from this venv)" in status.stdout

    freeze = run_cli("freeze", str(path), home=home, input="")
    assert freeze.returncode == 0, freeze.stderr
    lock = tmp_path / "requirements.lock"
    assert lock.read_text() == "mpmath==1.3.0\n"
    assert f"wrote 1 packages to {lock} (a new file)" in freeze.stderr
    assert f"wrote env.lock to {path}" in freeze.stderr
    assert "  lock: requirements.lock       # a pinned `pip freeze`" in path.read_text()
    assert load_recipe(path).env.lock == lock
    status = run_cli("status", str(path), home=home)
    assert "  env: matches the lock" in status.stdout, status.stdout

    # the other way there: env.lock named, its file not written yet
    lock.unlink()
    status = run_cli("status", str(path), home=home)
    assert status.returncode == 0 and f"  env: no lock yet ({lock} does not exist;" in status.stdout, status.stderr
    refused = run_cli("up", str(path), inst.host, home=home)
    assert refused.returncode == 2 and f"env.lock: the lock file {lock} does not exist" in refused.stderr
    again = run_cli("freeze", str(path), home=home, input="")
    assert again.returncode == 0, again.stderr
    assert lock.read_text() == "mpmath==1.3.0\n" and "internal error" not in again.stderr

    # changing the lock it made is another matter: the diff, and a prompt (none from a script)
    lock.write_text("mpmath==1.2.0\n")
    refused = run_cli("freeze", str(path), home=home, input="")
    assert refused.returncode == 2, refused.stderr
    assert "-mpmath==1.2.0" in refused.stdout and "+mpmath==1.3.0" in refused.stdout
    assert f"not writing 1 packages to {lock}: it replaces what is there (the diff above), and there is no " \
           "terminal to ask on" in refused.stderr and "rerun with --yes" in refused.stderr
    assert lock.read_text() == "mpmath==1.2.0\n"
    assert run_cli("freeze", str(path), "--yes", home=home).returncode == 0
    assert lock.read_text() == "mpmath==1.3.0\n"
