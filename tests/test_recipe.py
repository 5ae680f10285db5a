"""The recipe model: loading, extends, --set, providers, located errors, rendering.

Pure: no network, no hosts. Fixture recipes live in tests/fixtures/recipes/.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from relaunch.errors import RecipeError, UsageError
from relaunch.recipe import (
    Recipe,
    check_recipe,
    load_providers,
    load_recipe,
    render_at,
    render_context,
    render_shell_at,
    starter_recipe,
)
from relaunch.recipe.render import render_text
from relaunch.resources import recipes_dir

FIX = Path(__file__).parent / "fixtures" / "recipes"
REPO = Path(__file__).resolve().parent.parent


def error_of(path: Path | str, overrides: tuple[str, ...] = ()) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    assert info.value.exit_code == 2
    return info.value


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- a valid recipe and its defaults ------------------------------------------------------------

def test_minimal_recipe_gets_every_default() -> None:
    r = load_recipe(FIX / "minimal.yaml")
    assert r.name == "minimal" and r.extends == [] and r.provider is None
    assert (r.ssh.user, r.ssh.port, r.ssh.key, r.ssh.host_key, r.ssh.wait) == ("root", 22, None, None, 300)
    assert r.env.python == "3.11"
    assert r.env.venv == "~/venvs/minimal"
    assert (r.env.installer, r.env.lock, r.env.index_url) == ("uv", None, None)
    assert (r.env.extra_index_urls, r.env.apt, r.env.files, r.env.setup, r.env.vars, r.env.secrets) == (
        [], [], {}, [], {}, [])
    assert r.env.system_site_packages is False
    c = r.checkpoint
    assert (c.dir, c.layout, c.pattern, c.keep) == ("~/ckpt", "auto", "ckpt-*.pt", 2)
    assert (c.via, c.every) == ("local", 600)
    assert c.remote == FIX / "store" / "minimal"  # a local path, absolute, relative to the recipe file
    assert (r.run.workdir, r.run.session, r.run.log) == ("~", "minimal", "~/minimal.log")
    assert (r.run.stop.signal, r.run.stop.timeout) == ("TERM", 120)
    assert r.source == FIX / "minimal.yaml"
    assert "source" not in r.model_dump()


def test_contract_example_loads_with_every_key(tmp_path: Path) -> None:
    """The Recipe block of CONTRACT.md, verbatim in spirit: every key spelled as there."""
    (tmp_path / "team").mkdir()
    (tmp_path / "team" / "base.yaml").write_text("env: {python: '3.10'}\n")
    path = write(tmp_path, "llama.yaml", """\
name: llama-ft
extends: [team/base.yaml]
provider: lambda
ssh:
  user: ubuntu
  port: 22
  key: ~/.ssh/id_ed25519
  host_key: SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s
  wait: 300
env:
  python: "3.11"
  venv: ~/venvs/llama-ft
  installer: uv
  lock: requirements.lock
  index_url: https://download.pytorch.org/whl/cu124
  extra_index_urls: []
  system_site_packages: false
  apt: [tmux, rsync]
  files:
    train.py: ~/work/train.py
  setup: []
  vars: {WANDB_MODE: offline}
  secrets: [HF_TOKEN]
checkpoint:
  dir: ~/ckpt
  layout: hf-trainer
  pattern: "ckpt-*.pt"
  keep: 2
  remote: ./store/llama-ft
  via: local
  every: 600
run:
  command: python train.py --resume "{{ checkpoint }}"
  workdir: ~/work
  session: llama-ft
  log: ~/llama-ft.log
  stop: {signal: TERM, timeout: 120}
""")
    r = load_recipe(path)
    assert r.ssh.key == Path.home() / ".ssh" / "id_ed25519"
    assert r.env.lock == tmp_path / "requirements.lock"
    assert r.env.files == {tmp_path / "train.py": "~/work/train.py"}
    assert r.checkpoint.remote == tmp_path / "store" / "llama-ft"
    assert r.env.python == "3.11"  # this file wins over the base
    assert r.env.installer == "uv" and r.checkpoint.layout == "hf-trainer"


def test_remote_kinds(tmp_path: Path) -> None:
    base = "name: r\nenv: {python: '3.11'}\nrun: {command: x}\ncheckpoint:\n  remote: %s\n"
    for remote in ("rclone:s3:bucket/runs", "hf:me/ckpts", "hf:me/ckpts/run-1"):
        r = load_recipe(write(tmp_path, "r.yaml", base % remote))
        assert r.checkpoint.remote == remote and isinstance(r.checkpoint.remote, str)
    e = error_of(write(tmp_path, "r.yaml", base % "hf:just-a-name"))
    assert str(e).startswith(f"{tmp_path}/r.yaml:5: checkpoint.remote: must look like hf:OWNER/REPO")
    e = error_of(write(tmp_path, "r.yaml", base % "rclone:nocolon"))
    assert str(e).startswith(f"{tmp_path}/r.yaml:5: checkpoint.remote: must look like rclone:REMOTE:PATH")
    e = error_of(write(tmp_path, "r.yaml", base % "./store\n  via: instance"))
    assert str(e).startswith(f"{tmp_path}/r.yaml:6: checkpoint.via: instance: the instance cannot reach")


def test_empty_mapping_sections_mean_defaults(tmp_path: Path) -> None:
    # Every line of a section commented out leaves `ssh:` with a null value: that means "defaults".
    r = load_recipe(write(tmp_path, "r.yaml", "name: r\nssh:\n  # user: x\nenv: {python: '3.11', lock: }\n"
                                              "checkpoint: {remote: s}\nrun: {command: x}\n"))
    assert r.ssh.user == "root" and r.env.lock is None


def test_vars_scalars_become_the_text_written(tmp_path: Path) -> None:
    r = load_recipe(write(tmp_path, "r.yaml", "name: r\nenv:\n  python: '3.11'\n"
                                              "  vars: {A: 3.10, B: 7, C: true}\n"
                                              "checkpoint: {remote: s}\nrun: {command: x}\n"))
    assert r.env.vars == {"A": "3.10", "B": "7", "C": "true"}


# --- errors: one test per class, exact file:line and key ---------------------------------------

def test_yaml_tab() -> None:
    e = error_of(FIX / "bad_tab.yaml")
    assert str(e).startswith(f"{FIX}/bad_tab.yaml:3: env.python: YAML syntax error:")
    assert "'\\t'" in str(e) and "tab" in (e.hint or "")


def test_yaml_unclosed_quote_points_at_the_quote() -> None:
    e = error_of(FIX / "bad_quote.yaml")
    assert str(e).startswith(
        f"{FIX}/bad_quote.yaml:3: env.python: YAML syntax error: while scanning a quoted scalar")


def test_yaml_bad_indentation() -> None:
    e = error_of(FIX / "bad_indent.yaml")
    assert str(e).startswith(f"{FIX}/bad_indent.yaml:4: ")
    assert "YAML syntax error" in str(e)


def test_duplicate_key_names_both_lines() -> None:
    e = error_of(FIX / "duplicate.yaml")
    assert str(e) == (f"{FIX}/duplicate.yaml:9: checkpoint.keep: "
                      "duplicate key (first at line 7, again at line 9)")


def test_unknown_top_level_key_with_did_you_mean() -> None:
    e = error_of(FIX / "unknown_key.yaml")
    assert str(e).startswith(f"{FIX}/unknown_key.yaml:4: chekpoint: unknown key (did you mean checkpoint?)")


def test_unknown_nested_key_with_did_you_mean() -> None:
    e = error_of(FIX / "unknown_nested.yaml")
    assert str(e) == f"{FIX}/unknown_nested.yaml:4: env.instaler: unknown key (did you mean installer?)"


def test_wrong_type() -> None:
    e = error_of(FIX / "wrong_type.yaml")
    assert str(e) == f"{FIX}/wrong_type.yaml:6: checkpoint.keep: must be a whole number, got 'many'"
    assert (e.file, e.line, e.key) == (str(FIX / "wrong_type.yaml"), 6, "checkpoint.keep")


def test_wrong_type_is_located_in_the_file_that_wrote_it() -> None:
    e = error_of(FIX / "wrong_type_in_base.yaml")
    assert str(e) == f"{FIX}/team/bad_base.yaml:3: checkpoint.every: must be a number, got 'soon'"


def test_missing_required_key_points_at_its_section() -> None:
    e = error_of(FIX / "missing_required.yaml")
    assert str(e) == f"{FIX}/missing_required.yaml:2: env.python: required key missing"


def test_python_as_a_number() -> None:
    e = error_of(FIX / "python_float.yaml")
    assert str(e) == f'{FIX}/python_float.yaml:3: env.python: write it as a quoted string: "3.10"'


def test_bad_name() -> None:
    e = error_of(FIX / "bad_name.yaml")
    assert str(e).startswith(
        f"{FIX}/bad_name.yaml:1: name: 'my run #(reboot)': use only letters, digits, _ and -")


@pytest.mark.parametrize(("section", "line", "key", "fragment"), [
    ("run: {command: x, session: 'a#(b)'}", 5, "run.session", "tmux expands"),
    ("env: {python: '3.11', vars: {1BAD: x}}", 3, "env.vars", "'1BAD' is not a usable environment variable"),
    ("env: {python: '3.11', vars: {step: x}}", 3, "env.vars", "would hide relaunch's own template variable"),
    ("env: {python: '3.11', secrets: [HF-TOKEN]}", 3, "env.secrets", "'HF-TOKEN' is not an environment"),
    ("ssh: {host_key: 'MD5:aa:bb'}", 2, "ssh.host_key", "must look like SHA256:<base64>"),
    ("ssh: {port: 70000}", 2, "ssh.port", "must be <= 65535, got 70000"),
    ("checkpoint: {remote: s, layout: zip}", 4, "checkpoint.layout", "must be 'auto', 'files', 'hf-trainer'"),
    ("checkpoint: {remote: s, keep: 0}", 4, "checkpoint.keep", "must be >= 1, got 0"),
    ("env: {python: '3.11', installer: conda}", 3, "env.installer", "must be 'pip' or 'uv', got 'conda'"),
    ("run: {command: x, stop: {signal: NOPE}}", 5, "run.stop.signal", "'NOPE' is not a signal name"),
    ("env: {python: '3'}", 3, "env.python", 'must be MAJOR.MINOR such as "3.11"'),
    ("env: {python: '3.12', python_mirror: 'ftp://host/py'}", 3, "env.python_mirror",
     "must be an http://, https:// or file:// URL, got 'ftp://host/py'"),
    ("env: {python: '3.12', python_mirror: '/srv/python'}", 3, "env.python_mirror", "must be an http://"),
    ("env: {python: '3.11', apt: tmux}", 3, "env.apt", "must be a list, got 'tmux'"),
    ("run: [python, train.py]", 5, "run", "must be a mapping of keys, got a list"),
])
def test_field_rules(tmp_path: Path, section: str, line: int, key: str, fragment: str) -> None:
    # A valid recipe, one section per line; the case replaces the section it names.
    sections = {"name": "name: r", "ssh": "ssh: {}", "env": "env: {python: '3.11'}",
                "checkpoint": "checkpoint: {remote: s}", "run": "run: {command: x}"}
    sections[section.split(":")[0]] = section
    e = error_of(write(tmp_path, "r.yaml", "\n".join(sections.values()) + "\n"))
    assert str(e).startswith(f"{tmp_path}/r.yaml:{line}: {key}: "), str(e)
    assert fragment in str(e)


def test_missing_recipe_file(tmp_path: Path) -> None:
    e = error_of(tmp_path / "nope.yaml")
    assert str(e) == f"{tmp_path}/nope.yaml: cannot read recipe: No such file or directory"


def test_unreadable_recipe_file(tmp_path: Path) -> None:
    e = error_of(tmp_path)  # a folder
    assert str(e).startswith(f"{tmp_path}: cannot read recipe: ")
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    assert str(error_of(path)) == f"{path}: cannot read recipe: not UTF-8 text"


def test_not_a_mapping_and_empty(tmp_path: Path) -> None:
    e = error_of(write(tmp_path, "list.yaml", "- a\n- b\n"))
    assert str(e).startswith(f"{tmp_path}/list.yaml:1: a recipe is a mapping")
    e = error_of(write(tmp_path, "empty.yaml", "# nothing\n"))
    assert str(e) == f"{tmp_path}/empty.yaml: the recipe is empty"


def test_unknown_provider_with_did_you_mean() -> None:
    e = error_of(FIX / "unknown_provider.yaml")
    assert str(e).startswith(
        f"{FIX}/unknown_provider.yaml:2: provider: unknown provider 'lamda' (did you mean lambda?)")


# --- extends ------------------------------------------------------------------------------------

def test_extends_merges_relative_to_each_file() -> None:
    r = load_recipe(FIX / "child.yaml")
    assert r.extends == ["team/base.yaml"]
    assert r.provider == "lambda" and r.ssh.user == "ubuntu"  # from the base
    assert r.env.python == "3.11"
    assert r.env.apt == ["git"]  # lists are replaced, not appended
    assert r.env.vars == {"WANDB_MODE": "offline", "SEED": "42"}  # mappings merge deeply, child wins
    assert r.checkpoint.keep == 4
    # Relative paths in the base are relative to the base's folder.
    assert r.env.lock == FIX / "team" / "base.lock"
    assert r.checkpoint.remote == FIX / "store" / "team"
    assert r.run.command == 'python train.py --resume "{{ checkpoint }}"' and r.run.workdir == "~/work"
    # Each key remembers the file and line that wrote it.
    assert r.where("run.command") == f"{FIX}/child.yaml:8"
    assert r.where("run.workdir") == f"{FIX}/team/base.yaml:15"
    assert r.where("env.vars.SEED") == f"{FIX}/child.yaml:6"
    assert r.where("env.vars.WANDB_MODE") == f"{FIX}/team/base.yaml:8"
    assert r.where("env.apt") == f"{FIX}/child.yaml:4"
    assert r.where("checkpoint.dir") == f"{FIX}/child.yaml"  # a default: the recipe file


def test_extends_cycle_reports_the_chain() -> None:
    e = error_of(FIX / "cycle_a.yaml")
    a, b = FIX / "cycle_a.yaml", FIX / "cycle_b.yaml"
    assert str(e) == f"{b}:3: extends: cycle: {a} -> {b} -> {a}"


def test_extends_missing_file_reports_the_chain() -> None:
    e = error_of(FIX / "missing_base.yaml")
    assert str(e) == (f"{FIX}/missing_base.yaml:4: extends: cannot read {FIX}/team/nope.yaml: no such file "
                      f"(extended by {FIX}/missing_base.yaml)")


def test_extends_chain_of_three_and_missing_deep(tmp_path: Path) -> None:
    write(tmp_path, "a/b/deep.yaml", "env: {python: '3.12'}\nextends: ../../gone.yaml\n")
    write(tmp_path, "a/mid.yaml", "extends: b/deep.yaml\n")
    top = write(tmp_path, "top.yaml", "name: t\nextends: a/mid.yaml\n")
    e = error_of(top)
    t = tmp_path
    assert str(e) == (f"{t}/a/b/deep.yaml:2: extends: cannot read {t}/gone.yaml: no such file "
                      f"(extended by {t}/top.yaml -> {t}/a/mid.yaml -> {t}/a/b/deep.yaml)")


# --- providers ----------------------------------------------------------------------------------

def test_every_preset_loads_and_sets_the_ssh_user(tmp_path: Path) -> None:
    presets = load_providers()
    # The names and users of the first presets are contract: recipes in the wild name them.
    expected_users = {"lambda": "ubuntu", "runpod": "root", "vast": "root", "hyperstack": "ubuntu",
                      "massedcompute": "Ubuntu", "verda": "root", "generic": "root", "sandbox": "root"}
    assert set(expected_users) <= set(presets)
    for name, preset in presets.items():
        assert preset.user == expected_users.get(name, preset.user) and preset.notes
        r = load_recipe(write(tmp_path, f"{name}.yaml",
                              f"name: r\nprovider: {name}\nenv: {{python: '3.11'}}\n"
                              "checkpoint: {remote: s}\nrun: {command: x}\n"))
        # A preset that knows no user or port leaves the defaults (root, 22) in place.
        assert (r.ssh.user, r.ssh.port) == (preset.user or "root", preset.port or 22)


def test_recipe_ssh_user_wins_over_the_preset(tmp_path: Path) -> None:
    r = load_recipe(write(tmp_path, "r.yaml", "name: r\nprovider: lambda\nssh: {user: alice, port: 2200}\n"
                                              "env: {python: '3.11'}\ncheckpoint: {remote: s}\n"
                                              "run: {command: x}\n"))
    assert (r.ssh.user, r.ssh.port) == ("alice", 2200)


def test_starter_recipe_loads_for_every_provider(tmp_path: Path) -> None:
    for provider in [None, *load_providers()]:
        text = starter_recipe(provider)
        r = load_recipe(write(tmp_path, "recipe.yaml", text))
        assert r.provider == provider
        assert r.ssh.user == ((load_providers()[provider].user if provider else "") or "root")
        check_recipe(r)
    with pytest.raises(UsageError, match="did you mean runpod"):
        starter_recipe("runpd")


# --- --set --------------------------------------------------------------------------------------

def test_set_int_list_string_and_mapping_key() -> None:
    r = load_recipe(FIX / "minimal.yaml", [
        "checkpoint.keep=3", "--set env.apt=[git, tmux]", "run.command=python t.py # keep: all of it",
        "env.vars.LR=3e-4", "env.python='3.10'",
    ])
    assert r.checkpoint.keep == 3
    assert r.env.apt == ["git", "tmux"]
    assert r.run.command == "python t.py # keep: all of it"
    assert r.env.vars == {"LR": "3e-4"}
    assert r.env.python == "3.10"
    assert r.where("checkpoint.keep") == "--set" and r.where("env.apt.1") == "--set"
    assert r.where("run.workdir") == str(FIX / "minimal.yaml")


def test_set_paths_are_relative_to_the_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    r = load_recipe(FIX / "minimal.yaml", ["env.lock=pins.lock", "env.files.data/x.bin=~/x.bin"])
    assert r.env.lock == tmp_path / "pins.lock"
    assert r.env.files == {tmp_path / "data" / "x.bin": "~/x.bin"}


def test_set_unknown_key() -> None:
    e = error_of(FIX / "minimal.yaml", ("checkpoint.kep=3",))
    assert str(e) == "--set: checkpoint.kep: unknown key (did you mean checkpoint.keep?)"
    e = error_of(FIX / "minimal.yaml", ("run.command.x=3",))
    assert str(e) == "--set: run.command.x: run.command has no keys inside it"
    e = error_of(FIX / "minimal.yaml", ("checkpoint.keep",))
    assert str(e).startswith("--set: expected --set KEY.PATH=VALUE")


def test_set_wrong_type_is_located_at_set() -> None:
    e = error_of(FIX / "minimal.yaml", ("checkpoint.keep=0",))
    assert str(e) == "--set: checkpoint.keep: must be >= 1, got 0"
    e = error_of(FIX / "minimal.yaml", ("env.python=3.10",))
    assert str(e) == '--set: env.python: write it as a quoted string: "3.10"'


# --- rendering ----------------------------------------------------------------------------------

def test_render_context_and_render() -> None:
    r = load_recipe(FIX / "child.yaml", ["env.vars.OUT=~/out/{{ name }}-{{ step }}"])
    ctx = render_context(r, host="10.0.0.2", checkpoint="~/ckpt/ckpt-5.pt", step=5, gpus=4, nnodes=2)
    assert ctx["world_size"] == 8 and ctx["user"] == "ubuntu" and ctx["SEED"] == "42"
    assert ctx["OUT"] == "~/out/child-5"  # vars are rendered with the built-in variables
    assert render_context(r, gpus=0)["world_size"] == 1
    assert render_at(r, "run.command", ctx) == 'python train.py --resume "~/ckpt/ckpt-5.pt"'
    assert render_text(r, "{{ name }}@{{ host }}", ctx, key="run.log") == "child@10.0.0.2"


def test_undefined_variable_is_located() -> None:
    r = load_recipe(FIX / "undefined_var.yaml")  # loading does not render
    ctx = render_context(r, checkpoint="x")
    with pytest.raises(RecipeError) as info:
        render_at(r, "run.command", ctx)
    assert str(info.value) == (f"{FIX}/undefined_var.yaml:10: run.command: "
                               "undefined variable 'chekpoint' (did you mean checkpoint?)")
    with pytest.raises(RecipeError) as info:
        check_recipe(r)
    assert str(info.value) == (f"{FIX}/undefined_var.yaml:6: env.setup.1: "
                               "undefined variable 'nmae' (did you mean name?)")


def test_template_syntax_error_is_located() -> None:
    r = load_recipe(FIX / "template_syntax.yaml")
    with pytest.raises(RecipeError) as info:
        check_recipe(r)
    assert str(info.value).startswith(f"{FIX}/template_syntax.yaml:7: run.command: template syntax error:")


def test_check_recipe_notes_and_missing_local_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RELAUNCH_TEST_SECRET", raising=False)
    path = write(tmp_path, "r.yaml", "name: r\nenv:\n  python: '3.11'\n  secrets: [RELAUNCH_TEST_SECRET]\n"
                                     "  files:\n    train.py: ~/train.py\n"
                                     "checkpoint: {remote: s}\nrun: {command: x}\n")
    with pytest.raises(RecipeError) as info:
        check_recipe(load_recipe(path))
    local = tmp_path / "train.py"
    assert str(info.value) == f"{tmp_path}/r.yaml:6: env.files.{local}: local file {local} does not exist"
    (tmp_path / "train.py").write_text("print()\n")
    notes = check_recipe(load_recipe(path))
    assert any(n.startswith("no env.lock") for n in notes)
    assert any("RELAUNCH_TEST_SECRET is not set" in n for n in notes)


BAD = "$(touch {marker}); echo 'it ran' \"q\" `touch {marker}` ; x"


@pytest.mark.parametrize("command", [
    'printf "%s\\n" "{{ checkpoint }}"',               # double-quoted by the user
    "printf '%s\\n' {{ checkpoint }}",                 # unquoted
    'printf "%s\\n" "$(printf "%s" "{{ checkpoint }}")"',  # inside $( ) inside double quotes
    "bash -c 'printf \"%s\\n\" \"{{ checkpoint }}\"'",  # single quotes: the inner shell reads the env
])
def test_render_shell_keeps_values_as_data(tmp_path: Path, command: str) -> None:
    marker = tmp_path / "pwned"
    value = BAD.format(marker=marker)
    r = load_recipe(write(tmp_path, "r.yaml", yaml.safe_dump({
        "name": "r", "env": {"python": "3.11"}, "checkpoint": {"remote": "s"}, "run": {"command": command}})))
    text, env = render_shell_at(r, "run.command", render_context(r, checkpoint=value))
    assert env == {"RELAUNCH_checkpoint": value}
    assert "touch" not in text
    script = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()) + text + "\n"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                         env={"PATH": os.environ["PATH"]})
    assert out.stdout == value + "\n"
    assert not marker.exists()


def test_render_shell_names_and_expressions(tmp_path: Path) -> None:
    setup = "echo {{ step + 1 }} {{ name }} {% for g in [1, 2] %}{{ g }}{% endfor %}"
    r = load_recipe(write(tmp_path, "r.yaml", yaml.safe_dump({
        "name": "r", "env": {"python": "3.11", "setup": [setup]},
        "checkpoint": {"remote": "s"}, "run": {"command": "x"}})))
    text, env = render_shell_at(r, "env.setup.0", render_context(r, step=4))
    assert text == 'echo "${RELAUNCH_expr}" "${RELAUNCH_name}" "${RELAUNCH_g}""${RELAUNCH_g_2}"'
    assert env == {"RELAUNCH_expr": "5", "RELAUNCH_name": "r", "RELAUNCH_g": "1", "RELAUNCH_g_2": "2"}
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    out = subprocess.run(["bash", "-c", exports + text], capture_output=True, text=True, check=True)
    assert out.stdout == "5 r 12\n"


def test_render_shell_undefined_is_located(tmp_path: Path) -> None:
    r = load_recipe(FIX / "undefined_var.yaml")
    with pytest.raises(RecipeError, match=r"undefined_var.yaml:10: run.command: undefined variable 'chek"):
        render_shell_at(r, "run.command", render_context(r))


# --- shipped recipes ----------------------------------------------------------------------------

def test_providers_yaml_is_shipped_with_the_package() -> None:
    assert (recipes_dir() / "providers.yaml").is_file()


def test_shipped_recipes_load_and_render() -> None:
    """Every recipe under recipes/ and examples/ (globbed: new ones count too); a base without a name
    (a team's base.yaml) is checked through the recipes that extend it (tests/test_reference.py)."""
    shipped = sorted(p for folder in ("recipes", "examples") for p in (REPO / folder).rglob("*.yaml")
                     if p.name != "providers.yaml")
    for path in shipped:
        if "name" not in (yaml.safe_load(path.read_text()) or {}):
            continue
        r = load_recipe(path)
        assert isinstance(r, Recipe)
        check_recipe(r)


def test_the_store_and_the_pattern_are_rendered_once_with_the_name(tmp_path: Path) -> None:
    """checkpoint.remote and checkpoint.pattern name one thing for every host: a team's base recipe
    writes `./store/{{ name }}`, and every use and message gets the rendered value, never the template."""
    base = write(tmp_path, "base.yaml", "env: {python: '3.11'}\ncheckpoint: {remote: './store/{{ name }}', "
                                        "pattern: '{{ name }}-*.pt'}\n")
    r = load_recipe(write(tmp_path, "r.yaml", f"name: run1\nextends: [{base}]\nrun: {{command: x}}\n"))
    assert (r.checkpoint.remote, r.checkpoint.pattern) == (tmp_path / "store" / "run1", "run1-*.pt")
    hub = load_recipe(write(tmp_path, "h.yaml", "name: run2\nenv: {python: '3.11'}\nrun: {command: x}\n"
                                                "checkpoint: {remote: 'hf:team/ckpts/{{ name }}'}\n"))
    assert hub.checkpoint.remote == "hf:team/ckpts/run2"
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, "x.yaml", "name: x\nenv: {python: '3.11'}\n"
                                              "checkpoint:\n  remote: 'rclone:r2:b/{{ host }}'\nrun: {command: x}\n"))
    assert str(info.value) == (f"{tmp_path / 'x.yaml'}:4: checkpoint.remote: 'host' is undefined: it is the same for "
                               "every host, so it may use {{ name }} and env.vars that use nothing else")


def test_the_store_may_use_env_vars_that_are_the_same_on_every_host(tmp_path: Path) -> None:
    """The contract: every string may use any vars. A team's store names its project from
    env.vars; a var that uses a host's variable is not one store, and is refused at its line."""
    r = load_recipe(write(tmp_path, "r.yaml", "name: run1\nenv:\n  python: '3.11'\n  vars: {PROJECT: llama, "
                                             "RUN: '{{ name }}-a', N: 3, OUT: '~/o/{{ host }}'}\n"
                                             "checkpoint: {remote: 'rclone:r2:b/{{ PROJECT }}/{{ RUN }}{{ N }}', "
                                             "pattern: '{{ PROJECT }}-*.pt'}\nrun: {command: x}\n"))
    assert (r.checkpoint.remote, r.checkpoint.pattern) == ("rclone:r2:b/llama/run1-a3", "llama-*.pt")
    assert r.env.vars["RUN"] == "{{ name }}-a"                  # the var itself is still rendered per host
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, "x.yaml", "name: x\nenv:\n  python: '3.11'\n  vars: {OUT: '~/o/{{ host }}'}\n"
                                              "checkpoint:\n  remote: 'rclone:r2:b/{{ OUT }}'\nrun: {command: x}\n"))
    assert str(info.value).startswith(f"{tmp_path / 'x.yaml'}:6: checkpoint.remote: 'OUT' is undefined: "), info.value


def test_checkpoint_dir_is_a_template_variable(tmp_path: Path) -> None:
    """A command written once for every provider's disks: `{{ checkpoint_dir }}` is checkpoint.dir
    rendered (with the other variables), `~` expanded where the home is known; it may not name itself."""
    r = load_recipe(write(tmp_path, "r.yaml", "name: run1\nenv: {python: '3.11'}\n"
                                             "checkpoint: {remote: s, dir: '/workspace/ckpt/{{ name }}'}\n"
                                             "run: {command: 'python t.py --out \"{{ checkpoint_dir }}\"'}\n"))
    assert render_at(r, "run.command", render_context(r, home="/root")) == 'python t.py --out "/workspace/ckpt/run1"'
    home = load_recipe(write(tmp_path, "h.yaml", "name: h\nenv: {python: '3.11'}\ncheckpoint: {remote: s}\n"
                                                 "run: {command: 'x {{ checkpoint_dir }}'}\n"))
    assert render_context(home, home="/home/ubuntu")["checkpoint_dir"] == "/home/ubuntu/ckpt"
    with_vars = load_recipe(write(tmp_path, "v.yaml", "name: v\nenv: {python: '3.11', vars: {RUN: r7}}\n"
                                                      "checkpoint: {remote: s, dir: '~/ckpt/{{ RUN }}'}\n"
                                                      "run: {command: x}\n"))
    assert render_context(with_vars, home="/root")["checkpoint_dir"] == "/root/ckpt/r7"   # env.vars still work
    loop = load_recipe(write(tmp_path, "l.yaml", "name: l\nenv: {python: '3.11'}\n"
                                                 "checkpoint: {remote: s, dir: '{{ checkpoint_dir }}/x'}\n"
                                                 "run: {command: x}\n"))
    with pytest.raises(RecipeError, match="checkpoint.dir: undefined variable 'checkpoint_dir'"):
        render_context(loop, home="/root")
