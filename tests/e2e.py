"""Helpers for end-to-end tests: run the real CLI against sandbox instances."""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from relaunch.sandbox import INDEX_PORT
from relaunch.scripts import whole_lines

REPO = Path(__file__).resolve().parents[1]
# the package index a sandbox instance serves itself (the `sandbox` fixture gives each one), as it sees it
INDEX_URL = f"http://127.0.0.1:{INDEX_PORT}/simple/"
EXAMPLE = REPO / "examples" / "pytorch"


def cli_env(home: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment `relaunch` runs in here: its own state folder (known_hosts, debug log)."""
    return {**os.environ, "RELAUNCH_HOME": str(home), "COLUMNS": "200", **(env or {})}


def new_user(home: Path, key: Path | None = None) -> dict[str, str]:
    """A new user's environment: the HOME `home`, made with nothing but the key the README tells them
    to make (`ssh-keygen -t ed25519`: ~/.ssh/id_ed25519, no passphrase) unless `key` puts it
    elsewhere; nothing of this machine's user (ssh-agent, ~/.ssh, relaunch's state); relaunch on PATH.
    OpenSSH itself finds ~/.ssh through the password database, not $HOME: what runs `ssh` runs
    through as_user()."""
    key = key or home / ".ssh" / "id_ed25519"
    key.parent.mkdir(parents=True, mode=0o700)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, capture_output=True)
    mine = {k: v for k, v in os.environ.items()
            if k not in ("SSH_AUTH_SOCK", "SSH_AGENT_PID", "RELAUNCH_HOME") and not k.startswith("XDG_")}
    return {**mine, "HOME": str(home), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "COLUMNS": "200"}


def as_user(env: dict[str, str], argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """(argv, env) that run `argv` with the new user's HOME (new_user) as this machine's user's home
    directory, the one OpenSSH reads: bound over it in a mount namespace of the command's own, so
    nothing outside changes. This Python's installation, when it lives in that home (pyenv), is
    bound back in. Nothing run this way may mount (a sandbox instance's disks would be the
    namespace's only)."""
    real, home = Path(pwd.getpwuid(os.getuid()).pw_dir), Path(env["HOME"])
    binds = ""
    python = Path(sys.base_prefix)
    if python.is_relative_to(real):
        (home / python.relative_to(real)).mkdir(parents=True, exist_ok=True)
        binds = f"mount --bind {shlex.quote(str(python))} {shlex.quote(str(home / python.relative_to(real)))} && "
    script = binds + 'mount --rbind "$1" "$2" && shift 2 && exec "$@"'
    return (["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(home), str(real), *argv],
            {**env, "HOME": str(real)})


def run_cli(*args: str, home: Path, timeout: float = 900, env: dict[str, str] | None = None,
            input: str | None = None, script: str | None = None) -> subprocess.CompletedProcess[str]:
    """`relaunch ARGS` as a user runs it; `script`: Python run with `-c` instead, which calls
    `relaunch.cli.main.main(ARGS)` itself after changing what the test needs (a fault at a moment)."""
    program = ["-c", script] if script is not None else ["-m", "relaunch.cli"]
    return subprocess.run([sys.executable, *program, *args], capture_output=True, text=True, timeout=timeout,
                          env=cli_env(home, env), input=input)


def start_cli(*args: str, home: Path, env: dict[str, str] | None = None, err: Path) -> subprocess.Popen[str]:
    """`relaunch ARGS` started in the background, its stderr into the file `err`."""
    with open(err, "w") as handle:
        return subprocess.Popen([sys.executable, "-m", "relaunch.cli", *args], stdout=subprocess.DEVNULL,
                                stderr=handle, text=True, env=cli_env(home, env))


def stacks(proc: subprocess.Popen[str], err: Path, timeout: float) -> str:
    """Where each thread of a running relaunch is: `kill -USR1` makes it print them on its stderr
    (the file `err`), and it goes on. What it printed, or "" when nothing came within `timeout`."""
    proc.send_signal(signal.SIGUSR1)
    try:
        wait_for("the stacks", lambda: "most recent call first" in err.read_text(errors="replace"),
                 timeout=timeout, every=0.2)
    except AssertionError:
        return ""
    text = err.read_text(errors="replace")
    return text[text.find("Thread 0x"):] if "Thread 0x" in text else text


def write_recipe(folder: Path, data: dict[str, Any], name: str = "recipe.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def example_recipe(folder: Path, *, name: str, layout: str, key: Path, index_url: str | None,
                   steps: int = 30, save_every: int = 5, sleep: float = 0.3, keep: int = 2,
                   store: Path | None = None) -> Path:
    """The example recipe with its train.py and lock copied beside it; the store under `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(EXAMPLE / "train.py", folder / "train.py")
    shutil.copy(EXAMPLE / "requirements.lock", folder / "requirements.lock")
    pattern = {"files": "ckpt-*.pt"}.get(layout, "ckpt-*.pt")
    data = {
        "name": name,
        "provider": "sandbox",
        "ssh": {"key": str(key), "wait": 30},
        "env": {"python": "3.11", "venv": "~/venvs/example", "installer": "uv", "lock": "requirements.lock",
                "index_url": index_url, "files": {"train.py": "~/work/train.py"}},
        "checkpoint": {"dir": "~/ckpt", "layout": layout, "pattern": pattern, "keep": keep,
                       "remote": str(store or folder / "store")},
        "run": {"command": f"python train.py --out ~/ckpt --layout {layout} --steps {steps} "
                           f"--save-every {save_every} --sleep {sleep} --resume \"{{{{ checkpoint }}}}\" "
                           "--final ~/final.sha256",
                "workdir": "~/work", "ready": r"^step \d+ "},
    }
    return write_recipe(folder, data)


def wait_for(what: str, predicate: Callable[[], Any], timeout: float = 300, every: float = 0.5,
             explain: Callable[[], str] | None = None) -> Any:
    """Poll until predicate() is true; past the timeout, fail naming `what` (and what explain() says:
    the output of the process that should have done it)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f"\n{explain()}" if explain else ""))
        time.sleep(every)


def whole(text: str) -> str:
    """What a file another process is still writing (a log, an event stream, a record appended to)
    holds up to its last line end: a read may end inside a line (an append that crosses a page
    lands in two parts for a reader; a paused or killed writer stops mid-line), and half a line
    reads as another value: `step 1` of `step 150`, `grad_norm 1.` of `1.25`, JSON cut short."""
    return "".join(f"{line}\n" for line in whole_lines(text))


def local_final_hash(tmp: Path, layout: str, steps: int, save_every: int) -> str:
    """The uninterrupted run, on this machine: what every resumed run must reproduce bit for bit."""
    out, final = tmp / f"baseline-{layout}", tmp / f"baseline-{layout}.sha256"
    subprocess.run([sys.executable, str(EXAMPLE / "train.py"), "--out", str(out), "--layout", layout,
                    "--steps", str(steps), "--save-every", str(save_every), "--final", str(final)],
                   check=True, capture_output=True, timeout=300)
    return final.read_text().strip()


def plain_recipe(folder: Path, *, name: str, key: Path, command: str = "sleep 600", **sections: Any) -> Path:
    """A recipe with no lock (uv makes the venv from the instance's index, nothing installed): for
    tests that need no torch."""
    data: dict[str, Any] = {
        "name": name,
        "ssh": {"key": str(key), "wait": 20},
        "env": {"python": "3.11", "venv": "~/venvs/plain", "index_url": INDEX_URL},
        "checkpoint": {"dir": "~/ckpt", "layout": "files", "pattern": "ckpt-*.pt", "keep": 2,
                       "remote": str(folder / "store")},
        # a command that is still alive after a few seconds has started (up waits that long)
        "run": {"command": command, "workdir": "~", "grace": 3},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return write_recipe(folder, data)


def watched_and_refused(stderr: str) -> tuple[set[str], set[str]]:
    """From what `up` printed: the sources its guard line says it watches, and those the probe's lines
    say cannot reach the run."""
    line = next(ln for ln in stderr.splitlines() if "launch: guard: " in ln)
    words = line.split("launch: guard: ", 1)[1]
    watched = set(words[len("watching "):].split(" every ")[0].split(", ")) if words.startswith("watching ") else set()
    refused = {ln.split("guard: ", 1)[1].split(" cannot reach this run:")[0] for ln in stderr.splitlines()
               if "] guard: " in ln and " cannot reach this run:" in ln}
    return watched, refused
