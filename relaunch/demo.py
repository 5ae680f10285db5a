"""`relaunch demo`: the whole story on two local sandbox instances, with the real commands.

Train on instance A, evacuate it (verified), destroy it, bring up instance B (another address,
another SSH user, another host key) and watch training resume from the evacuated checkpoint.
Every relaunch command is printed as `$ relaunch ...` and run as a subprocess, so what the user
sees is the real output and every line can be copied into a shell.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import click

from . import sandbox as sb
from .errors import (
    CheckpointError,
    ConnectError,
    EnvError,
    EvacuationError,
    Interrupted,
    RelaunchError,
    UsageError,
)
from .resources import examples_dir

FIRST, SECOND = "demo-a", "demo-b"
MARKER = ".relaunch-demo"  # written into the workdir: a folder holding it may be cleared by a later demo
EXAMPLE = "pytorch"  # the folder under examples/ the demo runs
EXAMPLE_FILES = ("recipe.yaml", "train.py", "requirements.lock")
STORE = Path("store") / "example"  # the example recipe's checkpoint.remote, relative to the recipe
EVACUATE_AT_STEP = 20  # evacuate once A has a checkpoint at least this far
FINAL_STEP = 60  # the example recipe's --steps
CHECKPOINT_TIMEOUT = 180.0  # install (~10 s) + 20 steps of 0.5 s, with room for a slow machine
FINISH_TIMEOUT = 240.0
# command -> Debian package. This machine's tools are the instances' tools: tmux, rsync and
# python3.11 must be here, because an instance cannot apt-get anything (it has no network).
TOOLS = {
    "ip": "iproute2",
    "tc": "iproute2",
    "unshare": "util-linux",
    "nsenter": "util-linux",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "/usr/sbin/sshd": "openssh-server",
    "rsync": "rsync",
    "tmux": "tmux",
    "sudo": "sudo",
    "python3.11": "python3.11",
}
# a failed relaunch command's exit code -> the error that gives the demo the same exit code
EXIT_ERRORS: dict[int, type[RelaunchError]] = {
    2: UsageError, 3: ConnectError, 4: EnvError, 5: CheckpointError, 6: EvacuationError, 130: Interrupted,
}

Say = Callable[[str], None]


@dataclass
class DemoResult:
    workdir: Path
    first_host: str  # "root@10.213.1.2"
    first_host_key: str  # "SHA256:..."
    second_host: str
    second_host_key: str
    evacuated_step: int  # the newest checkpoint the store held after `evacuate`
    resumed_step: int  # the step B's training resumed at (equal to evacuated_step)
    seconds: float


# ---------------------------------------------------------------------------------------------
# checks and the workdir


def check_machine() -> None:
    """Root and the system tools, before anything is created; one error names every missing package."""
    if os.geteuid() != 0:
        raise UsageError("the demo needs root: sandbox instances are network namespaces with their own sshd",
                         "run it as root, e.g. sudo relaunch demo")
    missing = sorted({pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None})
    if missing:
        raise UsageError(f"the demo needs these Debian packages: {' '.join(missing)}",
                         f"apt-get install {' '.join(missing)}")


def check_workdir(workdir: Path) -> None:
    """Refuse a folder holding anything but an earlier demo's files (never clear someone's work)."""
    if workdir.exists() and not workdir.is_dir():
        raise UsageError(f"--workdir {workdir} exists and is not a folder")
    if workdir.is_dir() and any(workdir.iterdir()) and not (workdir / MARKER).is_file():
        raise UsageError(f"--workdir {workdir} is not empty and is not an earlier demo's folder; not touching it",
                         "pass --workdir with a new or empty folder")


def prepare_workdir(workdir: Path) -> Path:
    """Empty (an earlier demo's files go), then the example recipe, train.py and lock. Returns the recipe."""
    check_workdir(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for child in workdir.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    (workdir / MARKER).write_text("made by `relaunch demo`; a later demo clears this folder\n")
    example = examples_dir() / EXAMPLE
    for name in EXAMPLE_FILES:
        shutil.copy(example / name, workdir / name)
    return workdir / "recipe.yaml"


# ---------------------------------------------------------------------------------------------
# running the real CLI


class Shell:
    """Prints `$ relaunch ...`, runs it as `python -m relaunch.cli ...` in the workdir, shows its output."""

    def __init__(self, cwd: Path, say: Say) -> None:
        self.cwd = cwd
        self.say = say
        # unbuffered: the child's stdout and stderr arrive in the order it wrote them
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def relaunch(self, *args: str) -> str:
        """Run `relaunch ARGS`; its output (stdout and stderr) is shown and returned. Non-zero exit: raise."""
        self.say("$ " + shlex.join(["relaunch", *args]))
        proc = subprocess.Popen([sys.executable, "-m", "relaunch.cli", *args], cwd=self.cwd, env=self.env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace")
        lines: list[str] = []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                if line.strip():  # progress bars leave blank lines behind in a pipe
                    self.say(line)
                lines.append(line)
            code = proc.wait()
        finally:
            # Ctrl-C reached the child too (same process group): let it finish its own cleanup
            # and show what it says about it
            if proc.poll() is None:
                try:
                    rest, _ = proc.communicate(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    rest, _ = proc.communicate()
                for line in (rest or "").splitlines():
                    if line.strip():
                        self.say(line)
        output = "\n".join(lines)
        if code != 0:
            error = EXIT_ERRORS.get(code, RelaunchError)
            raise error(f"demo: `relaunch {shlex.join(args)}` failed (exit {code}); its output is above")
        return output


def instance_text(name: str, path: str) -> str:
    """A file's text inside a sandbox instance, as its console would show it ("" when missing)."""
    proc = sb.run_in(name, ["cat", path], capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else ""


def newest_checkpoint_step(name: str, folder: str) -> int:
    proc = sb.run_in(name, ["ls", "-1", folder], capture_output=True, text=True)
    steps = [int(m.group(1)) for m in re.finditer(r"^ckpt-(\d+)\.pt$", proc.stdout, re.M)]
    return max(steps, default=0)


def log_tail(text: str, lines: int = 15) -> str:
    return "\n".join("  | " + ln for ln in text.rstrip().splitlines()[-lines:])


def wait_until(what: str, name: str, log: str, ready: Callable[[], bool], timeout: float) -> None:
    """Poll `ready`; stop early when the training run ended (run.sh writes `=== relaunch: exit N`)."""
    deadline = time.monotonic() + timeout
    while not ready():
        text = instance_text(name, log)
        ended = re.search(r"^=== relaunch: exit (\d+)", text, re.M)
        if ended or time.monotonic() > deadline:
            why = f"training ended (exit {ended.group(1)})" if ended else f"not within {timeout:g}s"
            raise EnvError(f"demo: {name}: {what}: {why}; last lines of {log}:\n{log_tail(text)}")
        time.sleep(0.5)


def evacuated_step(store: Path) -> int:
    try:
        manifest = json.loads((store / ".relaunch" / "manifest.json").read_text())
        return max(int(c["step"]) for c in manifest["checkpoints"])
    except (OSError, ValueError, KeyError, TypeError):
        raise EvacuationError(f"demo: no readable manifest in {store}/.relaunch after `evacuate`") from None


# ---------------------------------------------------------------------------------------------
# the story


def run_demo(workdir: Path, keep: bool = False, say: Say = click.echo) -> DemoResult:
    """Up on A, evacuate, destroy A, up on B, resumed; every instance made is destroyed (B kept with
    `keep`), also on failure and Ctrl-C. Raises a relaunch error carrying the failed step's exit code."""
    started = time.monotonic()
    workdir = workdir.expanduser().absolute()
    check_workdir(workdir)
    check_machine()
    with _one_demo_at_a_time():
        return _run(workdir, keep, say, started)


@contextlib.contextmanager
def _one_demo_at_a_time() -> Iterator[None]:
    """demo-a and demo-b are fixed names: a second demo must not destroy a running one's instances."""
    sb.RUN_DIR.mkdir(parents=True, exist_ok=True)
    with open(sb.RUN_DIR / ".demo.lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            raise UsageError(f"another `relaunch demo` is running on this machine ({handle.read().strip()}); "
                             "it uses the sandbox names demo-a and demo-b", "wait for it to finish") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}, since {time.strftime('%H:%M:%S')}")
        handle.flush()
        yield


def _run(workdir: Path, keep: bool, say: Say, started: float) -> DemoResult:

    say("# 1. a local package index for the example's lock (torch CPU), served inside each instance")
    index = sb.build_index([examples_dir() / EXAMPLE / "requirements.lock"])
    say(f"package index: {index}")

    recipe = prepare_workdir(workdir)
    key = sb.default_key()
    sh = Shell(workdir, say)
    say(f"\n# 2. the example recipe, train.py and lock in {workdir}; the store will be {workdir / STORE}")
    say(f"$ cd {shlex.quote(str(workdir))}")

    leftovers = {inst.name for inst in sb.list_instances()} & {FIRST, SECOND}
    made: list[str] = []
    try:
        for name in sorted(leftovers):
            say(f"# {name} is left over from an earlier demo that did not finish")
            sh.relaunch("sandbox", "destroy", name)

        say("\n# 3. two throwaway instances: own address, real sshd, empty disk, new host key")
        made.append(FIRST)
        sh.relaunch("sandbox", "create", FIRST, "--user", "root", "--index", str(index))
        made.append(SECOND)
        sh.relaunch("sandbox", "create", SECOND, "--user", "ubuntu", "--index", str(index))
        a, b = sb.get(FIRST), sb.get(SECOND)
        host_a, host_b = f"{a.user}@{a.address}", f"{b.user}@{b.address}"
        # Pin each host key as a provider's console shows it. Sandbox addresses are reused by later
        # instances (with new keys), so trust-on-first-use would refuse a second demo's instances.
        opts_a = ["--set", f"ssh.key={key}", "--set", f"ssh.host_key={a.host_key_fingerprint}"]
        opts_b = ["--set", f"ssh.key={key}", "--set", f"ssh.host_key={b.host_key_fingerprint}"]

        say(f"\n# 4. train on {FIRST}, evacuate it mid-run, destroy it")
        sh.relaunch("up", recipe.name, host_a, *opts_a)
        ckpt_a, log_a = f"{a.home}/ckpt", f"{a.home}/example.log"
        say(f"# waiting until {FIRST} has a checkpoint at step >= {EVACUATE_AT_STEP} (ls {ckpt_a})")
        wait_until(f"a checkpoint at step >= {EVACUATE_AT_STEP}", FIRST, log_a,
                   lambda: newest_checkpoint_step(FIRST, ckpt_a) >= EVACUATE_AT_STEP, CHECKPOINT_TIMEOUT)
        say(f"# {FIRST} has ckpt-{newest_checkpoint_step(FIRST, ckpt_a):08d}.pt")
        out = sh.relaunch("evacuate", recipe.name, host_a, *opts_a)
        if "safe to destroy" not in out:
            raise EvacuationError("demo: `relaunch evacuate` exited 0 but did not say `safe to destroy`")
        step = evacuated_step(workdir / STORE)
        sh.relaunch("sandbox", "destroy", FIRST)
        made.remove(FIRST)

        say(f"\n# 5. a new instance: {SECOND}, another address, user and host key; training resumes there")
        sh.relaunch("up", recipe.name, host_b, *opts_b)
        final, log_b = f"{b.home}/final.sha256", f"{b.home}/example.log"
        say(f"# waiting until training on {SECOND} finishes ({final})")
        wait_until("training to finish", SECOND, log_b, lambda: bool(instance_text(SECOND, final).strip()),
                   FINISH_TIMEOUT)
        log = instance_text(SECOND, log_b)
        say(f"# {SECOND}:{log_b}:")
        shown = [ln for ln in log.splitlines() if re.match(r"(resumed from |done step )", ln)]
        for line in shown:
            say(f"  {line}")
        resumed = re.search(r"^resumed from \S+ at step (\d+)$", log, re.M)
        if not resumed:
            raise CheckpointError(f"demo: {SECOND} did not resume from a checkpoint:\n{log_tail(log)}")
        if int(resumed.group(1)) != step:
            raise CheckpointError(f"demo: {SECOND} resumed at step {resumed.group(1)}, but the store's newest "
                                  f"verified checkpoint is at step {step}")
        if not re.search(rf"^done step {FINAL_STEP}$", log, re.M):
            raise EnvError(f"demo: training on {SECOND} did not reach step {FINAL_STEP}:\n{log_tail(log)}")

        if keep:
            made.remove(SECOND)
        else:
            say("")
            sh.relaunch("sandbox", "destroy", SECOND)
            made.remove(SECOND)
    finally:
        cleanup(made, keep, say)

    result = DemoResult(workdir, host_a, a.host_key_fingerprint, host_b, b.host_key_fingerprint, step,
                        int(resumed.group(1)), time.monotonic() - started)
    say("")
    say(f"summary ({result.seconds:.0f} s):")
    say(f"  {FIRST}  {host_a:<20} host key {result.first_host_key}: trained, evacuated at step {step} "
        "(verified: safe to destroy), destroyed")
    say(f"  {SECOND}  {host_b:<20} host key {result.second_host_key}: a new instance, resumed at step "
        f"{result.resumed_step}, done step {FINAL_STEP}")
    say(f"  store   {workdir / STORE}")
    if keep:
        say(f"  kept {SECOND}: relaunch sandbox destroy {SECOND}")
    return result


def cleanup(names: list[str], keep: bool, say: Say) -> None:
    """After a failure or Ctrl-C: destroy what the demo made (in this process: a second Ctrl-C
    must not leave an instance behind half-destroyed), or with --keep say how to."""
    for name in names:
        if keep:
            say(f"kept {name}: relaunch sandbox destroy {name}")
            continue
        try:
            sb.destroy(name)
            say(f"destroyed {name}")
        except RelaunchError as exc:
            say(f"could not destroy {name}: {exc.message} (relaunch sandbox destroy {name})")
