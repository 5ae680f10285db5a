"""`relaunch adopt`'s reading, pure: facts in (as templates/adopt.py reports them), recipe out.

The runs here are the ones the real trainers make (HF Trainer under torchrun, Lightning's
ModelCheckpoint, `accelerate launch`, `python -m`), written as the facts the instance script
reports about them; what adopt makes of them is checked, and every recipe it writes must load
and pass `relaunch check`. The instance-side script's secret handling is checked by running
its own functions.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from relaunch.adopt.candidates import candidates, on_gpus
from relaunch.adopt.commandline import invocation
from relaunch.adopt.environment import lock_lines
from relaunch.adopt.facts import Detail, Scan
from relaunch.adopt.places import plan_places, scanned_places
from relaunch.adopt.reading import Context, read
from relaunch.adopt.recipe_text import recipe_text
from relaunch.adopt.words import shell_word
from relaunch.layouts import Entry
from relaunch.recipe import check_recipe, load_recipe
from relaunch.recipe.explain import explain
from relaunch.resources import templates_dir

HOME = "/home/ubuntu"
VENV = f"{HOME}/venv"


def proc(pid: int, ppid: int, argv: list[str], *, python: bool = True, cwd: str = f"{HOME}/work",
         **more: Any) -> dict[str, Any]:
    base = {"pid": pid, "ppid": ppid, "comm": "python3" if python else argv[0].rsplit("/", 1)[-1], "state": "S",
            "start": 1000.0, "uid": 1000, "user": "ubuntu", "argv": argv}
    if python:
        base |= {"python": True, "exe": "/usr/bin/python3.11", "cwd": cwd, "argv0": f"{VENV}/bin/python",
                 "argv0_root": VENV, "mapped": [VENV], "nvidia": [], "fd1": "/dev/pts/1", "home": HOME}
    return base | more


def scan(procs: list[dict[str, Any]], panes: list[dict[str, Any]] = (), gpus: dict[str, Any] | None = None,
         **more: Any) -> Scan:
    return Scan.from_dict({"self": 99999, "mine": [], "uid": 1000, "user": "ubuntu", "home": HOME, "hostname": "box",
                           "login_env": ["PATH", "HOME"], "dmi": {}, "procs": procs,
                           "tmux": [{"socket": "/tmp/tmux-1000/default", "error": "", "panes": list(panes)}],
                           "screen": [], "gpus": gpus or {"smi": False, "error": "", "list": [], "apps": []},
                           "secret_names": []} | more)


def pane(session: str, pid: int) -> dict[str, Any]:
    return {"session": session, "created": 1000, "window": "0", "pane": "0", "id": "%0", "pid": pid, "dead": False,
            "path": f"{HOME}/work", "start": ""}


def detail(pid: int, *, files: dict[str, str] | None = None, sources: dict[str, str] | None = None,
           env: list[dict[str, Any]] = (), dists: list[dict[str, Any]] = (), output: list[str] = (),
           pip_config: list[tuple[str, str]] = ()) -> Detail:
    files, sources = files or {}, sources or {}
    paths = [{"path": p, "kind": "f", "size": len(t), "text": t, "why": ""} for p, t in files.items()]
    return Detail.from_dict({
        "pid": pid, "alive": True, "env": list(env), "base_kind": "tmux",
        "prefix": {"path": VENV, "exists": True, "pyvenv": {"version": "3.11.2", "home": "/usr/bin"}, "conda": False,
                   "site": [f"{VENV}/lib/python3.11/site-packages"],
                   "dists": list(dists) or [{"name": "torch", "version": "2.13.0", "direct": None}]},
        "pip_config": [{"path": p, "text": t} for p, t in pip_config], "paths": paths,
        "sources": [{"path": p, "text": t, "why": ""} for p, t in sources.items()], "sources_capped": False,
        "checkpoint_folders": [], "output": {"from": "tmux capture-pane", "lines": list(output)}, "secret_names": []})


def entries(*names: str) -> list[Entry]:
    out, dirs = [], set()
    for name in names:
        parts = name.split("/")
        for n in range(1, len(parts)):
            dirs.add("/".join(parts[:n]))
        out.append(Entry(name, "f", 100, 2000.0))
    return [Entry(d, "d", 0, 2000.0) for d in sorted(dirs)] + out


def adopted(s: Scan, d: Detail, listings: dict[str, list[Entry]], tmp_path: Path, **ctx: Any) -> tuple[Any, dict]:
    """What adopt writes for this run: the Adoption and the recipe as loaded back (after `check`)."""
    found, _ = candidates(s)
    assert len(found) == 1
    c = found[0]
    context = Context(host="ubuntu@203.0.113.7", user="ubuntu", home=HOME, **ctx)
    text = "\n".join(filter(None, [d.paths[p].text for p in d.paths] + [t.text or "" for t in d.sources.values()]))
    named = plan_places(s, c, d.paths, text, HOME)
    scanned = scanned_places(d.folders, named)
    a = read(s, c, d, {p: v for p, v in listings.items()}, context, named, scanned)
    for local, content in a.files.items():
        (tmp_path / local).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / local).write_text(content)
    (tmp_path / "requirements.lock").write_text("\n".join(a.lock) + "\n")
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_text(a.data, a.notes, "test"))
    r = load_recipe(path)
    check_recipe(r)
    # `relaunch check` reads back every guess adopt marked, and nothing else as one
    guessed = [key for key, (_, guess) in a.notes.items() if guess]
    values = explain(r)
    assert {e.dotted for e in values if e.guess} == \
        {e.dotted for e in values if any(e.dotted == k or e.dotted.startswith(k + ".") for k in guessed)}
    return a, yaml.safe_load(path.read_text())


# -- command lines ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, launcher, kind, target, args", [
    ([f"{VENV}/bin/python", "-u", "train.py", "--lr", "1"], "", "script", "train.py", ["--lr", "1"]),
    ([f"{VENV}/bin/python", "-m", "pkg.train", "--x"], "", "module", "pkg.train", ["--x"]),
    ([f"{VENV}/bin/python", "-um", "pkg.train"], "", "module", "pkg.train", []),
    ([f"{VENV}/bin/python", f"{VENV}/bin/torchrun", "--standalone", "--nproc_per_node=2", "train.py", "--a", "b"],
     "torchrun", "script", "train.py", ["--a", "b"]),
    ([f"{VENV}/bin/python", "-m", "torch.distributed.run", "--nproc-per-node", "4", "-m", "pkg.main", "--c"],
     "torchrun", "module", "pkg.main", ["--c"]),
    ([f"{VENV}/bin/python", f"{VENV}/bin/accelerate", "launch", "--num_processes", "2", "--config_file", "a.yaml",
      "train.py", "--project_dir", "out"], "accelerate", "script", "train.py", ["--project_dir", "out"]),
])
def test_the_program_behind_launchers(argv, launcher, kind, target, args) -> None:
    call = invocation(argv)
    assert (call.launcher, call.kind, call.target, call.args) == (launcher, kind, target, args)


def test_shell_words_keep_the_home_portable_secrets_by_name_and_jinja_literal() -> None:
    assert shell_word(f"{HOME}/ckpt", HOME) == "~/ckpt"
    assert shell_word(f"--out={HOME}/my runs", HOME) == "--out={{ home }}/'my runs'"
    assert shell_word("--token=\0HF_TOKEN\0", HOME) == '--token="${HF_TOKEN}"'
    assert shell_word("{{ not a template }}", HOME) == "{% raw %}'{{ not a template }}'{% endraw %}"
    assert shell_word("", HOME) == "''"


# -- which process -------------------------------------------------------------------------------------
def test_gpu_users_win_tools_and_relaunch_own_processes_are_no_candidates() -> None:
    s = scan([proc(10, 1, ["tmux", "new", "-d"], python=False),
              proc(11, 10, ["bash"], python=False),
              proc(12, 11, [f"{VENV}/bin/python", "train.py", "--out", "a"], nvidia=["/dev/nvidia0"]),
              proc(13, 12, [f"{VENV}/bin/python", "train.py", "--out", "a"]),          # a data loader worker
              proc(20, 10, [f"{VENV}/bin/python", "eval.py"]),
              proc(30, 10, ["/usr/bin/python3", f"{HOME}/.relaunch/x/guard.py", "cfg"]),
              proc(31, 10, [f"{VENV}/bin/python", f"{VENV}/bin/tensorboard", "--logdir", "runs"]),
              proc(40, 1, ["/usr/bin/python3", "/usr/lib/somed/somed.py"], uid=0, argv0_root="", mapped=[],
                   exe="/usr/bin/python3.11")],
             panes=[pane("train", 11), pane("eval", 20), pane("guard", 30), pane("tb", 31)])
    found, skipped = candidates(s)
    assert sorted(c.root.pid for c in found) == [12, 20]
    assert {c.root.pid: [t.pid for t in c.tree] for c in found}[12] == [12, 13]
    assert any("relaunch's own" in line for line in skipped) and any("tensorboard" in line for line in skipped)
    assert any("system service" in line for line in skipped)
    pool, off = on_gpus(found)
    assert [c.session for c in pool] == ["train"] and [c.session for c in off] == ["eval"]


# -- the trainers: a recipe for each ---------------------------------------------------------------------
HF_SCRIPT = """
from transformers import HfArgumentParser, Trainer, TrainingArguments
parser = HfArgumentParser((TrainingArguments,))
(args,) = parser.parse_args_into_dataclasses()
trainer = Trainer(args=args)
trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
"""


def test_hf_trainer_under_torchrun(tmp_path) -> None:
    argv = [f"{VENV}/bin/python", f"{VENV}/bin/torchrun", "--nproc_per_node", "2", "train_hf.py",
            "--enable_jit_checkpoint", "--output_dir", f"{HOME}/out", "--save_steps", "10"]
    s = scan([proc(10, 1, ["bash"], python=False), proc(11, 10, argv),
              proc(12, 11, [f"{VENV}/bin/python", "-u", "train_hf.py"]),
              proc(13, 11, [f"{VENV}/bin/python", "-u", "train_hf.py"])], panes=[pane("hf", 10)])
    d = detail(11, files={f"{HOME}/work/train_hf.py": HF_SCRIPT},
               output=["{'loss': 1.23, 'grad_norm': 0.5, 'learning_rate': 5e-05, 'epoch': 0.1}"])
    a, recipe = adopted(s, d, {f"{HOME}/out": entries("checkpoint-10/trainer_state.json", "checkpoint-10/model.pt",
                                                      "checkpoint-20/model.pt")}, tmp_path)
    assert recipe["checkpoint"]["dir"] == "~/out" and recipe["checkpoint"]["layout"] == "hf-trainer"
    assert recipe["run"]["nproc_per_node"] == 2
    assert recipe["run"]["command"] == (
        "torchrun --nproc_per_node {{ nproc_per_node }} train_hf.py --enable_jit_checkpoint --output_dir ~/out "
        '--save_steps 10 {% if checkpoint %}--resume_from_checkpoint "{{ checkpoint }}"{% endif %}')
    assert "vars" not in recipe["env"]          # torchrun's shutdown timeout follows run.stop.timeout
    assert a.newest == "checkpoint-10"             # checkpoint-20 has no trainer_state.json: not complete
    assert recipe["run"]["ready"] == r"\{'loss': "
    guesses = {e.dotted: e.guess for e in explain(load_recipe(tmp_path / "recipe.yaml")) if e.guess}
    assert set(guesses) == {"run.command", "run.ready"}, guesses      # the resume argument added, the ready line
    assert "--resume_from_checkpoint" in guesses["run.command"] and "{'loss': 1.23" in guesses["run.ready"]


LIGHTNING_SCRIPT = """
import argparse
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from model import Net
p = argparse.ArgumentParser()
p.add_argument("--ckpt_path", default=None)
a = p.parse_args()
trainer = L.Trainer(callbacks=[ModelCheckpoint(dirpath="ckpts", every_n_train_steps=10, save_last=True)])
trainer.fit(Net(), ckpt_path=a.ckpt_path)
"""


def test_lightning_with_a_checkpoint_folder_named_in_the_script(tmp_path) -> None:
    s = scan([proc(10, 1, ["bash"], python=False), proc(11, 10, [f"{VENV}/bin/python", "fit.py"])],
             panes=[pane("pl", 10)])
    d = detail(11, files={f"{HOME}/work/fit.py": LIGHTNING_SCRIPT},
               sources={f"{HOME}/work/fit.py": LIGHTNING_SCRIPT, f"{HOME}/work/model.py": "import torch\n",
                        f"{HOME}/work/unused.py": "x = 1\n"})
    a, recipe = adopted(s, d, {f"{HOME}/work/ckpts": entries("epoch=0-step=10.ckpt", "last.ckpt")}, tmp_path)
    assert recipe["checkpoint"]["dir"] == "~/work/ckpts" and recipe["checkpoint"]["layout"] == "lightning"
    assert "dirpath = 'ckpts'" in a.notes["checkpoint.dir"][0]
    assert recipe["run"]["command"] == 'python fit.py {% if checkpoint %}--ckpt_path "{{ checkpoint }}"{% endif %}'
    assert recipe["env"]["files"] == {"fit.py": "~/work/fit.py", "model.py": "~/work/model.py"}


def test_accelerate_launch_with_its_default_config_and_project_dir(tmp_path) -> None:
    config = f"{HOME}/.cache/huggingface/accelerate/default_config.yaml"
    argv = [f"{VENV}/bin/python", f"{VENV}/bin/accelerate", "launch", "--multi_gpu", "--num_processes=2",
            "train_acc.py", "--project_dir", "acc", "--resume", ""]
    s = scan([proc(10, 1, ["bash"], python=False), proc(11, 10, argv)], panes=[pane("acc", 10)])
    d = detail(11, files={f"{HOME}/work/train_acc.py": "from accelerate import Accelerator\n",
                          config: "compute_environment: LOCAL_MACHINE\nnum_processes: 2\n"})
    _, recipe = adopted(s, d, {f"{HOME}/work/acc": entries("checkpoints/checkpoint_0/model.safetensors")}, tmp_path)
    assert recipe["checkpoint"]["dir"] == "~/work/acc" and recipe["checkpoint"]["layout"] == "accelerate"
    # --num_processes counts the processes of every machine; --multi_gpu refuses one process
    assert recipe["run"]["command"] == ('accelerate launch {% if world_size > 1 %}--multi_gpu{% endif %} '
                                        '--num_processes={{ world_size }} train_acc.py '
                                        '--project_dir acc --resume "{{ checkpoint }}"')
    assert recipe["run"]["nproc_per_node"] == 2
    # the launcher's shutdown timeout is not written: the run script exports it from run.stop.timeout
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in recipe["env"].get("vars", {})
    assert recipe["env"]["files"][".cache/huggingface/accelerate/default_config.yaml"] == \
        "~/.cache/huggingface/accelerate/default_config.yaml"


def test_python_m_module_and_environment_variables(tmp_path) -> None:
    argv = [f"{VENV}/bin/python", "-m", "proj.train", "--out", "runs", "--hub-token", "\0HUB_TOKEN\0"]
    s = scan([proc(10, 1, ["bash"], python=False), proc(11, 10, argv)], panes=[pane("mod", 10)])
    env = [{"name": "CUDA_VISIBLE_DEVICES", "secret": False, "value": "0,1", "in_base": True, "same": True},
           {"name": "DATA", "secret": False, "value": f"{HOME}/data", "in_base": False, "same": False},
           {"name": "EDITOR", "secret": False, "value": "vim", "in_base": True, "same": True},
           {"name": "WANDB_API_KEY", "secret": True, "value": None, "in_base": True, "same": True}]
    d = detail(11, env=env, sources={f"{HOME}/work/proj/__init__.py": "", f"{HOME}/work/proj/train.py":
                                     "from .data import load\n", f"{HOME}/work/proj/data.py": "def load(): pass\n"})
    _, recipe = adopted(s, d, {}, tmp_path)
    assert recipe["run"]["command"] == 'python -m proj.train --out runs --hub-token "${HUB_TOKEN}"'
    assert recipe["env"]["vars"] == {"CUDA_VISIBLE_DEVICES": "0,1", "DATA": "{{ home }}/data"}
    assert recipe["env"]["secrets"] == ["HUB_TOKEN", "WANDB_API_KEY"]
    assert set(recipe["env"]["files"]) == {"proj/__init__.py", "proj/train.py", "proj/data.py"}
    assert recipe["checkpoint"]["dir"] == "~/work/runs"            # guessed from --out, nothing there


PIP_FILES = [(f"{VENV}/pip.conf", "[global]\nindex-url = https://venv/simple\n"),       # the scan's order:
             (f"{HOME}/.config/pip/pip.conf",                                           # the file that wins first
              "[install]\nindex-url = https://user/simple\nextra-index-url = https://extra/simple\n")]


@pytest.mark.parametrize("config, env, index_url, extra, where", [
    # pip's own resolution: a key in [install] of any file over one in [global], not the first file read
    (PIP_FILES, [], "https://user/simple", ["https://extra/simple"], "pip.conf [install] index-url"),
    # uv's file is uv's view, the recipe's installer's: pip's default becomes one more index
    ([*PIP_FILES, (f"{HOME}/.config/uv/uv.toml", '[[index]]\nurl = "https://uv/simple"\ndefault = true\n')], [],
     "https://uv/simple", ["https://user/simple", "https://extra/simple"], "uv.toml [[index]]"),
    # uv.toml naming only an extra index: the default one is named too, or the recipe would lose it
    ([(f"{HOME}/.config/uv/uv.toml", '[[index]]\nurl = "https://cu/whl"\n')], [],
     "https://pypi.org/simple", ["https://cu/whl"], "uv's default index"),
    (PIP_FILES, [{"name": "PIP_INDEX_URL", "secret": False, "value": "https://env/simple", "in_base": False,
                  "same": False}], "https://env/simple", ["https://extra/simple"],
     "PIP_INDEX_URL in the training's environment"),
])
def test_the_package_index_is_read_as_pip_and_uv_resolve_it(tmp_path, config, env, index_url, extra, where) -> None:
    argv = [f"{VENV}/bin/python", "train.py"]
    s = scan([proc(10, 1, ["bash"], python=False), proc(11, 10, argv)], panes=[pane("idx", 10)])
    a, recipe = adopted(s, detail(11, pip_config=config, env=env), {}, tmp_path)
    assert recipe["env"]["index_url"] == index_url
    assert recipe["env"].get("extra_index_urls", []) == extra
    assert where in a.notes["env.index_url"][0]


def test_an_index_variable_holding_credentials_is_not_read(tmp_path) -> None:
    argv = [f"{VENV}/bin/python", "train.py"]
    s = scan([proc(10, 1, ["bash"], python=False), proc(11, 10, argv)], panes=[pane("idx", 10)])
    env = [{"name": "UV_INDEX_URL", "secret": True, "value": None, "in_base": False, "same": False}]
    a, recipe = adopted(s, detail(11, pip_config=PIP_FILES, env=env), {}, tmp_path)
    assert "index_url" not in recipe["env"]
    assert any("UV_INDEX_URL holds credentials (not read)" in w for w in a.warnings)


# the three places a token sits in an index URL, and URLs that hold none
USERINFO = "https://me:s3cr3t-t0ken@private.example.com/simple"
IN_PATH = "https://dl.cloudsmith.io/3b7bf1e5a3c2a8f7/team/repo/python/simple/"
IN_QUERY = "https://pypi.team.example/simple?token=q7Secret"


def test_an_index_with_a_credential_of_any_shape_is_named_by_a_variable_never_written(tmp_path) -> None:
    """adopt writes an index whose URL holds a token (userinfo, path segment, query) as ${NAME} and
    says which variable to set; the token never leaves the instance (the scan scrubs it)."""
    m = _instance_script()
    text = f"[global]\nindex-url = {IN_PATH}\nextra-index-url = {USERINFO}\n    {IN_QUERY}\n"
    scrubbed = m.scrub(text)
    for secret in ("s3cr3t-t0ken", "3b7bf1e5a3c2a8f7", "q7Secret"):
        assert secret not in scrubbed
    argv = [f"{VENV}/bin/python", "train.py"]
    s = scan([proc(10, 1, ["bash"], python=False), proc(11, 10, argv)], panes=[pane("idx", 10)])
    a, recipe = adopted(s, detail(11, pip_config=[(f"{HOME}/.config/pip/pip.conf", scrubbed)]), {}, tmp_path)
    assert recipe["env"]["index_url"] == "${INDEX_URL_DL_CLOUDSMITH_IO}"
    assert recipe["env"]["extra_index_urls"] == ["${INDEX_URL_PRIVATE_EXAMPLE_COM}", "${INDEX_URL_PYPI_TEAM_EXAMPLE}"]
    told = [w for w in a.warnings if "holds a credential" in w]
    assert told == [
        "the package index https://dl.cloudsmith.io/***/team/repo/python/simple/ holds a credential: the recipe names "
        "it as ${INDEX_URL_DL_CLOUDSMITH_IO}, never the URL; set INDEX_URL_DL_CLOUDSMITH_IO to that URL on this "
        "machine (export INDEX_URL_DL_CLOUDSMITH_IO='...') before `up`",
        *[f"the package index {shown} holds a credential: the recipe names it as ${{{name}}}, never the URL; set "
          f"{name} to that URL on this machine (export {name}='...') before `up`"
          for shown, name in (("https://***@private.example.com/simple", "INDEX_URL_PRIVATE_EXAMPLE_COM"),
                              ("https://pypi.team.example/simple?token=***", "INDEX_URL_PYPI_TEAM_EXAMPLE"))]]


@pytest.mark.parametrize("url, secrets", [
    (USERINFO, ["s3cr3t-t0ken"]), ("https://TOKENb42x@other.example/simple", ["TOKENb42x"]),
    (IN_PATH, ["3b7bf1e5a3c2a8f7"]), ("https://pypi.fury.io/AbCdEfGh12345678/me/", ["AbCdEfGh12345678"]),
    (IN_QUERY, ["q7Secret"]),
    ("https://b.s3.amazonaws.com/f.whl?X-Amz-Credential=AKIAX%2F1&X-Amz-Signature=d3adb33f", ["AKIAX%2F1", "d3adb33f"]),
    ("https://acct.blob.core.windows.net/c/f.whl?sv=2020-08-04&sig=abcDEF%3D", ["abcDEF%3D"]),
    ("https://download.pytorch.org/whl/cu124", []), ("https://pypi.org/simple", []),
    ("https://x.example/whl/manylinux2014_x86_64/", []), ("https://x.example/python-build-standalone/20240107/", []),
    ("file:///srv/mirror/test_uv_provides_the_recipes_python0/", []),
])
def test_the_instance_script_and_relaunch_find_the_same_credentials_in_a_url(url: str, secrets: list[str]) -> None:
    """templates/adopt.py (alone on the instance) and relaunch.ui agree on what in a URL is a credential."""
    from relaunch.ui import redact_url, url_credentials

    m = _instance_script()
    assert url_credentials(url) == secrets
    assert m.url_has_credentials(url) == bool(secrets)
    assert m.url_scrub(url).replace("\0URL_CREDENTIALS\0", "***") == redact_url(url)
    assert not any(secret in redact_url(url) for secret in secrets)


def test_the_lock_calls_out_git_and_local_installs() -> None:
    lines, callouts = lock_lines(_dists([
        ("torch", "2.13.0", None),
        ("mylib", "0.1", {"url": "file:///home/ubuntu/mylib", "dir_info": {"editable": True}}),
        ("peft", "0.9", {"url": "https://github.com/huggingface/peft", "vcs_info": {"vcs": "git", "commit_id": "abc"}}),
        ("pip", "25.0", None)]), "~/venv")
    assert [ln for ln in lines if not ln.startswith("#")] == ["peft @ git+https://github.com/huggingface/peft@abc",
                                                             "torch==2.13.0"]
    assert any(ln.startswith("# mylib==0.1  # installed from /home/ubuntu/mylib (editable)") for ln in lines)
    assert len(callouts) == 2 and "will not install elsewhere" in " ".join(callouts)


def _dists(rows: list[tuple[str, str, dict[str, Any] | None]]) -> list[Any]:
    from relaunch.adopt.facts import Dist

    return [Dist(n, v, d) for n, v, d in rows]



# -- relaunch.train: `up` brings its own --------------------------------------------------------------------
TRAIN_WITH_RELAUNCH = """
import argparse
import rich
from relaunch import train as relaunch_train
p = argparse.ArgumentParser()
p.add_argument("--output_dir")
p.add_argument("--resume_from_checkpoint", default="")
"""
RELAUNCH_TRAIN = "import os\nNOTICE = os.environ.get('RELAUNCH_NOTICE')\n"


def _dist(name: str, version: str, requires: list[str] = (), top: list[str] = ()) -> dict[str, Any]:
    return {"name": name, "version": version, "direct": None, "requires": list(requires), "top": list(top)}


def test_relaunch_in_the_venv_and_what_only_it_needs_stay_out_of_the_lock(tmp_path) -> None:
    """`pip install relaunch` in the training's venv: relaunch and the packages nothing else needs
    (fabric, paramiko and theirs) are left out; what another package needs (pyyaml for
    transformers) or the program imports itself (rich) stays."""
    s = scan([proc(10, 1, ["bash"], python=False), proc(11, 10, [f"{VENV}/bin/python", "train.py", "--output_dir",
                                                                   f"{HOME}/out"])], panes=[pane("hf", 10)])
    dists = [_dist("relaunch", "0.1.0", ["fabric>=3.2,<4", "paramiko>=3.4", "pyyaml>=6", "rich>=13",
                                         "pytest>=8; extra == 'test'"], ["relaunch"]),
             _dist("fabric", "3.2.3", ["invoke>=2.0", "paramiko>=2.4"], ["fabric"]),
             _dist("invoke", "2.2.1", [], ["invoke"]), _dist("paramiko", "5.1.0", ["bcrypt>=3.2"], ["paramiko"]),
             _dist("bcrypt", "5.0.0", [], ["bcrypt"]), _dist("PyYAML", "6.0.4", [], ["_yaml", "yaml"]),
             _dist("rich", "15.0.0", ["pygments>=2"], ["rich"]), _dist("Pygments", "2.21.0", [], ["pygments"]),
             _dist("pytest", "8.0", [], ["pytest"]),
             _dist("transformers", "5.24.0", ["pyyaml>=5.1"], ["transformers"]), _dist("torch", "2.13.0")]
    d = detail(11, files={f"{HOME}/work/train.py": TRAIN_WITH_RELAUNCH}, dists=dists)
    a, recipe = adopted(s, d, {}, tmp_path)
    pinned = sorted(line for line in a.lock if not line.startswith("#"))
    assert pinned == ["PyYAML==6.0.4", "Pygments==2.21.0", "pytest==8.0", "rich==15.0.0", "torch==2.13.0",
                      "transformers==5.24.0"]
    fact = next(f for f in a.facts if f.key == "relaunch.train")
    assert fact.value == "from `up`" and "relaunch 0.1.0 in the venv" in fact.evidence
    assert "bcrypt, fabric, invoke, paramiko, relaunch" in fact.evidence
    # a program that takes more from relaunch than relaunch.train keeps it
    d = detail(11, files={f"{HOME}/work/train.py": TRAIN_WITH_RELAUNCH + "from relaunch.layouts import Entry\n"},
               dists=dists)
    a, _ = adopted(s, d, {}, tmp_path / "more")
    assert "relaunch==0.1.0" in a.lock and "fabric==3.2.3" in a.lock
    assert any("imports relaunch.layouts" in w for w in a.warnings)


def test_a_copy_of_relaunch_train_beside_the_script_is_not_carried_over(tmp_path) -> None:
    """`up` puts relaunch/train.py on the training's PYTHONPATH; a copy in the workdir (env.files)
    would come first on the path and stay at the version it was copied at."""
    s = scan([proc(10, 1, ["bash"], python=False), proc(11, 10, [f"{VENV}/bin/python", "train.py"])],
             panes=[pane("hf", 10)])
    sources = {f"{HOME}/work/train.py": TRAIN_WITH_RELAUNCH, f"{HOME}/work/relaunch/__init__.py": "",
               f"{HOME}/work/relaunch/train.py": RELAUNCH_TRAIN}
    d = detail(11, files={f"{HOME}/work/train.py": TRAIN_WITH_RELAUNCH}, sources=sources)
    a, recipe = adopted(s, d, {}, tmp_path)
    assert recipe["env"]["files"] == {"train.py": "~/work/train.py"}
    fact = next(f for f in a.facts if f.key == "relaunch.train")
    assert "~/work/relaunch/train.py, a copy beside the program; not copied" in fact.evidence
    # a package of the user's own that is also named relaunch is the program's: copied
    sources[f"{HOME}/work/relaunch/train.py"] = "def fit(): pass\n"
    _, recipe = adopted(s, detail(11, files={f"{HOME}/work/train.py": TRAIN_WITH_RELAUNCH}, sources=sources),
                        {}, tmp_path / "own")
    assert set(recipe["env"]["files"]) == {"train.py", "relaunch/__init__.py", "relaunch/train.py"}


LIGHTNING_CLI = """
from lightning.pytorch.cli import LightningCLI
from model import Net
LightningCLI(Net)
"""


def test_lightning_cli_fit_gets_its_ckpt_path_and_default_root_dir(tmp_path) -> None:
    """LightningCLI: `fit --trainer.default_root_dir DIR` names the folder, `--ckpt_path` resumes
    (the script defines neither: LightningCLI does)."""
    argv = [f"{VENV}/bin/python", "main.py", "fit", "--trainer.default_root_dir", f"{HOME}/runs",
            "--trainer.max_steps", "100"]
    s = scan([proc(10, 1, ["bash"], python=False), proc(11, 10, argv)], panes=[pane("cli", 10)])
    d = detail(11, files={f"{HOME}/work/main.py": LIGHTNING_CLI},
               sources={f"{HOME}/work/main.py": LIGHTNING_CLI, f"{HOME}/work/model.py": "import torch\n"})
    a, recipe = adopted(s, d, {f"{HOME}/runs": entries("epoch=0-step=10.ckpt")}, tmp_path)
    assert recipe["checkpoint"] == {"dir": "~/runs", "layout": "lightning", "remote": "./store/cli"}
    assert recipe["run"]["command"] == ("python main.py fit --trainer.default_root_dir ~/runs --trainer.max_steps 100 "
                                        '{% if checkpoint %}--ckpt_path "{{ checkpoint }}"{% endif %}')
    assert "LightningCLI" in a.notes["run.command"][0]


def test_lightning_without_a_dirpath_watches_every_version_folder(tmp_path) -> None:
    """No ModelCheckpoint(dirpath=...): Lightning saves in default_root_dir/lightning_logs/version_N/
    checkpoints, a new version_N each run. checkpoint.dir is the folder above them, so that the
    checkpoints of the run `up` resumes (in version_N+1) are found there too."""
    argv = [f"{VENV}/bin/python", "main.py", "fit", "--trainer.default_root_dir", f"{HOME}/runs"]
    s = scan([proc(10, 1, ["bash"], python=False), proc(11, 10, argv)], panes=[pane("cli", 10)])
    d = detail(11, files={f"{HOME}/work/main.py": LIGHTNING_CLI})
    nested = entries("lightning_logs/version_0/checkpoints/epoch=0-step=10.ckpt",
                     "lightning_logs/version_1/checkpoints/epoch=0-step=20.ckpt",
                     "lightning_logs/version_1/hparams.yaml")
    a, recipe = adopted(s, d, {f"{HOME}/runs": nested}, tmp_path)
    assert recipe["checkpoint"]["dir"] == "~/runs" and recipe["checkpoint"]["layout"] == "lightning"
    assert a.newest == "lightning_logs/version_1/checkpoints/epoch=0-step=20.ckpt"
    assert not any("version_N" in w for w in a.warnings)
    # nothing names the folder (Lightning's default_root_dir is the working directory): the disk does
    from relaunch.adopt.facts import Folder

    plain = f"{HOME}/work/lightning_logs"
    s = scan([proc(10, 1, ["bash"], python=False), proc(11, 10, [f"{VENV}/bin/python", "fit.py"])],
             panes=[pane("pl", 10)])
    d = detail(11, files={f"{HOME}/work/fit.py": "import lightning as L\nL.Trainer().fit(None)\n"})
    d.folders = [Folder(f"{plain}/version_0/checkpoints", 1, 2000.0, ["epoch=0-step=10.ckpt"])]
    a, recipe = adopted(s, d, {plain: entries("version_0/checkpoints/epoch=0-step=10.ckpt")}, tmp_path / "plain")
    assert recipe["checkpoint"]["dir"] == "~/work/lightning_logs" and recipe["checkpoint"]["layout"] == "lightning"
    assert a.newest == "version_0/checkpoints/epoch=0-step=10.ckpt"
    assert "a new version_N each run" in a.notes["checkpoint.dir"][0]

# -- the instance script's secrets ---------------------------------------------------------------------------
def _instance_script() -> Any:
    spec = importlib.util.spec_from_file_location("adopt_instance", templates_dir() / "adopt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_instance_script_never_lets_a_secret_value_out() -> None:
    m = _instance_script()
    m.note_env({"HF_TOKEN": "hf_abcdefghijklmnopqrstu", "TOKENIZERS_PARALLELISM": "false", "MY_DB":
                "postgres://me:pw@db/x", "RUN": "abc", "OPAQUE": "Zx8kq2LmN4pR7sT1vW3yB6dF9gH0jK5a"})
    assert m.secret_names == {"HF_TOKEN", "MY_DB", "OPAQUE"}
    assert m.scrub("HF_TOKEN=hf_abcdefghijklmnopqrstu python t.py") == "HF_TOKEN=\0HF_TOKEN\0 python t.py"
    assert m.scrub("API_KEY=unknownvalue x") == "API_KEY=\0API_KEY\0 x"
    assert m.scrub_argv(["t.py", "--hf_token", "hf_abcdefghijklmnopqrstu", "--api-key=zzz", "--lr", "1"]) == \
        ["t.py", "--hf_token", "\0HF_TOKEN\0", "--api-key=\0API_KEY\0", "--lr", "1"]
    assert "pw" not in m.scrub("see postgres://me:pw@db/x")
    classified = {e["name"]: e for e in m.classify_env({"HF_TOKEN": "hf_abcdefghijklmnopqrstu", "A": "1"}, {"A": "1"})}
    assert classified["HF_TOKEN"]["value"] is None and classified["A"] == {
        "name": "A", "secret": False, "value": "1", "in_base": True, "same": True}


def test_the_instance_script_runs_on_its_own_and_reads_this_machine(tmp_path) -> None:
    """As the instance runs it: `python3 -I -S -B - scan`, the script on stdin; one JSON document, this
    process among it."""
    from relaunch.adopt.facts import script_command, script_stdin

    out = subprocess.run(["bash", "-c", script_command("scan")], input=script_stdin("scan", None).decode(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found = Scan.from_dict(json.loads(out.stdout))
    assert found.self_pid in found.mine and any(p.python for p in found.procs.values())
