"""Helpers for the tests of `relaunch run` on this machine (no scheduler, no root): a recipe whose
training is tests/spot_trainer.py and whose store is a folder, the command started as a job's
command is, and what the store and the log say afterwards."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import cli_env, wait_for, write_recipe
from relaunch.manifest import StoreManifest

HERE = Path(__file__).resolve().parent


def job_recipe(folder: Path, *trainer_args: str, **sections: Any) -> Path:
    """spot_trainer.py (a step every 0.1 s, a checkpoint every 10 steps, a save on SIGTERM) and a
    store folder beside the recipe; `sections` replace the recipe's own."""
    data: dict[str, Any] = {
        "name": "injob",
        "env": {"python": "3.11"},
        "checkpoint": {"dir": "~/ckpt", "layout": "files", "pattern": "ckpt-*.pt", "keep": 2,
                       "remote": str(folder / "store")},
        "run": {"command": f"{sys.executable} {HERE / 'spot_trainer.py'} \"{{{{ checkpoint }}}}\" --out ~/ckpt "
                           f"--every 10 --sleep 0.05 --size 20000 --keep 2 {' '.join(trainer_args)}",
                "workdir": "~/work", "log": str(folder / "train.log"), "stop": {"signal": "TERM", "timeout": 10}},
        "guard": {"enabled": False},
    }
    data.update(sections)
    return write_recipe(folder, data)


STARTED: list[subprocess.Popen[str]] = []


def start(folder: Path, *args: str, home: str = "home", env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`relaunch run recipe.yaml ARGS` as a job's command, its home `folder/home` (its disk)."""
    (folder / home).mkdir(parents=True, exist_ok=True)
    with open(folder / "out.txt", "a") as out, open(folder / "err.txt", "a") as err:
        proc = subprocess.Popen([sys.executable, "-m", "relaunch.cli", "run", str(folder / "recipe.yaml"), *args],
                                stdout=out, stderr=err, text=True, start_new_session=True,
                                env=cli_env(folder / "state", {"HOME": str(folder / home), **(env or {})}))
    STARTED.append(proc)
    return proc


@pytest.fixture(autouse=True)
def end_what_was_started() -> Iterator[None]:
    """Every relaunch run a test started, and its training, is gone when the test ends, also on failure."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            kill_all(proc)


def said(folder: Path) -> str:
    return (folder / "err.txt").read_text() if (folder / "err.txt").exists() else ""


def log(folder: Path) -> str:
    return (folder / "train.log").read_text() if (folder / "train.log").exists() else ""


def stored(folder: Path) -> StoreManifest | None:
    path = folder / "store" / ".relaunch" / "manifest.json"
    return StoreManifest.from_json(path.read_text(), str(path)) if path.exists() else None


def newest_step(folder: Path) -> int:
    manifest = stored(folder)
    newest = manifest.newest() if manifest else None
    return newest.step if newest else 0


def history(folder: Path) -> list[dict[str, Any]]:
    path = folder / "store" / ".relaunch" / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def stops(folder: Path) -> list[int]:
    return [int(s) for s in re.findall(r"stopped at step (\d+)", log(folder))]


def resumes(folder: Path) -> list[int]:
    return [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", log(folder))]


def training(folder: Path) -> bool:
    return bool(re.search(r"^step \d+ ", log(folder), re.M))


def wait_saved(folder: Path, step: int = 10, proc: subprocess.Popen[str] | None = None) -> None:
    wait_for(f"a checkpoint of step {step} or later verified in the store", lambda: newest_step(folder) >= step,
             timeout=120, explain=lambda: said(folder) + (f"\nexit {proc.poll()}" if proc else ""))


def descendants(pid: int) -> list[int]:
    """The processes started under `pid` (the training, its shell), by their parents."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(proc.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_all(proc: subprocess.Popen[str]) -> None:
    """SIGKILL to relaunch run and everything under it (an engine's end of the grace, a container's)."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)
