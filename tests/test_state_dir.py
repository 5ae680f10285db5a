"""Where relaunch keeps its state on this machine: RELAUNCH_HOME, else the XDG state folder (the
same place on every system, so a known_hosts recorded once is found again)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from relaunch.paths import state_dir


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RELAUNCH_HOME", raising=False)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    return tmp_path / "home"


def test_the_default_is_the_xdg_state_folder_made_private(home: Path) -> None:
    path = state_dir()
    assert path == home / ".local" / "state" / "relaunch"
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


def test_xdg_state_home_moves_it(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert state_dir() == tmp_path / "xdg" / "relaunch"


def test_relaunch_home_wins_and_expands_the_tilde(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("RELAUNCH_HOME", "~/state")
    assert state_dir() == home / "state"
