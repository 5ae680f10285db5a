"""Team recipes: extends by name from a recipe library, --explain, templates a team overrides,
`init`, the provider catalogue, and the CLI conventions (--json errors, --version, completion).

Pure tests use the real CLI in a subprocess where a user would; the last test runs the shipped
team example (examples/team) on a sandbox instance.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from e2e import REPO, run_cli, wait_for
from relaunch import scripts
from relaunch.adopt.recipe_text import recipe_text
from relaunch.errors import RecipeError
from relaunch.recipe import check_recipe, load_providers, load_recipe
from relaunch.recipe.explain import explain
from relaunch.recipe.providers import LAYOUTS, RECLAIM_NOTICES
from relaunch.resources import recipes_dir

TEAM = REPO / "examples" / "team"
PROJECT = "name: p\nrun: {command: x}\ncheckpoint: {remote: s}\n"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def error_of(path: Path) -> str:
    with pytest.raises(RecipeError) as info:
        check_recipe(load_recipe(path))
    assert info.value.exit_code == 2
    return str(info.value)


# --- extends by name ------------------------------------------------------------------------------

def test_names_are_found_in_the_folder_tree_then_relaunch_recipes_then_shipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = tmp_path / "lib"
    write(lib / "base" / "pytorch.yaml", "env: {python: '3.12', installer: pip}\n")
    write(lib / "shared.yaml", "env: {vars: {FROM: library}}\n")
    write(tmp_path / "team" / "shared.yaml", "env: {vars: {FROM: tree}}\n")  # nearer: wins
    top = write(tmp_path / "team" / "proj" / "recipe.yaml",
                PROJECT + "extends: [base/pytorch, shared, providers/sandbox]\n")
    monkeypatch.setenv("RELAUNCH_RECIPES", f"{tmp_path / 'nowhere'}{os.pathsep}{lib}")
    r = load_recipe(top)
    assert r.env.python == "3.12"                         # base/pytorch from $RELAUNCH_RECIPES
    assert r.env.vars["FROM"] == "tree"                   # shared.yaml one folder up, not the library's
    assert r.provider == "sandbox"                        # the shipped provider base
    assert r.env.installer == "uv"                        # later extends win over earlier ones
    shipped = recipes_dir() / "providers" / "sandbox.yaml"
    assert r.files == [str(lib / "base" / "pytorch.yaml"), str(tmp_path / "team" / "shared.yaml"),
                       str(shipped), str(top)]
    assert r.where("env.python") == f"{lib}/base/pytorch.yaml:1"
    assert r.where("env.installer").startswith(f"{shipped}:")


def test_merge_semantics_mappings_merge_lists_replace_this_file_last(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", "env:\n  python: '3.10'\n  apt: [git, curl]\n  vars: {A: a, B: a}\n"
                               "run: {workdir: ~/a, stop: {signal: INT, timeout: 30}}\n")
    write(tmp_path / "b.yaml", "env:\n  apt: [jq]\n  vars: {B: b, C: b}\nrun: {stop: {timeout: 60}}\n")
    write(tmp_path / "c.yaml", "checkpoint: {keep: 7}\n")
    r = load_recipe(write(tmp_path / "top.yaml", "name: p\nrun: {command: x}\nextends: [a, b.yaml, c]\n"
                                                 "env: {python: '3.11', vars: {C: top}}\n"
                                                 "checkpoint: {remote: s, keep: null}\n"))
    assert r.env.vars == {"A": "a", "B": "b", "C": "top"}         # deep merge, later wins
    assert r.env.apt == ["jq"]                                    # a list replaces the whole list
    assert r.env.python == "3.11" and r.run.workdir == "~/a"
    assert (r.run.stop.signal, r.run.stop.timeout) == ("INT", 60)  # nested mappings merge too
    assert r.checkpoint.keep == 2                                 # null: back to the default


def test_a_cycle_through_names_is_exit_2_with_the_chain(tmp_path: Path) -> None:
    a = write(tmp_path / "a.yaml", PROJECT + "extends: [b]\n")
    b = write(tmp_path / "b.yaml", "extends:\n  - a\n")
    assert error_of(a) == f"{b}:2: extends: cycle: {a} -> {b} -> {a}"
    out = run_cli("check", str(a), home=tmp_path / "home")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[0] == f"Error: {b}:2: extends: cycle: {a} -> {b} -> {a}"


def test_a_missing_name_shows_the_chain_and_where_it_looked(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAUNCH_RECIPES", str(tmp_path / "lib"))
    top = write(tmp_path / "top.yaml", PROJECT + "extends: [mid.yaml]\n")
    mid = write(tmp_path / "mid.yaml", "env: {python: '3.11'}\nextends: [base/nope]\n")
    message = error_of(top)
    assert message == (
        f"{mid}:2: extends: no recipe named base/nope: looked for base/nope.yaml in {tmp_path} and each "
        f"folder above it, {tmp_path / 'lib'} ($RELAUNCH_RECIPES), {recipes_dir()} (shipped with relaunch) "
        f"(extended by {top} -> {mid})")
    bad = write(tmp_path / "bad.yaml", PROJECT + "extends: [base/../x]\n")
    assert "neither a recipe name" in error_of(bad)


# --- --explain ------------------------------------------------------------------------------------

def test_explain_names_file_line_preset_default_and_set(tmp_path: Path) -> None:
    base = write(tmp_path / "team" / "base.yaml", "provider: lambda\nenv:\n  python: '3.11'\n  vars: {TEAM: t}\n")
    # The name team/base is looked up in proj/ (no team/base.yaml there), then in the folder above.
    top = write(tmp_path / "proj" / "recipe.yaml", PROJECT + "extends: [team/base]\nenv: {vars: {P: p}}\n")
    out = run_cli("check", str(top), "--explain", "--set", "checkpoint.keep=5", home=tmp_path / "home")
    assert out.returncode == 0, out.stderr
    lines: dict[str, str] = {}          # the first line of each key name (run.command before recover.command)
    for line in out.stdout.splitlines():
        if not line.startswith("#"):
            lines.setdefault(line.split(":")[0].strip(), line)
    assert lines["provider"].endswith(f"# {base}:1")
    assert lines["user"].split("#")[0].strip() == "user: ubuntu" and lines["user"].endswith("# preset lambda")
    assert lines["keep"].endswith("# --set") and "keep: 5" in lines["keep"]
    assert lines["layout"].endswith("# default") and lines["venv"].startswith("  venv: ~/venvs/p ")
    assert lines["TEAM"].endswith(f"# {base}:4") and lines["P"].endswith(f"# {top}:5")
    assert lines["command"].endswith(f"# {top}:2")
    assert out.stdout.startswith(f"# merged from {tmp_path}/proj/../team/base.yaml, then {top}\n".replace(
        "/proj/..", ""))

    data = json.loads(run_cli("check", str(top), "--explain", "--json", home=tmp_path / "home").stdout)
    values = {v["key"]: v for v in data["values"]}
    assert values["ssh.port"] == {"key": "ssh.port", "value": 22, "from": "preset lambda"}
    assert values["env.vars.TEAM"]["from"] == f"{base}:4"
    assert data["files"] == [str(base), str(top)]


def line_of(path: Path, start: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if line.lstrip().startswith(start))


def test_every_value_of_a_recipe_is_explained(tmp_path: Path) -> None:
    nlp, base = TEAM / "nlp" / "recipe.yaml", TEAM / "base.yaml"
    r = load_recipe(nlp, ["run.workdir=~/w"])
    got = {e.dotted: e.origin for e in explain(r)}
    assert got["checkpoint.keep"] == f"{nlp}:{line_of(nlp, 'keep:')}"
    assert got["checkpoint.pattern"] == f"{base}:{line_of(base, 'pattern:')}"
    assert got["templates"] == f"{base}:{line_of(base, 'templates:')}"
    assert got["run.workdir"] == "--set"
    assert got["ssh.user"] == "preset sandbox" and got["run.session"] == "default"


# --- plain check: the values a recipe sets, and the guesses its files mark -------------------------

def adopted_style(path: Path, data: dict, guesses: dict[str, str]) -> Path:
    """A recipe as `relaunch adopt` writes it (its own writer): a comment above every key, `GUESS:` on
    the ones in `guesses`."""
    notes = {key: (guesses.get(key, f"read {key}"), key in guesses) for key in [*_dotted(data), *guesses]}
    return write(path, recipe_text(data, notes, "Adopted by `relaunch adopt` (a test)"))


def _dotted(data: dict, prefix: str = "") -> list[str]:
    return [k for key, value in data.items()
            for k in (_dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"])]


def check_lines(*args: str, home: Path) -> tuple[dict[str, str], str]:
    """`relaunch check ARGS`: {dotted key: its line} of the values it lists, and what follows them."""
    out = run_cli("check", *args, home=home)
    assert out.returncode == 0, out.stderr
    head, _, rest = out.stdout.partition("  (")      # the values, then "(N more keys keep their defaults ...)"
    lines = head.splitlines()
    assert lines[0] == f"{args[0]}: ok (recipe {lines[0].rsplit(' ', 1)[1]}"
    return {line.split(":")[0].strip(): line for line in lines[1:]}, rest


def test_check_lists_every_value_set_with_its_source_and_adopts_guesses_until_confirmed(tmp_path: Path) -> None:
    data = {"name": "llama", "provider": "lambda", "env": {"python": "3.11", "vars": {"WANDB_MODE": "offline"}},
            "checkpoint": {"dir": "~/ckpt", "remote": "./store/llama"},
            "run": {"command": "python train.py --resume \"{{ checkpoint }}\"", "ready": "step \\d+"}}
    recipe = adopted_style(tmp_path / "recipe.yaml", data, {
        "run.command": "train.py:111 defines --resume; added so that `up` resumes",
        "run.ready": "its last output lines say 'step 377 loss 0.002271'", "env.vars": "the training's environment"})
    home, text = tmp_path / "home", recipe.read_text()
    at = {key: line_of(recipe, key.split(".")[-1] + ":") for key in ("run.command", "run.ready", "env.python")}
    got, rest = check_lines(str(recipe), home=home)
    assert got["run.command"].endswith(f"# {recipe}:{at['run.command']}, GUESS")
    assert got["run.ready"].endswith(f"# {recipe}:{at['run.ready']}, GUESS")
    assert got["env.vars.WANDB_MODE"].endswith(", GUESS")                 # a guessed mapping: each entry
    assert got["env.python"].endswith(f"# {recipe}:{at['env.python']}")    # read, not guessed
    assert got["ssh.user"].endswith("# preset lambda") and got["ssh.user"].split("#")[0].strip() == "ssh.user: ubuntu"
    assert "checkpoint.keep" not in got and rest.startswith(f"{len(explain(load_recipe(recipe))) - len(got)} more "
                                                            "keys keep their defaults")
    guesses = rest.split("\n", 1)[1]
    assert guesses.startswith("3 guess(es) left: check each, then delete `GUESS:` from the comment above its key\n")
    assert re.search(rf"\n  run.ready \({re.escape(str(recipe))}:{at['run.ready']}\) +its last output lines say "
                     r"'step 377 loss 0.002271'\n", guesses)

    data_out = json.loads(run_cli("check", str(recipe), "--json", home=home).stdout)
    assert {g["key"]: g["guess"] for g in data_out["guesses"]} == {
        "env.vars.WANDB_MODE": "the training's environment",
        "run.command": "train.py:111 defines --resume; added so that `up` resumes",
        "run.ready": "its last output lines say 'step 377 loss 0.002271'"}
    assert {v["key"]: v["from"] for v in data_out["values"]}["run.ready"] == f"{recipe}:{at['run.ready']}"

    # --set gives another value: no longer the guess; --explain marks the guesses in its fuller view
    explained = run_cli("check", str(recipe), "--explain", "--set", "run.ready=^step ", home=home)
    assert [line.split(":")[0].strip() for line in explained.stdout.splitlines() if line.endswith(", GUESS")] == \
        ["WANDB_MODE", "command"]
    assert "2 guess(es) left" in explained.stderr

    # the user confirms a guess by deleting its mark
    recipe.write_text(text.replace("# GUESS: its last output lines", "# its last output lines"))
    got, rest = check_lines(str(recipe), home=home)
    assert not got["run.ready"].endswith("GUESS") and got["run.command"].endswith("GUESS")
    assert "2 guess(es) left" in rest and "run.ready" not in rest
    recipe.write_text(text.replace("GUESS: ", ""))
    done = run_cli("check", str(recipe), home=home)
    assert "GUESS" not in done.stdout and "guess(es)" not in done.stdout


def test_check_names_each_values_file_line_through_extends_and_a_guess_a_later_file_replaced(tmp_path: Path) -> None:
    base = write(tmp_path / "team" / "base.yaml", "extends: [providers/runpod]\nenv:\n  # GUESS: the team's usual\n"
                 "  python: '3.10'\ncheckpoint:\n  # GUESS: picked by hand\n  keep: 4\n")
    top = write(tmp_path / "proj" / "recipe.yaml", PROJECT + "extends: [team/base]\nenv: {python: '3.11'}\n")
    got, rest = check_lines(str(top), "--set", "run.workdir=~/w", home=tmp_path / "home")
    assert got["env.python"].endswith(f"# {top}:5")                      # this file wins: its value, no guess
    assert got["checkpoint.keep"].endswith(f"# {base}:7, GUESS")        # the base's guess stands
    assert got["checkpoint.dir"].startswith("  checkpoint.dir: /workspace/ckpt/{{ name }} ")   # runpod's base
    assert "# " + str(recipes_dir() / "providers" / "runpod.yaml") + ":" in got["checkpoint.dir"]
    assert got["ssh.port"].endswith("# preset runpod") and got["run.workdir"].endswith("# --set")
    assert got["run.command"].endswith(f"# {top}:2")
    assert "\n1 guess(es) left" in rest and f"checkpoint.keep ({base}:7)  picked by hand" in rest


# --- templates a team overrides -------------------------------------------------------------------

def test_override_replaces_by_name_and_includes_resolve_through_it(tmp_path: Path) -> None:
    folder = tmp_path / "tpl"
    write(folder / "prelude.sh.j2", "echo team-prelude {{ name | q }}\n{% include 'shipped/prelude.sh.j2' %}")
    write(folder / "facts.sh", "echo team-facts\n")
    values = dict(name="job", session="job", command="true", workdir="~", venv="~/v", secrets_file="~/s",
                  start_mark="=== ",
                  exports={}, log="~/l", status_file="~/st", pgid_file="~/pg", python_path="~/py", stop_signal="TERM",
                  notice_file="~/n")
    shipped = scripts.render("run.sh.j2", **values)
    mine = scripts.render("run.sh.j2", templates=folder, **values)
    # run.sh.j2 is shipped, but its `include "prelude.sh.j2"` finds the team's prelude first.
    assert "team-prelude job" not in shipped and "echo team-prelude job\n" in mine
    assert mine.replace("echo team-prelude job\n", "") == shipped
    assert scripts.plain("facts.sh", folder) == "echo team-facts\n"
    assert scripts.plain("facts.sh") == (REPO / "templates" / "facts.sh").read_text()


@pytest.mark.parametrize("name, text, problem", [
    ("run.sh.jj2", "x", "run.sh.jj2 is not one of relaunch's instance scripts (did you mean run.sh.j2?)"),
    ("run.sh.j2", "{% if %}", "run.sh.j2:1: template syntax error:"),
    ("run.sh.j2", "{% include 'nope.j2' %}", "includes 'nope.j2', which is neither in the folder"),
    ("setup.sh.j2", "{{ command }}", "uses command, which setup.sh.j2 is not given"),
])
def test_a_bad_templates_folder_is_exit_2_at_check(tmp_path: Path, name: str, text: str, problem: str) -> None:
    write(tmp_path / "tpl" / name, text)
    top = write(tmp_path / "r.yaml", PROJECT + "env: {python: '3.11'}\ntemplates: tpl\n")
    message = error_of(top)
    assert message.startswith(f"{top}:5: templates: {tmp_path / 'tpl'}/") and problem in message
    out = run_cli("check", str(top), home=tmp_path / "home")
    assert out.returncode == 2 and "Traceback" not in out.stderr and problem in out.stderr


def test_templates_folder_must_exist(tmp_path: Path) -> None:
    top = write(tmp_path / "r.yaml", PROJECT + "env: {python: '3.11'}\ntemplates: ./gone\n")
    assert error_of(top) == f"{top}:5: templates: folder {tmp_path / 'gone'} does not exist"


# --- init -----------------------------------------------------------------------------------------

@pytest.mark.sandbox  # a minute of CLI runs: one per provider and layout
def test_init_writes_a_recipe_that_passes_check_for_every_provider_and_layout(tmp_path: Path) -> None:
    home = tmp_path / "home"
    providers = [None, *load_providers()]
    # Every provider and every layout at least once (the options do not interact).
    for n in range(max(len(providers), len(LAYOUTS))):
        provider, layout = providers[n % len(providers)], LAYOUTS[n % len(LAYOUTS)]
        folder = tmp_path / f"{provider}-{layout}"
        folder.mkdir()
        out = run_cli("init", str(folder / "recipe.yaml"), "--layout", layout,
                      *(["--provider", provider] if provider else []), home=home)
        assert out.returncode == 0, out.stderr
        check = run_cli("check", str(folder / "recipe.yaml"), "--json", home=home)
        assert check.returncode == 0, check.stderr
        assert json.loads(check.stdout)["ok"] is True
        r = load_recipe(folder / "recipe.yaml")
        assert (r.provider, r.checkpoint.layout, r.env.installer) == (provider, layout, "uv")


def init_here(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`relaunch init ARGS` run in `folder`, as a user in their project folder runs it."""
    return subprocess.run([sys.executable, "-m", "relaunch.cli", "init", *args], capture_output=True, text=True,
                          cwd=folder, env={**os.environ, "RELAUNCH_HOME": str(folder / "home")}, timeout=60)


def test_init_default_path_refuses_to_overwrite_and_keeps_old_spellings(tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = init_here(tmp_path)
    assert first.returncode == 0 and (tmp_path / "recipe.yaml").is_file()
    before = (tmp_path / "recipe.yaml").read_text()
    again = init_here(tmp_path, "--provider", "aws")
    assert again.returncode == 2 and "recipe.yaml exists; not overwriting it" in again.stderr
    assert (tmp_path / "recipe.yaml").read_text() == before
    old = run_cli("init", "-o", str(tmp_path / "old.yaml"), "--remote", "rclone:s3:bucket/run", home=home)
    assert old.returncode == 0 and load_recipe(tmp_path / "old.yaml").checkpoint.remote == "rclone:s3:bucket/run"
    printed = run_cli("init", "-", home=home)
    assert printed.returncode == 0 and printed.stdout.startswith("# A relaunch recipe.")
    bad = run_cli("init", str(tmp_path / "x.yaml"), "--remote", "hf:nope", home=home)
    assert bad.returncode == 2 and not (tmp_path / "x.yaml").exists()


STEPS = """import time
# a trainer with no ready line in its recipe: a line per step, as most print them
for step in range(1, 10**6):
    time.sleep(0.2)
    print(f"step {step} loss {1 / step:.4f}", flush=True)
"""
DIES = """import time
print("loading the model; resuming at step 40", flush=True)   # a step number once: no step ran
time.sleep(8)
raise SystemExit("RuntimeError: CUDA out of memory")
"""


def starter(folder: Path, key: Path, program: str, *provider: str) -> Path:
    """`relaunch init` as a user takes it: only its program (train.py), the store and the key written;
    run.ready, run.grace and run.metrics as the starter leaves them (commented out)."""
    recipe = folder / "recipe.yaml"
    made = run_cli("init", str(recipe), *provider, home=folder / "home")
    assert made.returncode == 0, made.stderr
    assert "\n  # ready: " in recipe.read_text() and "\n  # grace: 60 " in recipe.read_text()
    data = yaml.safe_load(recipe.read_text())
    assert set(data["run"]) == {"command", "workdir"} and "train.py" in data["run"]["command"]
    data["env"]["files"] = {"train.py": "~/work/train.py"}
    data["checkpoint"]["remote"] = str(folder / "store")
    data["ssh"] = {"key": str(key)}
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    (folder / "train.py").write_text(program)
    return recipe


def test_up_from_inits_starter_returns_when_the_step_goes_up_and_a_command_dying_first_is_exit_4(
        tmp_path: Path, sandbox, ssh, ssh_key: Path) -> None:
    """No ready line in the starter: `up` does not sit through run.grace once two log lines show the
    step going up (run.metrics.step); one that dies before any step ran is still exit 4."""
    home, box = tmp_path / "home", sandbox()
    recipe = starter(tmp_path / "trains", ssh_key, STEPS, "--provider", "sandbox")
    up = run_cli("up", str(recipe), box.host, home=home)
    assert up.returncode == 0, up.stderr
    assert "watching the command for 60s (run.grace) to see it start, or until its log shows the step going up " \
           "(run.metrics.step 'step (\\\\d+)')" in up.stderr
    proof = re.search(r"training is running in tmux session my-run \(fresh start; the step in its log went up: "
                      r"'step (\d+) loss [\d.]+'\)", up.stderr)
    assert proof and int(proof[1]) >= 2, up.stderr
    assert "alive after" not in up.stderr
    ssh(box, "tmux has-session -t =my-run")

    recipe = starter(tmp_path / "dies", ssh_key, DIES)          # the starter without a provider
    died = run_cli("up", str(recipe), box.host, "--set", "name=dies", home=home)
    assert died.returncode == 4, died.stderr
    assert "the command died" in died.stderr and "CUDA out of memory" in died.stderr
    assert "training is running" not in died.stderr


# --- the provider catalogue -----------------------------------------------------------------------

def test_catalogue_has_a_dozen_real_providers_each_fact_with_a_source(tmp_path: Path) -> None:
    presets = load_providers()
    real = {n: p for n, p in presets.items() if n not in ("generic", "sandbox")}
    assert len(real) >= 12
    for name, p in real.items():
        assert p.reclaim_notice in ("", *RECLAIM_NOTICES)
        assert all(s.startswith("https://") for s in p.sources)
        if p.disk_survives_stop is not None or p.reclaim_notice:
            assert p.sources, f"{name}: a fact with no source"
    assert {"aws", "gcp", "azure"} <= {n for n, p in real.items() if p.reclaim_notice == n}
    data = json.loads(run_cli("providers", "--json", home=tmp_path).stdout)
    assert data["aws"]["reclaim_notice"] == "aws" and data["aws"]["sources"]
    assert data["gcp"]["user"] is None and data["vast"]["disk_survives_stop"] is True
    text = run_cli("providers", home=tmp_path).stdout
    assert text.splitlines()[0].split() == ["provider", "user", "port", "disk", "kept", "notice", "notes"]
    assert any(line.split()[:6] == ["aws", "ubuntu", "22", "yes", "aws", "ubuntu"] for line in text.splitlines())


# --- conventions: --json errors, --version, completion --------------------------------------------

def test_json_errors_on_stdout_with_the_exit_code(tmp_path: Path) -> None:
    home = tmp_path / "home"
    bad = write(tmp_path / "r.yaml", PROJECT + "env: {python: 3.10}\n")
    out = run_cli("check", str(bad), "--json", home=home)
    assert out.returncode == 2
    assert json.loads(out.stdout) == {"error": f'{bad}:4: env.python: write it as a quoted string: "3.10"',
                                      "hint": None, "exit": 2, "refused": False}
    usage = run_cli("up", "--json", home=home)  # click's own usage error
    assert usage.returncode == 2 and json.loads(usage.stdout)["error"] == "Missing argument 'RECIPE'."
    unreachable = run_cli("status", str(TEAM / "vision" / "recipe.yaml"), "root@127.0.0.1:1", "--json",
                          "--set", "ssh.wait=0", home=home)
    assert unreachable.returncode == 3 and json.loads(unreachable.stdout)["exit"] == 3
    # `--json` as the value of --set is data, not the flag: a plain-text error, nothing on stdout.
    plain = run_cli("check", str(bad), "--set", "--json", home=home)
    assert plain.returncode == 2 and plain.stdout == ""


def test_version_lists_the_tools_and_survives_their_absence(tmp_path: Path) -> None:
    out = run_cli("--version", home=tmp_path)
    assert out.returncode == 0
    found = dict(line.split(None, 1) for line in out.stdout.splitlines())
    assert found["relaunch"] == "0.1.0" and set(found) >= {"ssh", "rsync", "tmux", "rclone", "hf", "uv"}
    assert found["tmux"][0].isdigit() and found["ssh"].startswith("OpenSSH")
    bare = run_cli("--version", home=tmp_path, env={"PATH": str(tmp_path / "empty")})
    assert bare.returncode == 0
    found = dict(line.split(None, 1) for line in bare.stdout.splitlines())
    assert found["ssh"] == "not found" and found["tmux"] == "not found"


def test_set_completes_recipe_keys(tmp_path: Path) -> None:
    out = run_cli(home=tmp_path, env={"_RELAUNCH_COMPLETE": "bash_complete",
                                      "COMP_WORDS": "relaunch up r.yaml --set checkpoint.ke", "COMP_CWORD": "4"})
    assert out.stdout.splitlines() == ["plain,checkpoint.keep="]
    out = run_cli(home=tmp_path, env={"_RELAUNCH_COMPLETE": "bash_complete",
                                      "COMP_WORDS": "relaunch check r.yaml --set run.s", "COMP_CWORD": "4"})
    assert out.stdout.splitlines() == ["plain,run.session=", "plain,run.stop=", "plain,run.stop.signal=",
                                       "plain,run.stop.timeout="]


# --- the shipped team example, end to end ---------------------------------------------------------

def test_team_projects_run_on_a_sandbox_with_the_team_launch_wrapper(tmp_path: Path, sandbox, ssh,
                                                                     ssh_key: Path) -> None:
    team = tmp_path / "team"
    shutil.copytree(TEAM, team, ignore=shutil.ignore_patterns("store"))
    home = tmp_path / "home"
    box = sandbox()
    host = f"root@{box.address}:{box.port}"
    key = ["--set", f"ssh.key={ssh_key}", "--set", f"ssh.host_key={box.host_key_fingerprint}"]

    plan = run_cli("plan", str(team / "vision" / "recipe.yaml"), host, *key, home=home)
    assert plan.returncode == 0, plan.stderr
    assert 'team launch: team-vision in tmux session team-vision" >> "$HOME/team-launches.log"' in plan.stdout

    for project in ("vision", "nlp"):  # vision names its base, nlp gives its path
        up = run_cli("up", str(team / project / "recipe.yaml"), host, *key, home=home)
        assert up.returncode == 0, up.stdout + up.stderr
    launches = ssh(box, "cat ~/team-launches.log").stdout
    assert "team launch: team-vision in tmux session team-vision" in launches
    assert "team launch: team-nlp in tmux session team-nlp" in launches
    for name, project in (("team-vision", "vision"), ("team-nlp", "nlp")):
        ssh(box, f"tmux has-session -t ={name}")
        newest = wait_for(f"a checkpoint of {name}", lambda n=name: ssh(
            box, f"ls ~/ckpt/{n}/ckpt-*.pt 2>/dev/null | tail -n 1", check=False).stdout.strip(), timeout=120)
        # The base's vars (TEAM, CKPT_DIR) and the project's (PROJECT) both reached the trainer.
        assert json.loads(ssh(box, f"cat {newest}").stdout)["project"] == project
        log = ssh(box, f"cat ~/{name}.log").stdout
        assert f"ml-research/{project}: training to step" in log

